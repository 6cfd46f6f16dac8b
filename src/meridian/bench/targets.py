"""The headline's evidence: Meridian against stock vLLM (forcing held equal) and the Pascal-like
baseline over a load sweep around the engine's capacity, per workload, several seeds, every
target (:data:`TARGETS_TEXT`, issue 44) marked.

``benchmarks/bench_targets.py`` runs the sweep and writes one :class:`TargetsRun` (JSON,
committed under ``benchmarks/results/``); :mod:`meridian.bench.targets_render` turns it into the
README's and docs' tables. A cell is one policy at one rate and one seed: ``duration_s`` of the
workload at ``load x capacity`` requests/s, on vLLM's own ``AsyncScheduler`` driven on virtual
time (``--engine vllm``) at vLLM's defaults for the hardware.

How a cell is measured (:mod:`meridian.bench.loads`, :mod:`meridian.bench.slo`): per workload
and seed one trace, drawn at the highest rate and thinned to each (a higher load holds every
request of a lower one); no statistic counts the arrivals of the first ``warmup_s`` seconds; SLO
attainment is from each request's latency on an idle engine of the same shape, at scales 1.5-10,
reasoning hidden and shown, and goodput is the requests meeting it at 3x per second of the
arrival window. Each cell records its peak KV use, longest waiting queue and preempted requests;
a load where neither policy preempted or queued anything in any seed is marked "no contention"
(every scheduler must tie there; its ratios are not claims).

Tables show, per load, each figure's median over the seeds for Meridian and stock, and the median
(and range) of the per-seed ratio Meridian / stock (the same seed is the same trace); a target
holds when the median ratio meets it.

Length: the committed results file's schema (:class:`TargetsRun`), the run that fills a cell and
the checks over the cells change together: a new figure is a field, its computation and perhaps
a target, and a schema change must stay readable for the files already committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from meridian.bench.offered import OfferedLoad
from meridian.bench.slo import UserModel

STOCK, MERIDIAN, PASCAL = "vllm-fcfs+forcing", "meridian", "pascal+forcing"
POLICIES = (STOCK, MERIDIAN, PASCAL)
# Capacity: the highest rate (req/s) at which stock vLLM's queue stays bounded over 10 minutes,
# found with this sweep (docs/benchmarks.md has the runs that bracket each one) and checked in
# every run: over the arrival window's last third the waiting queue averages at most
# max(8, 1.25 x its average over the middle third).
CAPACITY: dict[tuple[str, str, str], float] = {
    ("synthetic", "qwen3-8b", "h100-sxm"): 5.5,
    # vllm-fcfs+forcing, 600 s, seed 0: bounded at 1.4, 1.6, 1.8 and 1.9 req/s, grows at 2.0.
    ("servegen-r1", "qwen3-8b", "h100-sxm"): 1.9,
    ("synthetic", "qwen3-32b", "h100-sxm"): 0.88,
}
LOADS = (0.5, 0.7, 0.9, 1.0, 1.1, 1.3)
SEEDS = (0, 1, 2)
DURATION_S, WARMUP_S = 600.0, 200.0
LIGHT, HEAVY = 0.7, 1.1
LIGHT_TOLERANCE = 0.03
Op = Literal["le", "ge", "points"]
# (field, label, target at every load, target from HEAVY up): a target is (op, bound): "le"/"ge"
# a ratio to stock's, "points" percentage points above stock's.
METRICS: tuple[tuple[str, str, tuple[Op, float] | None, tuple[Op, float] | None], ...] = (
    ("ttft_p95_s", "TTFT P95 s", ("le", 1.1), None),
    ("ttfvt_p95_s", "TTFVT P95 s", ("le", 1.02), None),
    ("throughput_tok_s", "throughput tok/s", ("ge", 0.99), None),
    ("itl_p99_ms", "answer ITL P99 ms", None, ("le", 0.5)),
    ("recomputed_tokens", "recomputed tokens", None, ("le", 0.2)),
    ("slo_hidden_pct", "SLO met % at 3× (hidden)", None, ("points", 10.0)),
    ("slo_shown_pct", "SLO met % at 3× (shown)", None, ("points", 0.0)),
)
PERCENT_FIELDS = ("slo_hidden_pct", "slo_shown_pct")
HIGHER_IS_BETTER = ("throughput_tok_s", "goodput_req_s", *PERCENT_FIELDS)
TARGETS_TEXT = (
    "at every load TTFT P95 ≤ 1.1×, TTFVT P95 ≤ 1.02× and throughput ≥ 0.99× stock's; light "
    f"load (up to {LIGHT:.0%} of capacity) every figure within ±{LIGHT_TOLERANCE:.0%} (±3 points "
    f"for attainment); from {HEAVY:.0%} up answer ITL P99 ≤ 0.5×, recomputed tokens ≤ 0.2×, SLO "
    "attainment at 3× ≥ stock's + 10 points with the reasoning hidden and ≥ stock's with it "
    "shown (median over the seeds)"
)


@dataclass(frozen=True)
class Cell:
    """One run of the sweep. ``policy`` may be ``NAME@field=value@...``: policy NAME with those
    ``[scheduler]`` fields (an ablation). ``trace_rate``: the rate the seed's trace is drawn at
    and thinned from (``None``: drawn at ``rate``)."""

    workload: str
    model: str
    hardware: str
    engine: str
    rate: float
    policy: str
    duration_s: float
    seed: int = 0
    warmup_s: float = 0.0
    trace_rate: float | None = None


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
    """One cell's figures over its measured requests, and what its slowest requests waited for.

    Fields with defaults were added with schema 2 (seeds, warm-up, SLO attainment, contention);
    a schema-1 file (one seed, no warm-up, the old fixed SLO) has them unset.
    """

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
    # Why requests fell out of goodput's SLO: a late first visible token, a slow stream (and,
    # schema 1: answer gaps over the ITL SLO), a wrong answer (entropy model).
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
    seed: int = 0
    num_warmup_requests: int = 0
    slo_hidden_pct: float | None = None
    slo_shown_pct: float | None = None
    goodput_shown_req_s: float | None = None
    attainment_scales: list[float] | None = None
    attainment_hidden_pct: list[float] | None = None
    attainment_shown_pct: list[float] | None = None
    slo_missed_stall: int = 0
    slo_unfinished: int = 0
    kv_used_peak: float | None = None
    max_waiting: int | None = None
    num_preempted_requests: int | None = None
    num_queued_requests: int | None = None

    @property
    def contended(self) -> bool | None:
        """Something was preempted or queued (``None``: a schema-1 cell, unknown;
        :class:`~meridian.bench.summary.Contention`)."""
        if self.num_queued_requests is None or self.num_preempted_requests is None:
            return None
        return self.num_preempted_requests > 0 or self.num_queued_requests > 0


class WorkloadSweep(_Model):
    """One workload's sweep: its capacity, the offered load per rate (its first seed's), every
    cell (one per rate, policy and seed)."""

    workload: str
    capacity_req_s: float
    offered: dict[str, OfferedLoad]
    cells: list[CellResult]
    trace_rate: float | None = None

    def cells_at(self, rate: float, policy: str) -> list[CellResult]:
        """The cells of ``policy`` at ``rate``, by seed."""
        found = [c for c in self.cells if c.rate == rate and c.policy == policy]
        return sorted(found, key=lambda c: c.seed)

    def cell(self, rate: float, policy: str) -> CellResult | None:
        """The first seed's cell (``None`` when there is none)."""
        found = self.cells_at(rate, policy)
        return found[0] if found else None

    @property
    def rates(self) -> list[float]:
        return sorted({c.rate for c in self.cells})


