"""What a step-time model is: the batch it is asked about (:class:`BatchShape`) and the one method
it answers (:class:`StepTimeModel`); pure functions of the batch, integer nanoseconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meridian.errors import MeridianError

__all__ = ["NS_PER_MS", "NS_PER_S", "BatchShape", "CalibrationError", "StepTimeModel"]

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


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
