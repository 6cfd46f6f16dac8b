"""The fast engine's mutable per-request state (hot path: a slotted dataclass, no pydantic).

The attributes the policy reads have vLLM's ``Request`` names and meaning (``request_id``,
``num_computed_tokens``, ``num_tokens``), so :class:`~meridian.core.policy.MeridianPolicy` plans
over these exactly as it does over vLLM's requests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meridian.core.types import Phase
from meridian.sim.records import RequestRecord
from meridian.sim.streams import Stream


class RequestStatus(enum.Enum):
    """Where a request is in the engine: queued, holding KV in the running set, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the fast engine.

    Invariant: ``num_computed_tokens <= num_tokens``; a running request holds the KV blocks of
    its computed tokens (and of the tokens scheduled in the step in flight).
    """

    stream: Stream
    record: RequestRecord
    request_id: str
    priority: int
    status: RequestStatus = RequestStatus.WAITING
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    # Every token computed for it, recomputation after preemptions included.
    num_scheduled_tokens: int = 0

    @classmethod
    def from_stream(cls, stream: Stream) -> SimRequest:
        """Fresh state; vLLM's priority policy would see chat at 0, reasoning at 1."""
        return cls(
            stream=stream,
            record=RequestRecord.for_stream(stream),
            request_id=stream.request_id,
            priority=1 if stream.is_reasoning else 0,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return self.stream.spec.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.stream.max_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (vLLM's ``Request.num_tokens``)."""
        return self.stream.spec.num_prompt_tokens + self.num_output_tokens

    @property
    def phase(self) -> Phase:
        """THINK until its ``</think>`` is generated, then OUTPUT (chat: always OUTPUT)."""
        stream = self.stream
        if stream.is_reasoning and self.num_output_tokens <= stream.num_think:
            return Phase.THINK
        return Phase.OUTPUT
