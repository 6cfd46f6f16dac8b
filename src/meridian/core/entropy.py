"""Per-token entropy of the next-token distribution in numpy: the reference that the logits
processor's torch code (:func:`meridian.vllm.logits.entropy_torch`) matches within
``atol=1e-5``, and what ``benchmarks/bench_reasoner_traces.py`` computes traces with.

NOTE: numpy has no bfloat16; upcast bf16 logits to float32 before calling :func:`entropy_nats`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Float32Array", "entropy_nats"]

# Elements per working chunk: two float32 buffers of this size (1 MiB) stay in a 2 MiB L2, so
# every pass after the first read of the logits runs from cache. A row is never split.
_CHUNK_ELEMENTS = 1 << 17

Float32Array = npt.NDArray[np.float32]


def _validate_logits(logits: npt.ArrayLike) -> tuple[npt.NDArray[Any], bool]:
    """The logits as a 2-D float array (``[rows, vocab]``) and whether the input was 1-D."""
    x = np.asarray(logits)
    if x.ndim not in (1, 2):
        raise ValueError(
            f"logits must be [vocab] or [rows, vocab]; got an array of shape {x.shape}"
        )
    if x.dtype.kind != "f":
        raise TypeError(
            f"logits must be float16, float32 or float64; got {x.dtype} "
            "(numpy has no bfloat16: upcast bf16 logits to float32 first)"
        )
    if x.shape[-1] == 0:
        raise ValueError("logits have an empty vocab axis (vocab size 0); entropy is undefined")
    if x.dtype.itemsize > 8:
        # longdouble: nothing in Meridian needs more than float64.
        x = x.astype(np.float64)
    is_row = x.ndim == 1
    return (x[np.newaxis, :] if is_row else x), is_row


def _check_maxima(x: npt.NDArray[Any], row_offset: int, maxima: npt.NDArray[Any]) -> None:
    """Raise ValueError naming the first row whose maximum is not finite.

    NaN propagates through max, so this one check covers NaN, +inf and all-masked (-inf) rows.
    """
    if np.isfinite(maxima).all():
        return
    bad = int(np.flatnonzero(~np.isfinite(maxima))[0])
    row = x[bad]
    index = row_offset + bad
    if np.isnan(row).any():
        raise ValueError(f"logits row {index} contains NaN")
    if np.isposinf(row).any():
        raise ValueError(f"logits row {index} contains +inf; entropy is undefined")
    raise ValueError(f"logits row {index} has no finite logit (every entry is -inf)")


def entropy_nats(logits: npt.ArrayLike) -> Float32Array:
    """Shannon entropy in nats of ``softmax(logits)``, per row.

    Args:
        logits: ``[vocab]`` or ``[rows, vocab]``, float16, float32 or float64; any strides.
            ``-inf`` entries are masked tokens (probability 0).

    Returns:
        float32: a 0-d array for a ``[vocab]`` input (``float(...)`` it for a Python float),
        ``[rows]`` for a ``[rows, vocab]`` input. Every value is in ``[0, log(vocab)]``.

    Raises:
        ValueError: a row has no finite logit, or contains NaN or +inf (the message names the
            row), or the shape is not 1-D/2-D, or the vocab axis is empty.
        TypeError: the dtype is not a float type.

    Computed as ``H = log S - T / S`` with ``z = x - max(x)``, ``S = sum(exp z)`` and
    ``T = sum(exp(z) * z)``, which is ``logsumexp(z) - sum(softmax(z) * z)`` without forming the
    probabilities. float16 and float32 inputs are computed in float32 (numpy's pairwise
    summation keeps the error near 1e-6 nats even at 152k vocab), float64 in float64. Rows are
    processed in cache-sized chunks into two reused buffers, so a ``[64, 151936]`` batch makes no
    batch-sized temporaries.

    >>> round(float(entropy_nats(np.zeros(4, dtype=np.float32))), 6)  # uniform: log(4)
    1.386294
    >>> entropy_nats(np.array([[0.0, -np.inf], [1e4, -1e4]], dtype=np.float32)).tolist()
    [0.0, 0.0]
    """
    x, is_row = _validate_logits(logits)
    num_rows, vocab = x.shape
    work = np.float64 if x.dtype == np.float64 else np.float32
    out = np.empty(num_rows, dtype=np.float32)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // vocab)
    z_buf = np.empty((min(rows_per_chunk, num_rows), vocab), dtype=work)
    e_buf = np.empty_like(z_buf)
    # x - max may overflow to -inf and 0 * -inf is NaN; both are repaired below, so no warnings.
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, num_rows, rows_per_chunk):
            stop = min(num_rows, start + rows_per_chunk)
            xs = x[start:stop]
            z = z_buf[: stop - start]
            e = e_buf[: stop - start]
            if xs.dtype == work:
                maxima = np.max(xs, axis=1, keepdims=True)
                _check_maxima(xs, start, maxima)
                np.subtract(xs, maxima, out=z)
            else:
                # float16: cast once into the float32 buffer and work there; numpy's float16
                # max/subtract loops are unvectorised and made this path ~4x slower.
                np.copyto(z, xs, casting="same_kind")
                maxima = np.max(z, axis=1, keepdims=True)
                _check_maxima(xs, start, maxima)
                np.subtract(z, maxima, out=z)
            np.exp(z, out=e)
            s = np.sum(e, axis=1)
            np.multiply(e, z, out=e)
            t = np.sum(e, axis=1)
            if not np.isfinite(t).all():
                # Only masked rows get here: exp(-inf) * -inf = 0 * -inf = NaN (also when
                # x - max overflows to -inf). Every other product is <= 0, so fmin(., 0) maps
                # exactly the NaNs to their true value 0; unmasked batches never pay this pass.
                np.fmin(e, 0.0, out=e)
                t = np.sum(e, axis=1)
            # s >= 1 (the max contributes exp(0)), so the division is safe.
            out[start:stop] = np.log(s) - t / s
    # Rounding can push a one-hot row a hair below 0 or a uniform row a hair above log(V).
    np.clip(out, 0.0, math.log(vocab), out=out)
    return out.reshape(()) if is_row else out
