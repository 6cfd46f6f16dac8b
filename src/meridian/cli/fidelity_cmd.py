"""``meridian bench fidelity``: the fast engine model against vLLM's own scheduler."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meridian.bench.fidelity import (
    ASYNC_HEADER,
    ASYNC_NOTE,
    ASYNC_TITLE,
    HEADER,
    FidelityReport,
    render_markdown,
    table_rows,
)
from meridian.bench.fidelity import compare as compare_engines
from meridian.bench.report import to_json
from meridian.bench.simrun import (
    StreamSet,
    engine_config_for,
    load_requests,
    run_policy,
    step_model_for,
)
from meridian.cli.cluster_sim import cluster_spec, fidelity_rows
from meridian.cli.common import (
    check_args,
    check_out_dir,
    check_workload_args,
    make_console,
    make_progress,
    positive_number,
    require_vllm,
    run_spec,
)
from meridian.config import load_config


def run_fidelity_cmd(args: argparse.Namespace) -> int:
    """Both engines, every policy; the fidelity table, reports, and 1 when a target is missed."""
    check_workload_args(args)
    check_args(args)
    positive_number("--arrival-rate", args.arrival_rate)
    spec = run_spec(args, load_config(args.config).config, engine="vllm", async_scheduling=False)
    cluster = cluster_spec(args)
    engine_config = engine_config_for(spec, 1 if cluster is None else cluster.replicas)
    check_out_dir(args.out_dir)
    require_vllm("vllm")
    requests = load_requests(spec, args.arrival_rate)
    streams = StreamSet(requests, spec.config)
    step_model = step_model_for(spec)
    console = make_console()
    rows = []
    async_rows = []
    with make_progress(console) as progress:
        if cluster is not None:
            shape = {"engine_config": engine_config, "step_model": step_model}
            rows = fidelity_rows(spec, cluster, streams, progress, len(requests), **shape)
        # The fast engine schedules synchronously only; --async measures what that misses
        # against vLLM's AsyncScheduler (the GPU default) on the same streams.
        # (label, engine, its configuration)
        runs = [("model", "model", engine_config), ("vllm", "vllm", engine_config)]
        if args.compare_async:
            runs.append(("vllm async", "vllm", replace(engine_config, async_scheduling=True)))
        for policy in spec.policy_specs if cluster is None else ():
            results = {}
            for label, engine, run_config in runs:
                task = progress.add_task(f"{policy.name} on {label}", total=len(requests))

                def advance(done: int, task: Any = task) -> None:
                    progress.update(task, completed=done)

                results[label] = run_policy(
                    spec,
                    policy,
                    streams,
                    advance,
                    engine_config=run_config,
                    step_model=step_model,
                    engine=engine,
                )
            rows.append(compare_engines(results["model"], results["vllm"]))
            if args.compare_async:
                async_rows.append(compare_engines(results["model"], results["vllm async"]))
    report = FidelityReport(
        workload=Path(args.workload).name,
        arrival_rate=args.arrival_rate,
        duration_s=args.duration_s,
        seed=args.seed,
        hardware=args.hardware,
        model=args.model,
        max_num_seqs=engine_config.max_num_seqs,
        max_num_batched_tokens=engine_config.max_num_batched_tokens,
        num_kv_blocks=engine_config.num_kv_blocks,
        enable_prefix_caching=engine_config.enable_prefix_caching,
        rows=rows,
        async_rows=async_rows,
    )
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(to_json(report), encoding="utf-8", newline="")
    (out / "fidelity.md").write_text(render_markdown(report), encoding="utf-8", newline="")
    _print_fidelity(console, report)
    console.print(f"wrote fidelity.json and fidelity.md under {out}/")
    return 0 if report.passed else 1


def _print_fidelity(console: Console, report: Any) -> None:
    table = Table(
        title=f"fidelity: {report.workload} @ {report.arrival_rate:g} req/s, seed {report.seed}"
    )
    for i, title in enumerate(HEADER):
        table.add_column(title, justify="left" if i == 0 else "right")
    for cells in table_rows(report.rows):
        table.add_row(*(c.strip("`") for c in cells))
    console.print(table)
    console.print(f"targets: {report.targets}")
    if report.async_rows:
        table = Table(title=ASYNC_TITLE)
        for i, title in enumerate(ASYNC_HEADER):
            table.add_column(title, justify="left" if i == 0 else "right")
        for cells in table_rows(report.async_rows, with_targets=False):
            table.add_row(*(c.strip("`") for c in cells))
        console.print(table)
        console.print(ASYNC_NOTE)
