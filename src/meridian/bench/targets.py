"""The headline's evidence: Meridian against stock vLLM (forcing held equal) and the Pascal-like
baseline over a load sweep around the engine's capacity, per workload, every target marked.

``benchmarks/bench_targets.py`` runs the sweep and writes one :class:`TargetsRun` (JSON,
committed under ``benchmarks/results/``); :mod:`meridian.bench.targets_render` turns it into the
README's and docs' tables. A cell is one policy at one rate: ``duration_s`` of the workload (seed
``seed``) at ``load x capacity`` requests/s, on vLLM's own ``AsyncScheduler`` driven on virtual
time (``--engine vllm``) at vLLM's defaults for the hardware.

Capacity: the highest rate at which stock vLLM's queue stays bounded over the run, found with
this sweep (``--rates`` around it) and checked in every run: over the last third of the
arrival window the waiting queue averages at most max(8, 1.25 x its average over the middle
third).

The targets (:data:`TARGETS_TEXT`), each against stock with the same forcing: at loads up to
:data:`LIGHT` every metric within +-3 %; the worst answer stall at most 2 steps in every run;
from :data:`HEAVY` up answer ITL P99 <= 0.7x, TTFVT P95 <= 0.85x and <= Pascal's, TTFT P95 <=
1.25x, throughput >= 0.99x, recomputed tokens <= stock's, goodput >= 1.2x.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from meridian.bench.offered import OfferedLoad

STOCK, MERIDIAN, PASCAL = "vllm-fcfs+forcing", "meridian", "pascal+forcing"
POLICIES = (STOCK, MERIDIAN, PASCAL)
# Requests/s at which stock vLLM's queue stays bounded over 10 minutes, found with this sweep
# (docs/benchmarks.md has the runs that bracket each one).
CAPACITY: dict[tuple[str, str, str], float] = {
    ("synthetic", "qwen3-8b", "h100-sxm"): 5.5,
    # vllm-fcfs+forcing, 600 s, seed 0: bounded at 1.4, 1.6, 1.8 and 1.9 req/s, grows at 2.0.
    ("servegen-r1", "qwen3-8b", "h100-sxm"): 1.9,
    ("synthetic", "qwen3-32b", "h100-sxm"): 0.88,
}
LOADS = (0.5, 0.7, 0.9, 1.0, 1.1, 1.2)
LIGHT, HEAVY = 0.7, 0.9
LIGHT_TOLERANCE = 0.03
MAX_ANSWER_GAP_STEPS = 2
# (field, label, target from HEAVY up: ("le" | "ge", ratio to stock's); recomputed: <= stock's)
METRICS: tuple[tuple[str, str, tuple[str, float] | None], ...] = (
    ("itl_p99_ms", "answer ITL P99 ms", ("le", 0.7)),
    ("ttfvt_p95_s", "TTFVT P95 s", ("le", 0.85)),
    ("ttft_p95_s", "TTFT P95 s", ("le", 1.25)),
    ("throughput_tok_s", "throughput tok/s", ("ge", 0.99)),
    ("goodput_req_s", "goodput req/s", ("ge", 1.2)),
    ("recomputed_tokens", "recomputed tokens", None),
)
TARGETS_TEXT = (
    f"light load (up to {LIGHT:.0%} of capacity) every metric within ±{LIGHT_TOLERANCE:.0%} of "
    f"stock's; the worst answer stall ≤ {MAX_ANSWER_GAP_STEPS} steps in every run; from "
    f"{HEAVY:.0%} up answer ITL P99 ≤ 0.7×, TTFVT P95 ≤ 0.85× and ≤ Pascal's, TTFT P95 ≤ 1.25×, "
    "throughput ≥ 0.99×, recomputed tokens ≤ stock's, goodput ≥ 1.2×"
)


@dataclass(frozen=True)
class Cell:
    """One run of the sweep. ``policy`` may be ``NAME@field=value@...``: policy NAME with those
    ``[scheduler]`` fields (an ablation)."""

    workload: str
    model: str
    hardware: str
    engine: str
    rate: float
    policy: str
    duration_s: float
    seed: int = 0


def parse_variant(policy: str) -> tuple[str, dict[str, Any]]:
    """``NAME@field=value@...`` -> (NAME, the ``[scheduler]`` fields it sets)."""
    name, *settings = policy.split("@")
    fields: dict[str, Any] = {}
    for item in settings:
        key, _, raw = item.partition("=")
        try:
            fields[key] = float(raw) if "." in raw else int(raw)
        except ValueError:
            fields[key] = raw
    return name, fields


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CellResult(_Model):
    """One cell's figures, and what its slowest requests waited for."""

    workload: str
    policy: str
    rate: float
    wall_s: float
    num_requests: int
    itl_p99_ms: float | None
    ttfvt_p95_s: float | None
    ttft_p95_s: float | None
    throughput_tok_s: float | None
    goodput_req_s: float | None
    recomputed_tokens: int
    preemptions_think: int
    preemptions_answer: int
    worst_answer_gap_steps: int | None
    # Stock's queue over the arrival window: the capacity check.
    waiting_mid: float
    waiting_last: float
    queue_bounded: bool
    requests_in_cache: float
    # The requests at or above TTFVT P95: seconds queued (arrival to first token), seconds
    # reasoning (first token to first answer token), and that time per think token.
    ttfvt_top_wait_s: float
    ttfvt_top_think_s: float
    ttfvt_top_ms_per_think_token: float
    ttfvt_top_preempted_pct: float
    # Why requests fell out of goodput: late first answer, answer gaps over the ITL SLO, a
    # wrong answer (entropy model); a request can miss on several counts.
    slo_missed_ttfvt: int
    slo_missed_itl: int
    slo_wrong_answer: int
    # The P99 answer gap in engine steps (1: every answer stream got a token every step, so
    # answer ITL P99 is a step's duration) and the mean share of the KV cache in use.
    itl_p99_gap_steps: float | None
    kv_used_mean: float
    # Engine steps, and first arrival to last finish over them: a step's mean length.
    num_steps: int
    step_ms_mean: float | None


