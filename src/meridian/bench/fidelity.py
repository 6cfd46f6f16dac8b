"""``meridian bench fidelity``: does the fast engine model agree with vLLM's own scheduler?

Both engines run the same policy on the same streams, with synchronous scheduling (the fast
engine models that loop); per policy the report compares steps, makespan, preemptions by phase
and the per-request finish time. Targets (:data:`TARGETS`): steps within 1 %, median per-request
|finish-time difference| at most 3 % of the request's latency on vLLM, preemptions by phase
within 10 % (or one preemption, for small counts). With ``--async`` each policy also runs on
vLLM's ``AsyncScheduler`` (the GPU default; step ``k + 1`` is scheduled while step ``k`` runs), and
a second table compares the fast engine with it: a measure of what the fast engine, synchronous
only, does not model, with no targets (``async_rows``; ``passed`` reads ``rows`` only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from meridian.bench.report_render import fmt
from meridian.bench.summary import Sig6
from meridian.core.types import Phase
from meridian.sim.records import SimResult

STEPS_WITHIN_PCT = 1.0
FINISH_MEDIAN_WITHIN_PCT = 3.0
PREEMPTIONS_WITHIN_PCT = 10.0
TARGETS = (
    f"steps within {STEPS_WITHIN_PCT:g} %; median per-request |finish-time difference| ≤ "
    f"{FINISH_MEDIAN_WITHIN_PCT:g} % of the request's latency on vLLM; preemptions by phase "
    f"within {PREEMPTIONS_WITHIN_PCT:g} % (at least 1 preemption of slack)"
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnginePair(_Model):
    """One figure on both engines."""

    model: Sig6
    vllm: Sig6


class FidelityRow(_Model):
    """One policy on both engines."""

    policy: str
    steps: EnginePair
    makespan_s: EnginePair
    preemptions_think: EnginePair
    preemptions_output: EnginePair
    finish_diff_p50_pct: Sig6
    finish_diff_p90_pct: Sig6
    passed: bool


def _pct_diff(a: float, b: float) -> float:
    return 0.0 if a == b else 100.0 * abs(a - b) / max(abs(b), 1e-12)


def _counts_agree(a: int, b: int) -> bool:
    return abs(a - b) <= max(1.0, PREEMPTIONS_WITHIN_PCT / 100.0 * max(a, b))


def compare(model: SimResult, vllm: SimResult) -> FidelityRow:
    """Compare one policy's run on the fast engine with its run on vLLM's scheduler."""
    if model.policy != vllm.policy:
        raise ValueError(f"different policies: {model.policy} and {vllm.policy}")
    by_id = {r.request_id: r for r in model.records}
    diffs = []
    for ref in vllm.records:
        other = by_id.get(ref.request_id)
        if ref.finish_ns is None or other is None or other.finish_ns is None:
            continue
        latency = max(ref.finish_ns - ref.arrival_ns, 1)
        diffs.append(100.0 * abs(other.finish_ns - ref.finish_ns) / latency)
    p50, p90 = np.percentile(diffs, [50, 90]) if diffs else (0.0, 0.0)

    def count(result: SimResult, phase: Phase) -> int:
        return result.counters.preemptions_by_phase.get(phase, 0)

    steps = EnginePair(model=model.counters.num_steps, vllm=vllm.counters.num_steps)
    think = EnginePair(model=count(model, Phase.THINK), vllm=count(vllm, Phase.THINK))
    output = EnginePair(model=count(model, Phase.OUTPUT), vllm=count(vllm, Phase.OUTPUT))
    passed = (
        _pct_diff(steps.model, steps.vllm) <= STEPS_WITHIN_PCT
        and float(p50) <= FINISH_MEDIAN_WITHIN_PCT
        and _counts_agree(int(think.model), int(think.vllm))
        and _counts_agree(int(output.model), int(output.vllm))
    )
    return FidelityRow(
        policy=vllm.policy,
        steps=steps,
        makespan_s=EnginePair(model=_makespan(model), vllm=_makespan(vllm)),
        preemptions_think=think,
        preemptions_output=output,
        finish_diff_p50_pct=float(p50),
        finish_diff_p90_pct=float(p90),
        passed=passed,
    )


def _makespan(result: SimResult) -> float:
    finishes = [r.finish_ns for r in result.records if r.finish_ns is not None]
    if not finishes:
        return 0.0
    return (max(finishes) - min(r.arrival_ns for r in result.records)) / 1e9


class FidelityReport(_Model):
    """``fidelity.json``: the run and one row per policy."""

    schema_version: int = 1
    workload: str
    arrival_rate: Sig6
    duration_s: Sig6
    seed: int
    hardware: str
    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    targets: str = TARGETS
    rows: list[FidelityRow]
    async_rows: list[FidelityRow] = []

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)


def _pair(pair: EnginePair, scale: float = 1.0) -> list[str]:
    delta = _pct_diff(pair.model, pair.vllm)
    return [fmt(pair.model * scale), fmt(pair.vllm * scale), f"{delta:.2f}"]


def table_rows(rows: Sequence[FidelityRow], *, with_targets: bool = True) -> list[list[str]]:
    """The cells of the fidelity table (Markdown and the terminal share them); without the
    targets column for the asynchronous comparison."""
    return [
        [
            f"`{row.policy}`",
            *_pair(row.steps),
            *_pair(row.makespan_s),
            f"{fmt(row.preemptions_think.model)} / {fmt(row.preemptions_think.vllm)}",
            f"{fmt(row.preemptions_output.model)} / {fmt(row.preemptions_output.vllm)}",
            f"{row.finish_diff_p50_pct:.2f}",
            f"{row.finish_diff_p90_pct:.2f}",
            *(("PASS" if row.passed else "MISS",) if with_targets else ()),
        ]
        for row in rows
    ]


HEADER = (
    "policy",
    "steps model",
    "steps vLLM",
    "Δ %",
    "makespan model (s)",
    "makespan vLLM (s)",
    "Δ %",
    "think preemptions model / vLLM",
    "output preemptions model / vLLM",
    "finish Δ P50 (%)",
    "finish Δ P90 (%)",
    "targets",
)
ASYNC_HEADER = tuple(title.replace("vLLM", "vLLM async") for title in HEADER if title != "targets")
ASYNC_TITLE = "the fast engine (synchronous) against vLLM's AsyncScheduler"
ASYNC_NOTE = (
    "No targets: the fast engine schedules synchronously only; these differences are what it "
    "does not model of vLLM's asynchronous loop (figures on vLLM's scheduler with --engine vllm "
    "run it)."
)


def render_markdown(report: FidelityReport) -> str:
    """``fidelity.md``."""
    caching = "on" if report.enable_prefix_caching else "off"
    lines = [
        "# Fidelity: the fast engine model against vLLM's scheduler",
        "",
        f"Workload `{report.workload}`, {fmt(report.arrival_rate)} requests/s for "
        f"{fmt(report.duration_s)} s, seed {report.seed}; `{report.hardware}` / "
        f"`{report.model}` step times; max_num_seqs {fmt(report.max_num_seqs)}, "
        f"max_num_batched_tokens {fmt(report.max_num_batched_tokens)}, "
        f"{fmt(report.num_kv_blocks)} KV blocks, prefix caching {caching}, synchronous "
        "scheduling on both engines.",
        "",
        f"Targets: {report.targets}.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---"] + ["--:"] * (len(HEADER) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(report.rows)]
    lines += ["", "Every target met." if report.passed else "Some target was missed.", ""]
    if report.async_rows:
        lines += [
            f"## {ASYNC_TITLE[0].upper()}{ASYNC_TITLE[1:]}",
            "",
            ASYNC_NOTE,
            "",
            "| " + " | ".join(ASYNC_HEADER) + " |",
            "|" + "|".join(["---"] + ["--:"] * (len(ASYNC_HEADER) - 1)) + "|",
        ]
        lines += [
            "| " + " | ".join(cells) + " |"
            for cells in table_rows(report.async_rows, with_targets=False)
        ]
        lines.append("")
    return "\n".join(lines)
