#!/usr/bin/env python3
"""Print the ``servegen-r1`` workload hour by hour, as Meridian generates it (docs/simulator.md).

For each hour of the source's day (and the default 10-minute run from 10:00): the source's
aggregate rate, the clients with traffic, their rate-weighted CV of inter-arrival times, and
the lengths of the requests the generator draws there (seed 0; the lengths do not depend on
the rate, which only sets how many are drawn); then the load 10 minutes at 4 req/s offer on
``servegen-r1``, its busiest hour and ``synthetic``. Reads the committed data file only.

Usage::

    .venv/bin/python scripts/servegen_r1_profile.py
"""

from __future__ import annotations

import numpy as np

from meridian.bench.offered import offered_load
from meridian.bench.servegen import DEFAULT_START_S, draw_servegen, load_servegen
from meridian.bench.workloads import WorkloadParams, generate_workload

RATE = 4.0


def row(label: str, start_s: int, duration_s: int) -> str:
    data = load_servegen()
    first, last = start_s // data.window_s, (start_s + duration_s) // data.window_s
    windows = [w for c in data.clients for w in c.windows if first <= w[0] < last]
    clients = {c.id for c in data.clients for w in c.windows if first <= w[0] < last}
    count = sum(w[1] for w in windows)
    cv = sum(w[1] * w[2] for w in windows) / count
    draw = draw_servegen(data, RATE, duration_s, np.random.default_rng(0), start_s=start_s)
    p50, p90 = np.percentile(draw.think, [50, 90])
    cells = [
        label,
        f"{count / duration_s:.1f}",
        str(len(clients)),
        f"{cv:.2f}",
        f"{draw.prompt.mean():,.0f}",
        f"{draw.think.mean():,.0f} / {p50:,.0f} / {p90:,.0f}",
        f"{draw.answer.mean():,.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    print(
        "| hours | source req/s | clients | client CV | prompt mean | think mean / P50 / P90 | "
        "answer mean |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|")
    for hour in range(0, 24, 2):
        print(row(f"{hour:02d}:00-{hour + 2:02d}:00", hour * 3600, 7200))
    print(row("default run (10:00-10:10)", DEFAULT_START_S, 600))
    print()
    print("| workload | requests | mean req/s | fullest 10 s (req/s) | inter-arrival CV |")
    print("|---|--:|--:|--:|--:|")
    for name in ("servegen-r1", "servegen-r1@22:00", "synthetic"):
        requests = generate_workload(name, WorkloadParams(RATE, 600.0, seed=0))
        load = offered_load(requests, 600.0)
        print(
            f"| `{name}` | {load.num_requests:,} | {load.rate_req_s:.3f} | "
            f"{load.peak_rate_req_s:.1f} | {load.interarrival_cv:.2f} |"
        )


if __name__ == "__main__":
    main()
