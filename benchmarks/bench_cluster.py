"""Issue 32's cluster sweep: Meridian's router against Ray Serve's default (power of two choices
on queue length), round robin, vLLM's data-parallel balancer and a Pascal-like placement, each
with stock scheduling and with Meridian's, over a load sweep; every cell printed, losses marked;
and the routers' own cost per decision, measured in the same runs.

Run (fast engine, minutes; ``--engine vllm`` drives vLLM's own scheduler in each replica and
needs the vLLM environment)::

    .venv/bin/python benchmarks/bench_cluster.py                           # 4 x H100 / Qwen3-8B
    .venv/bin/python benchmarks/bench_cluster.py --replicas 16 --workload servegen-r1
    .venv/bin/python benchmarks/bench_cluster.py --replicas 16 --routers meridian,pow2

Load is the fraction of the cluster's capacity: ``replicas x capacity`` req/s, ``capacity`` one
replica's for the workload (:data:`meridian.bench.targets.CAPACITY`: the highest rate at which
stock vLLM's queue stays bounded, found on vLLM's scheduler by ``benchmarks/bench_targets.py``).

Every run writes its figures (JSON: the arguments, commit, every cell and the routers' costs) and
a plot of TTFVT P95 and goodput against load, a line per router and scheduling: to
``benchmarks/results/cluster-NxHARDWARE-MODEL-WORKLOAD.json`` and
``docs/img/cluster-NxHARDWARE-MODEL-WORKLOAD.png`` (docs/cluster.md shows it) when it is a full
sweep (all routers, both schedulings, the default loads, duration and seed, fast engine), else
under ``meridian-out/cluster/`` or beside ``--out``. Forcing is held equal:
the stock side runs ``vllm-fcfs+forcing``. The comparison table gives each run against
``meridian/meridian`` (Meridian's router and scheduler) as Meridian's / theirs: TTFVT P95, answer
ITL P99 and TTFT P95 (lower is better for Meridian below 1), throughput and goodput (better above
1). A ratio where Meridian is worse by more than 3 % is marked ``✗``.

Measured as the single-engine sweep measures (:mod:`meridian.bench.slo`,
:mod:`meridian.bench.loads`): per seed (``--seeds``, a cell per seed) one trace drawn at the sweep's
highest load and thinned to each lower one (nested loads); the first ``--warmup-s`` seconds of
arrivals in no statistic (default 200 from 600 s of arrivals up, else 0); SLO attainment at 3x each
request's idle latency, reasoning hidden and shown (goodput: hidden, per second of the arrival
window); the fullest replica's peak KV use, preemptions, requests held at the router, and "no
contention" where nothing was preempted, held or queued. Tables show the median over the seeds.

Decision cost: each router's ``choose`` and ``routed`` calls timed with ``perf_counter_ns`` while
the simulation runs (the simulator's renderings of the baselines, not Ray's or vLLM's code).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from meridian.bench import clusterrun, provenance
from meridian.bench.clusterrun import ClusterSpec, simulate_cluster
from meridian.bench.plots import write_cluster_plots
from meridian.bench.simrun import SimRunSpec, load_requests
from meridian.bench.slo import UserModel
from meridian.bench.targets import CAPACITY, WARMUP_S
from meridian.core.routing import NewRequest
from meridian.sim.routers import ROUTERS, parse_routers

STOCK, MERIDIAN = "vllm-fcfs+forcing", "meridian"
REPO = Path(__file__).resolve().parents[1]
LOADS, DURATION_S = "0.5,0.7,1.0,1.3", 60.0
NOISE = 0.03
# (label, getter, lower is better)
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("TTFVT P95 s", "ttfvt", True),
    ("ITL P99 ms", "itl", True),
    ("TTFT P95 s", "ttft", True),
    ("tok/s", "throughput", False),
    ("goodput req/s", "goodput", False),
    ("SLO % hidden", "slo_hidden", False),
    ("SLO % shown", "slo_shown", False),
)

# Nanoseconds each router spent deciding, and its decisions, by router name.
COST_NS: dict[str, list[int]] = defaultdict(list)


class TimedRouter:
    """A router of the simulator whose decisions are timed (same interface, delegated)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.stats_period_s = inner.stats_period_s
        self.needs_projection = inner.needs_projection
        self._chosen = 0

    def observe(self, replica: int, stats: Any) -> None:
        self.inner.observe(replica, stats)

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        start = time.perf_counter_ns()
        chosen: int | None = self.inner.choose(request, now_s, waited_s)
        self._chosen = time.perf_counter_ns() - start
        if chosen is None:
            COST_NS[self.name].append(self._chosen)
        return chosen

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        start = time.perf_counter_ns()
        self.inner.routed(replica, request_id, request, now_s)
        COST_NS[self.name].append(self._chosen + time.perf_counter_ns() - start)

    def completed(self, replica: int, request_id: str) -> None:
        self.inner.completed(replica, request_id)

    def __getattr__(self, name: str) -> Any:
        # What else the simulator reads of a router (its policy, attach, describe): the inner's.
        return getattr(self.inner, name)


