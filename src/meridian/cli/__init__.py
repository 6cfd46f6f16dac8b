"""The ``meridian`` command line: ``meridian config check``, ``meridian bench sim``, ...

Every subcommand registers itself on the parser; errors derived from MeridianError are printed as
one line (``error: ...``) with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meridian import __version__
from meridian.cli import bench_cmd, config_cmd, doctor_cmd
from meridian.errors import MeridianError


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meridian",
        description="Phase-aware scheduling for reasoning models on vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"meridian {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    config_cmd.register(commands)
    bench_cmd.register(commands)
    doctor_cmd.register(commands)
    commands.add_parser(
        "serve",
        help="vLLM's OpenAI server with Meridian (see: meridian serve -h)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meridian`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["serve"]:
        from meridian.cli import serve_cmd

        try:
            return serve_cmd.main(args_list[1:])
        except MeridianError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    extra: list[str] = []
    if "--" in args_list:  # arguments for a child program (e.g. vLLM in `bench ab-real`)
        cut = args_list.index("--")
        args_list, extra = args_list[:cut], args_list[cut + 1 :]
    args = parser.parse_args(args_list)
    try:
        if getattr(args, "takes_extra", False):
            code: int = args.handler(args, extra)
        elif extra:
            parser.error(f"unexpected arguments after --: {' '.join(extra)}")
        else:
            code = args.handler(args)
    except MeridianError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