class TargetsRun(_Model):
    """``benchmarks/results/targets-*.json``: how the sweep ran, and every cell."""

    schema_version: int = 2
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
    seeds: list[int] | None = None
    warmup_s: float = 0.0

    def sweep(self, workload: str) -> WorkloadSweep:
        for sweep in self.workloads:
            if sweep.workload == workload:
                return sweep
        raise KeyError(f"no {workload!r} sweep in this run")

    @property
    def all_seeds(self) -> list[int]:
        return self.seeds if self.seeds is not None else [self.seed]


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
        step_model_for,
        summaries,
        window_for,
    )
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
        warmup_s=cell.warmup_s,
        trace_rate=cell.trace_rate,
    )
    requests = load_requests(spec, cell.rate)
    total = len(requests)
    hook = None if on_progress is None else (lambda done: on_progress(done, total))
    started = time.perf_counter()
    result = run_policy(spec, parse_policy(name), StreamSet(requests, spec.config), hook)
    wall = time.perf_counter() - started
    shape, window = engine_config_for(spec), window_for(spec, requests)
    s = summaries(spec, {name: result}, requests, shape, step_model_for(spec))[name]
    a, c = s.attainment, s.contention
    assert a is not None and c is not None
    measured = window.measured(result.records)
    figures = _diagnose(result, measured, window, shape.num_kv_blocks * shape.block_size_tokens)
    row = CellResult(
        workload=cell.workload,
        policy=cell.policy,
        rate=cell.rate,
        seed=cell.seed,
        wall_s=round(wall, 1),
        num_requests=s.num_requests,
        num_warmup_requests=s.num_warmup_requests,
        itl_p99_ms=None if s.output_itl_s.p99 is None else s.output_itl_s.p99 * 1e3,
        ttfvt_p95_s=s.ttfvt_s.p95,
        ttft_p95_s=s.ttft_s.p95,
        throughput_tok_s=s.throughput_tok_s,
        goodput_req_s=s.goodput_req_s,
        goodput_shown_req_s=a.goodput_shown_req_s,
        slo_hidden_pct=a.pct_at(UserModel.HIDDEN, a.goodput_scale),
        slo_shown_pct=a.pct_at(UserModel.SHOWN, a.goodput_scale),
        attainment_scales=list(a.scales),
        attainment_hidden_pct=list(a.hidden_pct),
        attainment_shown_pct=list(a.shown_pct),
        slo_missed_ttfvt=a.missed_hidden.late_first_visible,
        slo_missed_itl=a.missed_hidden.slow_stream,
        slo_missed_stall=a.missed_hidden.stall,
        slo_wrong_answer=a.missed_hidden.wrong_answer,
        slo_unfinished=a.missed_hidden.unfinished,
        recomputed_tokens=s.num_recomputed_tokens,
        preemptions_think=s.preemptions.think,
        preemptions_answer=s.preemptions.output,
        worst_answer_gap_steps=s.worst_answer_gap_steps,
        kv_used_peak=c.kv_used_peak,
        max_waiting=c.max_waiting,
        num_preempted_requests=c.num_preempted_requests,
        num_queued_requests=c.num_queued_requests,
        num_steps=result.counters.num_steps,
        step_ms_mean=(
            None
            if s.makespan_s is None or not result.counters.num_steps
            else 1e3 * s.makespan_s / result.counters.num_steps
        ),
        **figures,
    )
    return row, offered_load(requests, cell.duration_s)


