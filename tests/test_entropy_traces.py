"""Statistics of per-token think-entropy traces (``meridian.bench.entropy_traces``)."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from meridian.bench import entropy_traces
from meridian.bench.entropy_traces import comparison_markdown, simulated_traces, trace_stats
from meridian.core.signals import EatTracker


def test_docstring_examples() -> None:
    assert doctest.testmod(entropy_traces).failed == 0


def test_trace_stats_match_the_core_eat_recursion() -> None:
    rng = np.random.default_rng(1)
    trace = rng.exponential(0.5, 320).astype(np.float32)
    stats = trace_stats([trace], interval_tokens=32, alpha=0.05)
    means = trace.astype(np.float64).reshape(10, 32).mean(axis=1)
    tracker = EatTracker(alpha=0.05, variance_threshold=0.0, min_distance=1, interval_tokens=32)
    variances = []
    for h in trace.tolist():
        tracker.observe(h)
        if tracker.num_samples >= 2 and len(variances) < tracker.num_samples - 1:
            variances.append(tracker.variance)
    assert stats.eat_variance_max == pytest.approx(max(variances))
    assert stats.interval_level == pytest.approx(means.mean())
    assert stats.interval_step_std == pytest.approx(np.diff(means).std())
    assert stats.num_chains == 1 and stats.num_tokens == 320
    assert math.isnan(stats.boundary_mean)  # no token text given


def test_trace_stats_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no traces"):
        trace_stats([])
    with pytest.raises(ValueError, match="one text per think token"):
        trace_stats([np.zeros(3, dtype=np.float32)], tokens=[["a"]])


def test_simulated_traces_are_seeded_and_sized() -> None:
    a = simulated_traces([20, 300], seed=5)
    b = simulated_traces([20, 300], seed=5)
    assert [t.size for t in a] == [20, 300]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # The entropy model's level is hundreds of times the trained reasoner's (about 0.0007 nats).
    assert trace_stats(a).mean > 0.1


def test_comparison_table_has_a_column_per_set() -> None:
    flat = trace_stats([np.full(64, 0.001, dtype=np.float32)])
    text = comparison_markdown(
        [("model", flat), ("simulator", trace_stats(simulated_traces([64])))]
    )
    lines = text.splitlines()
    assert lines[0] == "| quantity | model | simulator |"
    assert lines[2] == "| chains / think tokens | 1 / 64 | 1 / 64 |"
    assert "| n/a / n/a |" in text  # step boundaries need the tokens' text
    assert len(lines) == 3 + 8
