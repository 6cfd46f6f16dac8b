"""What the ``meridian bench`` commands share: the console, progress bars, argument checks and
the summary table."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from meridian.bench.effects import effect_lines
from meridian.bench.offered import describe
from meridian.bench.report import SimReport
from meridian.bench.report_render import fmt, losses_of
from meridian.bench.simrun import SimRunSpec
from meridian.bench.slo import UserModel
from meridian.bench.summary import PolicySummary
from meridian.bench.workloads import MAX_DURATION_S, default_duration_s, is_bundled
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
    """stderr, for progress; wide enough when it is not a terminal (logs, CI)."""
    return Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)


def make_screen() -> Console:
    """stdout, for the summary and the files written: the terminal's width, or 100 columns
    when stdout is not a terminal (a pipe or a log)."""
    return Console(width=None if Console().is_terminal else 100)


def check_workload_args(args: argparse.Namespace) -> None:
    """Check the workload arguments; an unset ``--duration-s`` becomes the workload's default."""
    if args.duration_s is None:
        args.duration_s = default_duration_s(args.workload)
    if not 0 < args.duration_s <= MAX_DURATION_S:
        raise MeridianError(
            f"--duration-s must be in (0, {MAX_DURATION_S:,.0f}] seconds (a week); "
            f"got {args.duration_s:g}"
        )
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
        return "-" if value is None else fmt(value, scale)

    return cell


def _forced_total(s: PolicySummary) -> str:
    f = s.forced_pct
    return f"{f.converged + f.overthinking + f.hard_cap:.1f}"


def _attained(s: PolicySummary, user: UserModel) -> str:
    a = s.attainment
    return "-" if a is None else fmt(a.pct_at(user, a.goodput_scale))


def _preemptions(s: PolicySummary) -> str:
    return f"{s.preemptions.output:,}/{s.preemptions.think:,}"


# (header, cell): two groups, so that each table fits 80 columns with the longest policy name.
_LATENCY: tuple[tuple[str, Callable[[PolicySummary], str]], ...] = (
    ("answer ITL P99 ms", _num("output_itl_s.p99", 1000)),
    ("TTFVT P95 s", _num("ttfvt_s.p95")),
    ("TTOT P95 s", _num("ttot_s.p95")),
    ("tok/s", _num("throughput_tok_s")),
    ("goodput req/s", _num("goodput_req_s")),
)
_WORK: tuple[tuple[str, Callable[[PolicySummary], str]], ...] = (
    ("think tok avg", _num("think_tokens.mean")),
    ("forced %", _forced_total),
    ("accuracy % (model)", _num("answer_accuracy_pct")),
    ("preempted answer / think", _preemptions),
    ("worst answer gap steps", _num("worst_answer_gap_steps")),
)
# SLO attainment (bench.slo) at the goodput scale, and how full the cache got.
_SLO: tuple[tuple[str, Callable[[PolicySummary], str]], ...] = (
    ("SLO met % at 3×, reasoning hidden", lambda s: _attained(s, UserModel.HIDDEN)),
    ("SLO met % at 3×, reasoning shown", lambda s: _attained(s, UserModel.SHOWN)),
    ("goodput (shown) req/s", _num("attainment.goodput_shown_req_s")),
    ("peak KV %", _num("contention.kv_used_peak", 100)),
)
# From this width the two groups share one table.
ONE_TABLE_FROM = 140


def engine_text(report: SimReport) -> str:
    """Which engine ran and how it schedules, in the words of the screen."""
    mode = "asynchronous" if report.async_scheduling else "synchronous"
    if report.engine == "vllm":
        kind = "AsyncScheduler" if report.async_scheduling else "Scheduler"
        return f"vLLM's own {kind} on virtual time ({mode} scheduling)"
    if report.engine == "model":
        return (
            f"the fast engine model ({mode} scheduling only; the headline runs vLLM's "
            "AsyncScheduler: --engine vllm)"
        )
    return "two live servers" if report.engine == "real" else report.engine


def _table(
    report: SimReport, columns: Sequence[tuple[str, Callable[[PolicySummary], str]]]
) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    width = max(len(name) for name in report.policies)
    table.add_column("policy", no_wrap=True, min_width=width)
    for title, _ in columns:
        table.add_column(title, justify="right", no_wrap=False, overflow="fold")
    for name in report.policies:
        s = report.summaries[name]
        table.add_row(name, *(cell(s) for _, cell in columns))
    return table


