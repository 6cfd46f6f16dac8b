"""What the ``meridian bench`` commands share: the console, progress bars, argument checks and
the summary table."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meridian.bench.metrics import PolicySummary
from meridian.bench.offered import describe
from meridian.bench.report import SimReport
from meridian.bench.simrun import SimRunSpec
from meridian.bench.workloads import default_duration_s
from meridian.errors import MeridianError
from meridian.sim.policies import parse_policies


def make_progress(console: Console) -> Progress:
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


def make_console() -> Console:
    """stderr; wide enough for the summary table when it is not a terminal (logs, CI)."""
    return Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)


def check_workload_args(args: argparse.Namespace) -> None:
    """Check the workload arguments; an unset ``--duration-s`` becomes the workload's default."""
    if args.duration_s is None:
        args.duration_s = default_duration_s(args.workload)
    if not args.duration_s > 0:
        raise MeridianError(f"--duration-s must be > 0; got {args.duration_s}")
    if args.seed < 0:
        raise MeridianError(f"--seed must be >= 0; got {args.seed}")


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


def print_summary(console: Console, report: SimReport) -> None:
    heading = f"{report.workload} @ {report.arrival_rate:g} req/s, seed {report.seed}, "
    heading += f"engine {report.engine}"
    if report.offered is not None:
        heading += f"\n{describe(report.offered)}"
    table = Table(title=heading)
    table.add_column("policy")
    for title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    for name in report.policies:
        s = report.summaries[name]
        cells = [name, *(cell(s) for _, cell in _COLUMNS)]
        table.add_row(*cells)
    console.print(table)


def check_args(args: argparse.Namespace) -> None:
    check_workload_args(args)
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise MeridianError(f"--{flag.replace('_', '-')} must be >= 1; got {value}")


def require_vllm(engine: str) -> None:
    """``--engine vllm`` runs vLLM's scheduler: say how to get it when it is missing."""
    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise MeridianError(
            "--engine vllm drives vLLM's own scheduler, and vLLM is not installed in this "
            "environment: run `make vllm-venv` once, then `.venv-vllm/bin/meridian bench sim "
            "--engine vllm ...`"
        )


ASYNC_SCHEDULING = {"auto": None, "on": True, "off": False}


def positive_gib(text: str) -> float:
    """An argparse type: a positive number of GiB (below 2**20)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not (value > 0 and value < 1 << 20):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB below 2**20: {text!r}")
    return value


def run_spec(args: argparse.Namespace, config: Any, **fields: Any) -> SimRunSpec:
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
        kv_offload_gib=args.kv_offload_gib,
        **fields,
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--model`` of the commands that talk to a live server."""
    parser.add_argument(
        "--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--model", required=True, help="model name the server serves")
