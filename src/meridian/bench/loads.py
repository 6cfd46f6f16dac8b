"""Nested loads: one trace per workload and seed, thinned to each arrival rate, so that a higher
load holds every request of a lower one.

Generating a workload afresh at each rate gives every load point its own requests, and load
points stop comparing: a heavier draw at 90 % than at 100 % makes the lower load the busier one.
Here a sweep draws its workload once, at its highest rate (the *trace rate*), and keeps each
request at rate ``r`` when its own uniform ``u`` (drawn once per request from the seed, apart
from the workload's draws) is below ``r / trace rate``. So:

- every request of a lower rate is in the trace of a higher one, with the same arrival, lengths
  and entropy trace (its id too);
- a Poisson workload (``synthetic`` and the other table workloads) thins to a Poisson process
  of the lower rate: independent thinning keeps it Poisson, and the lengths keep their
  distributions;
- ``servegen-r1`` keeps its shape over the day and its clients' shares at every rate (each
  request is kept with the same probability), but its bursts thin: a renewal process whose gaps
  have a squared CV ``c²``, thinned to a share ``p``, has gaps of squared CV ``p c² + 1 - p``
  (e.g. a client with CV 4 keeps CV 2.9 at ``p = 0.5``), where ServeGen at the lower rate would
  draw the same CV. Lower loads are a little smoother than ServeGen's own draw at their rate;
  the offered load of every point (:mod:`meridian.bench.offered`) states the burstiness it got.

A trace file is never thinned (it is replayed at its own arrival times).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from meridian.bench.workloads import WorkloadParams, generate_workload
from meridian.errors import MeridianError
from meridian.sim.request import RequestSpec

__all__ = ["THIN_STREAM", "keep_uniforms", "nested", "thin"]

# The seed's sub-stream the thinning draws from (apart from the workload's own draws).
THIN_STREAM = 0x7417


def keep_uniforms(seed: int, count: int) -> np.ndarray:
    """One uniform per request of the trace, in trace order, from ``seed``'s thinning stream."""
    return np.random.default_rng([seed, THIN_STREAM]).random(count)


def thin(
    requests: Sequence[RequestSpec], trace_rate: float, rate: float, seed: int
) -> list[RequestSpec]:
    """The requests of a trace drawn at ``trace_rate`` kept at ``rate`` (<= ``trace_rate``):
    those whose uniform is below ``rate / trace_rate``, in trace order."""
    if not 0 < rate <= trace_rate * (1 + 1e-12):
        raise MeridianError(
            f"a nested load's rate must be in (0, {trace_rate:g}] (the trace's rate); got {rate:g}"
        )
    share = rate / trace_rate
    u = keep_uniforms(seed, len(requests))
    return [spec for spec, x in zip(requests, u, strict=True) if x < share]


@lru_cache(maxsize=4)
def _trace(workload: str, trace_rate: float, duration_s: float, seed: int) -> list[RequestSpec]:
    # Cached: a sweep's cells in one process share the trace (specs are immutable).
    return generate_workload(workload, WorkloadParams(trace_rate, duration_s, seed))


def nested(
    workload: str, trace_rate: float, rate: float, duration_s: float, seed: int
) -> list[RequestSpec]:
    """Bundled ``workload`` (seed ``seed``, ``duration_s`` of arrivals) drawn at ``trace_rate``
    and thinned to ``rate``; at ``rate == trace_rate``, the trace itself."""
    return thin(_trace(workload, trace_rate, duration_s, seed), trace_rate, rate, seed)
