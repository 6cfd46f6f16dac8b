"""Plots: every PNG is written and is a real PNG of the expected size (drawing time:
``benchmarks/bench_plots.py``)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from meridian.bench.plots import write_cluster_plots, write_plots, write_sweep_plots
from meridian.bench.report import SimReport, build_sweep_report
from meridian.bench.slo import SloSpec
from meridian.bench.summary import summarize
from meridian.core.types import ForceReason, Phase
from meridian.errors import MeridianError
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestKind

MS = 1_000_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PLOTS = [
    "cdf-output-itl.png",
    "cdf-ttfvt.png",
    "cdf-ttot.png",
    "think-tokens.png",
    "kv-usage.png",
    "queue-depth.png",
]
POLICIES = ["meridian", "vllm-fcfs", "vllm-priority", "static-budget", "think-first"]


def run(policy: str, num_requests: int, gap_ms: int, *, chat_only: bool = False) -> SimResult:
    """A deterministic synthetic run: arrivals every 100 ms, a stall every 7th request."""
    records = []
    for i in range(num_requests):
        reasoning = not chat_only and i % 4 != 0
        arrival = i * 100 * MS
        think = 200 + (i * 37) % 900 if reasoning else 0
        first_answer = arrival + (think * 2 + 80) * MS
        num_answers = 20 + i % 40
        answers = [first_answer]
        for k in range(1, num_answers):
            stall = 300 if i % 7 == 0 and k == 5 else 0
            answers.append(answers[-1] + (gap_ms + (i + k) % 9 + stall) * MS)
        records.append(
            RequestRecord(
                request_id=f"r{i}",
                kind=RequestKind.REASONING if reasoning else RequestKind.CHAT,
                arrival_ns=arrival,
                num_prompt_tokens=64,
                num_think_tokens_requested=think + (50 if i % 3 == 0 else 0),
                num_answer_tokens_requested=num_answers,
                settle_token=think - 10 if reasoning else None,
                first_token_ns=arrival + 40 * MS,
                think_end_ns=first_answer - 30 * MS if reasoning else None,
                first_answer_ns=first_answer,
                finish_ns=answers[-1],
                num_think_tokens=think,
                num_answer_tokens=num_answers,
                forced_reason=ForceReason.CONVERGED if reasoning and i % 3 == 0 else None,
                answer_token_ns=answers,
                answer_token_step=list(range(num_answers)),
            )
        )
    end = max(r.answer_token_ns[-1] for r in records)
    samples = [
        TimeSample(t * 20 * MS, (t * 7) % 500, (t * 3) % 200, 16, 4, t % 6, t % 11)
        for t in range(end // (20 * MS))
    ]
    counters = RunCounters(num_steps=len(samples), preemptions_by_phase={Phase.THINK: 1})
    return SimResult(policy, "model", 512, records, samples, counters, end_ns=end)


def assert_pngs(paths: list[Path], names: list[str], min_bytes: int = 8_000) -> None:
    assert [p.name for p in paths] == names
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC, p
        assert len(data) > min_bytes, (p, len(data))
        width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
        assert width >= 700 and height >= 450, (p, width, height)


def test_plots_from_raw_results(tmp_path: Path) -> None:
    runs = {p: run(p, 120, 15 + 5 * i) for i, p in enumerate(POLICIES)}
    paths = write_plots(runs, tmp_path / "plots", SloSpec())
    assert_pngs(paths, RUN_PLOTS)
    # 8 x 5 inches at 100 dpi.
    assert struct.unpack(">II", paths[0].read_bytes()[16:24]) == (800, 500)


def test_plots_from_summaries(tmp_path: Path) -> None:
    slo = SloSpec()
    summaries = {p: summarize(run(p, 80, 20 + 3 * i), slo) for i, p in enumerate(POLICIES[:3])}
    assert_pngs(write_plots(summaries, tmp_path), RUN_PLOTS)


def test_plots_without_reasoning_requests(tmp_path: Path) -> None:
    # No TTOT and no think tokens anywhere: the figures still exist and say "no data".
    runs = {"meridian": run("meridian", 30, 20, chat_only=True)}
    assert_pngs(write_plots(runs, tmp_path), RUN_PLOTS, min_bytes=4_000)


def test_nothing_to_plot_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(MeridianError, match="nothing to plot"):
        write_plots({}, tmp_path)


def test_sweep_plots(tmp_path: Path) -> None:
    slo = SloSpec()
    reports = []
    for rate in (2.0, 4.0, 8.0, 16.0):
        gap = int(10 + rate * 3)
        summaries = {p: summarize(run(p, 40, gap + 4 * i), slo) for i, p in enumerate(POLICIES)}
        reports.append(
            SimReport(
                workload="mixed",
                seed=1,
                duration_s=4.0,
                hardware="h100-sxm",
                model="qwen3-8b",
                slo=slo,
                policies=POLICIES,
                arrival_rate=rate,
                summaries=summaries,
            )
        )
    paths = write_sweep_plots(build_sweep_report(reports), tmp_path / "sweep")
    assert_pngs(paths, ["sweep-goodput.png", "sweep-output-itl-p99.png"])


@pytest.mark.slow
def test_five_policies_of_2000_requests_plot(tmp_path: Path) -> None:
    runs = {p: run(p, 2000, 15 + 5 * i) for i, p in enumerate(POLICIES)}
    assert_pngs(write_plots(runs, tmp_path / "big", SloSpec()), RUN_PLOTS)


def test_cluster_plots(tmp_path: Path) -> None:
    rows = {
        (load, f"{router}/{policy}"): {"ttfvt": 30.0 * load + i, "goodput": 2.0 * load - i / 10}
        for load in (0.5, 0.7, 1.0, 1.3)
        for i, router in enumerate(("meridian", "pow2", "round-robin"))
        for policy in ("meridian", "vllm-fcfs+forcing")
    }
    # A missing cell breaks its line rather than failing the plot.
    del rows[(1.3, "pow2/vllm-fcfs+forcing")]
    path = write_cluster_plots(rows, "4 x h100-sxm / qwen3-8b", tmp_path / "c" / "cluster.png")
    assert_pngs([path], ["cluster.png"], min_bytes=20_000)
