"""``meridian bench real`` (a live server) and ``meridian bench ab-real`` (stock vLLM, then
Meridian, on the same model and workload)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from meridian.bench.offered import offered_load
from meridian.bench.plots import write_plots
from meridian.bench.report import SimReport, build_ab_report
from meridian.bench.report_render import write_ab_report, write_report
from meridian.bench.simrun import SimRunSpec, load_requests
from meridian.bench.slo import ExplicitSlo, SloSpec
from meridian.bench.summary import summarize
from meridian.bench.workloads import is_bundled
from meridian.cli.common import (
    check_out_dir,
    check_workload_args,
    make_console,
    make_progress,
    positive_number,
    print_summary,
)
from meridian.config import load_config
from meridian.errors import MeridianError
from meridian.sim.records import SimResult
from meridian.sim.request import RequestSpec


def run_real_cmd(args: argparse.Namespace) -> int:
    """Replay the workload against a live server and write the report."""
    from meridian.bench.realmode import RealRunSpec, run_real

    if not args.url.startswith(("http://", "https://")):
        raise MeridianError(f"--url must start with http:// or https://; got {args.url!r}")
    requests = _real_requests(args)
    console = make_console()
    # A live server has no step-time model for an idle latency: its SLO is the explicit one.
    slo = SloSpec(explicit=ExplicitSlo())
    with make_progress(console) as progress:
        task = progress.add_task(f"{args.label} @ {args.arrival_rate:g} req/s", total=len(requests))
        result, errors, retried = run_real(
            RealRunSpec(
                url=args.url, model=args.model, replay_think_lengths=args.replay_think_lengths
            ),
            requests,
            label=args.label,
            on_done=lambda n: progress.update(task, completed=n),
        )
    report = _real_report(args, args.model, slo, [args.label], {args.label: result}, requests)
    written = write_report(report, args.out_dir)
    if not args.no_plots:
        written += write_plots({args.label: result}, args.out_dir, slo)
    print_summary(console, report)
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
    requests: list[RequestSpec],
) -> SimReport:
    """The report of a real-mode run: one summary per server, in ``policies`` order, and the
    load the replayed requests offered."""
    return SimReport(
        workload=Path(args.workload).name,
        seed=args.seed,
        duration_s=args.duration_s,
        hardware="real",
        model=model,
        slo=slo,
        policies=policies,
        arrival_rate=args.arrival_rate,
        offered=offered_load(requests, args.duration_s if is_bundled(args.workload) else None),
        summaries={name: summarize(results[name], slo) for name in policies},
    )


def _real_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The workload of a real-mode run, with the optional think and prompt caps applied."""
    positive_number("--arrival-rate", args.arrival_rate)
    check_workload_args(args)
    check_out_dir(args.out_dir)
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
    from meridian.vllm.resolve import resolve_engine

    loaded = load_config(args.config)
    requests = _real_requests(args)
    spec = AbRealSpec(
        engine=resolve_engine(args.model, vllm_args),
        model=args.model,
        vllm_args=vllm_args,
        config=loaded.config,
        config_path=loaded.source,
        model_family=args.model_family,
        log_dir=args.out_dir,
        replay_think_lengths=args.replay_think_lengths,
    )
    slo = SloSpec(explicit=ExplicitSlo())  # a live server: no idle latency to scale
    console = make_console()
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
    policies = [CANDIDATE, STOCK]
    report = _real_report(args, Path(args.model).name, slo, policies, results, requests)
    written = write_report(report, args.out_dir)
    written += write_ab_report(build_ab_report(report), args.out_dir)
    if not args.no_plots:
        written += write_plots(results, args.out_dir, slo)
    print_summary(console, report)
    console.print(f"wrote {len(written)} files under {args.out_dir}/ (server logs there too)")
    return 0


def cap_think(spec: RequestSpec, cap: int) -> RequestSpec:
    """``spec`` with at most ``cap`` think tokens (its entropy trace cut to match)."""
    if spec.num_think_tokens <= cap:
        return spec
    entropy = None if spec.think_entropy is None else spec.think_entropy[:cap]
    settle = None if spec.settle_token is None else min(spec.settle_token, cap)
    return replace(spec, num_think_tokens=cap, think_entropy=entropy, settle_token=settle)
