"""Headroom admission's cost on the scheduler's thread: building the length model's curves and
projecting the running and waiting requests' KV, against what the build no longer pays.

Workload: a length model that has seen 1,024 finished requests (half reasoning, seeded lengths).
Figures, in this fresh process:

- the first build of the curves (the cold one: nothing of numpy's lazily imported modules is
  loaded yet), and the baseline measured right after in the same process: the first calls of
  ``np.quantile`` and ``np.unique``, which an earlier build used (they import numpy modules on
  first use);
- a steady rebuild (the model rebuilds every 32 finished requests);
- one projection (``expected_blocks``) of 64, 320 and 1,088 requests: 256 running plus the 64
  waiting candidates is what the vLLM adapter projects per step at 256 running, 1,088 at
  vLLM's GPU default of 1,024.

Run: ``.venv/bin/python benchmarks/bench_headroom.py``
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from meridian.core.headroom import REBUILD_EVERY, LengthModel
from timing import seconds_per_call

SAMPLES = 1024


def teach(model: LengthModel, rng: np.random.Generator, n: int) -> None:
    for i in range(n):
        rest = int(rng.integers(10, 500))
        model.finished(int(rng.integers(10, 3000)) if i % 2 else None, rest, 100)


def main() -> None:
    rng = np.random.default_rng(0)
    model = LengthModel()
    teach(model, rng, SAMPLES)

    def project(n: int) -> Callable[[], object]:
        kinds = rng.integers(0, 3, n).tolist()
        progress = rng.integers(0, 2000, n).tolist()
        tokens = rng.integers(100, 3000, n).tolist()
        return lambda: model.expected_blocks(kinds, progress, tokens, 16)

    start = time.perf_counter()
    model.expected_blocks([0], [0], [100], 16)  # builds the curves, then one projection
    cold_ms = 1e3 * (time.perf_counter() - start)
    sample = rng.integers(0, 3000, SAMPLES)
    start = time.perf_counter()
    np.quantile(sample, np.linspace(0.0, 1.0, 25))
    np.unique(sample)
    baseline_ms = 1e3 * (time.perf_counter() - start)

    one = project(1)

    def rebuild() -> None:
        teach(model, rng, REBUILD_EVERY)
        one()

    rebuild_ms = 1e3 * (seconds_per_call(rebuild, 20) - seconds_per_call(one, 200))
    print(f"first build (cold process)                     {cold_ms:8.2f} ms")
    print(f"baseline: first np.quantile + np.unique calls  {baseline_ms:8.2f} ms")
    print(f"ratio first build / baseline                   {cold_ms / baseline_ms:8.3f}")
    print(f"steady rebuild                                 {rebuild_ms:8.2f} ms")
    for n in (64, 320, 1088):
        us = 1e6 * seconds_per_call(project(n), 200)
        print(f"projection of {n:>5} requests                    {us:8.1f} us")


if __name__ == "__main__":
    main()