class WorkloadSweep(_Model):
    """One workload's sweep: its capacity, the offered load per rate, every cell."""

    workload: str
    capacity_req_s: float
    offered: dict[str, OfferedLoad]
    cells: list[CellResult]

    def cell(self, rate: float, policy: str) -> CellResult | None:
        return next((c for c in self.cells if c.rate == rate and c.policy == policy), None)

    @property
    def rates(self) -> list[float]:
        return sorted({c.rate for c in self.cells})


class TargetsRun(_Model):
    """``benchmarks/results/targets-*.json``: how the sweep ran, and every cell."""

    schema_version: int = 1
    command: str
    engine: str
    scheduler: str
    vllm_version: str | None
    commit: str
    uncommitted_changes: bool
    date: str
    model: str
    hardware: str
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int
    duration_s: float
    jobs: int
    wall_s: float
    targets: str = TARGETS_TEXT
    workloads: list[WorkloadSweep]

    def sweep(self, workload: str) -> WorkloadSweep:
        for sweep in self.workloads:
            if sweep.workload == workload:
                return sweep
        raise KeyError(f"no {workload!r} sweep in this run")


# -- running one cell ---------------------------------------------------------------------------


def run_cell(
    cell: Cell, on_progress: Callable[[int, int], None] | None = None
) -> tuple[CellResult, OfferedLoad]:
    """Run one cell; ``on_progress(finished, total)`` as requests finish."""
    from meridian.bench.offered import offered_load
    from meridian.bench.simrun import (
        SimRunSpec,
        StreamSet,
        engine_config_for,
        load_requests,
        run_policy,
    )
    from meridian.bench.summary import summarize
    from meridian.config import MeridianConfig, SchedulerConfig
    from meridian.sim.policies import parse_policy

    name, fields = parse_variant(cell.policy)
    spec = SimRunSpec(
        workload=cell.workload,
        arrival_rate=cell.rate,
        duration_s=cell.duration_s,
        engine=cell.engine,
        model=cell.model,
        hardware=cell.hardware,
        config=MeridianConfig(scheduler=SchedulerConfig(**fields)),
        seed=cell.seed,
    )
    requests = load_requests(spec, cell.rate)
    total = len(requests)
    hook = None if on_progress is None else (lambda done: on_progress(done, total))
    started = time.perf_counter()
    result = run_policy(spec, parse_policy(name), StreamSet(requests, spec.config), hook)
    wall = time.perf_counter() - started
    s = summarize(result, spec.slo)
    shape = engine_config_for(spec)
    figures = _diagnose(
        result, spec.slo, cell.duration_s, shape.num_kv_blocks * shape.block_size_tokens
    )
    row = CellResult(
        workload=cell.workload,
        policy=cell.policy,
        rate=cell.rate,
        wall_s=round(wall, 1),
        num_requests=s.num_requests,
        itl_p99_ms=None if s.output_itl_s.p99 is None else s.output_itl_s.p99 * 1e3,
        ttfvt_p95_s=s.ttfvt_s.p95,
        ttft_p95_s=s.ttft_s.p95,
        throughput_tok_s=s.throughput_tok_s,
        goodput_req_s=s.goodput_req_s,
        recomputed_tokens=s.num_recomputed_tokens,
        preemptions_think=s.preemptions.think,
        preemptions_answer=s.preemptions.output,
        worst_answer_gap_steps=s.worst_answer_gap_steps,
        num_steps=result.counters.num_steps,
        step_ms_mean=(
            None
            if s.makespan_s is None or not result.counters.num_steps
            else 1e3 * s.makespan_s / result.counters.num_steps
        ),
        **figures,
    )
    return row, offered_load(requests, cell.duration_s)


