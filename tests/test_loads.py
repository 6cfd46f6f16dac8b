"""Nested loads (bench.loads): one trace per workload and seed, thinned to each rate, so a higher
load holds every request of a lower one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.loads import nested, thin
from meridian.bench.simrun import SimRunSpec, load_requests
from meridian.bench.workloads import WorkloadParams, generate_workload
from meridian.errors import MeridianError
from meridian.sim.request import RequestSpec

TRACE_RATE = 8.0
TRACE = generate_workload("synthetic", WorkloadParams(TRACE_RATE, 60.0, seed=3))


def _key(spec: RequestSpec) -> tuple[object, ...]:
    return (spec.request_id, spec.arrival_ns, spec.num_prompt_tokens, spec.num_think_tokens,
            spec.num_answer_tokens, spec.settle_token)  # fmt: skip


@given(
    low=st.floats(0.01, TRACE_RATE),
    high=st.floats(0.01, TRACE_RATE),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=80, deadline=None)
def test_every_request_of_a_lower_rate_is_in_a_higher_rates_trace(
    low: float, high: float, seed: int
) -> None:
    r1, r2 = sorted((low, high))
    lower, higher = thin(TRACE, TRACE_RATE, r1, seed), thin(TRACE, TRACE_RATE, r2, seed)
    kept = {id(s) for s in higher}
    assert all(id(s) in kept for s in lower)  # the same request: arrival, lengths, entropy
    assert lower == sorted(lower, key=lambda s: s.arrival_ns)
    # Each request kept with probability r / trace rate: the count is binomial.
    n, p = len(TRACE), r1 / TRACE_RATE
    assert abs(len(lower) - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1


def test_the_trace_rate_keeps_everything_and_a_rate_above_it_is_refused() -> None:
    assert thin(TRACE, TRACE_RATE, TRACE_RATE, seed=1) == TRACE
    with pytest.raises(MeridianError, match="nested load's rate"):
        thin(TRACE, TRACE_RATE, 9.0, seed=1)


@pytest.mark.parametrize("workload", ["synthetic", "servegen-r1"])
def test_nested_workloads_through_the_run_spec(workload: str) -> None:
    spec = SimRunSpec(workload=workload, duration_s=120.0, seed=5, trace_rate=3.0)
    by_rate = {r: load_requests(spec, r) for r in (1.0, 2.0, 3.0)}
    for a, b in ((1.0, 2.0), (2.0, 3.0)):
        assert {_key(s) for s in by_rate[a]} <= {_key(s) for s in by_rate[b]}
        assert len(by_rate[a]) < len(by_rate[b])
    # The highest rate is the workload drawn at it, as without nesting.
    alone = load_requests(replace(spec, trace_rate=None), 3.0)
    assert [_key(s) for s in by_rate[3.0]] == [_key(s) for s in alone]
    assert nested(workload, 3.0, 1.0, 120.0, 5) == by_rate[1.0]
