"""``meridian bench sim`` (the simulator A/B) and ``meridian bench real`` (a live server)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meridian.bench.fidelity import TARGETS as FIDELITY_TARGETS
from meridian.bench.metrics import PolicySummary, SloSpec, summarize
from meridian.bench.plots import write_plots, write_sweep_plots
from meridian.bench.report import (
    SimReport,
    build_ab_report,
    build_sweep_report,
    write_ab_report,
    write_report,
    write_sweep_report,
)
from meridian.bench.simrun import ENGINES, SimRunSpec, load_requests, simulate
from meridian.bench.traces import write_trace
from meridian.bench.workloads import WORKLOADS
from meridian.config import load_config
from meridian.errors import MeridianError
from meridian.sim.policies import parse_policies
from meridian.sim.presets import HARDWARE, MODELS
from meridian.sim.records import SimResult
from meridian.sim.request import RequestSpec

DEFAULT_OUT_DIR = Path("meridian-out") / "sim"
_DEFAULT_SLO = SloSpec()


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
        default="8",
        help="requests per second; a comma list (e.g. 2,4,8,16) runs a sweep (default: 8)",
    )
    _add_engine_args(sim, policies="all", out_dir=DEFAULT_OUT_DIR)
    sim.add_argument(
        "--step-time-csv",
        type=Path,
        help="calibrate the step-time model to measured steps (CSV; see docs) instead of a preset",
    )
    sim.add_argument(
        "--ttfvt-slo-base-s",
        type=float,
        default=_DEFAULT_SLO.ttfvt_base_s,
        help="TTFVT SLO: base seconds, plus think tokens requested x think_tpot_budget_ms (2.0)",
    )
    sim.add_argument(
        "--output-itl-slo-ms",
        type=float,
        default=_DEFAULT_SLO.output_itl_s * 1000,
        help="output ITL SLO on each request's answer-gap P95, in ms (50)",
    )
    sim.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="vLLM's asynchronous scheduling; auto: on with --engine vllm (vLLM's GPU default), "
        "off with --engine model (the fast engine models synchronous scheduling only)",
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
            "reasoning_content/content deltas; write report.json/.md and plots."
        ),
    )
    real.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000/v1")
    real.add_argument("--model", required=True, help="model name the server serves")
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


def _add_engine_args(parser: argparse.ArgumentParser, *, policies: str, out_dir: Path) -> None:
    """The workload, engine-shape and policy arguments ``bench sim`` and ``bench fidelity``
    share."""
    parser.add_argument(
        "--workload",
        default="synthetic",
        help=f"bundled workload ({', '.join(WORKLOADS)}) or a JSONL trace (default: synthetic)",
    )
    parser.add_argument(
        "--policies",
        default=policies,
        help="policies to run: 'all' or a comma list of meridian, meridian-sched, vllm-fcfs, "
        "vllm-priority, pascal (each also as NAME+forcing), static-budget[:CAP] "
        f"(default: {policies})",
    )
    parser.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals (30)")
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


def _add_replay_args(parser: argparse.ArgumentParser, out_dir: Path) -> None:
    """The workload-replay arguments ``bench real`` and ``bench ab-real`` share."""
    parser.add_argument("--workload", default="synthetic", help="bundled workload or JSONL trace")
    parser.add_argument("--arrival-rate", type=float, default=2.0, help="requests per second (2)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals (30)")
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
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MeridianError(
            f"--arrival-rate must be a number or a comma list of numbers; got {text!r}"
        ) from None
    if not rates or any(not r > 0 for r in rates):
        raise MeridianError(f"--arrival-rate values must be > 0; got {text!r}")
    return sorted(set(rates))


def _check_workload_args(args: argparse.Namespace) -> None:
    if not args.duration_s > 0:
        raise MeridianError(f"--duration-s must be > 0; got {args.duration_s}")
    if args.seed < 0:
        raise MeridianError(f"--seed must be >= 0; got {args.seed}")


def _check_args(args: argparse.Namespace) -> None:
    _check_workload_args(args)
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise MeridianError(f"--{flag.replace('_', '-')} must be >= 1; got {value}")


def run_real_cmd(args: argparse.Namespace) -> int:
    """Replay the workload against a live server and write the report."""
    from meridian.bench.realmode import RealRunSpec, run_real

    if not args.url.startswith(("http://", "https://")):
        raise MeridianError(f"--url must start with http:// or https://; got {args.url!r}")
    config = load_config(None).config
    requests = _real_requests(args)
    console = _console()
    slo = SloSpec.from_scheduler(config.scheduler)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(f"{args.label} @ {args.arrival_rate:g} req/s", total=len(requests))
        result, errors, retried = run_real(
            RealRunSpec(
                url=args.url, model=args.model, replay_think_lengths=args.replay_think_lengths
            ),
            requests,
            label=args.label,
            on_done=lambda n: progress.update(task, completed=n),
        )
    report = _real_report(args, args.model, slo, [args.label], {args.label: result})
    written = write_report(report, args.out_dir)
    if not args.no_plots:
        written += write_plots({args.label: result}, args.out_dir, slo)
    _print_summary(console, report)
    _print_retried(console, args.label, retried)
    for line in errors[:10]:
        console.print(f"[red]failed[/red] {line}")
    if errors:
        console.print(f"{len(errors)} of {len(requests)} requests failed (reported as unfinished)")
    console.print(f"wrote {len(written)} files under {args.out_dir}/")
    return 1 if len(errors) == len(requests) else 0


def _print_retried(console: Console, side: str, retried: list[str]) -> None:
    if retried:
        console.print(
            f"{side}: {len(retried)} request(s) sent again after their connection failed before "
            f"any response (first: {retried[0]})"
        )


def _real_report(
    args: argparse.Namespace,
    model: str,
    slo: SloSpec,
    policies: list[str],
    results: dict[str, SimResult],
) -> SimReport:
    """The report of a real-mode run: one summary per server, in ``policies`` order."""
    return SimReport(
        workload=Path(args.workload).name,
        seed=args.seed,
        duration_s=args.duration_s,
        hardware="real",
        model=model,
        slo=slo,
        policies=policies,
        arrival_rate=args.arrival_rate,
        summaries={name: summarize(results[name], slo) for name in policies},
    )


def _real_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The workload of a real-mode run, with the optional think and prompt caps applied."""
    if not args.arrival_rate > 0:
        raise MeridianError(f"--arrival-rate must be > 0; got {args.arrival_rate}")
    _check_workload_args(args)
    spec = SimRunSpec(workload=args.workload, duration_s=args.duration_s, seed=args.seed)
    requests = load_requests(spec, args.arrival_rate)
    if args.max_think_tokens is not None:
        if args.max_think_tokens < 1:
            raise MeridianError(f"--max-think-tokens must be >= 1; got {args.max_think_tokens}")
        requests = [cap_think(r, args.max_think_tokens) for r in requests]
    if args.max_prompt_tokens is not None:
        if args.max_prompt_tokens < 1:
            raise MeridianError(f"--max-prompt-tokens must be >= 1; got {args.max_prompt_tokens}")
        cap = args.max_prompt_tokens
        requests = [replace(r, num_prompt_tokens=min(r.num_prompt_tokens, cap)) for r in requests]
    return requests


