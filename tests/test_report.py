"""Reports and the A/B: flags at every threshold, canonical JSON, Markdown, sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from meridian.bench.ab import HEADLINE_METRICS, AbFlag, Direction, classify, delta_pct
from meridian.bench.effects import effect_lines, effects
from meridian.bench.offered import NS_PER_S, offered_load
from meridian.bench.report import (
    AbReport,
    ForcingSummary,
    SimReport,
    SweepReport,
    ab_baselines,
    build_ab_report,
    build_sweep_report,
    load_report,
    to_json,
)
from meridian.bench.report_render import (
    render_markdown,
    write_ab_report,
    write_report,
    write_sweep_report,
)
from meridian.bench.slo import ExplicitSlo, SloSpec, Window
from meridian.bench.summary import PolicySummary, summarize
from meridian.core.types import ForceReason, Phase
from meridian.errors import MeridianError
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestKind, RequestSpec

MS = 1_000_000
POLICIES = ["meridian", "vllm-fcfs+forcing", "static-budget"]


def run(
    policy: str,
    gap_ms: int,
    ttfvt_ms: int,
    *,
    output_preemptions: int = 0,
    think: int = 300,
    recomputed: int = 0,
    wrong: int = 0,
) -> SimResult:
    """Six requests (two chat), five answer tokens each, gaps of ``gap_ms`` or ``gap_ms + 1``;
    the first ``wrong`` of the four reasoning requests have a wrong answer (entropy model)."""
    records = []
    num_reasoning = 0
    for i in range(6):
        arrival = i * 250 * MS
        reasoning = i % 3 != 0
        first_answer = arrival + ttfvt_ms * MS + (7 * i) * MS
        answers = [first_answer + k * (gap_ms + i % 2) * MS for k in range(5)]
        num_reasoning += reasoning
        records.append(
            RequestRecord(
                request_id=f"r{i}",
                kind=RequestKind.REASONING if reasoning else RequestKind.CHAT,
                arrival_ns=arrival,
                num_prompt_tokens=32,
                num_think_tokens_requested=400 if reasoning else 0,
                num_answer_tokens_requested=5,
                settle_token=250 if reasoning else None,
                first_token_ns=arrival + 50 * MS,
                think_end_ns=first_answer - 20 * MS if reasoning else None,
                first_answer_ns=first_answer,
                finish_ns=answers[-1],
                num_think_tokens=(think + 13 * i) if reasoning else 0,
                num_answer_tokens=5,
                forced_reason=ForceReason.CONVERGED if reasoning and think < 400 else None,
                answer_correct=num_reasoning > wrong if reasoning else None,
                answer_token_ns=answers,
                answer_token_step=[3 * k for k in range(5)],
            )
        )
    # The run's preemptions and recomputed tokens, on its first request (per-request figures).
    records[0].preemptions_by_phase = {Phase.OUTPUT: output_preemptions, Phase.THINK: 2}
    records[0].num_recomputed_tokens = recomputed
    counters = RunCounters(
        num_steps=100,
        num_scheduled_rows=600,
        num_scheduled_tokens=2000 + 10 * think + recomputed,
        preemptions_by_phase={Phase.OUTPUT: output_preemptions, Phase.THINK: 2},
        num_recomputed_tokens=recomputed,
    )
    samples = [TimeSample(t * 10 * MS, t % 50, t % 20, 4, 1, t % 3, t % 5) for t in range(700)]
    end = max(r.answer_token_ns[-1] for r in records)
    return SimResult(policy, "model", 64, records, samples, counters, end_ns=end)


def report(rate: float = 4.0, **overrides: Any) -> SimReport:
    """Meridian: 20 ms gaps; vllm-fcfs+forcing: 55 ms gaps (misses the ITL SLO), output preemptions,
    recomputed tokens and one wrong answer of four; static-budget: 21 ms gaps but answers 400 ms
    sooner (Meridian's TTFVT loses)."""
    runs = {
        "meridian": run("meridian", 20, 1500, think=260),
        "vllm-fcfs+forcing": run(
            "vllm-fcfs+forcing", 55, 1600, output_preemptions=4, recomputed=120, wrong=1
        ),
        "static-budget": run("static-budget", 21, 1100, think=300),
    }
    slo = SloSpec(explicit=ExplicitSlo())
    window = Window.of_run(3.0)  # goodput per second of a 3-s arrival window
    fields: dict[str, Any] = {
        "workload": "synthetic",
        "seed": 7,
        "duration_s": 60.0,
        "hardware": "h100-sxm",
        "model": "qwen3-8b",
        "slo": slo,
        "policies": list(runs),
        "arrival_rate": rate,
        "summaries": {p: summarize(r, slo, window=window) for p, r in runs.items()},
    }
    fields.update(overrides)
    return SimReport(**fields)


# --- flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "baseline", "direction", "flag"),
    [
        (100.0, 100.0, Direction.LOWER, AbFlag.FLAT),
        (98.01, 100.0, Direction.LOWER, AbFlag.FLAT),  # -1.99 %
        (98.0, 100.0, Direction.LOWER, AbFlag.WIN_SMALL),  # -2 % exactly
        (90.01, 100.0, Direction.LOWER, AbFlag.WIN_SMALL),  # -9.99 %
        (90.0, 100.0, Direction.LOWER, AbFlag.WIN),  # -10 % exactly
        (101.99, 100.0, Direction.LOWER, AbFlag.FLAT),
        (102.0, 100.0, Direction.LOWER, AbFlag.LOSS_SMALL),
        (109.99, 100.0, Direction.LOWER, AbFlag.LOSS_SMALL),
        (110.0, 100.0, Direction.LOWER, AbFlag.LOSS),
        # Higher is better (throughput, goodput): the same Δ reads the other way.
        (110.0, 100.0, Direction.HIGHER, AbFlag.WIN),
        (105.0, 100.0, Direction.HIGHER, AbFlag.WIN_SMALL),
        (101.0, 100.0, Direction.HIGHER, AbFlag.FLAT),
        (95.0, 100.0, Direction.HIGHER, AbFlag.LOSS_SMALL),
        (80.0, 100.0, Direction.HIGHER, AbFlag.LOSS),
    ],
)
def test_flags_at_each_threshold(
    candidate: float, baseline: float, direction: Direction, flag: AbFlag
) -> None:
    c = classify(candidate, baseline, direction)
    assert c.flag is flag
    assert c.delta_pct == pytest.approx((candidate - baseline) / baseline * 100)


