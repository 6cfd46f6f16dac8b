"""The ``servegen-r1`` workload: production DeepSeek-R1 traffic, generated the way ServeGen does.

The data are ServeGen's reasoning workload (Alibaba, Apache-2.0; arXiv:2505.09999): one day of
DeepSeek-R1 traffic on Alibaba Cloud Model Studio, per client. ``bench/data/servegen-r1.json``
is a compact derivative of ``data/reason/deepseek-r1`` at ServeGen commit f891d11, rebuilt from
the raw files by ``scripts/build_servegen_r1.py`` (its ``notice`` says what changed; the license
is ``bench/data/LICENSE-servegen.txt``). Per client it holds, for each 10-minute window with
traffic, the number of requests, the CV of the inter-arrival times and the fitted inter-arrival
distribution (Gamma or Weibull, its shape); and per 6-hour window the inverse CDFs of
``input_tokens``, ``output_tokens`` and ``reason_ratio`` (the share of the output inside
``<think>``).

A run follows ServeGen's ``generate_workload`` (``servegen/construct.py``); where it differs,
the step says so:

1. **Span.** The run covers ``[start_s, start_s + duration_s)`` of the source's day, wrapping at
   midnight (``servegen-r1`` starts at 10:00, see :data:`DEFAULT_START_S`; ``servegen-r1@HH:MM``
   at HH:MM), cut into pieces at the 10-minute window boundaries.
2. **Rate.** Every client's rate in every window is multiplied by one factor,
   ``arrival_rate / (the source's mean aggregate rate over the span)``: the run's mean rate is
   ``arrival_rate``, and the clients' shares and the day's shape keep their proportions (over one
   window this is ServeGen's constant rate function).
3. **Arrivals.** A client expecting ``m`` requests in a piece gets ``floor(m)`` or
   ``floor(m) + 1`` of them (the mean is ``m``), at the cumulative sums of ``n + 1`` gaps drawn
   from its fitted distribution and rescaled to fill the piece, which cancels the fitted scale.
   ServeGen draws ``ceil(m)`` gaps and keeps the arrivals before the window's end, one fewer
   than ``m`` on average per client and window (a small client's only request is lost).
4. **Lengths.** Input, output and reason ratio by inverse-CDF sampling of the client's table
   for the window (the latest at or before it), all three from one uniform draw per request,
   as ServeGen draws them (``_sample_data_batch``): within a client's window they are
   rank-coupled (a long prompt comes with a long output and a high reasoning share). The data
   hold each field's distribution, not how the fields go together, so the coupling is
   ServeGen's modelling choice; Meridian follows it so that ``servegen-r1`` is the workload
   ServeGen generates. Drawn independently instead, reasoning came out 7.9 % shorter on the
   mean and 10-26 % at P90 than ServeGen's own generator (10:00, 3 req/s, 30 seeds);
   ``tests/test_servegen.py`` compares the moments with figures recorded from ServeGen's
   generator (``bench/data/servegen-reference.json``, made by
   ``scripts/servegen_reference.py``).
5. **Phases.** ``think = round(output * ratio)``, at most ``output - 1`` so that every request
   answers; the answer is the rest. A request without think tokens is a chat request.
6. **Entropy.** Each reasoning request gets an entropy trace and a settle point from
   :class:`~meridian.bench.entropy_model.EntropyTraceModel`: an assumption, not ServeGen's data.

Determinism: one ``numpy.random.default_rng(seed)`` feeds every draw: per piece in time order,
per client in the file's order, the count's rounding, the gaps, then one uniform per request
for its lengths; then the entropy traces in arrival order (ties in arrival keep that order).

>>> from meridian.bench.workloads import WorkloadParams
>>> specs = generate_servegen(WorkloadParams(arrival_rate=2.0, duration_s=60.0, seed=0))
>>> len(specs) in range(100, 141), all(s.num_answer_tokens >= 1 for s in specs)
(True, True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from itertools import pairwise
from typing import Annotated, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meridian.bench.workloads import (
    NS_PER_S,
    SERVEGEN,
    IntArray,
    WorkloadError,
    WorkloadParams,
    build_specs,
)
from meridian.config.loading import format_validation_error
from meridian.sim.request import RequestSpec

__all__ = [
    "DATA_FILE",
    "DEFAULT_START_S",
    "WORKLOAD",
    "Piece",
    "ServeGenData",
    "ServeGenDraw",
    "draw_servegen",
    "generate_servegen",
    "load_servegen",
    "parse_servegen",
    "plan_pieces",
    "start_of",
]

WORKLOAD = SERVEGEN
DATA_FILE = "servegen-r1.json"
# 10:00 in the source's day: the morning hours are where the source shows what it is known for,
# bimodal reasoning lengths (modes near 500 and 3,000 think tokens) and bursty clients
# (rate-weighted CV of the gaps 4-6). The busiest hour, 22:00 (``servegen-r1@22:00``), is short
# reasoning (mean think 570 tokens) from steadier clients (CV 2).
DEFAULT_START_S = 36_000
_START = re.compile(r"(?P<hours>[01]\d|2[0-3]):(?P<minutes>[0-5]\d)")

FloatArray = npt.NDArray[np.float64]
Count = Annotated[int, Field(ge=1)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# [window index, requests in the window, CV of the gaps, distribution, shape]
WindowRow = tuple[
    Annotated[int, Field(ge=0)], Count, Positive, Literal["Gamma", "Weibull"], Positive
]


class Source(BaseModel):
    """Where the data come from (docs/simulator.md says it too)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repository: str
    path: str
    commit: str = Field(pattern=r"^[0-9a-f]{7,40}$")
    license: Literal["Apache-2.0"]
    paper: str
    traffic: str


