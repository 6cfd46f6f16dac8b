"""How long one engine step takes: the simulator's only notion of cost.

The engine describes a step as a :class:`BatchShape` and asks a :class:`StepTimeModel` for its
duration in integer nanoseconds. Two models ship:

- :class:`RooflineStepTime`: analytic, from a :class:`HardwareSpec` and a :class:`ModelSpec`
  (see :mod:`meridian.sim.presets`). A step is bound either by arithmetic or by HBM traffic.
- :class:`FittedStepTime`: a linear model least-squares fitted to step times measured on the
  user's own hardware (``from_csv``), for when the roofline's assumptions do not hold.

Both are pure functions of the batch: no wall clock, no randomness.
"""

from __future__ import annotations

import csv
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict

import numpy as np

from meridian.errors import ConfigError, MeridianError

__all__ = [
    "CSV_COLUMNS",
    "BatchShape",
    "Bound",
    "CalibrationError",
    "FittedStepTime",
    "HardwareSpec",
    "ModelSpec",
    "RooflineStepTime",
    "StepBreakdown",
    "StepTimeModel",
    "rows_within_budget",
]

_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000


class CalibrationError(MeridianError):
    """A step-time calibration file or sample set cannot be fitted; the message names where."""


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one engine step computes, summed over every request in the step.

    Fields:
        num_prefill_tokens: prompt (or recompute) tokens processed this step, all requests.
        num_decode_seqs: requests generating one token this step.
        num_kv_tokens_read: sum over the step's requests of the context each one attends over,
            *including* the tokens it adds this step (a decode row at position ``n`` reads ``n + 1``
            KV entries; a prefill chunk ending at position ``n`` reads ``n + 1``). Every KV entry
            is read from memory once per request per step.
        num_seqs: distinct requests in the step (prefill chunks + decodes).

    Invariants (checked; a violation raises ``ValueError``): every count is ``>= 0``;
    ``num_decode_seqs <= num_seqs <= num_decode_seqs + num_prefill_tokens`` (each prefill request
    brings at least one token); prefill tokens imply a prefill request; and
    ``num_kv_tokens_read >= num_prefill_tokens + num_decode_seqs`` (a request attends at least to
    the tokens it adds). ``num_seqs == 0`` is the empty batch.

    Example: 64 decode rows, each at context 1024::

        BatchShape(num_prefill_tokens=0, num_decode_seqs=64, num_kv_tokens_read=65536, num_seqs=64)
    """

    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens_read: int
    num_seqs: int

    def __post_init__(self) -> None:
        p, d, kv, s = (
            self.num_prefill_tokens,
            self.num_decode_seqs,
            self.num_kv_tokens_read,
            self.num_seqs,
        )
        if min(p, d, kv, s) < 0:
            raise ValueError(f"{self}: every count must be >= 0")
        if not d <= s <= d + p:
            raise ValueError(
                f"{self}: need num_decode_seqs <= num_seqs <= num_decode_seqs + num_prefill_tokens"
            )
        if p > 0 and s == d:
            raise ValueError(f"{self}: prefill tokens but no prefill request (num_seqs == decodes)")
        if kv < p + d:
            raise ValueError(
                f"{self}: num_kv_tokens_read must count each request's context including the "
                f"tokens it adds this step, so be >= num_prefill_tokens + num_decode_seqs"
            )

    @classmethod
    def decode_only(cls, num_rows: int, context_tokens_per_row: int) -> BatchShape:
        """``num_rows`` decode rows, each attending ``context_tokens_per_row`` tokens."""
        return cls(
            num_prefill_tokens=0,
            num_decode_seqs=num_rows,
            num_kv_tokens_read=num_rows * context_tokens_per_row,
            num_seqs=num_rows,
        )

    @property
    def is_empty(self) -> bool:
        """True when the step runs no request (and so costs nothing)."""
        return self.num_seqs == 0

    @property
    def num_query_tokens(self) -> int:
        """Tokens that pass through the model this step (one per decode row, plus prefill)."""
        return self.num_prefill_tokens + self.num_decode_seqs


class StepTimeModel(Protocol):
    """Duration of one engine step. Contract: deterministic; an empty batch costs 0; the result
    never decreases when any of ``num_prefill_tokens``, ``num_decode_seqs`` or
    ``num_kv_tokens_read`` grows (both bundled models are also monotone in ``num_seqs``)."""

    @property
    def label(self) -> str:
        """Short name for reports, e.g. ``roofline:h100-sxm/llama-3-8b``."""
        ...

    def step_time_ns(self, batch: BatchShape) -> int:
        """Simulated duration of the step, in integer nanoseconds."""
        ...


def _check_fraction(where: str, value: float) -> None:
    if not (0.0 < value <= 1.0):
        raise ConfigError(f"{where} must be in (0, 1]; got {value}")


def _check_positive(where: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{where} must be a positive finite number; got {value}")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator, as the roofline sees it.

    ``peak_flops`` is dense (no 2:4 sparsity) bf16 tensor-core FLOP/s and ``hbm_bandwidth`` is
    bytes/s, both datasheet peaks. ``mfu`` and ``bandwidth_efficiency`` are the fractions of those
    peaks a serving engine reaches; ``step_overhead_ns`` is the fixed host-side cost of a step
    (scheduling, input preparation, kernel launches) and ``per_request_overhead_ns`` the part that
    grows with the number of requests (per-row bookkeeping, sampling, output processing).
    ``host_link_bandwidth`` is the host link's datasheet bytes/s in one direction (KV offload
    copies over it, at ``bandwidth_efficiency`` of it); 0 where unknown.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: int
    mfu: float
    bandwidth_efficiency: float
    step_overhead_ns: int
    per_request_overhead_ns: int
    host_link_bandwidth: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        where = f"hardware.{self.name}"
        _check_positive(f"{where}.peak_flops", self.peak_flops)
        _check_positive(f"{where}.hbm_bandwidth", self.hbm_bandwidth)
        _check_positive(f"{where}.memory_bytes", self.memory_bytes)
        _check_fraction(f"{where}.mfu", self.mfu)
        _check_fraction(f"{where}.bandwidth_efficiency", self.bandwidth_efficiency)
        if self.step_overhead_ns < 0 or self.per_request_overhead_ns < 0:
            raise ConfigError(
                f"{where}: step_overhead_ns and per_request_overhead_ns must be >= 0; got "
                f"{self.step_overhead_ns}, {self.per_request_overhead_ns}"
            )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a dense decoder-only transformer, as far as step cost is concerned.

    The KV cache is assumed to be stored in the weights' dtype (``bytes_per_param``), which is
    vLLM's default (``--kv-cache-dtype auto``).
    """

    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        where = f"model.{self.name}"
        for field in (
            "num_params",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "bytes_per_param",
        ):
            value = getattr(self, field)
            if value < 1:
                raise ConfigError(f"{where}.{field} must be >= 1; got {value}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read by every step (all of them: a dense model)."""
        return self.num_params * self.bytes_per_param


class Bound(enum.StrEnum):
    """Which roof a step hits. A ``StrEnum``, so it compares equal to ``"compute"``/``"memory"``."""

    COMPUTE = "compute"
    MEMORY = "memory"


class StepBreakdown(TypedDict):
    """Where a roofline step's time goes (seconds); ``bound`` names the larger roof."""

    compute_s: float
    memory_s: float
    overhead_s: float
    bound: Bound


class RooflineStepTime:
    """Analytic step time: the larger of the compute and memory roofs, plus host overhead.

    ::

        time = max(FLOPs / (peak_flops * mfu), bytes / (hbm_bandwidth * bandwidth_efficiency))
               + step_overhead_ns + per_request_overhead_ns * num_seqs

        FLOPs = 2 * num_params * num_query_tokens               (every token through every matmul)
              + 4 * num_layers * num_attention_heads * head_dim * attended_pairs
        bytes = weight_bytes + num_kv_tokens_read * kv_bytes_per_token

    ``4 * L * H * d`` per (query, key) pair is ``QK^T`` (2d FLOPs per head) plus ``PV`` (2d).
    What ``attended_pairs`` counts, given only the step totals::

        attended_pairs = num_kv_tokens_read + num_prefill_tokens * (num_prefill_tokens - 1) / 2

    - each request's last row attends its whole context: ``num_kv_tokens_read`` in total, exact
      for decode rows (a decode row *is* its request's last row);
    - the other rows of a prefill chunk attend causally within the chunk. This is exact for one
      fresh prompt (``c (c + 1) / 2`` pairs); it leaves out what the earlier rows of a later
      chunk (or a recompute) attend in the request's prefix (``(c - 1) * prefix`` pairs), and it
      counts the prefill tokens of several requests as one chunk (cross-request pairs that do
      not exist). Either error is confined to the attention term, which for every preset is at
      most about a third of the ``2 * num_params`` per token of the matmuls at contexts up to
      10k tokens (e.g. 4 * 32 * 32 * 128 * 10k = 5.2 GFLOP vs 16.1 GFLOP for Llama-3-8B).

    ``num_seqs`` enters only through the per-request overhead, so step time is non-decreasing in
    every field. Simplifications: the embedding table counts as a matmul and so do the logits
    vLLM skips for non-final prefill rows (``2 * num_params`` per token slightly overstates);
    activations and KV writes are left out of the byte count. An empty batch costs 0.
    """

    __slots__ = (
        "_attn_flops_per_pair",
        "_flops_per_token",
        "_kv_bytes_per_token",
        "_per_request_ns",
        "_step_overhead_ns",
        "_sustained_bandwidth",
        "_sustained_flops",
        "_weight_bytes",
        "hardware",
        "label",
        "model",
    )

    def __init__(self, hardware: HardwareSpec, model: ModelSpec) -> None:
        self.hardware = hardware
        self.model = model
        self.label = f"roofline:{hardware.name}/{model.name}"
        self._flops_per_token = 2.0 * model.num_params
        self._attn_flops_per_pair = 4.0 * model.num_layers * model.num_attention_heads
        self._attn_flops_per_pair *= model.head_dim
        self._weight_bytes = float(model.weight_bytes)
        self._kv_bytes_per_token = float(model.kv_bytes_per_token)
        self._sustained_flops = hardware.peak_flops * hardware.mfu
        self._sustained_bandwidth = hardware.hbm_bandwidth * hardware.bandwidth_efficiency
        self._step_overhead_ns = hardware.step_overhead_ns
        self._per_request_ns = hardware.per_request_overhead_ns

    def flops(self, batch: BatchShape) -> float:
        """Floating-point operations of the step (see the class docstring for what counts)."""
        p = batch.num_prefill_tokens
        attended_pairs = batch.num_kv_tokens_read + p * (p - 1) / 2
        return (
            self._flops_per_token * batch.num_query_tokens
            + self._attn_flops_per_pair * attended_pairs
        )

    def bytes_read(self, batch: BatchShape) -> float:
        """HBM bytes the step reads: all weights once, plus every attended KV entry once."""
        return self._weight_bytes + self._kv_bytes_per_token * batch.num_kv_tokens_read

    def breakdown(self, batch: BatchShape) -> StepBreakdown:
        """Seconds per roof and of overhead; all zero for an empty batch."""
        if batch.is_empty:
            return StepBreakdown(compute_s=0.0, memory_s=0.0, overhead_s=0.0, bound=Bound.MEMORY)
        compute_s = self.flops(batch) / self._sustained_flops
        memory_s = self.bytes_read(batch) / self._sustained_bandwidth
        overhead_ns = self._step_overhead_ns + self._per_request_ns * batch.num_seqs
        return StepBreakdown(
            compute_s=compute_s,
            memory_s=memory_s,
            overhead_s=overhead_ns / _NS_PER_S,
            bound=Bound.COMPUTE if compute_s > memory_s else Bound.MEMORY,
        )

    def step_time_ns(self, batch: BatchShape) -> int:
        """``max(compute, memory)`` rounded to the nanosecond, plus overheads; 0 when empty."""
        if batch.is_empty:
            return 0
        compute_s = self.flops(batch) / self._sustained_flops
        memory_s = self.bytes_read(batch) / self._sustained_bandwidth
        return (
            round(max(compute_s, memory_s) * _NS_PER_S)
            + self._step_overhead_ns
            + self._per_request_ns * batch.num_seqs
        )

    def __repr__(self) -> str:
        return f"RooflineStepTime({self.hardware.name!r}, {self.model.name!r})"


CSV_COLUMNS: tuple[str, ...] = (
    "num_prefill_tokens",
    "num_decode_seqs",
    "num_kv_tokens_read",
    "num_seqs",
    "step_time_ms",
)
_NUM_COEFFICIENTS = 5
_MIN_SAMPLES = _NUM_COEFFICIENTS
_COEFFICIENT_NAMES: tuple[str, ...] = (
    "base_ns",
    "ns_per_prefill_token",
    "ns_per_decode_seq",
    "ns_per_kv_token",
    "ns_per_seq",
)


@dataclass(frozen=True, slots=True)
class FittedStepTime:
    """A linear step-time model calibrated to measured steps::

        t_ns = base_ns + ns_per_prefill_token * num_prefill_tokens
               + ns_per_decode_seq * num_decode_seqs + ns_per_kv_token * num_kv_tokens_read
               + ns_per_seq * num_seqs

    Every coefficient is ``>= 0`` (so the model is monotone in every field); an empty batch
    costs 0. ``r_squared`` and ``max_relative_error`` describe the fit on its own samples
    (``max |predicted - measured| / measured``). Build one with :meth:`from_csv` or
    :meth:`from_samples`.
    """

    base_ns: float
    ns_per_prefill_token: float
    ns_per_decode_seq: float
    ns_per_kv_token: float
    ns_per_seq: float
    r_squared: float = 1.0
    max_relative_error: float = 0.0
    num_samples: int = 0
    label: str = "fitted"

    def __post_init__(self) -> None:
        for name, value in zip(_COEFFICIENT_NAMES, self.coefficients_ns, strict=True):
            if not (value >= 0 and math.isfinite(value)):
                raise CalibrationError(f"{self.label}: {name} must be finite and >= 0; got {value}")

    @property
    def coefficients_ns(self) -> tuple[float, float, float, float, float]:
        """``(base, per prefill token, per decode seq, per KV token, per seq)`` in nanoseconds."""
        return (
            self.base_ns,
            self.ns_per_prefill_token,
            self.ns_per_decode_seq,
            self.ns_per_kv_token,
            self.ns_per_seq,
        )

    def step_time_ns(self, batch: BatchShape) -> int:
        """The fitted linear function of the batch, rounded to the nanosecond; 0 when empty."""
        if batch.is_empty:
            return 0
        return round(
            self.base_ns
            + self.ns_per_prefill_token * batch.num_prefill_tokens
            + self.ns_per_decode_seq * batch.num_decode_seqs
            + self.ns_per_kv_token * batch.num_kv_tokens_read
            + self.ns_per_seq * batch.num_seqs
        )

    @classmethod
    def from_samples(
        cls, samples: Sequence[tuple[BatchShape, float]], *, label: str = "fitted"
    ) -> FittedStepTime:
        """Fit to ``(batch, measured step time in milliseconds)`` pairs (the CSV's unit).

        Least squares (``numpy.linalg.lstsq``) of the relative error (each sample weighted by
        ``1 / measured``, columns scaled to unit range first). A negative
        coefficient would make a bigger batch faster, so the most negative one is clamped to 0
        and the rest refitted, until none is negative: a greedy approximation of non-negative
        least squares (it may stop short of the exact NNLS optimum; ``r_squared`` shows the
        price). Raises :class:`CalibrationError` for fewer than 5 samples, an empty batch, a
        time that is not positive and finite, or a dimension that no sample exercises.
        """
        if len(samples) < _MIN_SAMPLES:
            raise CalibrationError(
                f"{label}: {len(samples)} samples; at least {_MIN_SAMPLES} are needed to fit "
                f"{_NUM_COEFFICIENTS} coefficients"
            )
        rows: list[tuple[float, float, float, float, float]] = []
        times_ms: list[float] = []
        for index, (batch, time_ms) in enumerate(samples):
            if batch.is_empty:
                raise CalibrationError(f"{label}: sample {index} is an empty batch")
            if not (time_ms > 0 and math.isfinite(time_ms)):
                raise CalibrationError(
                    f"{label}: sample {index}: step time must be > 0 ms; got {time_ms}"
                )
            rows.append(
                (
                    1.0,
                    batch.num_prefill_tokens,
                    batch.num_decode_seqs,
                    batch.num_kv_tokens_read,
                    batch.num_seqs,
                )
            )
            times_ms.append(time_ms)
        design = np.asarray(rows, dtype=np.float64)
        measured = np.asarray(times_ms, dtype=np.float64)
        scale = design.max(axis=0)
        unused = [_COEFFICIENT_NAMES[i] for i in range(_NUM_COEFFICIENTS) if scale[i] == 0]
        if unused:
            raise CalibrationError(
                f"{label}: no sample exercises {', '.join(unused)}; add steps where it is > 0 "
                f"so its cost can be fitted"
            )
        # Rows weighted by 1 / measured: the fit minimises the squared *relative* error, so a
        # 5 ms decode step counts as much as a 300 ms prefill (ITL accuracy is what matters).
        weights = 1.0 / measured
        scaled = design / scale * weights[:, np.newaxis]
        coefficients_ms = _fit_non_negative(scaled, measured * weights) / scale
        predicted = design @ coefficients_ms
        residual = float(np.sum((measured - predicted) ** 2))
        spread = float(np.sum((measured - measured.mean()) ** 2))
        r_squared = 1.0 - residual / spread if spread > 0 else float(residual == 0)
        max_relative_error = float(np.max(np.abs(predicted - measured) / measured))
        c = [float(x) * _NS_PER_MS for x in coefficients_ms]
        return cls(
            base_ns=c[0],
            ns_per_prefill_token=c[1],
            ns_per_decode_seq=c[2],
            ns_per_kv_token=c[3],
            ns_per_seq=c[4],
            r_squared=r_squared,
            max_relative_error=max_relative_error,
            num_samples=len(samples),
            label=label,
        )

    @classmethod
    def from_csv(cls, path: Path) -> FittedStepTime:
        """Fit to a CSV of measured steps; see :meth:`from_samples` for the method.

        The header must name :data:`CSV_COLUMNS` (other columns are ignored); counts are
        non-negative integers, ``step_time_ms`` a positive number. Errors name ``file:line``.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        reader = csv.DictReader(text.splitlines())
        header = [name.strip() for name in reader.fieldnames or []]
        if not header:
            raise CalibrationError(f"{path}: empty file; expected a header {','.join(CSV_COLUMNS)}")
        reader.fieldnames = header
        missing = [name for name in CSV_COLUMNS if name not in header]
        if missing:
            raise CalibrationError(
                f"{path}:1: missing column(s) {', '.join(missing)}; the header must name "
                f"{','.join(CSV_COLUMNS)} (found: {','.join(header)})"
            )
        samples: list[tuple[BatchShape, float]] = []
        for record in reader:
            where = f"{path}:{reader.line_num}"
            if all(not (value or "").strip() for value in record.values()):
                continue
            counts = [_parse_count(where, name, record.get(name)) for name in CSV_COLUMNS[:4]]
            time_ms = _parse_time(where, record.get("step_time_ms"))
            try:
                batch = BatchShape(*counts)
            except ValueError as exc:
                raise CalibrationError(f"{where}: {exc}") from None
            if batch.is_empty:
                raise CalibrationError(f"{where}: an empty batch (num_seqs = 0) is not a sample")
            samples.append((batch, time_ms))
        if len(samples) < _MIN_SAMPLES:
            raise CalibrationError(
                f"{path}: {len(samples)} samples; at least {_MIN_SAMPLES} are needed to fit "
                f"{_NUM_COEFFICIENTS} coefficients"
            )
        return cls.from_samples(samples, label=f"fitted:{path.name}")


def _parse_count(where: str, column: str, raw: str | None) -> int:
    text = (raw or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise CalibrationError(
            f"{where}: column {column}: {text!r} is not a non-negative integer"
        ) from None
    if value < 0:
        raise CalibrationError(f"{where}: column {column}: {value} is negative")
    return value


def _parse_time(where: str, raw: str | None) -> float:
    text = (raw or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise CalibrationError(f"{where}: column step_time_ms: {text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise CalibrationError(f"{where}: column step_time_ms: {text!r} must be > 0 and finite")
    return value


def _fit_non_negative(design: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Least squares with the most negative coefficient clamped to 0 and refitted, repeatedly."""
    active = list(range(design.shape[1]))
    solution = np.zeros(design.shape[1], dtype=np.float64)
    while active:
        fitted, *_ = np.linalg.lstsq(design[:, active], measured, rcond=None)
        worst = int(np.argmin(fitted))
        if fitted[worst] >= 0:
            solution[active] = fitted
            return solution
        del active[worst]
    return solution


def rows_within_budget(
    model: StepTimeModel, budget_ns: int, context_tokens_per_row: int, max_rows: int
) -> int:
    """Most decode rows (each attending ``context_tokens_per_row``) whose step fits ``budget_ns``.

    Binary search over ``[1, max_rows]``; relies on the model being monotone in the row count,
    which both bundled models are. Never returns less than 1, even when one row alone exceeds
    the budget: the scheduler must still make progress. The scheduler uses it as the output
    budget (rows that keep the inter-token latency within the SLO).

    Example: ``rows_within_budget(roofline, 30_000_000, 4096, 512)`` is how many 4k-context rows
    an H100 can decode within a 30 ms ITL.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1; got {max_rows}")
    if context_tokens_per_row < 1:
        raise ValueError(f"context_tokens_per_row must be >= 1; got {context_tokens_per_row}")
    if budget_ns < 0:
        raise ValueError(f"budget_ns must be >= 0; got {budget_ns}")

    def fits(num_rows: int) -> bool:
        batch = BatchShape.decode_only(num_rows, context_tokens_per_row)
        return model.step_time_ns(batch) <= budget_ns

    if fits(max_rows):
        return max_rows
    # Invariant: lo == 1 or lo fits; hi does not fit.
    lo, hi = 1, max_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
