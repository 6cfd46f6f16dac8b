"""``meridian doctor [--model M] [--config PATH] [--model-family NAME] [-- vLLM args]``.

The checks of :mod:`meridian.vllm.doctor`, one line each (pass, warn or fail, with the fix);
exit status 1 when any fails. It starts no engine and does not need the model hub.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    """Add ``doctor`` to the top-level subparsers."""
    doctor = commands.add_parser(
        "doctor",
        help="check this machine before the first meridian serve (vLLM, runner, config, ...)",
        description=(
            "Check what meridian serve needs before it starts vLLM: the vLLM version and build, "
            "the model runner and scheduling mode vLLM's own config code picks for the vLLM "
            "arguments given after --, the logits processor and scheduler class that match, "
            "the model family and its boundary token ids (when the tokenizer is on this "
            "machine), the reasoning parser, the metrics directory and the bind address. "
            "Starts no engine; exits 1 if a check fails."
        ),
        usage="meridian doctor [--model MODEL] [--config PATH] [--model-family NAME] "
        "[-- vLLM args...]",
    )
    doctor.add_argument("--model", help="model name or local directory, as vLLM's --model")
    doctor.add_argument("--config", type=Path, help="meridian.toml (default: the usual search)")
    doctor.add_argument("--model-family", help="reasoning-model family (default: guessed)")
    doctor.set_defaults(handler=run_doctor, takes_extra=True)


def run_doctor(args: argparse.Namespace, vllm_args: list[str]) -> int:
    """Print every check; 1 if any failed."""
    from meridian.vllm.doctor import run_checks

    report = run_checks(
        args.model, vllm_args, config_path=args.config, model_family=args.model_family
    )
    for check in report.checks:
        print(check.line())
    print(f"meridian doctor: {report.summary()}")
    return 1 if report.failed else 0