def test_zero_baseline_is_an_absolute_comparison() -> None:
    assert classify(0, 0, Direction.LOWER).flag is AbFlag.FLAT
    assert classify(1, 0, Direction.LOWER).flag is AbFlag.LOSS  # first eviction: LOSS
    assert classify(1, 0, Direction.LOWER).delta_pct is None
    assert classify(5.0, 0.0, Direction.HIGHER).flag is AbFlag.WIN
    assert delta_pct(3.0, 0.0) is None


def test_missing_values_have_no_flag() -> None:
    assert classify(None, 1.0, Direction.LOWER).flag is None
    assert classify(1.0, None, Direction.HIGHER).delta_pct is None


def test_headline_metrics_order() -> None:
    assert [m.label for m in HEADLINE_METRICS] == [
        "output ITL P99",
        "output ITL P95",
        "TTFVT P95",
        "TTFVT P50",
        "TTOT P95",
        "TTFT P95",
        "throughput",
        "goodput",
        "SLO attainment at 3× (reasoning hidden)",
        "SLO attainment at 3× (reasoning shown)",
        "think tokens avg",
        "answer accuracy (model)",
        "worst answer gap",
        "preemptions (output phase)",
        "preemptions (think phase)",
        "recomputed tokens",
    ]
    assert [m.key for m in HEADLINE_METRICS] == [
        "output_itl_p99_s",
        "output_itl_p95_s",
        "ttfvt_p95_s",
        "ttfvt_p50_s",
        "ttot_p95_s",
        "ttft_p95_s",
        "throughput_tok_s",
        "goodput_req_s",
        "slo_hidden_pct",
        "slo_shown_pct",
        "think_tokens_avg",
        "answer_accuracy_pct",
        "worst_answer_gap_steps",
        "preemptions_output",
        "preemptions_think",
        "recomputed_tokens",
    ]
    higher = {m.label for m in HEADLINE_METRICS if m.direction is Direction.HIGHER}
    assert higher == {
        "throughput",
        "goodput",
        "SLO attainment at 3× (reasoning hidden)",
        "SLO attainment at 3× (reasoning shown)",
        "answer accuracy (model)",
    }