def _timed(make: Any) -> Any:
    def make_timed(*args: Any, **kwargs: Any) -> TimedRouter:
        return TimedRouter(make(*args, **kwargs))

    return make_timed


def _row(summary: Any, held: int, kv_peak: float, moved: int = 0) -> dict[str, float]:
    def val(x: Any) -> float:
        return float("nan") if x is None else float(x)

    a, c = summary.attainment, summary.contention
    return {
        "ttfvt": val(summary.ttfvt_s.p95),
        "itl": val(summary.output_itl_s.p99) * 1e3,
        "ttft": val(summary.ttft_s.p95),
        "throughput": val(summary.throughput_tok_s),
        "goodput": val(summary.goodput_req_s),
        "recomputed": summary.num_recomputed_tokens,
        "pre_think": summary.preemptions.think + summary.preemptions.prefill,
        "pre_out": summary.preemptions.output,
        "held": held,
        "moved": moved,
        "slo_hidden": val(a and a.pct_at(UserModel.HIDDEN, a.goodput_scale)),
        "slo_shown": val(a and a.pct_at(UserModel.SHOWN, a.goodput_scale)),
        "kv_peak_replica": kv_peak,
        "queued": val(c and c.num_queued_requests),
        "contended": float(held > 0 or bool(c and c.contended)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--loads", default=LOADS, help="fractions of capacity")
    ap.add_argument("--routers", default="all", help=f"'all' or a comma list of {list(ROUTERS)}")
    ap.add_argument("--policies", default=f"{MERIDIAN},{STOCK}")
    ap.add_argument("--engine", choices=("model", "vllm"), default="model")
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--workload", default="synthetic")
    ap.add_argument("--duration-s", type=float, default=DURATION_S)
    ap.add_argument(
        "--warmup-s", type=float,
        help=f"seconds of arrivals at the start in no statistic (default: {WARMUP_S:g} from "
        f"{3 * WARMUP_S:g} s of arrivals up, as the headline sweep; 0 for shorter runs)",
    )  # fmt: skip
    ap.add_argument("--seeds", default="0", help="workload seeds, a cell per seed (0)")
    ap.add_argument("--capacity", type=float, help="one replica's req/s (default: measured)")
    ap.add_argument("--out", type=Path, help="the JSON to write (the plot beside it, .png)")
    ap.add_argument(
        "--render", type=Path, nargs="+", metavar="JSON",
        help="run nothing: print the tables of these runs' JSONs together (their cells pooled, "
        "the median over every seed they hold)",
    )  # fmt: skip
    ap.add_argument(
        "--answer-share", action="store_true",
        help="run nothing: print the answer phase's share of the KV the workload's requests hold "
        "over their decode steps, per seed, at the first load (what meridian-split is sized by)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.render:
        _render(args.render)
        return
    key = (args.workload, args.model, args.hardware)
    if args.capacity is None and key not in CAPACITY:
        ap.error(f"no measured capacity for {', '.join(key)}: pass --capacity REQ_S")
    capacity = args.capacity or CAPACITY[key]
    if args.answer_share:
        rate = float(args.loads.split(",")[0]) * capacity * args.replicas
        for seed in (int(x) for x in args.seeds.split(",")):
            spec = SimRunSpec(workload=args.workload, duration_s=args.duration_s, seed=seed)
            requests = load_requests(spec, rate)
            share = clusterrun.answer_kv_share(requests)
            print(
                f"{args.workload}, seed {seed}, {rate:g} req/s for {args.duration_s:g} s: "
                f"{len(requests)} requests, answer share of decode-step KV {share:.3f}"
            )
        return
    name = f"cluster-{args.replicas}x{args.hardware}-{args.model}-{args.workload}"
    full = (
        args.routers == "all" and args.policies == f"{MERIDIAN},{STOCK}" and args.loads == LOADS
        and args.duration_s == DURATION_S and args.seeds == "0" and args.engine == "model"
        and args.warmup_s is None and args.capacity is None
    )  # fmt: skip
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out: Path = args.out or (
        REPO / "benchmarks" / "results" / f"{name}.json"
        if full
        else REPO / "meridian-out" / "cluster" / f"{name}-{stamp}.json"
    )
    routers = parse_routers(args.routers)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    clusterrun.make_router = _timed(clusterrun.make_router)  # type: ignore[attr-defined]
    cluster = ClusterSpec(replicas=args.replicas, routers=routers)
    if args.warmup_s is None:
        args.warmup_s = WARMUP_S if args.duration_s >= 3 * WARMUP_S else 0.0
    seeds = [int(x) for x in args.seeds.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    print(
        f"{args.replicas} x {args.hardware} / {args.model}, engine {args.engine}, workload "
        f"{args.workload}, {args.duration_s:g} s of arrivals (the first {args.warmup_s:g} s "
        f"warm-up), seeds {args.seeds}, loads nested, capacity {capacity:g} req/s per replica"
    )
    per_seed: dict[tuple[float, str], list[dict[str, float]]] = defaultdict(list)
    started = time.monotonic()
    for seed in seeds:
        for load in loads:
            rate = load * capacity * args.replicas
            spec = SimRunSpec(
                workload=args.workload,
                arrival_rate=rate,
                duration_s=args.duration_s,
                seed=seed,
                hardware=args.hardware,
                model=args.model,
                policies=policies,
                engine=args.engine,
                warmup_s=args.warmup_s,
                trace_rate=max(loads) * capacity * args.replicas,
            )
            report, _ = simulate_cluster(spec, cluster, rate, load_requests(spec, rate))
            for run, summary in report.summaries.items():
                moves = report.migrations.get(run, {})
                moved = sum(moves.get(r, 0) for r in ("preempted", "waited", "answer"))
                figures = _row(summary, report.holds[run].num_held,
                               report.kv_used_peak_replica[run], moved)  # fmt: skip
                per_seed[(load, run)].append({"seed": seed, **figures})
            print(f"  seed {seed}, load {load:.0%} ({rate:g} req/s) done at "
                  f"{time.monotonic() - started:.0f} s")  # fmt: skip
    rows = {key: _median(cells) for key, cells in per_seed.items()}
    _print_raw(rows)
    _print_ratios(rows)
    _print_gate(rows, per_seed)
    costs_us: dict[str, dict[str, float]] = {}
    for router, costs in COST_NS.items():
        c = np.asarray(costs) / 1e3
        costs_us[router] = {
            "median": float(np.median(c)),
            "p99": float(np.percentile(c, 99)),
            "calls": len(c),
        }
    _print_costs("in the runs above", costs_us)
    title = (
        f"{args.replicas} x {args.hardware} / {args.model}, {args.workload}, engine "
        f"{args.engine}, {args.duration_s:g} s of arrivals"
    )
    _write(out, args, capacity, per_seed, costs_us, time.monotonic() - started)
    image = REPO / "docs" / "img" / f"{name}.png" if full and args.out is None else None
    plot = write_cluster_plots(rows, title, image or out.with_suffix(".png"))
    print(f"\n{out}\n{plot}")


def _render(paths: list[Path]) -> None:
    """The tables of runs already made, their cells pooled (e.g. seed 0 from one run, seeds 1-2
    from another, same arguments otherwise)."""
    per_seed: dict[tuple[float, str], list[dict[str, float]]] = defaultdict(list)
    costs: dict[Path, dict[str, dict[str, float]]] = {}
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for cell in doc["cells"]:
            figures = {k: v for k, v in cell.items() if k not in ("load", "run")}
            per_seed[(cell["load"], cell["run"])].append(figures)
        costs[path] = doc.get("router_cost_us", {})
    seeds = sorted({int(c["seed"]) for cells in per_seed.values() for c in cells})
    print(f"{', '.join(map(str, paths))}: seeds {seeds}, the median over them")
    rows = {key: _median(cells) for key, cells in sorted(per_seed.items())}
    _print_raw(rows)
    _print_ratios(rows)
    _print_gate(rows, per_seed)
    for path, cost in costs.items():
        if cost:
            _print_costs(f"in {path.name}", cost)


def _print_costs(where: str, costs_us: dict[str, dict[str, float]]) -> None:
    """Each router's cost per decision as a run measured it (its JSON keeps the figures)."""
    print(f"\nrouter cost per decision (µs; choose + routed, {where}):")
    for router, c in costs_us.items():
        print(
            f"  {router:12s} median {c['median']:7.1f}  P99 {c['p99']:7.1f}  "
            f"({c['calls']:.0f} calls)"
        )


def _median(cells: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the seeds; "contended" if any seed was."""
    keys = [k for k in cells[0] if k != "seed"]
    out = {k: float(np.nanmedian([c[k] for c in cells])) for k in keys}
    out["contended"] = max(c["contended"] for c in cells)
    return out


def _write(
    out: Path,
    args: argparse.Namespace,
    capacity: float,
    per_seed: dict[tuple[float, str], list[dict[str, float]]],
    costs_us: dict[str, dict[str, float]],
    wall_s: float,
) -> None:
    """The run's figures as JSON: its arguments, the commit (and whether the code differed from
    it), every cell of every seed, the routers' costs."""
    doc = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "capacity_req_s": capacity,
        "commit": provenance.commit(REPO),
        "uncommitted_changes": provenance.has_changes(REPO, "src", "benchmarks/bench_cluster.py"),
        "wall_s": round(wall_s, 1),
        "cells": [
            {"load": load, "run": run, **figures}
            for (load, run), cells in per_seed.items()
            for figures in cells
        ],
        "router_cost_us": costs_us,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _quiet(*runs: dict[str, float]) -> str:
    """The mark of a comparison no run in it contended in (nothing preempted, held or queued)."""
    return "" if any(r["contended"] for r in runs) else " (no contention)"


def _print_raw(rows: dict[tuple[float, str], dict[str, float]]) -> None:
    head = "| load | router/scheduler | " + " | ".join(m[0] for m in METRICS)
    print(
        "\n" + head + " | recomputed tok | preempt think/out | held | moved | peak KV (replica) |"
    )
    print("|" + "---|" * (len(METRICS) + 7))
    for (load, name), r in rows.items():
        cells = [f"{r[key]:.4g}" for _, key, _ in METRICS]
        print(
            f"| {load:.0%}{_quiet(r)} | `{name}` | "
            + " | ".join(cells)
            + f" | {r['recomputed']:.0f}"
            f" | {r['pre_think']:.0f}/{r['pre_out']:.0f} | {r['held']:.0f} | "
            f"{r.get('moved', 0.0):.0f} | {r['kv_peak_replica']:.0%} |"
        )


def _print_ratios(rows: dict[tuple[float, str], dict[str, float]]) -> None:
    print(
        "\nMeridian's router + scheduler (`meridian/meridian`) / each other run; ✗: worse > 3 %;"
        " (no contention): neither run preempted, held or queued anything: not a claim"
    )
    print("| load | against | " + " | ".join(m[0] for m in METRICS) + " |")
    print("|" + "---|" * (len(METRICS) + 2))
    losses = 0
    for (load, name), theirs in rows.items():
        ours = rows.get((load, f"meridian/{MERIDIAN}"))
        if ours is None or name == f"meridian/{MERIDIAN}":
            continue
        cells = []
        for _, key, lower in METRICS:
            ratio = ours[key] / theirs[key] if theirs[key] else float("nan")
            worse = ratio > 1 + NOISE if lower else ratio < 1 - NOISE
            losses += worse
            cells.append(f"{ratio:.2f}" + (" ✗" if worse else ""))
        print(f"| {load:.0%}{_quiet(ours, theirs)} | `{name}` | " + " | ".join(cells) + " |")
    print(f"{losses} cells where Meridian's router + scheduler is worse by more than 3 %")


def _print_gate(
    rows: dict[tuple[float, str], dict[str, float]],
    per_seed: dict[tuple[float, str], list[dict[str, float]]],
) -> None:
    """Issue 45's gate against Ray's default router with stock scheduling (``pow2/STOCK``): TTFVT
    P95 <= 0.85x or SLO attainment (hidden) >= +10 points, with TTFT P95 <= 1.1x and throughput
    >= 0.99x; every run, at every load (the medians over the seeds), with the range of the TTFVT
    ratio over the seeds (each seed against the same seed's baseline)."""
    print(
        f"\nissue 45's gate, each run against `pow2/{STOCK}`: TTFVT P95 <= 0.85x or SLO % hidden "
        ">= +10 points, with TTFT P95 <= 1.1x and tok/s >= 0.99x; (no contention): neither run "
        "preempted, held or queued anything: not a claim"
    )
    print("| load | run | TTFVT P95 | over seeds | SLO hidden (points) | TTFT P95 | tok/s | gate |")
    print("|---|---|---|---|---|---|---|---|")
    for (load, name), r in rows.items():
        base = rows.get((load, f"pow2/{STOCK}"))
        if base is None or name == f"pow2/{STOCK}":
            continue
        ttfvt = r["ttfvt"] / base["ttfvt"] if base["ttfvt"] else float("nan")
        points = r["slo_hidden"] - base["slo_hidden"]
        ttft = r["ttft"] / base["ttft"] if base["ttft"] else float("nan")
        tok = r["throughput"] / base["throughput"] if base["throughput"] else float("nan")
        gate = (ttfvt <= 0.85 or points >= 10.0) and ttft <= 1.1 and tok >= 0.99
        bases = {c["seed"]: c["ttfvt"] for c in per_seed[(load, f"pow2/{STOCK}")]}
        each = [
            c["ttfvt"] / bases[c["seed"]] for c in per_seed[(load, name)] if bases.get(c["seed"])
        ]
        spread = f"{min(each):.2f}–{max(each):.2f}" if each else "–"
        print(
            f"| {load:.0%}{_quiet(r, base)} | `{name}` | {ttfvt:.2f} | {spread} | {points:+.1f} | "
            f"{ttft:.2f} | "
            f"{tok:.3f} | {'reached' if gate else 'no'} |"
        )


if __name__ == "__main__":
    main()
