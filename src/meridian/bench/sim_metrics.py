"""Report a simulator run through the metric catalogue, as a live server would have.

A :class:`~meridian.sim.records.SimResult` is replayed into a :class:`MeridianMetrics`:
per-request histograms (think tokens, TTFVT, TTOT, output ITL), counters (forces by reason,
preemptions by phase) and, for the gauges, the state of the last sample. Simulated nanoseconds
become seconds, so a dashboard or a scrape test reads a simulator run and a real run the same
way.

Counters accumulate: record one run per :class:`MeridianMetrics` (an A/B gives each policy its
own instance, each on its own private registry).
"""

from __future__ import annotations

from itertools import pairwise

from meridian.core.types import Phase, Tier
from meridian.sim.records import SimResult
from meridian.telemetry.metrics import MeridianMetrics

_NS: float = 1e-9


def record_sim_result(
    metrics: MeridianMetrics,
    result: SimResult,
    *,
    block_size_bytes: int | None = None,
) -> None:
    """Report ``result`` through ``metrics``.

    Args:
        metrics: where to report (counters add to what is already there).
        result: one policy's simulator run.
        block_size_bytes: bytes of one KV block; when given, KV capacity and the last sample's
            KV usage are reported in bytes (think blocks as THINK_ACTIVE, the rest as
            OUTPUT_CRITICAL).

    Think tokens are observed for requests that ended a think phase; the latency histograms
    for requests that produced the corresponding tokens. Unfinished requests (a truncated run)
    count as tracked.
    """
    if block_size_bytes is not None and block_size_bytes <= 0:
        raise ValueError(f"block_size_bytes must be positive; got {block_size_bytes}")
    for rec in result.records:
        if rec.think_end_ns is not None:
            metrics.observe_think_tokens(rec.num_think_tokens)
        if rec.forced_reason is not None:
            metrics.count_force(rec.forced_reason)
        if rec.first_answer_ns is not None:
            metrics.observe_ttfvt((rec.first_answer_ns - rec.arrival_ns) * _NS)
            if rec.think_end_ns is not None:
                metrics.observe_ttot((rec.first_answer_ns - rec.think_end_ns) * _NS)
        for earlier, later in pairwise(rec.answer_token_ns):
            metrics.observe_output_itl((later - earlier) * _NS)

    counters = result.counters
    for phase, n in sorted(counters.preemptions_by_phase.items()):
        if n:
            metrics.count_preemption(phase, n)
    metrics.set_tracked_requests(sum(1 for rec in result.records if not rec.finished))

    if result.samples:
        last = result.samples[-1]
        metrics.set_queue_depth(Phase.OUTPUT, last.queue_output)
        metrics.set_queue_depth(Phase.THINK, last.queue_think)
        if block_size_bytes is not None:
            think = last.num_kv_blocks_think
            metrics.set_kv_used_bytes(Tier.THINK_ACTIVE, think * block_size_bytes)
            metrics.set_kv_used_bytes(
                Tier.OUTPUT_CRITICAL, (last.num_kv_blocks_used - think) * block_size_bytes
            )
    if block_size_bytes is not None:
        metrics.set_kv_capacity_bytes(result.num_kv_blocks * block_size_bytes)
