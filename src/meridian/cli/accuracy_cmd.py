"""``meridian bench accuracy``: forcing policies' accuracy and think tokens on a labelled set,
against a live OpenAI-compatible server (:mod:`meridian.bench.accuracy`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.progress import TaskID
from rich.table import Table

from meridian.bench.eat_probe import DEFAULT_SUFFIX
from meridian.cli.common import add_server_args, check_out_dir, make_console, make_progress
from meridian.config import load_config
from meridian.errors import MeridianError

DEFAULT_POLICIES = "none,cap:64,256,hard-cap:256,meridian,eat,rpdi"


def register(sub: Any) -> None:
    """Add ``bench accuracy`` to the ``bench`` subcommands."""
    acc = sub.add_parser(
        "accuracy",
        help="accuracy and think tokens of forcing policies on a labelled set, on a live server",
        description=(
            "Send every item of DATASET (JSONL: prompt, answer, checker) to the server once per "
            "forcing policy (per-request knobs, so one server serves them all); write "
            "accuracy.json/.md and a plot of accuracy against think tokens with the Pareto front."
        ),
    )
    add_server_args(acc)
    acc.add_argument("--dataset", required=True, type=Path, help="labelled items (JSONL)")
    acc.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma list of none, cap:N (vLLM's thinking_token_budget; cap:64,128 sweeps), "
        "hard-cap:N, meridian, eat, rpdi, eat-probe[:N] (the paper's EAT measured by the "
        "harness every N reasoning tokens; vLLM servers only; N defaults to "
        f"[entropy].eat_probe_interval_tokens) (default: {DEFAULT_POLICIES})",
    )
    acc.add_argument(
        "--config",
        type=Path,
        help="meridian.toml whose [entropy] section sets eat-probe's tracker and default "
        "interval (default: the usual search)",
    )
    acc.add_argument(
        "--probe-logprobs",
        type=int,
        default=20,
        help="eat-probe: top-K log-probabilities per probe, at most the server's --max-logprobs "
        "(20); the rest of the vocabulary counts as one outcome (a lower bound)",
    )
    acc.add_argument(
        "--probe-suffix",
        default=DEFAULT_SUFFIX,
        help="eat-probe: the text appended to the reasoning for a probe and for a force "
        f"(default: {DEFAULT_SUFFIX!r}, as the paper's code)",
    )
    acc.add_argument("--max-tokens", type=int, default=2048, help="max_tokens per request (2048)")
    acc.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    acc.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    acc.add_argument("--seed", type=int, default=0, help="seed of the item order and sampling (0)")
    acc.add_argument(
        "--out-dir", type=Path, default=Path("meridian-out") / "accuracy", help="output folder"
    )
    acc.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    acc.set_defaults(handler=run_accuracy_cmd)


def run_accuracy_cmd(args: argparse.Namespace) -> int:
    from meridian.bench.accuracy import (
        COLUMNS,
        AccuracyRun,
        cells,
        load_dataset,
        pareto_front,
        parse_forcing_policies,
        run_accuracy,
        summarize,
        write_accuracy_report,
    )

    if not args.url.startswith(("http://", "https://")):
        raise MeridianError(f"--url must start with http:// or https://; got {args.url!r}")
    for name in ("max_tokens", "concurrency", "probe_logprobs"):
        if getattr(args, name) < 1:
            raise MeridianError(
                f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}"
            )
    if args.seed < 0:
        raise MeridianError(f"--seed must be >= 0; got {args.seed}")
    if not 0 <= args.temperature <= 2:
        raise MeridianError(f"--temperature must be in [0, 2]; got {args.temperature}")
    if not args.probe_suffix:
        raise MeridianError("--probe-suffix must not be empty")
    check_out_dir(args.out_dir)
    entropy = load_config(args.config).config.entropy
    policies = parse_forcing_policies(args.policies, entropy.eat_probe_interval_tokens)
    items = load_dataset(args.dataset)
    run = AccuracyRun(
        url=args.url,
        model=args.model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
        seed=args.seed,
        probe_logprobs=args.probe_logprobs,
        probe_suffix=args.probe_suffix,
        entropy=entropy,
    )
    console = make_console()
    with make_progress(console) as progress:
        tasks: dict[str, TaskID] = {}

        def done(name: str, n: int) -> None:
            # A bar per policy as it starts (none before the server answered /models).
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=len(items))
            progress.update(tasks[name], completed=n)

        outcomes, walls = run_accuracy(run, policies, items, done)
    rows = summarize(outcomes, walls)
    meta = {
        "url": args.url,
        "model": args.model,
        "dataset": str(args.dataset),
        "items": len(items),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "policies": [{"name": p.name, "fields": p.fields} for p in policies],
    }
    if any(p.probe_interval is not None for p in policies):
        meta["eat_probe"] = {
            "eat_source": "after_think",
            "suffix": args.probe_suffix,
            "logprobs": args.probe_logprobs,
            "tail": "lumped into one outcome (a lower bound of the entropy)",
            "ema_alpha": entropy.ema_alpha,
            "variance_threshold": entropy.eat_ema_variance_threshold,
            "min_distance": entropy.effective_eat_min_distance,
        }
    written = write_accuracy_report(args.out_dir, rows, outcomes, meta, plot=not args.no_plots)
    table = Table(title=f"accuracy on {args.dataset.name} ({len(items)} items)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "policy" else "right")
    front = {r.policy for r in pareto_front(rows)}
    for r in rows:
        table.add_row(*cells(r, r.policy in front))
    console.print(table)
    failed = [o for o in outcomes if o.error is not None]
    for o in failed[:5]:
        console.print(f"[red]failed[/red] {o.policy} {o.item}: {o.error}")
    console.print(f"wrote {len(written)} files under {args.out_dir}/")
    return 1 if failed and len(failed) == len(outcomes) else 0
