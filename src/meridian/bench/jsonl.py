"""JSON Lines inputs (the accuracy dataset, request traces): one JSON object per line, each
validated by a pydantic model, so that a bad line is one error naming the file, the line and the
field (worded by the config's formatter, :func:`~meridian.config.loading.format_validation_error`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, PlainValidator, Strict, ValidationError

from meridian.config.files import read_user_file
from meridian.config.loading import format_validation_error
from meridian.errors import MeridianError

__all__ = ["FiniteNonNegative", "NonEmptyText", "read_jsonl"]

M = TypeVar("M", bound=BaseModel)
# At most this many of a line's errors are reported (the message stays one line).
MAX_ERRORS = 3


def _non_empty_text(value: object) -> str:
    if isinstance(value, str) and value:
        return value
    raise ValueError("must be a non-empty string")


def _finite_non_negative(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("must be a finite number >= 0")
    return value


# A JSON string of at least one character (its error: "must be a non-empty string").
NonEmptyText = Annotated[str, PlainValidator(_non_empty_text)]
# A JSON number (not a boolean, not a numeric string) that is finite and >= 0.
FiniteNonNegative = Annotated[float, Strict(), AfterValidator(_finite_non_negative)]


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type (``array`` for a list, ``null`` for None)."""
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def read_jsonl(
    path: Path,
    model: type[M],
    error: type[MeridianError],
    *,
    what: str,
    max_bytes: int,
    max_lines: int,
) -> Iterator[tuple[int, M]]:
    """Each non-blank line of ``path`` validated as ``model``, with its line number (from 1), as
    it is read: the caller keeps what it needs of a line (a trace's entropies as float32), not
    every line's Python objects at once.

    Raises ``error`` for a file that is unreadable, not a regular file, over ``max_bytes``
    (:func:`~meridian.config.files.read_user_file`), empty, or of more than ``max_lines`` lines
    (``what`` names it: "dataset", "trace"), and for the first bad line: not JSON, not an
    object, or what ``model`` rejects.

    >>> from pydantic import BaseModel
    >>> class Point(BaseModel):
    ...     x: int
    >>> import tempfile; f = Path(tempfile.mkdtemp()) / "p.jsonl"; _ = f.write_text('{"x": "a"}')
    >>> list(read_jsonl(f, Point, MeridianError, what="point", max_bytes=99, max_lines=9))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    meridian.errors.MeridianError: .../p.jsonl:1: x: input should be a valid integer, ...; got 'a'
    """
    text = read_user_file(path, what=f"{what} file", max_bytes=max_bytes, error=error)
    allowed = f"allowed: {', '.join(model.model_fields)}"
    num_rows = 0
    for number, line in enumerate(_lines(text), start=1):
        if number > max_lines:
            raise error(f"{path} has more than {max_lines:,} lines, the limit of a {what} file")
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(raw, dict):
            raise error(f"{where}: expected a JSON object; got {_json_type(raw)}")
        try:
            row = model.model_validate(raw)
        except ValidationError as exc:
            found = exc.errors()[:MAX_ERRORS]
            lines = [format_validation_error(e, unknown_hint=allowed) for e in found]
            raise error(f"{where}: " + "; ".join(lines)) from None
        num_rows += 1
        yield number, row
    if not num_rows:
        raise error(f"{path}: {what} file is empty (expected one JSON object per line)")


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` split at ``\\n`` (a ``\\r`` before it is JSON whitespace), one
    at a time: no list of copies of a file of hundreds of MiB."""
    start, end = 0, len(text)
    while start < end:
        stop = text.find("\n", start)
        if stop < 0:
            stop = end
        yield text[start:stop]
        start = stop + 1
