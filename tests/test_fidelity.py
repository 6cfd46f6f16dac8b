"""``meridian bench fidelity``'s comparison: figures, targets, report (pure; no vLLM needed)."""

from __future__ import annotations

import pytest

from meridian.bench.fidelity import FidelityReport, compare, render_markdown
from meridian.core.types import Phase
from meridian.sim.records import RequestRecord, RunCounters, SimResult
from meridian.sim.request import RequestKind

S = 1_000_000_000


def result(
    engine: str, finishes: list[int], *, steps: int, think: int = 0, output: int = 0
) -> SimResult:
    records = []
    for i, finish in enumerate(finishes):
        rec = RequestRecord(f"r{i}", RequestKind.CHAT, 0, 10, 0, 5)
        rec.finish_ns = finish
        records.append(rec)
    counters = RunCounters(num_steps=steps, preemptions_by_phase={Phase.THINK: think})
    if output:
        counters.preemptions_by_phase[Phase.OUTPUT] = output
    return SimResult("p", engine, 100, records, [], counters, max(finishes))


def test_identical_runs_pass_with_zero_differences() -> None:
    a = result("model", [10 * S, 20 * S, 30 * S], steps=500, think=40, output=2)
    b = result("vllm", [10 * S, 20 * S, 30 * S], steps=500, think=40, output=2)
    row = compare(a, b)
    assert row.passed
    assert (row.finish_diff_p50_pct, row.finish_diff_p90_pct) == (0.0, 0.0)
    assert row.makespan_s.model == row.makespan_s.vllm == 30.0


def test_each_target_can_fail() -> None:
    ref = result("vllm", [10 * S, 20 * S, 30 * S, 40 * S], steps=1000, think=100, output=10)
    # Steps 1.2 % apart: a miss.
    assert not compare(result("model", [10 * S, 20 * S, 30 * S, 40 * S], steps=1012,
                              think=100, output=10), ref).passed  # fmt: skip
    # Finish times 5 % late each (median 5 % > 3 %): a miss.
    late = [int(f * 1.05) for f in (10 * S, 20 * S, 30 * S, 40 * S)]
    row = compare(result("model", late, steps=1000, think=100, output=10), ref)
    assert row.finish_diff_p50_pct == pytest.approx(5.0) and not row.passed
    # 12 against 10 output preemptions: over 10 %, a miss; 11 is within it.
    same = [10 * S, 20 * S, 30 * S, 40 * S]
    assert not compare(result("model", same, steps=1000, think=100, output=12), ref).passed
    assert compare(result("model", same, steps=1000, think=100, output=11), ref).passed
    # Small counts get one preemption of slack: 1 against 0 passes, 2 does not.
    small = result("vllm", same, steps=1000)
    assert compare(result("model", same, steps=1000, think=1), small).passed
    assert not compare(result("model", same, steps=1000, think=2), small).passed


def test_the_report_says_whether_every_target_was_met() -> None:
    ok = compare(result("model", [S], steps=10), result("vllm", [S], steps=10))
    miss = compare(result("model", [S], steps=20), result("vllm", [S], steps=10))
    fields = dict(
        workload="synthetic", arrival_rate=24, duration_s=30, seed=0, hardware="h100-sxm",
        model="qwen3-8b", max_num_seqs=1024, max_num_batched_tokens=8192, num_kv_blocks=26552,
        enable_prefix_caching=True,
    )  # fmt: skip
    good = FidelityReport(**fields, rows=[ok])  # type: ignore[arg-type]
    bad = FidelityReport(**fields, rows=[ok, miss])  # type: ignore[arg-type]
    assert good.passed and not bad.passed
    assert "Every target met." in render_markdown(good)
    text = render_markdown(bad)
    assert "Some target was missed." in text and "| MISS |" in text
    assert "26,552 KV blocks" in text
    with pytest.raises(ValueError, match="different policies"):
        compare(result("model", [S], steps=1), SimResult("q", "vllm", 1, [], [], RunCounters(), 0))
