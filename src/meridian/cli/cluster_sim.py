"""``meridian bench sim --replicas N --router NAMES`` and ``meridian bench fidelity --replicas N``:
the cluster simulator (:mod:`meridian.bench.clusterrun`) from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from meridian.bench.clusterrun import ClusterReport, ClusterSpec, run_cluster
from meridian.bench.fidelity import FidelityRow
from meridian.bench.fidelity import compare as compare_engines
from meridian.bench.plots import write_plots, write_sweep_plots
from meridian.bench.report import SimReport, build_sweep_report
from meridian.bench.report_render import write_report, write_sweep_report
from meridian.bench.simrun import SimRunSpec, StreamSet, load_requests
from meridian.cli.common import make_progress, print_summary
from meridian.sim.routers import ROUTERS, parse_routers

__all__ = ["add_cluster_args", "cluster_spec", "fidelity_rows", "run_cluster_sim"]


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """``--replicas``, ``--router`` and ``--stats-period-s``."""
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="simulate N replicas behind a router, each an engine of this shape (1)",
    )
    parser.add_argument(
        "--router",
        help=f"router(s) in front of the replicas: 'all' or a comma list of {', '.join(ROUTERS)} "
        "(default with --replicas > 1: meridian)",
    )
    parser.add_argument(
        "--stats-period-s",
        type=float,
        help="how often routers that read replica stats get them, seconds (default: each "
        "router's own: 1 for meridian and pascal-like, as Meridian's Ray deployment polls; "
        "0.1 for vllm-dp, vLLM's coordinator)",
    )


def cluster_spec(args: argparse.Namespace) -> ClusterSpec | None:
    """The cluster the arguments ask for (``None``: one engine, no router)."""
    if args.replicas == 1 and not args.router:
        return None
    routers = parse_routers(args.router or "meridian")
    return ClusterSpec(replicas=args.replicas, routers=routers, stats_period_s=args.stats_period_s)


def run_cluster_sim(
    args: argparse.Namespace,
    spec: SimRunSpec,
    cluster: ClusterSpec,
    rates: list[float],
    console: Console,
) -> list[Path]:
    """Every router x policy at every rate: reports, plots, summary tables."""
    from meridian.bench.clusterrun import simulate_cluster

    out: Path = args.out_dir
    reports: list[SimReport] = []
    written: list[Path] = []
    for rate in rates:
        requests = load_requests(spec, rate)
        names = [f"{r}/{p}" for r in cluster.routers for p in spec.policies]
        with make_progress(console) as progress:
            tasks = {
                name: progress.add_task(f"{name} @ {rate:g} req/s", total=len(requests))
                for name in names
            }

            def hook(
                name: str, done: int, progress: Progress = progress, tasks: dict[str, Any] = tasks
            ) -> None:
                progress.update(tasks[name], completed=done)

            report, runs = simulate_cluster(spec, cluster, rate, requests, hook)
        reports.append(report)
        rate_dir = out if len(rates) == 1 else out / f"rate-{rate:g}"
        written += write_report(report, rate_dir)
        if not args.no_plots:
            written += write_plots({k: r.result for k, r in runs.items()}, rate_dir, spec.slo)
        print_summary(console, report)
        _print_holds(console, report)
    if len(rates) > 1:
        sweep = build_sweep_report(reports)
        written += write_sweep_report(sweep, out)
        if not args.no_plots:
            written += write_sweep_plots(sweep, out)
    return written


def _print_holds(console: Console, report: ClusterReport) -> None:
    table = Table(title=f"{report.replicas} replicas: requests held at the router")
    for title in ("run", "held", "hold P95 (s)", "hold max (s)"):
        table.add_column(title, justify="left" if title == "run" else "right")
    for name, hold in report.holds.items():
        p95 = "-" if hold.hold_p95_s is None else f"{hold.hold_p95_s:.3g}"
        worst = "-" if hold.hold_max_s is None else f"{hold.hold_max_s:.3g}"
        table.add_row(name, str(hold.num_held), p95, worst)
    console.print(table)


def fidelity_rows(
    spec: SimRunSpec,
    cluster: ClusterSpec,
    streams: StreamSet,
    progress: Progress,
    num_requests: int,
    **shape: Any,
) -> list[FidelityRow]:
    """``bench fidelity --replicas N``: each router x policy on both engines, compared."""
    rows = []
    for router in cluster.routers:
        for policy in spec.policy_specs:
            results = {}
            for engine in ("model", "vllm"):
                task = progress.add_task(
                    f"{router}/{policy.name} on {engine} x {cluster.replicas}", total=num_requests
                )

                def advance(done: int, task: Any = task) -> None:
                    progress.update(task, completed=done)

                run = run_cluster(
                    spec, cluster, router, policy, streams, advance, engine=engine, **shape
                )
                results[engine] = run.result
            rows.append(compare_engines(results["model"], results["vllm"]))
    return rows