# --- A/B ------------------------------------------------------------------------------------------


def test_ab_report_values_and_flags() -> None:
    ab = build_ab_report(report())
    assert ab.candidate == "meridian" and ab.baselines == ["vllm-fcfs+forcing", "static-budget"]
    rows = {r.metric: r for r in ab.rows}
    assert [r.metric for r in ab.rows] == [m.key for m in HEADLINE_METRICS]

    itl = rows["output_itl_p99_s"]
    assert itl.values["meridian"] == pytest.approx(0.021)
    assert itl.values["vllm-fcfs+forcing"] == pytest.approx(0.056)
    assert itl.comparisons["vllm-fcfs+forcing"].flag is AbFlag.WIN
    assert itl.comparisons["vllm-fcfs+forcing"].delta_pct == pytest.approx((21 - 56) / 56 * 100)
    # 21 vs 22 ms: -4.5 %, a small win.
    assert itl.comparisons["static-budget"].flag is AbFlag.WIN_SMALL

    # static-budget answers 400 ms sooner: Meridian's TTFVT is a LOSS there.
    assert rows["ttfvt_p50_s"].comparisons["static-budget"].flag is AbFlag.LOSS
    assert rows["ttfvt_p50_s"].comparisons["vllm-fcfs+forcing"].flag is AbFlag.WIN_SMALL
    # Answer accuracy (model), higher is better: 100 % against 75 % is a WIN.
    acc = rows["answer_accuracy_pct"]
    assert acc.values == {"meridian": 100.0, "vllm-fcfs+forcing": 75.0, "static-budget": 100.0}
    assert acc.comparisons["vllm-fcfs+forcing"].delta_pct == 33.3333  # +1/3, 6 significant digits
    assert acc.comparisons["vllm-fcfs+forcing"].flag is AbFlag.WIN
    assert acc.comparisons["static-budget"].flag is AbFlag.FLAT
    assert acc.comparisons["static-budget"].delta_pct == 0.0
    # Recomputed tokens 0 against 120: -100 %, a WIN; 0 against 0: flat, by absolute comparison.
    rec = rows["recomputed_tokens"]
    assert rec.values == {"meridian": 0.0, "vllm-fcfs+forcing": 120.0, "static-budget": 0.0}
    assert rec.comparisons["vllm-fcfs+forcing"].delta_pct == -100.0
    assert rec.comparisons["vllm-fcfs+forcing"].flag is AbFlag.WIN
    assert rec.comparisons["static-budget"].flag is AbFlag.FLAT
    assert rec.comparisons["static-budget"].delta_pct is None
    assert rows["preemptions_think"].comparisons["vllm-fcfs+forcing"].flag is AbFlag.FLAT
    assert rows["preemptions_output"].comparisons["vllm-fcfs+forcing"].flag is AbFlag.WIN
    assert rows["preemptions_output"].comparisons["static-budget"].flag is AbFlag.FLAT
    # Every request's answer gaps are 3 steps: equal everywhere.
    assert rows["worst_answer_gap_steps"].values["vllm-fcfs+forcing"] == 3.0
    assert rows["worst_answer_gap_steps"].comparisons["vllm-fcfs+forcing"].flag is AbFlag.FLAT


def test_ab_needs_the_candidate_and_known_baselines() -> None:
    r = report()
    with pytest.raises(MeridianError, match="candidate policy 'think-first'"):
        build_ab_report(r, candidate="think-first")
    with pytest.raises(MeridianError, match="not in the run"):
        build_ab_report(r, baselines=["vllm-priority"])
    only = build_ab_report(r, baselines=["static-budget"])
    assert only.baselines == ["static-budget"]
    assert set(only.rows[0].values) == {"meridian", "static-budget"}


