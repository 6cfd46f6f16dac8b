"""``meridian serve MODEL [--config PATH] [--model-family NAME] [vLLM args...]``.

Runs ``meridian doctor``'s checks (:mod:`meridian.vllm.doctor`; a failed one stops it with one
line), then starts vLLM's OpenAI server with Meridian's scheduler, logits processor, the model's
reasoning parser and the config file (see :mod:`meridian.vllm.serve`). Everything after the
model that is not one of Meridian's own options goes to vLLM unchanged.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from meridian.cli.common import check_out_file, positive_gib
from meridian.errors import MeridianError

USAGE = (
    "meridian serve MODEL [--config PATH] [--model-family NAME] [--kv-offload-gib N] "
    "[--step-log CSV] [vLLM args...]"
)


def build_parser() -> argparse.ArgumentParser:
    """Meridian's own options of ``meridian serve``; the rest is vLLM's."""
    parser = argparse.ArgumentParser(
        prog="meridian serve",
        usage=USAGE,
        allow_abbrev=False,  # vLLM's own flags must never match ours by prefix
        description=(
            "Start vLLM's OpenAI-compatible server (python -m vllm.entrypoints.openai."
            "api_server) with Meridian's phase-aware scheduler and logits processor. Arguments "
            "Meridian does not know (e.g. --port, --max-model-len) are passed to vLLM."
        ),
    )
    parser.add_argument("model", help="model name or local directory, as vLLM's --model")
    parser.add_argument("--config", type=Path, help="meridian.toml (default: the usual search)")
    parser.add_argument(
        "--model-family",
        help="reasoning-model family (bundled: deepseek_r1, r1_distill_qwen, qwen3, qwq, "
        "granite_3_2, gpt_oss, or a [model.NAME] table); default: guessed from the model name",
    )
    parser.add_argument(
        "--kv-offload-gib",
        type=positive_gib,
        metavar="N",
        help="store KV to up to N GiB of host memory through vLLM's OffloadingConnector, so a "
        "preempted request's KV (its reasoning included) is loaded back instead of recomputed "
        "(default: off)",
    )
    parser.add_argument(
        "--step-log",
        type=Path,
        metavar="CSV",
        help="append every engine step's shape and duration to CSV, the step-time file that "
        "meridian bench sim --step-time-csv fits the simulator to (default: off)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Parse, run ``meridian doctor``'s checks, then exec the server (never returns); a failed
    check stops it with that check's line."""
    args, vllm_args = build_parser().parse_known_args(list(argv))
    if vllm_args[:1] == ["--"]:
        vllm_args = vllm_args[1:]
    if args.step_log is not None:
        check_out_file(args.step_log, "--step-log")
    from meridian.vllm.doctor import Status, run_checks

    print("meridian serve: checking (as meridian doctor does) ...", flush=True)
    report = run_checks(
        args.model,
        vllm_args,
        config_path=args.config,
        model_family=args.model_family,
        offline=False,
    )
    if report.failed:
        raise MeridianError("\n".join(c.line() for c in report.failed))
    for check in report.checks:
        if check.status is Status.WARN:
            print(f"meridian serve: warning: {check.line()}")
    assert report.engine is not None and report.loaded is not None
    from meridian.vllm.serve import serve

    serve(
        args.model,
        vllm_args,
        report.loaded.config,
        engine=report.engine,
        config_path=report.loaded.source,
        model_family=args.model_family,
        kv_offload_bytes=None if args.kv_offload_gib is None else int(args.kv_offload_gib * 2**30),
        step_log=args.step_log,
    )
    return 0  # not reached: serve() replaces this process