def _diagnose(
    result: Any, records: Sequence[Any], window: Any, cache_tokens: int
) -> dict[str, Any]:
    """The per-request figures behind a cell (the measured requests): the capacity check and
    what the slowest waited for (:class:`CellResult`'s comments)."""
    start, end = window.start_ns, window.end_ns
    third = (end - start) / 3
    waiting = [(x.time_ns, x.num_waiting) for x in result.samples if start <= x.time_ns <= end]
    mid = [w for t, w in waiting if start + third <= t < start + 2 * third]
    last = [w for t, w in waiting if t >= start + 2 * third]
    mid_q, last_q = (float(np.mean(v)) if v else 0.0 for v in (mid, last))
    finished = [r for r in records if r.finish_ns is not None]
    sizes = [r.num_prompt_tokens + r.num_think_tokens + r.num_answer_tokens for r in finished]
    answered = [r for r in records if r.first_answer_ns is not None]
    ttfvt = np.array([r.first_answer_ns - r.arrival_ns for r in answered], dtype=np.float64)
    cut = np.percentile(ttfvt, 95) if ttfvt.size else 0.0
    top = [r for r, t in zip(answered, ttfvt, strict=True) if t >= cut]
    n_top = max(len(top), 1)
    top_think = sum(r.first_answer_ns - r.first_token_ns for r in top) / 1e9 / n_top
    top_think_tokens = sum(r.num_think_tokens for r in top) / n_top
    steps = [np.diff(r.answer_token_step) for r in records if len(r.answer_token_step) > 1]
    gap_steps = np.concatenate(steps) if steps else np.zeros(0)
    capacity = max(result.num_kv_blocks, 1)
    kv = [x.num_kv_blocks_used / capacity for x in result.samples if start <= x.time_ns <= end]
    return {
        "waiting_mid": mid_q,
        "waiting_last": last_q,
        "queue_bounded": last_q <= max(8.0, 1.25 * mid_q),
        "requests_in_cache": cache_tokens / float(np.mean(sizes)) if sizes else 0.0,
        "ttfvt_top_wait_s": sum(r.first_token_ns - r.arrival_ns for r in top) / 1e9 / n_top,
        "ttfvt_top_think_s": top_think,
        "ttfvt_top_ms_per_think_token": 1e3 * top_think / max(top_think_tokens, 1.0),
        "ttfvt_top_preempted_pct": 100.0 * sum(bool(r.preemptions_by_phase) for r in top) / n_top,
        "itl_p99_gap_steps": float(np.percentile(gap_steps, 99)) if gap_steps.size else None,
        "kv_used_mean": float(np.mean(kv)) if kv else 0.0,
    }