class LengthTable(BaseModel):
    """One client's lengths over a 6-hour window: each field's inverse CDF at the quantiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_s: Annotated[int, Field(ge=0)]
    input_tokens: list[Count]
    output_tokens: list[Count]
    reason_ratio: list[Annotated[float, Field(ge=0, le=1)]]

    @field_validator("input_tokens", "output_tokens", "reason_ratio")
    @classmethod
    def _non_decreasing(cls, knots: list[float]) -> list[float]:
        if any(b < a for a, b in pairwise(knots)):
            raise ValueError("must be non-decreasing (an inverse CDF)")
        return knots


class Client(BaseModel):
    """One client: its windows with traffic and the length tables they use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[int, Field(ge=0)]
    windows: list[WindowRow] = Field(min_length=1)
    tables: list[LengthTable] = Field(min_length=1)

    @model_validator(mode="after")
    def _ordered(self) -> Client:
        indices = [w[0] for w in self.windows]
        starts = [t.start_s for t in self.tables]
        if indices != sorted(set(indices)) or starts != sorted(set(starts)):
            raise ValueError(f"windows and tables must be in increasing order; got {indices}")
        return self


class ServeGenData(BaseModel):
    """The bundled data file, validated on load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1]
    name: Literal["servegen-r1"]
    source: Source
    notice: str = Field(min_length=1)
    window_s: Annotated[int, Field(ge=1)]
    num_windows: Annotated[int, Field(ge=1)]
    quantiles: list[float] = Field(min_length=2)
    clients: list[Client] = Field(min_length=1)

    @property
    def day_s(self) -> int:
        return self.window_s * self.num_windows

    @model_validator(mode="after")
    def _consistent(self) -> ServeGenData:
        q = self.quantiles
        if q[0] != 0.0 or q[-1] != 1.0 or any(b <= a for a, b in pairwise(q)):
            raise ValueError(f"quantiles must rise strictly from 0 to 1; got {q[:3]}...")
        if len({c.id for c in self.clients}) != len(self.clients):
            raise ValueError("client ids must be unique")
        for c in self.clients:
            if c.windows[-1][0] >= self.num_windows:
                raise ValueError(f"client {c.id}: window {c.windows[-1][0]} >= num_windows")
            if c.windows[0][0] * self.window_s < c.tables[0].start_s:
                raise ValueError(f"client {c.id}: window {c.windows[0][0]} has no length table")
            for t in c.tables:
                if not len(t.input_tokens) == len(t.output_tokens) == len(t.reason_ratio) == len(q):
                    raise ValueError(f"client {c.id}: table {t.start_s} needs {len(q)} knots")
        return self


def start_of(name: str) -> int:
    """Seconds into the source's day where workload ``name`` starts: ``servegen-r1`` at
    :data:`DEFAULT_START_S`, ``servegen-r1@HH:MM`` at that time."""
    if name == WORKLOAD:
        return DEFAULT_START_S
    text = name.removeprefix(f"{WORKLOAD}@")
    match = _START.fullmatch(text)
    if not name.startswith(f"{WORKLOAD}@") or match is None:
        raise WorkloadError(
            f"workload {name!r}: write {WORKLOAD}@HH:MM with a time of day from 00:00 to 23:59 "
            f"(the start in the source's day); got {text!r}"
        )
    return int(match["hours"]) * 3600 + int(match["minutes"]) * 60


def parse_servegen(text: str, *, source: str = DATA_FILE) -> ServeGenData:
    """Validate the data file's text; :class:`WorkloadError` names ``source`` and the field."""
    try:
        return ServeGenData.model_validate_json(text)
    except ValidationError as exc:
        lines = [format_validation_error(err) for err in exc.errors()[:3]]
        raise WorkloadError(f"{source}: " + "; ".join(lines)) from None