def test_ab_report_files(tmp_path: Path) -> None:
    ab = build_ab_report(report())
    paths = write_ab_report(ab, tmp_path / "out")
    assert [p.name for p in paths] == ["ab-report.json", "ab-report.md"]
    assert load_report(paths[0], AbReport) == ab
    md = paths[1].read_text()
    assert (
        "| metric | unit | direction | `meridian` | `vllm-fcfs+forcing` | `static-budget` |" in md
    )
    assert "Δ vs `vllm-fcfs+forcing`" in md and "Δ vs `static-budget`" in md
    assert "-62.5 % WIN" in md  # output ITL P99 against vllm-fcfs+forcing: 21 vs 56 ms
    # Goodput per second of the 3-s arrival window: all 6 of Meridian's requests meet the SLO.
    assert "| goodput | requests/s | higher is better | 2 | 0 | 2 | base 0: WIN |" in md
    assert "## Where Meridian loses" in md
    assert "- **TTFVT P50** vs `static-budget`" in md
    assert "|Δ| < 2 % is FLAT" in md and "≥ 10 % worse is LOSS" in md
    assert "*model*" in md


# --- report.json / report.md ----------------------------------------------------------------------


def test_report_json_is_byte_identical_and_canonical(tmp_path: Path) -> None:
    a = write_report(report(), tmp_path / "a")
    b = write_report(report(), tmp_path / "b")
    assert a[0].read_bytes() == b[0].read_bytes()
    assert a[1].read_bytes() == b[1].read_bytes()
    text = a[0].read_text()
    assert text.endswith("}\n") and "\r" not in text
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert str(tmp_path) not in text
    data = json.loads(text)
    assert data["schema_version"] == 3
    assert data["summaries"]["meridian"]["output_itl_s"]["p50"] == 0.0205
    # The defaults of the run parameters added in schema version 2.
    assert data["engine"] == "model" and data["async_scheduling"] is False
    assert data["max_num_seqs"] is None and data["num_kv_blocks"] is None
    assert data["static_cap"] is None and data["forcing"] == []
    assert data["summaries"]["vllm-fcfs+forcing"]["num_scheduled_tokens"] == 5120
    assert data["summaries"]["vllm-fcfs+forcing"]["answer_accuracy_pct"] == 75.0
    assert "num_output_critical_evictions" not in data["summaries"]["meridian"]


