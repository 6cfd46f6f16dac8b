"""Issue 45's router-cost check: the same decisions, timed against any version of the policy.

``record`` runs the cluster simulator once (16 x H100 / Qwen3-8B, ``servegen-r1``, 130 %, Meridian's
router and scheduler, ``--duration-s`` of arrivals) and pickles every call the run made of
:class:`~meridian.core.routing.RoutingPolicy` (``observe``, ``routed``, ``completed``, ``rank``).
``replay`` makes those calls again on a fresh policy of whatever ``meridian`` is importable,
times each ``rank`` (``--clock wall``: ``perf_counter_ns``; ``cpu``: the thread's CPU time, steadier
on a busy machine) and prints the median and P99 per repetition; with
``--choices`` it saves each decision's first-ranked replica, and ``--compare`` tells how many
match another replay's; ``--count-full`` also counts, after each decision (untimed), the
candidates without room for its request (``RoutingPolicy.headroom`` False: the ones whose
projection the decision had to age). The run's own bench timing (``bench_cluster.py``) moves
with the machine's load; a replay holds the decisions fixed::

    .venv/bin/python benchmarks/bench_router_replay.py record --out /tmp/calls.pkl
    .venv/bin/python benchmarks/bench_router_replay.py replay /tmp/calls.pkl --choices /tmp/new.pkl
    git archive e50f607 src | tar -x -C /tmp/old   # the version before issue 45
    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/bench_router_replay.py replay \\
        /tmp/calls.pkl --choices /tmp/old.pkl --compare /tmp/new.pkl

Versions without ``RoutingConfig.hold`` hold by headroom; a replay gives newer ones the same.
The pickles are this machine's own files (``pickle`` runs what it reads: replay only your own).
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np

from meridian.core import routing

METHODS = ("observe", "routed", "completed", "rank")


def record(out: Path, duration_s: float) -> None:
    from meridian.bench.clusterrun import ClusterSpec, simulate_cluster
    from meridian.bench.simrun import SimRunSpec, load_requests
    from meridian.bench.targets import CAPACITY

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for name in METHODS:
        original = getattr(routing.RoutingPolicy, name)

        def logged(
            self: Any, *a: Any, _original: Any = original, _name: str = name, **k: Any
        ) -> Any:
            calls.append((_name, a, k))
            return _original(self, *a, **k)

        setattr(routing.RoutingPolicy, name, logged)
    rate = 1.3 * CAPACITY[("servegen-r1", "qwen3-8b", "h100-sxm")] * 16
    spec = SimRunSpec(workload="servegen-r1", arrival_rate=rate, duration_s=duration_s, seed=0,
                      hardware="h100-sxm", model="qwen3-8b", policies=["meridian"])  # fmt: skip
    cluster = ClusterSpec(replicas=16, routers=["meridian"])
    simulate_cluster(spec, cluster, rate, load_requests(spec, rate))
    out.write_bytes(pickle.dumps(calls))
    print(f"{len(calls)} calls, {sum(c[0] == 'rank' for c in calls)} decisions: {out}")


# What a replay times a decision by: the wall clock, or this thread's CPU time (on a busy machine
# the CPU time leaves out the moments another process had the core).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def replay(
    calls_file: Path,
    repeats: int,
    choices: Path | None,
    compare: Path | None,
    clock: str,
    count_full: bool = False,
) -> None:
    calls = pickle.loads(calls_file.read_bytes())
    hold = {"hold": routing.Hold.HEADROOM} if hasattr(routing, "Hold") else {}
    first: list[list[str]] = []
    now = CLOCKS[clock]
    for rep in range(repeats):
        policy = routing.RoutingPolicy(routing.RoutingConfig(**hold))
        times: list[int] = []
        first = []
        full = assessed = 0
        for name, a, k in calls:
            method = getattr(policy, name)
            if name != "rank":
                method(*a, **k)
                continue
            start = now()
            ranked = method(*a, **k)
            times.append(now() - start)
            first.append(ranked[:1])
            if count_full:
                candidates, request, at = a[:3]
                assessed += len(candidates)
                full += sum(policy.headroom(c, request, at) is False for c in candidates)
        us = np.asarray(times) / 1e3
        print(f"rep {rep}: rank median {np.median(us):.1f} µs, P99 {np.percentile(us, 99):.1f} µs "
              f"({len(us)} decisions, {clock} clock)")  # fmt: skip
        if count_full:
            print(f"  without room for the request: {full} of {assessed} replica assessments "
                  f"({full / max(assessed, 1):.1%})")  # fmt: skip
    if choices is not None:
        choices.write_bytes(pickle.dumps(first))
    if compare is not None:
        other = pickle.loads(compare.read_bytes())
        same = sum(x == y for x, y in zip(first, other, strict=True))
        print(f"first-ranked replica the same in {same} of {len(first)} decisions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--duration-s", type=float, default=120.0)
    rep = sub.add_parser("replay")
    rep.add_argument("calls", type=Path)
    rep.add_argument("--repeats", type=int, default=3)
    rep.add_argument("--choices", type=Path)
    rep.add_argument("--compare", type=Path)
    rep.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    rep.add_argument("--count-full", action="store_true")
    args = ap.parse_args()
    if args.command == "record":
        record(args.out, args.duration_s)
    else:
        replay(args.calls, args.repeats, args.choices, args.compare, args.clock, args.count_full)


if __name__ == "__main__":
    main()
