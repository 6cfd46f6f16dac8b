"""The calibrated step-time model: a linear model least-squares fitted to step times measured on
the user's own hardware (``from_csv``; ``meridian serve --step-log`` writes such a file), for when
the roofline's assumptions do not hold."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meridian.config.files import MIB, check_user_file, read_user_file
from meridian.sim.steptime.base import NS_PER_MS, BatchShape, CalibrationError

__all__ = ["CSV_COLUMNS", "FittedStepTime"]


CSV_COLUMNS: tuple[str, ...] = (
    "num_prefill_tokens",
    "num_decode_seqs",
    "num_kv_tokens_read",
    "num_seqs",
    "step_time_ms",
)
_NUM_COEFFICIENTS = 5
_MIN_SAMPLES = _NUM_COEFFICIENTS
# A step log (``meridian serve --step-log``) takes about 40 bytes a step: 64 MiB is over a million
# steps, hours of a busy engine; more adds nothing to a five-term fit but memory.
MAX_CSV_BYTES = 64 * MIB
_CSV_WHAT = "step-time CSV"


def check_csv_file(path: Path) -> None:
    """Fail now if ``path`` cannot be a step-time CSV (not a regular file, or over
    :data:`MAX_CSV_BYTES`), as :meth:`FittedStepTime.from_csv` would later."""
    check_user_file(path, what=_CSV_WHAT, max_bytes=MAX_CSV_BYTES, error=CalibrationError)


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
        c = [float(x) * NS_PER_MS for x in coefficients_ms]
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
        non-negative integers, ``step_time_ms`` a positive number. Errors name ``file:line``; the
        file is read bounded (a regular file of at most :data:`MAX_CSV_BYTES`).
        """
        path = Path(path)
        text = read_user_file(path, what=_CSV_WHAT, max_bytes=MAX_CSV_BYTES, error=CalibrationError)
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