# -- the targets over the seeds -----------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; 1 when both are 0; ``None`` when undefined."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def compare(field: str, a: float | None, b: float | None) -> float | None:
    """Meridian against stock on ``field``: a ratio, or for attainment the points above."""
    if field in PERCENT_FIELDS:
        return None if a is None or b is None else a - b
    return ratio(a, b)


@dataclass(frozen=True, slots=True)
class Paired:
    """One field at one load over the seeds both policies ran: each side's median, and the
    median and range of the per-seed comparison (:func:`compare`)."""

    mine: float | None
    theirs: float | None
    median: float | None
    low: float | None
    high: float | None
    num_seeds: int


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def paired(field: str, ms: Sequence[CellResult], bs: Sequence[CellResult]) -> Paired:
    """Meridian's cells ``ms`` against stock's ``bs`` on ``field``, paired by seed."""
    theirs = {b.seed: b for b in bs}
    pairs = [(m, theirs[m.seed]) for m in ms if m.seed in theirs]
    comparisons = [compare(field, getattr(m, field), getattr(b, field)) for m, b in pairs]
    present = [c for c in comparisons if c is not None]
    return Paired(
        mine=_median([getattr(m, field) for m, _ in pairs]),
        theirs=_median([getattr(b, field) for _, b in pairs]),
        median=_median(present),
        low=min(present) if present else None,
        high=max(present) if present else None,
        num_seeds=len(pairs),
    )


def target_of(load: float, field: str) -> tuple[Op, float] | None:
    """The target ``field`` has at ``load`` (the light-load band is checked apart)."""
    _, _, every, heavy = next(m for m in METRICS if m[0] == field)
    return heavy if load >= HEAVY - 1e-9 and heavy is not None else every


def check(load: float, field: str, p: Paired) -> bool | None:
    """Whether the median comparison meets ``field``'s target at ``load`` (``None``: no target
    there, or nothing to compare)."""
    if p.median is None:
        return None if p.mine is None and p.theirs is None else False
    points = field in PERCENT_FIELDS
    if load <= LIGHT + 1e-9:
        limit = 100 * LIGHT_TOLERANCE if points else LIGHT_TOLERANCE
        if abs(p.median - (0.0 if points else 1.0)) > limit + 1e-9:
            return False
    target = target_of(load, field)
    if target is None:
        return True if load <= LIGHT + 1e-9 else None
    op, bound = target
    if op == "le" and p.mine == p.theirs == 0:
        return True  # nothing to reduce (e.g. no token recomputed on either side)
    if op == "points":
        return p.median >= bound - 1e-9
    return p.median <= bound + 1e-9 if op == "le" else p.median >= bound - 1e-9


def better(field: str, mine: float, theirs: float) -> bool:
    """Whether ``mine`` is better than ``theirs`` on ``field`` (throughput, goodput and
    attainment up)."""
    return mine > theirs if field in HIGHER_IS_BETTER else mine < theirs


def uncontended(ms: Sequence[CellResult], bs: Sequence[CellResult]) -> bool:
    """No cell of either side preempted or queued anything (unknown counts as contended)."""
    return all(c.contended is False for c in [*ms, *bs])
