"""The load a run actually offered: what the requests were, not what was asked for.

A report states the requested arrival rate; a bursty workload (``servegen-r1``) or a replayed
trace can offer something else in a given run, and its bursts matter as much as its mean. So
every report also states, from the requests themselves, how many there were, their mean rate,
the highest rate over any 10-second bin, the CV of the inter-arrival times (1 for Poisson
arrivals) and the mean lengths.

>>> from meridian.sim.request import RequestKind, RequestSpec
>>> specs = [RequestSpec(f"r{i}", i * 500_000_000, 10, 0, 5, RequestKind.CHAT) for i in range(4)]
>>> load = offered_load(specs, duration_s=2.0)
>>> load.num_requests, load.rate_req_s, load.interarrival_cv
(4, 2.0, 0.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from meridian.bench.summary import Sig6
from meridian.sim.request import RequestSpec

__all__ = ["PEAK_BIN_S", "OfferedLoad", "describe", "offered_load"]

NS_PER_S = 1_000_000_000
# The bin of the peak rate: short enough to show a burst, long enough to hold a few requests.
PEAK_BIN_S = 10.0


class OfferedLoad(BaseModel):
    """What the run's requests were (the same for every policy of a run)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_requests: int
    num_reasoning: int
    rate_req_s: Sig6 | None = Field(
        description="Requests per second of arrivals: the count over the run's duration for a "
        "bundled workload; (count - 1) over first-to-last arrival for a trace."
    )
    peak_rate_req_s: Sig6 = Field(description=f"Most arrivals in a {PEAK_BIN_S:g}-s bin, per s.")
    interarrival_cv: Sig6 | None = Field(description="Std over mean of the gaps; 1 is Poisson.")
    prompt_tokens_mean: Sig6
    think_tokens_mean: Sig6 | None = Field(description="Over the reasoning requests.")
    answer_tokens_mean: Sig6


def offered_load(requests: Sequence[RequestSpec], duration_s: float | None) -> OfferedLoad:
    """The offered load of ``requests`` (non-empty, sorted by arrival), generated over
    ``duration_s`` seconds, or ``None`` for a trace (the rate is then taken between the first
    and the last arrival)."""
    arrivals = np.array([r.arrival_ns for r in requests], dtype=np.int64) / NS_PER_S
    gaps = np.diff(arrivals)
    if duration_s is not None:
        rate: float | None = len(requests) / duration_s
    else:
        span = float(arrivals[-1] - arrivals[0])
        rate = (len(requests) - 1) / span if span > 0 else None
    bins = np.floor((arrivals - arrivals[0]) / PEAK_BIN_S).astype(np.int64)
    think = [r.num_think_tokens for r in requests if r.is_reasoning]
    return OfferedLoad(
        num_requests=len(requests),
        num_reasoning=len(think),
        rate_req_s=rate,
        peak_rate_req_s=int(np.bincount(bins).max()) / PEAK_BIN_S,
        interarrival_cv=float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else None,
        prompt_tokens_mean=float(np.mean([r.num_prompt_tokens for r in requests])),
        think_tokens_mean=float(np.mean(think)) if think else None,
        answer_tokens_mean=float(np.mean([r.num_answer_tokens for r in requests])),
    )


def describe(load: OfferedLoad) -> str:
    """One sentence for reports: ``offered 2,399 requests (4 req/s, peak 10-s 7 req/s, ...)``."""
    rate = "" if load.rate_req_s is None else f"{load.rate_req_s:,.4g} req/s, "
    cv = "" if load.interarrival_cv is None else f", inter-arrival CV {load.interarrival_cv:.3g}"
    think = "" if load.think_tokens_mean is None else f", think {load.think_tokens_mean:,.0f}"
    return (
        f"offered {load.num_requests:,} requests ({load.num_reasoning:,} reasoning; {rate}peak "
        f"{load.peak_rate_req_s:,.4g} req/s over {PEAK_BIN_S:g} s{cv}); mean tokens: prompt "
        f"{load.prompt_tokens_mean:,.0f}{think}, answer {load.answer_tokens_mean:,.0f}"
    )
