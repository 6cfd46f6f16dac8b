"""The ``meridian bench`` commands: ``sim`` (the simulator A/B) here; ``fidelity``, ``real`` and
``ab-real`` registered here and run from their own modules."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

from meridian.bench.fidelity import TARGETS as FIDELITY_TARGETS
from meridian.bench.plots import (
    attainment_panels,
    write_attainment_plot,
    write_plots,
    write_sweep_plots,
)
from meridian.bench.report import SimReport, ab_baselines, build_ab_report, build_sweep_report
from meridian.bench.report_render import write_ab_report, write_report, write_sweep_report
from meridian.bench.simrun import ENGINES, SimRunSpec, engine_config_for, load_requests, simulate
from meridian.bench.slo import ExplicitSlo, SloSpec
from meridian.bench.traces import write_trace
from meridian.bench.workloads import (
    DEFAULT_DURATION_S,
    SERVEGEN,
    SERVEGEN_DURATION_S,
    WORKLOADS,
    is_bundled,
)
from meridian.cli import accuracy_cmd
from meridian.cli.cluster_sim import add_cluster_args, cluster_spec, run_cluster_sim
from meridian.cli.common import (
    ASYNC_SCHEDULING,
    add_server_args,
    check_args,
    check_out_dir,
    check_out_file,
    hide_vllm_logs,
    make_console,
    make_progress,
    make_screen,
    positive_gib,
    positive_number,
    print_summary,
    require_vllm,
    run_spec,
)
from meridian.cli.fidelity_cmd import run_fidelity_cmd
from meridian.cli.real_cmd import run_ab_real_cmd, run_real_cmd
from meridian.config import load_config
from meridian.errors import MeridianError
from meridian.sim.presets import HARDWARE, MODELS
from meridian.sim.records import SimResult
from meridian.sim.steptime.fitted import check_csv_file

DEFAULT_OUT_DIR = Path("meridian-out") / "sim"
DURATION_HELP = (
    f"seconds of arrivals ({DEFAULT_DURATION_S:g}; {SERVEGEN_DURATION_S:g} for {SERVEGEN}: one "
    "10-minute window of its source)"
)
_EXPLICIT = ExplicitSlo()
# The default shows scheduling at work: at 16 req/s for 60 s stock vLLM preempts (the synthetic
# workload fills an H100's KV cache for Qwen3-8B); at 8 req/s for 30 s only forcing would show.
DEFAULT_RATE = 16.0
SIM_DEFAULT_DURATION_S = 60.0
# SLO bounds: an hour between two answer tokens (as scheduler.output_tpot_budget_ms), a day of
# base wait before the first one (a larger one is no SLO; an infinite one overflows the ns clock).
MAX_ITL_SLO_MS = 3_600_000.0
MAX_TTFVT_SLO_BASE_S = 86_400.0


def register(commands: Any) -> None:
    """Add ``bench sim``, ``bench real`` and ``bench ab-real`` to the top-level subparsers."""
    bench = commands.add_parser("bench", help="benchmarks: the simulator A/B")
    sub = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    sim = sub.add_parser(
        "sim",
        help="simulate Meridian and the baselines on one workload (deterministic)",
        description=(
            "Run the same workload and seed through Meridian and each baseline policy, on vLLM's "
            "own scheduler (--engine vllm) or the fast engine model; write report.json/.md, "
            "ab-report.json/.md and PNG plots. Several --arrival-rate values make a sweep "
            "(sweep-report and load charts)."
        ),
    )
    sim.add_argument(
        "--engine",
        choices=ENGINES,
        default="model",
        help="vllm: vLLM's own scheduler on virtual time (needs the vLLM environment, "
        ".venv-vllm); model: the fast engine model, checked against it by `bench fidelity` "
        "(default: model)",
    )
    sim.add_argument(
        "--arrival-rate",
        default=f"{DEFAULT_RATE:g}",
        help="requests per second; a comma list (e.g. 4,8,16) runs a sweep (default: "
        f"{DEFAULT_RATE:g}, where the default workload preempts on the default engine, so "
        "scheduling has something to do)",
    )
    _add_engine_args(
        sim,
        policies="all",
        out_dir=DEFAULT_OUT_DIR,
        duration_help=DURATION_HELP.replace(
            f"({DEFAULT_DURATION_S:g};", f"({SIM_DEFAULT_DURATION_S:g} for synthetic;"
        ),
    )
    sim.add_argument(
        "--step-time-csv",
        type=Path,
        help="calibrate the step-time model to measured steps (CSV; see docs) instead of a preset",
    )
    sim.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="seconds of arrivals at the start that no statistic counts (the engine fills up "
        "from empty there); default 0: every arrival counts, as in the main job's short run",
    )
    sim.add_argument(
        "--ttfvt-slo-base-s",
        type=float,
        help="an explicit SLO instead of the unloaded-latency one for goodput: TTFVT <= this "
        f"base + think tokens requested x --think-tpot-slo-ms ({_EXPLICIT.ttfvt_base_s:g} when "
        "another explicit-SLO flag is given)",
    )
    sim.add_argument(
        "--think-tpot-slo-ms",
        type=float,
        help="explicit SLO: TTFVT allowance per think token requested, in ms "
        f"({_EXPLICIT.think_tpot_s * 1000:g})",
    )
    sim.add_argument(
        "--output-itl-slo-ms",
        type=float,
        help="explicit SLO: each request's answer-gap P95 bound, in ms "
        f"({_EXPLICIT.output_itl_s * 1000:g}); also the answer ITL Pascal's token pacer holds "
        f"(default {SimRunSpec.answer_pace_s * 1000:g})",
    )
    sim.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="vLLM's asynchronous scheduling; auto: on with --engine vllm (vLLM's GPU default), "
        "off with --engine model (the fast engine models synchronous scheduling only)",
    )
    sim.add_argument(
        "-v", "--verbose", action="store_true", help="--engine vllm: show vLLM's own log lines"
    )
    sim.add_argument("--export-trace", type=Path, help="also write the workload as a JSONL trace")
    sim.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    sim.add_argument(
        "--metrics",
        action="store_true",
        help="also write each policy's run as Prometheus metrics (metrics-POLICY.prom) through "
        "Meridian's metric catalogue",
    )
    sim.set_defaults(handler=run_sim)

    fidelity = sub.add_parser(
        "fidelity",
        help="check the fast engine model against vLLM's own scheduler (needs .venv-vllm)",
        description=(
            "Run each policy on the same workload on both engines (synchronous scheduling) and "
            "print, per policy, steps, makespan, preemptions by phase and the median and P90 of "
            f"the per-request finish-time difference, against the targets ({FIDELITY_TARGETS}); "
            "write fidelity.json/.md. Exit status 1 when a target is missed."
        ),
    )
    fidelity.add_argument(
        "--arrival-rate", type=float, default=24.0, help="requests per second (24)"
    )
    fidelity.add_argument(
        "--async",
        dest="compare_async",
        action="store_true",
        help="also run each policy on vLLM's AsyncScheduler (the GPU default) and print what the "
        "fast engine, synchronous only, misses against it (no targets: a measure, not a check)",
    )
    _add_engine_args(
        fidelity, policies="vllm-fcfs,meridian", out_dir=Path("meridian-out") / "fidelity"
    )
    fidelity.set_defaults(handler=run_fidelity_cmd)

    real = sub.add_parser(
        "real",
        help="replay a workload against a live OpenAI-compatible server (vLLM, SGLang)",
        description=(
            "Stream every request of the workload to URL/chat/completions at its arrival time; "
            "measure TTFT, TTFVT (first content token), TTOT and output ITL from the "
            "reasoning (or reasoning_content) and content deltas; write report.json/.md and plots."
        ),
    )
    add_server_args(real)
    real.add_argument("--label", default="server", help="name of this run in the report")
    _add_replay_args(real, Path("meridian-out") / "real")
    real.set_defaults(handler=run_real_cmd)

    ab = sub.add_parser(
        "ab-real",
        help="start a stock vLLM server and a Meridian server in turn; same model and workload",
        description=(
            "Serve MODEL with stock vLLM ordering, replay the workload, stop; then the same with "
            "`meridian serve`; write report.json/.md and ab-report.json/.md. Arguments after "
            "`--` go to both vLLM servers (e.g. -- --max-model-len 2048)."
        ),
    )
    ab.add_argument("--model", required=True, help="model name or local directory")
    ab.add_argument("--model-family", help="reasoning-model family (default: guessed)")
    ab.add_argument("--config", type=Path, help="meridian.toml for the Meridian server")
    _add_replay_args(ab, Path("meridian-out") / "ab-real")
    ab.set_defaults(handler=run_ab_real_cmd, takes_extra=True)

    accuracy_cmd.register(sub)


def _add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    policies: str,
    out_dir: Path,
    duration_help: str = DURATION_HELP,
) -> None:
    """The workload, engine-shape and policy arguments ``bench sim`` and ``bench fidelity``
    share."""
    parser.add_argument(
        "--workload",
        default="synthetic",
        help=f"bundled workload ({', '.join(WORKLOADS)}; {SERVEGEN}@HH:MM starts at that time "
        "of its source's day instead of 10:00) or a JSONL trace (default: synthetic)",
    )
    parser.add_argument(
        "--policies",
        default=policies,
        help="policies to run: 'all' or a comma list of meridian, meridian-sched, vllm-fcfs, "
        "vllm-priority, pascal (each also as NAME+forcing), static-budget[:CAP] "
        f"(default: {policies})",
    )
    parser.add_argument("--duration-s", type=float, help=duration_help)
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload generator (0)")
    parser.add_argument(
        "--hardware", default="h100-sxm", choices=sorted(HARDWARE), help="hardware preset"
    )
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS), help="model preset")
    parser.add_argument("--config", type=Path, help="meridian.toml (default: the usual search)")
    parser.add_argument("--out-dir", type=Path, default=out_dir, help=f"output folder ({out_dir})")
    parser.add_argument(
        "--max-num-seqs", type=int, help="engine max_num_seqs (default: vLLM's for the hardware)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="engine token budget per step (default: vLLM's for the hardware)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn vLLM's prefix caching off (on by default)",
    )
    parser.add_argument(
        "--kv-offload-gib",
        type=positive_gib,
        metavar="N",
        help="--engine vllm: a host tier of N GiB behind vLLM's OffloadingConnector, as meridian "
        "serve --kv-offload-gib sets it up; preempted KV is reloaded over the hardware's host "
        "link instead of recomputed (default: off)",
    )
    add_cluster_args(parser)


def _add_replay_args(parser: argparse.ArgumentParser, out_dir: Path) -> None:
    """The workload-replay arguments ``bench real`` and ``bench ab-real`` share."""
    parser.add_argument("--workload", default="synthetic", help="bundled workload or JSONL trace")
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="requests per second (2)")
    parser.add_argument("--duration-s", type=float, help=DURATION_HELP)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    parser.add_argument(
        "--max-think-tokens",
        type=int,
        help="cap each request's think tokens (and so its max_tokens) for small servers",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="cap each request's prompt length (for servers with a short --max-model-len)",
    )
    parser.add_argument("--out-dir", type=Path, default=out_dir, help=f"output folder ({out_dir})")
    parser.add_argument(
        "--replay-think-lengths",
        action="store_true",
        help="send vLLM's thinking_token_budget = each request's think length (for models that "
        "never close </think> by themselves, such as random test models)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _rates(text: str) -> list[float]:
    """``--arrival-rate``: one rate or a comma list, each a finite number > 0."""
    items = [x.strip() for x in text.split(",")]
    if "" in items:
        raise MeridianError(f"--arrival-rate has an empty value in {text!r}")
    try:
        rates = [float(x) for x in items]
    except ValueError:
        raise MeridianError(
            f"--arrival-rate must be a number or a comma list of numbers; got {text!r}"
        ) from None
    if any(not (math.isfinite(r) and r > 0) for r in rates):
        raise MeridianError(f"--arrival-rate values must be finite numbers > 0; got {text!r}")
    return sorted(set(rates))


def _write_metrics(results: dict[str, SimResult], out_dir: Path) -> list[Path]:
    """Each run reported through the metric catalogue, in Prometheus text format."""
    from prometheus_client import generate_latest

    from meridian.bench.sim_metrics import record_sim_result
    from meridian.telemetry.metrics import MeridianMetrics

    paths = []
    for name, result in results.items():
        metrics = MeridianMetrics()
        record_sim_result(metrics, result)
        path = out_dir / f"metrics-{name}.prom"
        path.write_bytes(generate_latest(metrics.registry))
        paths.append(path)
    return paths


def _slo(args: argparse.Namespace) -> SloSpec:
    """The unloaded-latency SLO, or the explicit one when an explicit-SLO flag is given."""
    flags = (args.ttfvt_slo_base_s, args.think_tpot_slo_ms, args.output_itl_slo_ms)
    if all(flag is None for flag in flags):
        return SloSpec()
    base, tpot_ms, itl_ms = (
        positive_number(name, default if value is None else value, maximum)
        for (name, (default, maximum)), value in zip(_EXPLICIT_DEFAULTS.items(), flags, strict=True)
    )
    return SloSpec(explicit=ExplicitSlo(base, tpot_ms / 1000, itl_ms / 1000))


# Each explicit-SLO flag's default and largest value.
_EXPLICIT_DEFAULTS = {
    "--ttfvt-slo-base-s": (_EXPLICIT.ttfvt_base_s, MAX_TTFVT_SLO_BASE_S),
    "--think-tpot-slo-ms": (_EXPLICIT.think_tpot_s * 1000, MAX_ITL_SLO_MS),
    "--output-itl-slo-ms": (_EXPLICIT.output_itl_s * 1000, MAX_ITL_SLO_MS),
}


def _attainment_plot(reports: list[SimReport], path: Path) -> list[Path]:
    """SLO attainment against the scale, a row of panels per rate (none without curves)."""
    rows = [attainment_panels(r.summaries) for r in reports]
    if not any(lines for row in rows for _, lines in row):
        return []
    if len(reports) > 1:
        rows = [
            [(f"{r.arrival_rate:g} req/s, {title}", lines) for title, lines in row]
            for r, row in zip(reports, rows, strict=True)
        ]
    title = f"SLO attainment: {reports[0].workload}, {reports[0].model} on {reports[0].hardware}"
    return [write_attainment_plot(rows, title, path)]


def run_sim(args: argparse.Namespace) -> int:
    """Run the A/B (or the sweep), write reports and plots, print a summary table."""
    if args.duration_s is None and args.workload == "synthetic":
        args.duration_s = SIM_DEFAULT_DURATION_S
    check_args(args)
    rates = _rates(args.arrival_rate)
    slo = _slo(args)
    config = load_config(args.config).config
    # An explicit ITL SLO is also what Pascal's pacer holds, as before the unloaded SLO.
    explicit = slo.explicit
    pace = {"answer_pace_s": explicit.output_itl_s} if explicit and args.output_itl_slo_ms else {}
    spec = run_spec(
        args,
        config,
        slo=slo,
        engine=args.engine,
        async_scheduling=ASYNC_SCHEDULING[args.async_scheduling],
        step_time_csv=args.step_time_csv,
        warmup_s=args.warmup_s,
        # Several rates nest: one trace drawn at the highest, thinned to each (bench.loads).
        trace_rate=max(rates) if len(rates) > 1 and is_bundled(args.workload) else None,
        **pace,
    )
    require_vllm(spec.engine)
    cluster = cluster_spec(args)
    # Everything a run reads or writes is checked before the first request is generated: the
    # KV cache's size, the step-time CSV, the output folder and the trace file.
    engine_config_for(spec, 1 if cluster is None else cluster.replicas)
    if args.step_time_csv is not None:
        check_csv_file(args.step_time_csv)
    check_out_dir(args.out_dir)
    if args.export_trace is not None:
        check_out_file(args.export_trace, "--export-trace")
    if not args.verbose:
        hide_vllm_logs()
    console, screen = make_console(), make_screen()
    out: Path = args.out_dir
    started = time.perf_counter()
    reports: list[SimReport] = []
    written: list[Path] = []
    if cluster is not None:
        written = run_cluster_sim(args, spec, cluster, rates, console)
        rates = []  # done
    for rate in rates:
        requests = load_requests(spec, rate)
        if args.export_trace is not None and rate == rates[0]:
            write_trace(args.export_trace, requests)
            written.append(args.export_trace)
        with make_progress(console) as progress:
            tasks = {
                name: progress.add_task(f"{name} @ {rate:g} req/s", total=len(requests))
                for name in spec.policies
            }

            def hook(
                name: str, done: int, progress: Progress = progress, tasks: dict[str, Any] = tasks
            ) -> None:
                progress.update(tasks[name], completed=done)

            report, results = simulate(spec, rate, requests, hook)
        reports.append(report)
        rate_dir = out if len(rates) == 1 else out / f"rate-{rate:g}"
        written += write_report(report, rate_dir)
        baselines = ab_baselines(report) if "meridian" in spec.policies else []
        if baselines:
            written += write_ab_report(build_ab_report(report, baselines=baselines), rate_dir)
        if not args.no_plots:
            written += write_plots(results, rate_dir, slo)
            written += _attainment_plot([report], rate_dir / "attainment.png")
        if args.metrics:
            written += _write_metrics(results, rate_dir)
        print_summary(screen, report)
    if len(reports) > 1:
        sweep = build_sweep_report(reports)
        written += write_sweep_report(sweep, out)
        if not args.no_plots:
            written += write_sweep_plots(sweep, out)
            written += _attainment_plot(reports, out / "sweep-attainment.png")
    elapsed = time.perf_counter() - started
    screen.print(f"wall time {elapsed:.1f} s; wrote {len(written)} files under {out}/:")
    for path in written:
        screen.print(f"  {path}", soft_wrap=True)
    return 0