def print_summary(console: Console, report: SimReport) -> None:
    """The first screen: the run, the engine, the figures per policy, then what scheduling and
    forcing each did with the other held equal, and where Meridian loses against the baselines
    with its forcing."""
    if is_bundled(report.workload):
        load = f"{report.arrival_rate:g} req/s for {report.duration_s:g} s, seed {report.seed}"
    else:
        load = "the trace's own arrival times"
    console.print(f"[bold]{report.workload}[/bold], {load}; {report.model} on {report.hardware}")
    console.print(f"engine: {engine_text(report)}", highlight=False)
    warmup = f"; the first {report.warmup_s:g} s of arrivals are warm-up" if report.warmup_s else ""
    console.print(f"SLO: {report.slo.describe()}{warmup}", highlight=False)
    if report.offered is not None:
        console.print(describe(report.offered), highlight=False)
    groups = [(*_LATENCY, *_WORK)] if console.width >= ONE_TABLE_FROM else [_LATENCY, _WORK]
    groups.append(_SLO)
    for columns in groups:
        console.print(_table(report, columns))
    lines = effect_lines(report.summaries)
    for line in lines:
        console.print(line, highlight=False, markup=False)
    losses = losses_of(report)
    if losses is not None:
        console.print(
            "Where meridian loses (against the baselines with its forcing; ab-report.md has "
            "every WIN and LOSS):",
            highlight=False,
        )
        for line in losses or ["  nowhere on this run."]:
            text = line.replace("**", "").replace("`", "").lstrip("- ")
            console.print("  " + text, highlight=False, markup=False)
    console.print()


def hide_vllm_logs() -> None:
    """vLLM's log lines below ERROR hidden, in this process and the ones it forks: its start-up
    lines (Triton, the CPU backend's block size) say nothing about a simulated run. Call it
    before vLLM is imported: its import-time warnings go to Python's last-resort handler, so the
    ``vllm`` logger's level is set here, and vLLM's own logging config, which would reset it,
    is turned off."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.getLogger("vllm").setLevel(logging.ERROR)


def check_out_dir(path: Path, flag: str = "--out-dir") -> None:
    """Make ``path`` the output folder now, before any work: create it (and its parents) and
    write a scratch file in it, so that a path that cannot be created (``/proc/nope``), a file
    in its place or a folder that cannot be written is one error naming ``flag``, not a
    traceback after the run."""
    if path.exists() and not path.is_dir():
        raise MeridianError(f"{flag} {path} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise MeridianError(
            f"{flag} {path} cannot be created: {_first_non_directory(path)} is not a directory"
        ) from None
    except OSError as exc:
        raise MeridianError(f"{flag} {path} cannot be created: {exc.strerror or exc}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise MeridianError(f"{flag} {path} is not writable: {exc.strerror or exc}") from None


def check_out_file(path: Path, flag: str) -> None:
    """An output file such as ``--export-trace``: its folder is made now (``check_out_dir``),
    and the path itself must not be a folder."""
    if path.is_dir():
        raise MeridianError(f"{flag} {path} is a directory; give a file name")
    check_out_dir(path.parent, flag=f"{flag} {path}: folder")


def _first_non_directory(path: Path) -> Path:
    """The first of ``path`` and its parents, from the root down, that exists and is not a
    directory (what stopped ``mkdir``)."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return path


def positive_number(flag: str, value: float, maximum: float = math.inf) -> float:
    """``value`` when it is a finite number in (0, ``maximum``]; else a one-line error naming
    ``flag``."""
    if not (math.isfinite(value) and 0 < value <= maximum):
        bound = "> 0" if maximum == math.inf else f"in (0, {maximum:,.0f}]"
        raise MeridianError(f"{flag} must be a number {bound}; got {value:g}")
    return value


def check_args(args: argparse.Namespace) -> None:
    """The workload and engine-shape arguments of ``bench sim`` and ``bench fidelity`` (the
    output folder is checked last, by the command, once everything else is known to be fine)."""
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
