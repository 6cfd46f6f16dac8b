"""JSONL request traces: replay your own traffic in the simulator, or save a generated workload.

One JSON object per line::

    {"id": "r000000", "arrival_s": 0.125, "prompt_tokens": 161, "think_tokens": 2048,
     "answer_tokens": 220, "settle_token": 1200, "entropy": [0.41, 0.38, ...]}

Required: ``arrival_s`` (seconds from the start of the run, a number in ``[0, 604800]``: a week
at most), ``prompt_tokens`` (integer >= 1), ``think_tokens`` (integer >= 0), ``answer_tokens``
(integer >= 1), the three together at most 131,072 (the simulated model's context). Optional:
``id`` (string, unique; default ``"r%06d"`` of the record's position in the file), ``entropy``
(one finite number >= 0 per think token, nats), ``settle_token`` (integer in
``[0, think_tokens]``). A request with ``think_tokens > 0`` is a reasoning request, one with 0 a
chat request. Blank lines are skipped; any other field is an error (a misspelt optional field
would otherwise be dropped silently).

Arrival times are stored in seconds and converted to integer nanoseconds
(``round(arrival_s * 1e9)``); a time written by :func:`write_trace` reads back to the same
nanosecond. Entropy values are written with 9 significant digits, which reads back to the same
float32.

A trace file is read bounded: a regular file of at most 256 MiB and 1,000,000 lines (the most
requests a bundled workload generates), so a wrong path (``/dev/zero``, a FIFO) or a runaway file
is one error, not a hang.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, model_validator

from meridian.bench.jsonl import FiniteNonNegative, NonEmptyText, read_jsonl
from meridian.bench.workloads import MAX_DURATION_S, MAX_EXPECTED_REQUESTS
from meridian.config.files import MIB
from meridian.errors import MeridianError
from meridian.sim.request import MAX_REQUEST_TOKENS, RequestKind, RequestSpec

__all__ = ["TraceError", "TraceLine", "read_trace", "write_trace"]

NS_PER_S = 1_000_000_000
# A trace of 1,000,000 requests without entropies is about 100 MiB; with per-token entropies (10
# bytes a think token) 256 MiB holds about 25 million think tokens. Parsed, a trace takes a few
# times its size in memory.
MAX_TRACE_BYTES = 256 * MIB
_Tokens = Annotated[StrictInt, Field(le=MAX_REQUEST_TOKENS)]


class TraceError(MeridianError):
    """A trace file cannot be read or written; the message names the file, line and field."""


def write_trace(path: str | Path, requests: Iterable[RequestSpec]) -> None:
    """Write ``requests`` to ``path`` as JSONL, one line per request, in the given order.

    ``entropy`` and ``settle_token`` are written when the spec has them; missing parent folders
    are created. Raises :class:`TraceError` when the file cannot be written or an entropy value
    is not finite.
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
        target.parent.mkdir(parents=True, exist_ok=True)  # a new folder is fine
        with target.open("w", encoding="utf-8") as out:
            for line in lines:
                out.write(line)
                out.write("\n")
    except OSError as exc:
        raise TraceError(f"{target}: cannot write trace file: {exc.strerror or exc}") from None


class TraceLine(BaseModel):
    """One line of a trace as written (the module docstring describes the fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival_s: Annotated[FiniteNonNegative, Field(le=MAX_DURATION_S)]
    prompt_tokens: Annotated[_Tokens, Field(ge=1)]
    think_tokens: Annotated[_Tokens, Field(ge=0)]
    answer_tokens: Annotated[_Tokens, Field(ge=1)]
    id: NonEmptyText | None = None
    # Strict: a boolean or a numeric string is not an entropy. Finiteness and sign are checked
    # below over the whole array at once (a trace holds thousands of values per request).
    entropy: list[Annotated[float, Strict()]] | None = None
    settle_token: Annotated[StrictInt, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _fits_think_tokens(self) -> TraceLine:
        think = self.think_tokens
        total = self.prompt_tokens + think + self.answer_tokens
        if total > MAX_REQUEST_TOKENS:
            raise ValueError(
                f"prompt_tokens + think_tokens + answer_tokens must be at most "
                f"{MAX_REQUEST_TOKENS:,} (the simulated model's context); got {total:,}"
            )
        if self.entropy is not None:
            if len(self.entropy) != think:
                raise ValueError(
                    f"entropy must hold one value per think token ({think}); "
                    f"got {len(self.entropy)} values"
                )
            array = np.asarray(self.entropy, dtype=np.float64)
            bad = ~np.isfinite(array) | (array < 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"entropy[{i}] must be a finite number >= 0; got {array[i]}")
        if self.settle_token is not None and think == 0:
            raise ValueError(
                "settle_token is given but think_tokens is 0 (a chat request); "
                f"got {self.settle_token}"
            )
        if self.settle_token is not None and self.settle_token > think:
            raise ValueError(
                f"settle_token must be <= think_tokens ({think}); got {self.settle_token}"
            )
        return self

    def spec(self, default_id: str) -> RequestSpec:
        """The request, ``default_id`` its id where the line gives none."""
        think = self.think_tokens
        entropy = None if self.entropy is None else np.asarray(self.entropy, dtype=np.float32)
        return RequestSpec(
            request_id=self.id if self.id is not None else default_id,
            arrival_ns=round(self.arrival_s * NS_PER_S),
            num_prompt_tokens=self.prompt_tokens,
            num_think_tokens=think,
            num_answer_tokens=self.answer_tokens,
            kind=RequestKind.REASONING if think > 0 else RequestKind.CHAT,
            think_entropy=entropy,
            settle_token=self.settle_token,
        )


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Read a JSONL trace into request specs sorted by arrival (ties keep file order).

    Raises :class:`TraceError` naming the file, the line and the field for: an unreadable or
    empty file, a line that is not JSON or not an object, a missing or unknown field, a value of
    the wrong type, a negative number, an entropy list whose length differs from
    ``think_tokens``, a ``settle_token`` outside ``[0, think_tokens]``, or a duplicate id.
    """
    source = Path(path)
    specs: list[RequestSpec] = []
    first_line_of: dict[str, int] = {}
    lines = read_jsonl(
        source,
        TraceLine,
        TraceError,
        what="trace",
        max_bytes=MAX_TRACE_BYTES,
        max_lines=MAX_EXPECTED_REQUESTS,
    )
    for lineno, line in lines:
        spec = line.spec(default_id=f"r{len(specs):06d}")
        if spec.request_id in first_line_of:
            raise TraceError(
                f"{source}:{lineno}: id: duplicate id {spec.request_id!r} "
                f"(first on line {first_line_of[spec.request_id]})"
            )
        first_line_of[spec.request_id] = lineno
        specs.append(spec)
    specs.sort(key=lambda s: s.arrival_ns)
    return specs
