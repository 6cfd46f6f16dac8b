"""JSONL request traces: replay your own traffic in the simulator, or save a generated workload.

One JSON object per line::

    {"id": "r000000", "arrival_s": 0.125, "prompt_tokens": 161, "think_tokens": 2048,
     "answer_tokens": 220, "settle_token": 1200, "entropy": [0.41, 0.38, ...]}

Required: ``arrival_s`` (seconds from the start of the run, a number >= 0), ``prompt_tokens``
(integer >= 1), ``think_tokens`` (integer >= 0), ``answer_tokens`` (integer >= 1). Optional:
``id`` (string, unique; default ``"r%06d"`` of the record's position in the file), ``entropy``
(one finite number >= 0 per think token, nats), ``settle_token`` (integer in
``[0, think_tokens]``). A request with ``think_tokens > 0`` is a reasoning request, one with 0 a
chat request. Blank lines are skipped; any other field is an error (a misspelt optional field
would otherwise be dropped silently).

Arrival times are stored in seconds and converted to integer nanoseconds
(``round(arrival_s * 1e9)``); a time written by :func:`write_trace` reads back to the same
nanosecond. Entropy values are written with 9 significant digits, which reads back to the same
float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from meridian.bench.jsonl import json_type
from meridian.errors import MeridianError
from meridian.sim.request import RequestKind, RequestSpec

__all__ = ["TraceError", "read_trace", "write_trace"]

REQUIRED_FIELDS = ("arrival_s", "prompt_tokens", "think_tokens", "answer_tokens")
OPTIONAL_FIELDS = ("id", "entropy", "settle_token")
NS_PER_S = 1_000_000_000


class TraceError(MeridianError):
    """A trace file cannot be read or written; the message names the file, line and field."""


def write_trace(path: str | Path, requests: Iterable[RequestSpec]) -> None:
    """Write ``requests`` to ``path`` as JSONL, one line per request, in the given order.

    ``entropy`` and ``settle_token`` are written when the spec has them. Raises
    :class:`TraceError` when the file cannot be written or an entropy value is not finite.
    """
    target = Path(path)
    lines: list[str] = []
    for spec in requests:
        record: dict[str, Any] = {
            "id": spec.request_id,
            "arrival_s": spec.arrival_ns / NS_PER_S,
            "prompt_tokens": spec.num_prompt_tokens,
            "think_tokens": spec.num_think_tokens,
            "answer_tokens": spec.num_answer_tokens,
        }
        if spec.settle_token is not None:
            record["settle_token"] = spec.settle_token
        line = json.dumps(record, separators=(",", ":"))
        if spec.think_entropy is not None:
            values = np.asarray(spec.think_entropy, dtype=np.float32)
            if not np.isfinite(values).all():
                bad = int(np.flatnonzero(~np.isfinite(values))[0])
                raise TraceError(
                    f"{target}: request {spec.request_id}: entropy[{bad}] is {values[bad]}; "
                    "a trace holds finite entropies only"
                )
            # 9 significant digits identify a float32 exactly, even when parsed via float64.
            # "-0" would parse as the JSON integer 0 and lose its sign: write it as a float.
            texts = list(map("{:.9g}".format, values.tolist()))
            for i in np.flatnonzero((values == 0) & np.signbit(values)).tolist():
                texts[i] = "-0.0"
            body = ",".join(texts)
            line = f'{line[:-1]},"entropy":[{body}]}}'
        lines.append(line)
    try:
        with target.open("w", encoding="utf-8") as out:
            for line in lines:
                out.write(line)
                out.write("\n")
    except OSError as exc:
        raise TraceError(f"{target}: cannot write trace file: {exc.strerror or exc}") from None


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace into request specs sorted by arrival (ties keep file order).

    Raises :class:`TraceError` naming the file, the line and the field for: an unreadable or
    empty file, a line that is not JSON or not an object, a missing or unknown field, a value of
    the wrong type, a negative number, an entropy list whose length differs from
    ``think_tokens``, a ``settle_token`` outside ``[0, think_tokens]``, or a duplicate id.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise TraceError(f"{source}: cannot read trace file: {reason}") from None
    specs: list[RequestSpec] = []
    first_line_of: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        spec = _parse_line(line, f"{source}:{lineno}", default_id=f"r{len(specs):06d}")
        if spec.request_id in first_line_of:
            raise TraceError(
                f"{source}:{lineno}: field 'id': duplicate id {spec.request_id!r} "
                f"(first on line {first_line_of[spec.request_id]})"
            )
        first_line_of[spec.request_id] = lineno
        specs.append(spec)
    if not specs:
        raise TraceError(f"{source}: trace file is empty (expected one JSON object per line)")
    specs.sort(key=lambda s: s.arrival_ns)
    return specs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(record: dict[str, Any], key: str, at: str, minimum: int) -> int:
    value = record[key]
    if not _is_int(value):
        raise TraceError(
            f"{at}: field {key!r} must be an integer; got {value!r} ({json_type(value)})"
        )
    if value < minimum:
        raise TraceError(f"{at}: field {key!r} must be >= {minimum}; got {value}")
    return int(value)


def _parse_line(line: str, at: str, *, default_id: str) -> RequestSpec:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{at}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{at}: expected a JSON object; got {json_type(record)}")
    for key in REQUIRED_FIELDS:
        if key not in record:
            raise TraceError(f"{at}: missing required field {key!r}")
    unknown = sorted(set(record) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        allowed = ", ".join(REQUIRED_FIELDS + OPTIONAL_FIELDS)
        raise TraceError(f"{at}: unknown field {unknown[0]!r} (allowed: {allowed})")

    arrival_s = record["arrival_s"]
    if not _is_number(arrival_s):
        raise TraceError(
            f"{at}: field 'arrival_s' must be a number of seconds; got {arrival_s!r} "
            f"({json_type(arrival_s)})"
        )
    if not math.isfinite(arrival_s) or arrival_s < 0:
        raise TraceError(f"{at}: field 'arrival_s' must be a finite number >= 0; got {arrival_s}")
    prompt = _count(record, "prompt_tokens", at, 1)
    think = _count(record, "think_tokens", at, 0)
    answer = _count(record, "answer_tokens", at, 1)

    request_id = record.get("id", default_id)
    if not isinstance(request_id, str) or not request_id:
        raise TraceError(
            f"{at}: field 'id' must be a non-empty string; got {request_id!r} "
            f"({json_type(request_id)})"
        )

    entropy = None
    if "entropy" in record:
        entropy = _entropy(record["entropy"], think, at)
    settle = None
    if "settle_token" in record:
        settle = _count(record, "settle_token", at, 0)
        if think == 0:
            raise TraceError(
                f"{at}: field 'settle_token' is given but think_tokens is 0 (a chat request)"
            )
        if settle > think:
            raise TraceError(
                f"{at}: field 'settle_token' must be <= think_tokens ({think}); got {settle}"
            )

    return RequestSpec(
        request_id=request_id,
        arrival_ns=round(arrival_s * NS_PER_S),
        num_prompt_tokens=prompt,
        num_think_tokens=think,
        num_answer_tokens=answer,
        kind=RequestKind.REASONING if think > 0 else RequestKind.CHAT,
        think_entropy=entropy,
        settle_token=settle,
    )


def _entropy(values: object, think: int, at: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    if not isinstance(values, list):
        raise TraceError(
            f"{at}: field 'entropy' must be an array of numbers; got {json_type(values)}"
        )
    if len(values) != think:
        raise TraceError(
            f"{at}: field 'entropy' has {len(values)} values but think_tokens is {think}; "
            "give one entropy per think token"
        )
    # Check types first: numpy would also accept booleans and numeric strings. JSON numbers
    # parse to exactly int or float, so one pass over the set of types decides.
    if not set(map(type, values)) <= {int, float}:
        i, v = next((i, v) for i, v in enumerate(values) if not _is_number(v))
        raise TraceError(
            f"{at}: field 'entropy': entropy[{i}] must be a number; got {v!r} ({json_type(v)})"
        )
    array = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceError(
            f"{at}: field 'entropy': entropy[{i}] must be a finite number >= 0; got {values[i]}"
        )
    return array.astype(np.float32)
