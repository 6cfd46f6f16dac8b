"""Files a user hands Meridian (a config, a trace, a step-time CSV, a dataset, a tokenizer),
read bounded, with one wording for everything that can be wrong with them.

Every command reads such a file through :func:`read_user_file`: it must be a regular file (a
symlink to one is fine), at most ``max_bytes`` long, and UTF-8 text. A directory, a device such as
``/dev/zero``, a FIFO or a socket is named as what it is, not reported as "not found", and is
never opened (reading ``/dev/zero`` or a FIFO with no writer would never end); a file over the
limit is refused before it is read, and a file that grows past it while being read (or reports a
size of 0, as ``/proc`` files do) is cut off at the limit and refused, so memory stays bounded
whatever the path points at.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> read_user_file(d, what="config file", max_bytes=1 << 20)  # doctest: +ELLIPSIS
Traceback (most recent call last):
meridian.errors.MeridianError: ... is a directory, not a config file
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from meridian.errors import MeridianError

__all__ = ["KIB", "MIB", "check_user_file", "describe_size", "kind_of", "read_user_file"]

KIB = 1 << 10
MIB = 1 << 20

# What each kind of non-regular file is called in an error.
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def describe_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps it at least 1 (``64 MiB``)."""
    value = float(num_bytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{num_bytes:,} bytes" if unit == "bytes" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def kind_of(path: str | Path) -> str:
    """What ``path`` is, following symlinks: "a regular file", "a directory", "a character
    device", ..., or "missing"."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


def _named(path: Path) -> str:
    """``path`` as an error names it: with its target when it is a symlink."""
    try:
        return f"{path} (a symlink to {os.readlink(path)})" if path.is_symlink() else str(path)
    except OSError:
        return str(path)


def check_user_file(
    path: str | Path, *, what: str, max_bytes: int, error: type[MeridianError] = MeridianError
) -> int:
    """The size of ``path`` when it is a regular file of at most ``max_bytes``; else ``error``
    saying what it is instead (``what`` names the role: "config file", "trace file")."""
    path = Path(path)
    try:
        info = os.stat(path)  # follows symlinks: a link to a regular file is one
    except FileNotFoundError:
        if path.is_symlink():
            raise error(f"{what} not found: {_named(path)}, which does not exist") from None
        raise error(f"{what} not found: {path}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {_named(path)}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = kind_of(path)
        hint = "" if stat.S_ISDIR(info.st_mode) else " (Meridian reads regular files only)"
        raise error(f"{_named(path)} is {kind}, not {_a(what)}{hint}")
    if info.st_size > max_bytes:
        raise _too_large(path, what, max_bytes, error, info.st_size)
    return info.st_size


def read_user_file(
    path: str | Path, *, what: str, max_bytes: int, error: type[MeridianError] = MeridianError
) -> str:
    """The text of ``path``, a regular UTF-8 file of at most ``max_bytes`` (module docstring);
    ``error`` names the file, what it should have been, and the limit when it is over it."""
    path = Path(path)
    check_user_file(path, what=what, max_bytes=max_bytes, error=error)
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {_named(path)}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:  # it grew, or its size said nothing (/proc)
        raise _too_large(path, what, max_bytes, error, None)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"cannot read {what} {_named(path)}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def _too_large(
    path: Path, what: str, max_bytes: int, error: type[MeridianError], size: int | None
) -> MeridianError:
    """``size`` ``None``: not known (the file read past the limit)."""
    limit = f"the {describe_size(max_bytes)} limit of {_a(what)}"
    if size is None:
        return error(f"{_named(path)} is larger than {limit}")
    return error(f"{_named(path)} is {describe_size(size)}, over {limit}")