def _diagnose(result: Any, slo: Any, duration_s: float, cache_tokens: int) -> dict[str, Any]:
    """The per-request figures behind a cell: the capacity check and what the slowest waited
    for (module docstring of :class:`CellResult`)."""
    from meridian.bench.summary import answer_gaps_ns, meets_slo

    end_ns = duration_s * 1e9
    waiting = [(x.time_ns, x.num_waiting) for x in result.samples if x.time_ns <= end_ns]
    mid = [w for t, w in waiting if end_ns / 3 <= t < 2 * end_ns / 3]
    last = [w for t, w in waiting if t >= 2 * end_ns / 3]
    mid_q, last_q = (float(np.mean(v)) if v else 0.0 for v in (mid, last))
    records = result.records
    finished = [r for r in records if r.finish_ns is not None]
    sizes = [r.num_prompt_tokens + r.num_think_tokens + r.num_answer_tokens for r in finished]
    answered = [r for r in records if r.first_answer_ns is not None]
    ttfvt = np.array([r.first_answer_ns - r.arrival_ns for r in answered], dtype=np.float64)
    top = [r for r, t in zip(answered, ttfvt, strict=True) if t >= np.percentile(ttfvt, 95)]
    n_top = max(len(top), 1)
    top_think = sum(r.first_answer_ns - r.first_token_ns for r in top) / 1e9 / n_top
    top_think_tokens = sum(r.num_think_tokens for r in top) / n_top
    missed_ttfvt = missed_itl = wrong = 0
    for r in finished:
        if meets_slo(r, slo):
            continue
        wrong += r.answer_correct is False
        assert r.first_answer_ns is not None
        missed_ttfvt += (r.first_answer_ns - r.arrival_ns) / 1e9 > slo.ttfvt_slo_s(
            r.num_think_tokens_requested
        )
        gaps = answer_gaps_ns(r)
        missed_itl += bool(gaps.size) and np.percentile(gaps, 95) / 1e9 > slo.output_itl_s
    steps = [np.diff(r.answer_token_step) for r in records if len(r.answer_token_step) > 1]
    gap_steps = np.concatenate(steps) if steps else np.zeros(0)
    capacity = max(result.num_kv_blocks, 1)
    kv = [x.num_kv_blocks_used / capacity for x in result.samples if x.time_ns <= end_ns]
    return {
        "waiting_mid": mid_q,
        "waiting_last": last_q,
        "queue_bounded": last_q <= max(8.0, 1.25 * mid_q),
        "requests_in_cache": cache_tokens / float(np.mean(sizes)) if sizes else 0.0,
        "ttfvt_top_wait_s": sum(r.first_token_ns - r.arrival_ns for r in top) / 1e9 / n_top,
        "ttfvt_top_think_s": top_think,
        "ttfvt_top_ms_per_think_token": 1e3 * top_think / max(top_think_tokens, 1.0),
        "ttfvt_top_preempted_pct": 100.0 * sum(bool(r.preemptions_by_phase) for r in top) / n_top,
        "slo_missed_ttfvt": missed_ttfvt,
        "slo_missed_itl": missed_itl,
        "slo_wrong_answer": wrong,
        "itl_p99_gap_steps": float(np.percentile(gap_steps, 99)) if gap_steps.size else None,
        "kv_used_mean": float(np.mean(kv)) if kv else 0.0,
    }


# -- the targets --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; 1 when both are 0; ``None`` when undefined."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def check(
    load: float, field: str, m: CellResult, b: CellResult, p: CellResult | None
) -> tuple[float | None, bool | None]:
    """Meridian's ratio to stock on ``field`` at ``load`` and whether it meets the target
    (``None``: no target between the light and the heavy band)."""
    target = dict((f, t) for f, _, t in METRICS)[field]
    mine, theirs = getattr(m, field), getattr(b, field)
    r = ratio(mine, theirs)
    if load <= LIGHT + 1e-9:
        return r, mine == theirs or (r is not None and abs(r - 1.0) <= LIGHT_TOLERANCE)
    if load < HEAVY - 1e-9:
        return r, None
    if target is None:
        return r, mine <= theirs
    op, bound = target
    ok = r is not None and (r <= bound if op == "le" else r >= bound)
    if field == "ttfvt_p95_s" and p is not None and p.ttfvt_p95_s is not None:
        ok = ok and mine <= p.ttfvt_p95_s
    return r, ok


def gap_ok(m: CellResult) -> bool:
    """The worst answer stall target, which holds at every load."""
    return m.worst_answer_gap_steps is None or m.worst_answer_gap_steps <= MAX_ANSWER_GAP_STEPS


def better(field: str, mine: float, theirs: float) -> bool:
    """Whether ``mine`` is better than ``theirs`` on ``field`` (throughput and goodput up)."""
    return mine > theirs if field in ("throughput_tok_s", "goodput_req_s") else mine < theirs