def run_ab_real_cmd(args: argparse.Namespace, vllm_args: list[str]) -> int:
    """Stock vLLM, then Meridian, on the same model and workload; reports and the A/B."""
    from meridian.bench.abreal import CANDIDATE, STOCK, AbRealSpec, run_side

    loaded = load_config(args.config)
    requests = _real_requests(args)
    spec = AbRealSpec(
        model=args.model,
        vllm_args=vllm_args,
        config=loaded.config,
        config_path=loaded.source,
        model_family=args.model_family,
        log_dir=args.out_dir,
        replay_think_lengths=args.replay_think_lengths,
    )
    slo = SloSpec.from_scheduler(loaded.config.scheduler)
    console = _console()
    results: dict[str, SimResult] = {}
    for side in (STOCK, CANDIDATE):
        console.print(f"{side}: starting the server for {args.model} ...")
        result, errors, retried = run_side(side, spec, requests)
        _print_retried(console, side, retried)
        for line in errors[:5]:
            console.print(f"[red]failed[/red] {side}: {line}")
        if len(errors) == len(requests):
            raise MeridianError(f"every request to the {side} server failed: {errors[0]}")
        results[side] = result
    report = _real_report(args, Path(args.model).name, slo, [CANDIDATE, STOCK], results)
    written = write_report(report, args.out_dir)
    written += write_ab_report(build_ab_report(report), args.out_dir)
    if not args.no_plots:
        written += write_plots(results, args.out_dir, slo)
    _print_summary(console, report)
    console.print(f"wrote {len(written)} files under {args.out_dir}/ (server logs there too)")
    return 0


