"""``meridian config check [PATH] [--tokenizer DIR]``: validate, print the effective config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from meridian.config import TokenizerJsonVocab, load_config, resolve_boundary_ids


def register(commands: Any) -> None:
    """Add the ``config`` command group to the top-level subparsers."""
    config = commands.add_parser("config", help="inspect and validate meridian.toml")
    sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check",
        help="validate a config file and print the effective configuration",
        description=(
            "Validate PATH (default: ./meridian.toml, then ~/.config/meridian/meridian.toml, "
            "then built-in defaults) and print the effective configuration as JSON."
        ),
    )
    check.add_argument("path", nargs="?", type=Path, help="config file to check")
    check.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="local tokenizer directory (tokenizer.json): resolve every model's boundary ids",
    )
    check.add_argument(
        "--model",
        metavar="NAME",
        help="check that this model family is defined; with --tokenizer resolve only its "
        "boundaries (default: every family)",
    )
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    """Validate, optionally resolve boundary ids, print the effective config."""
    loaded = load_config(args.path)
    config = loaded.config
    source = str(loaded.source) if loaded.source else "built-in defaults"
    effective: dict[str, Any] = config.model_dump(mode="json")
    effective["model"] = {n: m.model_dump(mode="json") for n, m in config.all_models().items()}
    effective["entropy"]["effective_eat_min_distance"] = config.entropy.effective_eat_min_distance
    names = [args.model] if args.model else sorted(config.all_models())
    if args.model:
        config.model_definition(args.model)  # an unknown family: one line, before any output
    print(f"# config: {source}: OK")
    if args.tokenizer is not None:
        vocab = TokenizerJsonVocab.from_dir(args.tokenizer)
        resolved: dict[str, Any] = {}
        for name in names:
            ids = resolve_boundary_ids(config.model_definition(name), vocab, name=name)
            resolved[name] = {
                "think_start": list(ids.think_start),
                "think_end": list(ids.think_end),
            }
            print(f"# boundaries of {name}: {resolved[name]}")
        effective["resolved_boundaries"] = resolved
    print(json.dumps(effective, indent=2, sort_keys=False))
    return 0
