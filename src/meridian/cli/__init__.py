"""The ``meridian`` command line: ``meridian config check``, ``meridian bench sim``, ...

Every subcommand registers itself on the parser; errors derived from MeridianError are printed as
one line (``error: ...``) with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import meridian
from meridian.cli import bench_cmd, cluster_cmd, config_cmd, doctor_cmd
from meridian.errors import MeridianError


def version_text() -> str:
    """``meridian VERSION``, plus the commit when this code runs from a git checkout's ``src/``
    (an editable install or PYTHONPATH), where the version alone does not say which code it is."""
    text = f"meridian {meridian.__version__}"
    package = Path(meridian.__file__).resolve().parent
    root = package.parents[1]
    # A wheel's meridian/ sits in site-packages, never in a checkout's src/ (even when the
    # virtual environment lives inside the checkout).
    if package.parent.name != "src" or not (root / "pyproject.toml").is_file():
        return text
    from meridian.bench.provenance import commit, has_changes

    head = commit(root)
    if not head:  # a source tree without git (an unpacked sdist)
        return text
    changed = ", uncommitted changes" if has_changes(root) else ""
    return f"{text} (git checkout {root}, commit {head}{changed})"


class _VersionAction(argparse.Action):
    """``--version``, computed when asked for (the commit costs two git calls)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="meridian",
        description="Phase-aware scheduling for reasoning models on vLLM.",
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    config_cmd.register(commands)
    bench_cmd.register(commands)
    doctor_cmd.register(commands)
    cluster_cmd.register(commands)
    commands.add_parser(
        "serve",
        help="vLLM's OpenAI server with Meridian (see: meridian serve -h)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meridian`` console script.

    A reader that closes stdout early (``meridian config check | head -1``) ends the command
    quietly with status 141, as a program killed by SIGPIPE reports in the shell: the rest of
    the output, and Python's flush at exit, go to /dev/null instead of a BrokenPipeError.
    """
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


# 128 + SIGPIPE: what the shell reports for a program the closed pipe stopped.
EXIT_BROKEN_PIPE = 141


def _run(args_list: list[str]) -> int:
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
