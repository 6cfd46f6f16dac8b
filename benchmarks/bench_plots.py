"""Drawing a run's plots: five policies of 2,000 requests each, against one policy's plots.

Workload: the synthetic runs of ``tests/test_plots.py`` (deterministic: arrivals every 100 ms,
lengths by index), five policies x 2,000 requests, every run plot ``write_plots`` draws.
Baseline, measured in the same run: the same plots for one policy (the fixed cost of figures and
PNG encoding). Target: five policies under 3 s.

Run: ``.venv/bin/python benchmarks/bench_plots.py``
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from meridian.bench.plots import write_plots
from meridian.bench.slo import SloSpec
from test_plots import POLICIES, run

NUM_REQUESTS = 2000
TARGET_S = 3.0


def seconds(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> int:
    runs = {p: run(p, NUM_REQUESTS, 15 + 5 * i) for i, p in enumerate(POLICIES)}
    one = {"meridian": runs["meridian"]}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_plots(one, out / "warm")  # font cache, imports
        base = min(seconds(lambda: write_plots(one, out / "one", SloSpec())) for _ in range(3))
        five = min(seconds(lambda: write_plots(runs, out / "five", SloSpec())) for _ in range(3))
    print(f"write_plots, {NUM_REQUESTS:,} requests per policy (best of 3)")
    print(f"  one policy (baseline)  {base:6.2f} s")
    print(f"  five policies          {five:6.2f} s  ({five / base:.2f}x baseline)")
    print(f"  target < {TARGET_S:.0f} s: {'ok' if five < TARGET_S else 'OVER TARGET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
