"""The timing helper the micro-benchmarks share (imported as a sibling: scripts run from here)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` rounds of the mean seconds per call, after one warm-up call
    (page faults, lazy imports, buffer allocation)."""
    fn()
    means: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)