def cap_think(spec: RequestSpec, cap: int) -> RequestSpec:
    """``spec`` with at most ``cap`` think tokens (its entropy trace cut to match)."""
    if spec.num_think_tokens <= cap:
        return spec
    entropy = None if spec.think_entropy is None else spec.think_entropy[:cap]
    settle = None if spec.settle_token is None else min(spec.settle_token, cap)
    return replace(spec, num_think_tokens=cap, think_entropy=entropy, settle_token=settle)


def _write_metrics(results: dict[str, SimResult], out_dir: Path) -> list[Path]:
    """Each run reported through the metric catalogue, in Prometheus text format."""
    from prometheus_client import generate_latest

    from meridian.telemetry.metrics import MeridianMetrics
    from meridian.telemetry.sim_export import record_sim_result

    paths = []
    for name, result in results.items():
        metrics = MeridianMetrics()
        record_sim_result(metrics, result)
        path = out_dir / f"metrics-{name}.prom"
        path.write_bytes(generate_latest(metrics.registry))
        paths.append(path)
    return paths


def _progress(console: Console) -> Progress:
    """One bar per run: requests finished, and time."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _console() -> Console:
    """stderr; wide enough for the summary table when it is not a terminal (logs, CI)."""
    return Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)


def _require_vllm(engine: str) -> None:
    """``--engine vllm`` runs vLLM's scheduler: say how to get it when it is missing."""
    if engine != "vllm":
        return
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except ImportError:
        raise MeridianError(
            "--engine vllm drives vLLM's own scheduler, and vLLM is not installed in this "
            "environment: run `make vllm-venv` once, then `.venv-vllm/bin/meridian bench sim "
            "--engine vllm ...`"
        ) from None


_ASYNC = {"auto": None, "on": True, "off": False}


def _run_spec(args: argparse.Namespace, config: Any, **fields: Any) -> SimRunSpec:
    """The run the shared workload and engine arguments describe (``_add_engine_args``)."""
    return SimRunSpec(
        workload=args.workload,
        duration_s=args.duration_s,
        seed=args.seed,
        hardware=args.hardware,
        model=args.model,
        policies=[p.name for p in parse_policies(args.policies)],
        config=config,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        **fields,
    )


def run_sim(args: argparse.Namespace) -> int:
    """Run the A/B (or the sweep), write reports and plots, print a summary table."""
    _check_args(args)
    rates = _rates(args.arrival_rate)
    config = load_config(args.config).config
    slo = SloSpec.from_scheduler(
        config.scheduler,
        ttfvt_base_s=args.ttfvt_slo_base_s,
        output_itl_s=args.output_itl_slo_ms / 1000,
    )
    spec = _run_spec(
        args,
        config,
        slo=slo,
        engine=args.engine,
        async_scheduling=_ASYNC[args.async_scheduling],
        step_time_csv=args.step_time_csv,
    )
    _require_vllm(spec.engine)
    console = _console()
    out: Path = args.out_dir
    started = time.perf_counter()
    reports: list[SimReport] = []
    written: list[Path] = []
    for rate in rates:
        requests = load_requests(spec, rate)
        if args.export_trace is not None and rate == rates[0]:
            write_trace(args.export_trace, requests)
            written.append(args.export_trace)
        with _progress(console) as progress:
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
        if len(spec.policies) > 1 and "meridian" in spec.policies:
            written += write_ab_report(build_ab_report(report), rate_dir)
        if not args.no_plots:
            written += write_plots(results, rate_dir, slo)
        if args.metrics:
            written += _write_metrics(results, rate_dir)
        _print_summary(console, report)
    if len(rates) > 1:
        sweep = build_sweep_report(reports)
        written += write_sweep_report(sweep, out)
        if not args.no_plots:
            written += write_sweep_plots(sweep, out)
    elapsed = time.perf_counter() - started
    console.print(f"wall time {elapsed:.1f} s; wrote {len(written)} files under {out}/:")
    for path in written:
        console.print(f"  {path}")
    return 0


