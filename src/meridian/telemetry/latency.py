"""The latencies a user feels, defined once. The simulator's reports (:mod:`meridian.bench.summary`)
and the live scheduler's metrics (:mod:`meridian.vllm.publishing`) both compute them here, so a
figure from either means the same thing.

- **TTFVT**, time to first visible token: from the request's arrival to its first answer token
  (the first token after ``</think>``, or the first token of a request that did not reason: there
  it is the request's TTFT). GuideLLM and aiperf call it time to first output token.
- **TTOT**, time to output token: from the end of the reasoning (``</think>``) to the first answer
  token; only for a request that reasoned. It is what a forced or natural end of reasoning costs
  before the answer starts to stream.
- **Answer ITL**: the gaps between consecutive answer tokens of one request (think tokens
  excluded): a stalled or preempted answer stream's gap includes the stall.

The functions take any one unit of time (the simulator's integer nanoseconds, the engine's float
seconds) and never return a negative duration (two clocks read a few microseconds apart).
"""

from __future__ import annotations

__all__ = ["ttfvt", "ttot"]


def ttfvt(arrival: float, first_answer: float) -> float:
    """Time to first visible token of any request: arrival to its first answer token."""
    return max(first_answer - arrival, 0)


def ttot(think_end: float | None, first_answer: float) -> float | None:
    """Time from the end of reasoning to the first answer token; ``None`` for a request that
    did not reason (no ``think_end``)."""
    if think_end is None:
        return None
    return max(first_answer - think_end, 0)
