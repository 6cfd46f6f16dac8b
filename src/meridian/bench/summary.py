"""Metrics of one simulator run: from a :class:`SimResult` to a :class:`PolicySummary`.

Every time is in seconds of simulated time. Every
per-request figure is over the *measured* requests: those arriving in the run's window
(:class:`~meridian.bench.slo.Window`, after the warm-up); the engine-wide figures (peak KV use,
the longest waiting queue, computed tokens) are the engine's from the warm-up's end on.

- TTFT  = first generated token (think or answer) - arrival.
- TTFVT = first answer token - arrival: the wait the user feels when the reasoning is hidden.
- TTOT  = first answer token - ``</think>`` (reasoning requests only).
- output ITL = every gap between two consecutive answer tokens of one request, pooled over all
  requests.
- throughput = generated tokens (think + answer) / makespan, where the makespan runs from the
  first measured arrival to the last measured finish.
- SLO attainment: the share of requests meeting their unloaded-latency SLO at each scale, for
  reasoning hidden and shown (:mod:`meridian.bench.slo`).
- goodput = requests meeting the SLO (:class:`~meridian.bench.slo.SloSpec`: the unloaded one at
  scale 3, reasoning hidden, unless an explicit SLO is given) / the arrival window's length.
- answer accuracy (model) = finished reasoning requests with a correct answer, as the entropy
  model defines it, over those with a verdict (a simulator figure, not a measured accuracy).

Percentiles use ``numpy.percentile(..., method="linear")``; a metric with no values is ``None``
(JSON ``null``), never an error. Every float of a summary is rounded to 6 significant digits so
that a report does not change with the last bits of a float sum.

Length: every figure a report states is defined here, in one place, with the pydantic models
the JSON report is written from; splitting the definitions from their models would put one fact
in two files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from meridian.bench.attainment import Attainment, Contention, attainment, contention
from meridian.bench.rounding import Sig6 as Sig6
from meridian.bench.rounding import round_sig as round_sig
from meridian.bench.slo import (
    ExplicitSlo,
    IdleLatency,
    NeededScales,
    SloSpec,
    Window,
    answer_gaps_ns,
    meets_explicit,
)
from meridian.core.types import ForceReason, Phase
from meridian.sim.records import RequestRecord, SimResult, TimeSample
from meridian.sim.request import RequestKind
from meridian.telemetry.latency import ttfvt, ttot

NS_PER_S = 1_000_000_000
# Plots read these, so they are part of the report; 300 points is a smooth line at 100 dpi.
MAX_SERIES_POINTS = 300
# Quantiles 0, 1, ..., 100 % of each distribution: enough to redraw a CDF from a report alone.
CDF_QUANTILES = tuple(range(101))

FloatArray = npt.NDArray[np.float64]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Percentiles(_Model):
    """Summary statistics of one distribution; all ``None`` when ``count == 0``."""

    count: int = Field(description="Number of values.")
    mean: Sig6 | None = None
    p50: Sig6 | None = None
    p95: Sig6 | None = None
    p99: Sig6 | None = None
    max: Sig6 | None = None


class Cdf(_Model):
    """A distribution as its quantiles 0, 1, ..., 100 % (empty when there are no values)."""

    quantiles: list[Sig6] = Field(default_factory=list)


class Distributions(_Model):
    """Quantile sketches from which the plots redraw CDFs and histograms without the raw run."""

    output_itl_s: Cdf
    ttfvt_s: Cdf
    ttot_s: Cdf
    think_tokens: Cdf


class ForcedByReason(_Model):
    """Budget-forced stops as a percentage of all reasoning requests, by reason."""

    converged: Sig6 = 0.0
    overthinking: Sig6 = 0.0
    hard_cap: Sig6 = 0.0


class PreemptionsByPhase(_Model):
    """Preemptions (run-wide) by the phase the victim was in."""

    prefill: int = 0
    think: int = 0
    output: int = 0


class TimeSeries(_Model):
    """Engine state over time, down-sampled to at most ``MAX_SERIES_POINTS`` points.

    Each point summarises a contiguous bucket of samples: its time is the bucket's last sample
    time and its values are the bucket's maxima, so short spikes survive the down-sampling.
    Fractions are of the run's total KV blocks.
    """

    time_s: list[Sig6] = Field(default_factory=list)
    kv_used_fraction: list[Sig6] = Field(default_factory=list)
    kv_think_fraction: list[Sig6] = Field(default_factory=list)
    queue_output: list[int] = Field(default_factory=list)
    queue_think: list[int] = Field(default_factory=list)
    num_running: list[int] = Field(default_factory=list)


class PolicySummary(_Model):
    """Every metric of one policy's run (the report schema). Units are in the field names:
    ``_s`` seconds, ``_tok_s`` tokens/s, ``_req_s`` requests/s, ``_pct`` percent (0-100),
    token counts otherwise."""

    policy: str
    num_requests: int = Field(description="Measured requests (arrived after the warm-up).")
    num_warmup_requests: int = Field(
        default=0, description="Requests that arrived in the warm-up: in no statistic."
    )
    num_finished: int
    num_reasoning: int
    num_chat: int
    sim_duration_s: Sig6 = Field(description="Simulated time at the end of the run (end_ns).")
    makespan_s: Sig6 | None = Field(description="First measured arrival to last finish.")
    window_s: Sig6 | None = Field(
        default=None, description="The measured arrival window (goodput's denominator)."
    )

    ttft_s: Percentiles
    ttfvt_s: Percentiles
    ttot_s: Percentiles = Field(description="Reasoning requests only.")
    output_itl_s: Percentiles = Field(description="All answer-token gaps of all requests pooled.")
    think_tokens: Percentiles = Field(description="Generated think tokens, finished reasoning.")
    answer_tokens: Percentiles = Field(description="Generated answer tokens, finished requests.")

    num_forced: int
    forced_pct: ForcedByReason
    premature_force_pct: Sig6 | None = Field(
        description=(
            "Share of forced stops before the request's settle point, per the workload's entropy "
            "*model* (an accuracy-risk proxy, not a measured accuracy); null when nothing was "
            "forced with a known settle point."
        )
    )
    think_tokens_saved: int = Field(
        description="Requested - generated think tokens over reasoning requests past </think>."
    )
    think_tokens_saved_pct: Sig6 | None

    preemptions: PreemptionsByPhase = Field(description="Of the measured requests.")
    num_recomputed_tokens: int = Field(
        description="Tokens the measured requests computed again after preemptions (prefix-cache "
        "hits excluded)."
    )
    num_scheduled_tokens: int = Field(
        default=0,
        description="Every token the engine computed in the run (its work), recompute included.",
    )
    num_offload_loaded_blocks: int = Field(
        default=0,
        description="KV blocks loaded back from the host tier instead of recomputed (offload).",
    )
    answer_accuracy_pct: Sig6 | None = Field(
        default=None,
        description=(
            "Finished reasoning requests whose answer is correct per the workload's entropy "
            "*model* (a forced stop before the settle point is wrong); null without a verdict."
        ),
    )
    worst_answer_gap_steps: int | None = Field(
        description="Largest engine-step distance between two consecutive answer tokens."
    )

    throughput_tok_s: Sig6 | None
    goodput_req_s: Sig6 | None
    num_slo_met: int = Field(
        description="Measured requests meeting goodput's SLO (finished, answer not wrong)."
    )
    slo_met_pct: Sig6 | None = Field(description="num_slo_met over the measured requests.")
    attainment: Attainment | None = Field(
        default=None, description="SLO attainment curves (null without a step-time model)."
    )
    contention: Contention | None = None

    series: TimeSeries
    distributions: Distributions


@dataclass(frozen=True, slots=True)
class RunDistributions:
    """The raw per-request (or per-gap) values of one run, in seconds or tokens.

    ``summarize`` reduces these to percentiles; the plots draw their CDFs.
    """

    ttft_s: FloatArray
    ttfvt_s: FloatArray
    ttot_s: FloatArray
    output_itl_s: FloatArray
    think_tokens: FloatArray
    answer_tokens: FloatArray


def _seconds(values: Iterable[float]) -> FloatArray:
    return np.fromiter(values, dtype=np.float64) / NS_PER_S


def collect_distributions(records: Sequence[RequestRecord]) -> RunDistributions:
    """The raw values behind each distribution metric; a request lacking a timestamp is skipped."""
    ttft = [r.first_token_ns - r.arrival_ns for r in records if r.first_token_ns is not None]
    answered = [(r, r.first_answer_ns) for r in records if r.first_answer_ns is not None]
    to_visible = [ttfvt(r.arrival_ns, first) for r, first in answered]
    to_answer = [
        t
        for r, first in answered
        if r.kind is RequestKind.REASONING and (t := ttot(r.think_end_ns, first)) is not None
    ]
    gaps = [answer_gaps_ns(r) for r in records if len(r.answer_token_ns) > 1]
    finished = [r for r in records if r.finished]
    think = [r.num_think_tokens for r in finished if r.kind is RequestKind.REASONING]
    answer = [r.num_answer_tokens for r in finished]
    return RunDistributions(
        ttft_s=_seconds(ttft),
        ttfvt_s=_seconds(to_visible),
        ttot_s=_seconds(to_answer),
        output_itl_s=(np.concatenate(gaps).astype(np.float64) / NS_PER_S if gaps else np.zeros(0)),
        think_tokens=np.asarray(think, dtype=np.float64),
        answer_tokens=np.asarray(answer, dtype=np.float64),
    )


def percentiles(values: FloatArray) -> Percentiles:
    """Mean, P50/P95/P99 (linear interpolation) and max of ``values``; ``None`` when empty.

    >>> percentiles(np.array([1.0, 2.0, 3.0, 4.0])).p50
    2.5
    """
    if values.size == 0:
        return Percentiles(count=0)
    p50, p95, p99 = np.percentile(values, [50, 95, 99], method="linear")
    return Percentiles(
        count=int(values.size),
        mean=float(values.mean()),
        p50=float(p50),
        p95=float(p95),
        p99=float(p99),
        max=float(values.max()),
    )


def cdf_sketch(values: FloatArray) -> Cdf:
    """The 0..100 % quantiles of ``values`` (empty for no values)."""
    if values.size == 0:
        return Cdf()
    quantiles = np.percentile(values, CDF_QUANTILES, method="linear")
    return Cdf(quantiles=[float(q) for q in quantiles])


def downsample(samples: Sequence[TimeSample], num_kv_blocks: int) -> TimeSeries:
    """At most ``MAX_SERIES_POINTS`` points: contiguous equal-count buckets, maxima per bucket.

    Deterministic: bucket edges depend only on ``len(samples)``.
    """
    if not samples:
        return TimeSeries()
    n = len(samples)
    num_points = min(n, MAX_SERIES_POINTS)
    # Bucket i covers samples[starts[i]:starts[i + 1]]; integer edges, every bucket non-empty.
    starts = np.arange(num_points, dtype=np.int64) * n // num_points
    ends = np.append(starts[1:], n) - 1

    def bucket_max(attr: str) -> npt.NDArray[np.int64]:
        values = np.fromiter((getattr(s, attr) for s in samples), dtype=np.int64, count=n)
        return np.maximum.reduceat(values, starts)

    capacity = max(num_kv_blocks, 1)
    times = np.fromiter((s.time_ns for s in samples), dtype=np.int64, count=n)
    return TimeSeries(
        time_s=(times[ends] / NS_PER_S).tolist(),
        kv_used_fraction=(bucket_max("num_kv_blocks_used") / capacity).tolist(),
        kv_think_fraction=(bucket_max("num_kv_blocks_think") / capacity).tolist(),
        queue_output=bucket_max("queue_output").tolist(),
        queue_think=bucket_max("queue_think").tolist(),
        num_running=bucket_max("num_running").tolist(),
    )


def worst_answer_gap_steps(records: Sequence[RequestRecord]) -> int | None:
    """The largest difference of consecutive ``answer_token_step`` within one request."""
    worst: int | None = None
    for r in records:
        steps = r.answer_token_step
        for a, b in pairwise(steps):
            if worst is None or b - a > worst:
                worst = b - a
    return worst


def _pct(part: float, whole: float) -> float | None:
    return None if whole <= 0 else 100.0 * part / whole


def _forced_stats(reasoning: Sequence[RequestRecord]) -> tuple[int, ForcedByReason, float | None]:
    counts = dict.fromkeys(ForceReason, 0)
    num_premature = 0
    num_known = 0
    for r in reasoning:
        if r.forced_reason is not None:
            counts[r.forced_reason] += 1
        premature = r.premature_force
        if premature is not None:
            num_known += 1
            num_premature += int(premature)
    total = len(reasoning)
    by_reason = ForcedByReason(
        converged=_pct(counts[ForceReason.CONVERGED], total) or 0.0,
        overthinking=_pct(counts[ForceReason.OVERTHINKING], total) or 0.0,
        hard_cap=_pct(counts[ForceReason.HARD_CAP], total) or 0.0,
    )
    return sum(counts.values()), by_reason, _pct(num_premature, num_known)


def summarize(
    result: SimResult,
    slo: SloSpec,
    *,
    window: Window | None = None,
    idle: IdleLatency | None = None,
) -> PolicySummary:
    """Reduce one run to its :class:`PolicySummary` (pure; same result in, same summary out).

    ``window`` picks the measured requests (default: every request, the window ending at the
    last arrival); ``idle`` is the run's idle latency, without which there are no attainment
    curves and goodput counts the explicit SLO (``slo.explicit``, or :class:`ExplicitSlo`'s
    defaults: a live server's run has no step-time model).

    Request subsets (all within the measured requests): TTFT/TTFVT/TTOT use every request that
    reached the event; token counts use finished requests; forced percentages are over all
    reasoning requests; think tokens saved are over reasoning requests that passed ``</think>``
    (an unfinished think phase saved nothing).
    """
    if window is None:
        window = Window.spanning(r.arrival_ns for r in result.records)
    records = window.measured(result.records)
    reasoning = [r for r in records if r.kind is RequestKind.REASONING]
    finished = [r for r in records if r.finished]
    dist = collect_distributions(records)

    num_forced, forced_pct, premature_pct = _forced_stats(reasoning)
    past_think = [r for r in reasoning if r.think_end_ns is not None]
    requested = sum(r.num_think_tokens_requested for r in past_think)
    saved = requested - sum(r.num_think_tokens for r in past_think)

    makespan_s: float | None = None
    if finished:
        first_arrival = min(r.arrival_ns for r in records)
        last_finish = max(r.finish_ns for r in finished if r.finish_ns is not None)
        makespan_s = (last_finish - first_arrival) / NS_PER_S
    # A zero makespan (everything finished at its arrival instant) has no meaningful rate.
    rate_window_s = makespan_s if makespan_s is not None and makespan_s > 0 else None
    generated = sum(r.num_think_tokens + r.num_answer_tokens for r in records)

    needed = None if idle is None else NeededScales.of(records, idle, slo.stall_ns)
    curves = None if needed is None else attainment(needed, window, slo.scale)
    if needed is not None and slo.explicit is None:
        num_slo_met = needed.num_met(slo.user, slo.scale)
    else:
        explicit = slo.explicit or ExplicitSlo()
        num_slo_met = sum(meets_explicit(r, explicit) for r in finished)
    verdicts = [
        r.answer_correct
        for r in finished
        if r.kind is RequestKind.REASONING and r.answer_correct is not None
    ]

    by_phase: dict[Phase, int] = {}
    for r in records:
        for phase, n in r.preemptions_by_phase.items():
            by_phase[phase] = by_phase.get(phase, 0) + n
    counters = result.counters
    return PolicySummary(
        policy=result.policy,
        num_requests=len(records),
        num_warmup_requests=sum(r.arrival_ns < window.start_ns for r in result.records),
        num_finished=len(finished),
        num_reasoning=len(reasoning),
        num_chat=len(records) - len(reasoning),
        sim_duration_s=result.end_ns / NS_PER_S,
        makespan_s=makespan_s,
        window_s=window.length_s,
        ttft_s=percentiles(dist.ttft_s),
        ttfvt_s=percentiles(dist.ttfvt_s),
        ttot_s=percentiles(dist.ttot_s),
        output_itl_s=percentiles(dist.output_itl_s),
        think_tokens=percentiles(dist.think_tokens),
        answer_tokens=percentiles(dist.answer_tokens),
        num_forced=num_forced,
        forced_pct=forced_pct,
        premature_force_pct=premature_pct,
        think_tokens_saved=saved,
        think_tokens_saved_pct=_pct(saved, requested),
        preemptions=PreemptionsByPhase(
            prefill=by_phase.get(Phase.PREFILL, 0),
            think=by_phase.get(Phase.THINK, 0),
            output=by_phase.get(Phase.OUTPUT, 0),
        ),
        num_recomputed_tokens=sum(r.num_recomputed_tokens for r in records),
        num_scheduled_tokens=counters.num_scheduled_tokens,
        num_offload_loaded_blocks=counters.num_offload_loaded_blocks,
        answer_accuracy_pct=_pct(sum(verdicts), len(verdicts)),
        worst_answer_gap_steps=worst_answer_gap_steps(records),
        throughput_tok_s=None if rate_window_s is None else generated / rate_window_s,
        goodput_req_s=num_slo_met / window.length_s,
        num_slo_met=num_slo_met,
        slo_met_pct=_pct(num_slo_met, len(records)),
        attainment=curves,
        contention=contention(result, records, window, idle),
        series=downsample(result.samples, result.num_kv_blocks),
        distributions=Distributions(
            output_itl_s=cdf_sketch(dist.output_itl_s),
            ttfvt_s=cdf_sketch(dist.ttfvt_s),
            ttot_s=cdf_sketch(dist.ttot_s),
            think_tokens=cdf_sketch(dist.think_tokens),
        ),
    )