def test_report_json_is_identical_in_another_process(tmp_path: Path) -> None:
    ours = write_report(report(), tmp_path / "here")[0].read_bytes()
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_report import report
        from meridian.bench.report_render import write_report
        write_report(report(), Path({str(tmp_path / "there")!r}))
        """
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    assert (tmp_path / "there" / "report.json").read_bytes() == ours


def test_report_round_trips_through_the_schema(tmp_path: Path) -> None:
    r = report()
    path = write_report(r, tmp_path)[0]
    again = load_report(path, SimReport)
    assert again == r
    assert isinstance(again.summaries["vllm-fcfs+forcing"], PolicySummary)
    data = json.loads(path.read_text())
    data["schema_version"] = 1  # a report of the previous schema is refused, not misread
    path.write_text(json.dumps(data))
    with pytest.raises(MeridianError, match=r"not a valid SimReport \(schema_version 3\)"):
        load_report(path, SimReport)
    with pytest.raises(MeridianError, match="report not found"):
        load_report(tmp_path / "missing.json", SimReport)


FORCING = [
    ForcingSummary(
        forcing="off",
        num_reasoning=4,
        think_tokens_avg=350.0,
        think_tokens_saved_pct=0.0,
        num_forced=0,
        answer_accuracy_pct=100.0,
    ),
    ForcingSummary(
        forcing="meridian",
        num_reasoning=4,
        think_tokens_avg=299.0,
        think_tokens_saved_pct=100 * 51 / 350,  # 14.571428...: stored as 14.5714
        num_forced=4,
        answer_accuracy_pct=75.0,
    ),
    ForcingSummary(
        forcing="static:280",
        num_reasoning=4,
        think_tokens_avg=280.0,
        think_tokens_saved_pct=20.0,
        num_forced=3,
        answer_accuracy_pct=50.0,
    ),
]
ENGINE_SHAPE: dict[str, Any] = {
    "engine": "vllm",
    "async_scheduling": True,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "num_kv_blocks": 4096,
}


def test_report_with_forcing_round_trips_as_schema_3(tmp_path: Path) -> None:
    r = report(static_cap=280, forcing=FORCING, **ENGINE_SHAPE)
    path = write_report(r, tmp_path)[0]
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3
    assert data["engine"] == "vllm" and data["async_scheduling"] is True
    assert (data["max_num_seqs"], data["max_num_batched_tokens"], data["num_kv_blocks"]) == (
        256,
        8192,
        4096,
    )
    assert data["static_cap"] == 280
    assert [f["forcing"] for f in data["forcing"]] == ["off", "meridian", "static:280"]
    assert data["forcing"][1] == {
        "forcing": "meridian",
        "num_reasoning": 4,
        "think_tokens_avg": 299.0,
        "think_tokens_saved_pct": 14.5714,
        "num_forced": 4,
        "answer_accuracy_pct": 75.0,
    }
    again = load_report(path, SimReport)
    assert again == r
    assert isinstance(again.forcing[0], ForcingSummary)
    # The A/B and the sweep carry the run parameters, not the forcing comparison.
    ab = build_ab_report(again)
    assert (ab.engine, ab.async_scheduling, ab.num_kv_blocks) == ("vllm", True, 4096)
    assert "forcing" not in json.loads(to_json(ab))
    sweep = build_sweep_report([again, report(8.0, **ENGINE_SHAPE)])
    assert sweep.engine == "vllm" and sweep.max_num_seqs == 256


def test_report_markdown_forcing_section_and_engine() -> None:
    md = render_markdown(report(static_cap=280, forcing=FORCING, **ENGINE_SHAPE))
    assert (
        "Engine: vLLM's own scheduler driven on virtual time (`--engine vllm`). Engine shape: "
        "max_num_seqs 256, max_num_batched_tokens 8,192, 4,096 KV blocks, chunked prefill and "
        "prefix caching on, asynchronous scheduling." in md
    )
    assert "## Forcing, apart from scheduling" in md
    section = md.split("## Forcing, apart from scheduling", 1)[1].split("\n## ", 1)[0]
    assert "`static-budget` ran at cap 280: the saving of Meridian's forcing." in section
    assert (
        "| forcing | think tokens avg | saved (%) | forced | answer accuracy (model, %) |"
        in section
    )
    assert "| `off` | 350 | 0 | 0 | 100 |" in section
    assert "| `meridian` | 299 | 14.57 | 4 | 75 |" in section
    assert "| `static:280` | 280 | 20 | 3 | 50 |" in section
    # Between the summary and the losses.
    assert md.index("## Summary") < md.index("## Forcing") < md.index("## Where Meridian loses")
    # Without a static cap the section says nothing about one.
    no_cap = render_markdown(report(forcing=FORCING[:2]))
    assert "## Forcing, apart from scheduling" in no_cap
    assert "ran at cap" not in no_cap and "`static:280`" not in no_cap
    synchronous = render_markdown(report(**{**ENGINE_SHAPE, "async_scheduling": False}))
    assert "prefix caching on, synchronous scheduling." in synchronous


def test_report_markdown_table_and_losses(tmp_path: Path) -> None:
    md = write_report(report(), tmp_path)[1].read_text()
    assert "| metric | unit | `meridian` | `vllm-fcfs+forcing` | `static-budget` |" in md
    assert "| output ITL P99 | ms | 21 | 56 | 22 |" in md
    assert "| premature force rate (model) | % forced |" in md
    assert "| recomputed tokens | tokens | 0 | 120 | 0 |" in md
    # Think tokens 260 / 300 / 300 (+ 13 i): 2000 + 10 x think + recomputed.
    assert "| computed tokens (work) | tokens | 4,600 | 5,120 | 5,000 |" in md
    assert "| answer accuracy (model) | % reasoning | 100 | 75 | 100 |" in md
    assert "OutputCritical" not in md
    assert "Engine: the fast engine model (`--engine model`)" in md
    assert "Engine shape" not in md  # no shape given
    assert "## Forcing, apart from scheduling" not in md  # no forcing given
    assert "## Where Meridian loses" in md
    # static-budget runs another forcing: its TTFVT win is forcing's, not scheduling's, so it is
    # no loss of Meridian's here (ab-report.json compares every policy when asked).
    assert "vs `static-budget`" not in md.split("## Where Meridian loses", 1)[1]
    assert "Nowhere on this run." not in md
    # Fewer think tokens over a similar makespan: the report must own the throughput loss.
    assert "- **throughput** vs `vllm-fcfs+forcing`: -4.1 % (loss)" in md


def test_markdown_says_nowhere_when_meridian_never_loses() -> None:
    # Meridian against its own twin: everything FLAT, no loss to list.
    meridian = report().summaries["meridian"]
    r = report(
        policies=["meridian", "pascal+forcing"],
        summaries={
            "meridian": meridian,
            "pascal+forcing": meridian.model_copy(update={"policy": "pascal+forcing"}),
        },
    )
    md = render_markdown(r)
    section = md.split("## Where Meridian loses", 1)[1]
    assert section.lstrip().startswith("Nowhere on this run.")


def test_report_rejects_bad_parameters() -> None:
    with pytest.raises(ValidationError, match="not an absolute path"):
        report(workload="/home/me/traces/mixed.jsonl")
    with pytest.raises(ValidationError, match="same policies"):
        report(policies=["meridian", "vllm-fcfs+forcing"])
    good = report()
    with pytest.raises(ValidationError, match="holds policy"):
        report(summaries={**good.summaries, "meridian": good.summaries["vllm-fcfs+forcing"]})


# --- sweep ----------------------------------------------------------------------------------------


def test_sweep_report(tmp_path: Path) -> None:
    sweep = build_sweep_report([report(8.0), report(2.0)])
    assert sweep.arrival_rates == [2.0, 8.0]
    point = sweep.points[0]
    assert set(point.goodput_req_s) == set(POLICIES)
    assert point.goodput_req_s["meridian"] == point.summaries["meridian"].goodput_req_s
    assert point.output_itl_p99_s["vllm-fcfs+forcing"] == pytest.approx(0.056)
    paths = write_sweep_report(sweep, tmp_path)
    assert [p.name for p in paths] == ["sweep-report.json", "sweep-report.md"]
    assert load_report(paths[0], SweepReport) == sweep
    md = paths[1].read_text()
    assert "## Goodput (requests/s)" in md and "## Output ITL P99 (ms)" in md
    assert "| 2 | " in md and "| 8 | " in md
    assert "**TTFVT P50** vs `static-budget`" not in md  # another forcing: not a loss
    assert "- at 2 requests/s: **throughput** vs `vllm-fcfs+forcing`" in md


def test_sweep_rejects_mismatched_runs() -> None:
    with pytest.raises(MeridianError, match="differ in \\['seed'\\]"):
        build_sweep_report([report(2.0), report(4.0, seed=8)])
    with pytest.raises(MeridianError, match="differ in \\['engine', 'num_kv_blocks'\\]"):
        build_sweep_report([report(2.0), report(4.0, engine="vllm", num_kv_blocks=64)])
    with pytest.raises(MeridianError, match="distinct"):
        build_sweep_report([report(2.0), report(2.0)])
    with pytest.raises(MeridianError, match="at least one"):
        build_sweep_report([])


def test_builder_matches_the_records_it_claims() -> None:
    # Guards the fixtures above: the meridian run has 20/21 ms gaps and the SLOs hold.
    r = report()
    s = r.summaries["meridian"]
    assert s.output_itl_s.p50 == pytest.approx(0.0205)
    assert s.num_slo_met == 6 and s.num_finished == 6
    assert r.summaries["vllm-fcfs+forcing"].num_slo_met == 0


def test_offered_load_of_generated_and_replayed_requests() -> None:
    """A bundled workload's rate is its count over the run's duration; a trace's is taken
    between its first and last arrival; the peak is the fullest 10-s bin."""
    specs = [
        RequestSpec(f"r{i}", t * NS_PER_S, 100, 50 * (i % 2), 20, kind)
        for i, (t, kind) in enumerate(
            [(0.0, RequestKind.CHAT), (1.0, RequestKind.REASONING), (1.5, RequestKind.CHAT),
             (2.0, RequestKind.REASONING), (30.0, RequestKind.CHAT)]
        )
    ]  # fmt: skip
    generated = offered_load(specs, duration_s=40.0)
    assert (generated.num_requests, generated.num_reasoning) == (5, 2)
    assert generated.rate_req_s == 5 / 40 and generated.peak_rate_req_s == 4 / 10
    assert generated.think_tokens_mean == 50 and generated.answer_tokens_mean == 20
    gaps = np.diff([0.0, 1.0, 1.5, 2.0, 30.0])
    assert generated.interarrival_cv == pytest.approx(gaps.std() / gaps.mean(), rel=1e-5)
    assert offered_load(specs, duration_s=None).rate_req_s == pytest.approx(4 / 30, rel=1e-5)
    single = offered_load(specs[:1], duration_s=None)
    assert single.rate_req_s is None and single.interarrival_cv is None
    assert single.think_tokens_mean is None


def test_reports_state_the_offered_load(tmp_path: Path) -> None:
    load = offered_load([RequestSpec("r0", 0, 10, 0, 5, RequestKind.CHAT)], duration_s=2.0)
    with_load = report(offered=load)
    assert "Load: offered 1 requests (0 reasoning; 0.5 req/s" in render_markdown(with_load)
    write_report(with_load, tmp_path)
    assert load_report(tmp_path / "report.json", SimReport).offered == load
    assert build_ab_report(with_load).offered == load
    assert "Load:" not in render_markdown(report())  # a report that does not know it
    sweep = build_sweep_report([report(2.0, offered=load), report(4.0, offered=load)])
    write_sweep_report(sweep, tmp_path)
    text = (tmp_path / "sweep-report.md").read_text()
    assert "- at 2 requests/s: Load: offered 1 requests" in text


# --- scheduling and forcing apart -----------------------------------------------------------------


def _pairs() -> dict[str, PolicySummary]:
    """Meridian's scheduler beats FCFS with forcing on (20 vs 55 ms gaps); with forcing off the
    two schedulers are the same run; forcing saves think tokens under either scheduler."""
    runs = {
        "meridian": run("meridian", 20, 1500, think=260),
        "vllm-fcfs+forcing": run("vllm-fcfs+forcing", 55, 1600, output_preemptions=4),
        "meridian-sched": run("meridian-sched", 20, 1500, think=380),
        "vllm-fcfs": run("vllm-fcfs", 20, 1500, think=380),
    }
    return {p: summarize(r, SloSpec()) for p, r in runs.items()}


def test_effects_hold_the_other_thing_equal_and_say_when_nothing_changed() -> None:
    lines = effect_lines(_pairs())
    text = "\n".join(lines)
    assert lines[0] == "What scheduling did (forcing held equal):"
    assert lines[1].startswith("  meridian vs vllm-fcfs+forcing: output ITL P99 21 vs 56 ms")
    assert "(-62 % WIN)" in lines[1]
    assert lines[2] == (
        "  meridian-sched vs vllm-fcfs: scheduling changed nothing at this load (every "
        "headline metric within 2 %)."
    )
    assert "What forcing did (scheduling held equal):" in text
    forcing = next(x for x in lines if x.startswith("  meridian vs meridian-sched:"))
    assert "think tokens avg" in forcing and "WIN" in forcing
    assert "entropy model: an assumption" in text
    assert [e.kind for e in effects(_pairs())] == ["scheduling", "scheduling", "forcing", "forcing"]


def test_win_and_loss_only_against_the_baselines_with_the_same_forcing() -> None:
    summaries = _pairs()
    r = report(policies=list(summaries), summaries=summaries)
    assert ab_baselines(r) == ["vllm-fcfs+forcing"]
    assert ab_baselines(r, "meridian-sched") == ["vllm-fcfs"]
    assert (
        ab_baselines(report(policies=list(summaries), summaries=summaries, engine="real")) is None
    )
    md = render_markdown(r)
    assert "## Scheduling and forcing, each with the other held equal" in md
    assert "meridian-sched vs vllm-fcfs: scheduling changed nothing at this load" in md
    losses = md.split("## Where Meridian loses", 1)[1]
    assert "vs `vllm-fcfs`" not in losses and "vs `meridian-sched`" not in losses