@lru_cache(maxsize=1)
def load_servegen() -> ServeGenData:
    """The bundled ``servegen-r1.json`` (validated once per process)."""
    text = resources.files("meridian.bench").joinpath("data", DATA_FILE).read_text("utf-8")
    return parse_servegen(text)


@dataclass(frozen=True, slots=True)
class Piece:
    """One client's share of one window of the span: where it lies in the run and what it
    expects (``expected`` requests, already scaled to the run's rate)."""

    client: int
    window: int
    offset_s: float
    length_s: float
    expected: float
    distribution: str
    shape: float
    table: LengthTable


def _span(data: ServeGenData, start_s: float, duration_s: float) -> list[tuple[int, float, float]]:
    """``(window index, offset in the run, length)`` of each piece of the span, in time order."""
    pieces: list[tuple[int, float, float]] = []
    offset = 0.0
    while offset < duration_s:
        day_time = (start_s + offset) % data.day_s
        window = int(day_time // data.window_s)
        length = min((window + 1) * data.window_s - day_time, duration_s - offset)
        pieces.append((window, offset, length))
        offset += length
    return pieces


def plan_pieces(
    data: ServeGenData, rate: float, duration_s: float, start_s: float = DEFAULT_START_S
) -> list[Piece]:
    """Every client's pieces of the span, scaled so that the expected total is
    ``rate * duration_s`` (steps 1 and 2 of the module docstring)."""
    windows = {c.id: {w[0]: w for w in c.windows} for c in data.clients}
    raw: list[tuple[int, int, float, float, float, str, float, LengthTable]] = []
    for window, offset, length in _span(data, start_s, duration_s):
        for client in data.clients:
            row = windows[client.id].get(window)
            if row is None:
                continue
            table = next(t for t in reversed(client.tables) if t.start_s <= window * data.window_s)
            source_expected = row[1] * length / data.window_s
            raw.append((client.id, window, offset, length, source_expected, row[3], row[4], table))
    total = sum(r[4] for r in raw)
    if total <= 0:
        raise WorkloadError(f"{WORKLOAD}: the source has no traffic in this span")
    scale = rate * duration_s / total
    return [Piece(c, w, o, n, e * scale, d, k, t) for c, w, o, n, e, d, k, t in raw]


@dataclass(frozen=True, slots=True)
class ServeGenDraw:
    """A generated run as columns in arrival order, before the entropy traces: each request's
    client and source window, its lengths and the reason ratio drawn for it."""

    arrival_ns: IntArray
    client: IntArray
    window: IntArray
    prompt: IntArray
    output: IntArray
    reason_ratio: FloatArray
    think: IntArray
    answer: IntArray


def _gaps(distribution: str, shape: float, size: int, rng: np.random.Generator) -> FloatArray:
    """Inter-arrival gaps of unit scale (the scale cancels when they are rescaled)."""
    if distribution == "Gamma":
        return rng.gamma(shape, 1.0, size)
    return rng.weibull(shape, size)


def _arrivals_s(piece: Piece, count: int, rng: np.random.Generator) -> FloatArray:
    """``count`` arrival times inside the piece: ``count + 1`` gaps rescaled to fill it."""
    gaps = _gaps(piece.distribution, piece.shape, count + 1, rng)
    total = float(gaps.sum())
    if not total > 0:  # every gap underflowed (a tiny Gamma shape): spread them evenly
        gaps, total = np.ones(count + 1), float(count + 1)
    return piece.offset_s + np.cumsum(gaps[:count]) * (piece.length_s / total)


def _inverse_cdf(knots: Sequence[float], quantiles: FloatArray, u: FloatArray) -> FloatArray:
    """Inverse-CDF sampling: ``u`` mapped through the knots, linear between two."""
    return np.interp(u, quantiles, np.asarray(knots, dtype=np.float64))


def _counts(values: FloatArray) -> IntArray:
    """Rounded to whole tokens, at least one."""
    return np.maximum(np.rint(values), 1).astype(np.int64)


def draw_servegen(
    data: ServeGenData,
    rate: float,
    duration_s: float,
    rng: np.random.Generator,
    start_s: float = DEFAULT_START_S,
) -> ServeGenDraw:
    """Arrivals and lengths of one run (steps 1-5 of the module docstring)."""
    quantiles = np.asarray(data.quantiles, dtype=np.float64)
    parts: list[tuple[FloatArray, int, int, FloatArray, FloatArray, FloatArray]] = []
    for piece in plan_pieces(data, rate, duration_s, start_s):
        whole = math.floor(piece.expected)
        count = whole + int(rng.random() < piece.expected - whole)
        if count == 0:
            continue
        times = _arrivals_s(piece, count, rng)
        table = piece.table
        # One uniform for all three fields, as ServeGen (step 4).
        u = rng.random(count)
        prompts = _inverse_cdf(table.input_tokens, quantiles, u)
        outputs = _inverse_cdf(table.output_tokens, quantiles, u)
        ratios = _inverse_cdf(table.reason_ratio, quantiles, u)
        parts.append((times, piece.client, piece.window, prompts, outputs, ratios))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return ServeGenDraw(empty, empty, empty, empty, empty, np.zeros(0), empty, empty)
    seconds = np.concatenate([p[0] for p in parts])
    order = np.argsort(seconds, kind="stable")
    arrival_ns = np.minimum(
        np.floor(seconds[order] * NS_PER_S).astype(np.int64), math.ceil(duration_s * NS_PER_S) - 1
    )

    def column(i: int) -> FloatArray:
        return np.concatenate([p[i] for p in parts])[order]

    sizes = [p[0].size for p in parts]
    client = np.repeat([p[1] for p in parts], sizes).astype(np.int64)[order]
    window = np.repeat([p[2] for p in parts], sizes).astype(np.int64)[order]
    prompt, output, ratio = _counts(column(3)), _counts(column(4)), column(5)
    think: IntArray = np.minimum(np.rint(output * ratio).astype(np.int64), output - 1)
    return ServeGenDraw(arrival_ns, client, window, prompt, output, ratio, think, output - think)


def generate_servegen(
    params: WorkloadParams, *, start_s: float = DEFAULT_START_S
) -> list[RequestSpec]:
    """The requests of ``servegen-r1`` for ``params`` (``reasoning_ratio`` must be unset: the
    data set the mix), sorted by arrival, with entropy traces for the reasoning requests."""
    if params.reasoning_ratio is not None:
        raise WorkloadError(
            f"workload {WORKLOAD!r} takes its reasoning share from the data; "
            f"reasoning_ratio must be None; got {params.reasoning_ratio}"
        )
    rng = np.random.default_rng(params.seed)
    draw = draw_servegen(load_servegen(), params.arrival_rate, params.duration_s, rng, start_s)
    return build_specs(
        draw.arrival_ns, draw.prompt, draw.think, draw.answer, rng, params.entropy_params
    )