def _get(summary: PolicySummary, path: str) -> float | None:
    value: Any = summary
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return float(value)


def _num(path: str, scale: float = 1) -> Callable[[PolicySummary], str]:
    """A cell showing the summary field at dotted ``path`` times ``scale`` ("-" when absent)."""

    def cell(s: PolicySummary) -> str:
        value = _get(s, path)
        return "-" if value is None else f"{value * scale:,.4g}"

    return cell


def _forced_total(s: PolicySummary) -> str:
    f = s.forced_pct
    return f"{f.converged + f.overthinking + f.hard_cap:.1f}"


def _preemptions(s: PolicySummary) -> str:
    return f"{s.preemptions.output}/{s.preemptions.think}"


_COLUMNS: tuple[tuple[str, Callable[[PolicySummary], str]], ...] = (
    ("output ITL P99 (ms)", _num("output_itl_s.p99", 1000)),
    ("TTFVT P95 (s)", _num("ttfvt_s.p95")),
    ("TTOT P95 (s)", _num("ttot_s.p95")),
    ("think tok avg", _num("think_tokens.mean")),
    ("forced %", _forced_total),
    ("accuracy % (model)", _num("answer_accuracy_pct")),
    ("preempt out/think", _preemptions),
    ("worst gap (steps)", _num("worst_answer_gap_steps")),
    ("tok/s", _num("throughput_tok_s")),
    ("goodput req/s", _num("goodput_req_s")),
)


def _print_summary(console: Console, report: SimReport) -> None:
    table = Table(
        title=f"{report.workload} @ {report.arrival_rate:g} req/s, seed {report.seed}, "
        f"engine {report.engine}"
    )
    table.add_column("policy")
    for title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    for name in report.policies:
        s = report.summaries[name]
        cells = [name, *(cell(s) for _, cell in _COLUMNS)]
        table.add_row(*cells)
    console.print(table)


def run_fidelity_cmd(args: argparse.Namespace) -> int:
    """Both engines, every policy; the fidelity table, reports, and 1 when a target is missed."""
    from meridian.bench.fidelity import FidelityReport, render_markdown
    from meridian.bench.fidelity import compare as compare_engines
    from meridian.bench.report import to_json
    from meridian.bench.simrun import StreamSet, engine_config_for, run_policy, step_model_for

    _check_workload_args(args)
    _check_args(args)
    if not args.arrival_rate > 0:
        raise MeridianError(f"--arrival-rate must be > 0; got {args.arrival_rate}")
    spec = _run_spec(args, load_config(args.config).config, engine="vllm", async_scheduling=False)
    _require_vllm("vllm")
    requests = load_requests(spec, args.arrival_rate)
    streams = StreamSet(requests, spec.config)
    engine_config, step_model = engine_config_for(spec), step_model_for(spec)
    console = _console()
    rows = []
    with _progress(console) as progress:
        for policy in spec.policy_specs:
            results = {}
            for engine in ("model", "vllm"):
                task = progress.add_task(f"{policy.name} on {engine}", total=len(requests))

                def advance(done: int, task: Any = task) -> None:
                    progress.update(task, completed=done)

                results[engine] = run_policy(
                    spec,
                    policy,
                    streams,
                    advance,
                    engine_config=engine_config,
                    step_model=step_model,
                    engine=engine,
                )
            rows.append(compare_engines(results["model"], results["vllm"]))
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
    )
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(to_json(report), encoding="utf-8", newline="")
    (out / "fidelity.md").write_text(render_markdown(report), encoding="utf-8", newline="")
    _print_fidelity(console, report)
    console.print(f"wrote fidelity.json and fidelity.md under {out}/")
    return 0 if report.passed else 1


def _print_fidelity(console: Console, report: Any) -> None:
    from meridian.bench.fidelity import HEADER, table_rows

    table = Table(
        title=f"fidelity: {report.workload} @ {report.arrival_rate:g} req/s, seed {report.seed}"
    )
    for i, title in enumerate(HEADER):
        table.add_column(title, justify="left" if i == 0 else "right")
    for cells in table_rows(report.rows):
        table.add_row(*(c.strip("`") for c in cells))
    console.print(table)
    console.print(f"targets: {report.targets}")
