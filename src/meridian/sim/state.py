"""The engine's mutable per-request state (hot path: a slotted dataclass, no pydantic)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meridian.core.entropy import EntropyProbe
from meridian.core.types import Phase
from meridian.sim.records import RequestRecord
from meridian.sim.request import RequestSpec

# Token ids of the simulated stream; the engine's router sees exactly these.
THINK_START_ID = 1
THINK_END_ID = 2
NO_THINK_ID = 3
THINK_TOKEN_ID = 10
ANSWER_TOKEN_ID = 11


class RequestStatus(enum.Enum):
    """Where a request is in the engine: queued, holding KV in the running set, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the simulated engine.

    The generated stream of a reasoning request is ``think_target`` think tokens, ``</think>``,
    then the answer; a chat request generates only its answer. ``think_target`` starts at the
    workload's think length and is cut short when the budget policy forces ``</think>``.
    Invariant: ``num_computed <= num_tokens`` and ``num_blocks * block_size >= num_computed``.
    """

    spec: RequestSpec
    record: RequestRecord
    rid: str
    think_target: int
    entropy: npt.NDArray[np.float32] | None
    phase: Phase = Phase.PREFILL
    status: RequestStatus = RequestStatus.WAITING
    num_generated: int = 0
    num_think: int = 0
    num_answer: int = 0
    num_computed: int = 0
    num_blocks: int = 0
    last_token_id: int = -1
    last_scheduled_step: int = -1
    readmitted_step: int | None = None
    probe: EntropyProbe | None = None
    num_offloaded_blocks: int = 0
    offload_pending: tuple[int, ...] = ()
    offload_epoch: int = 0

    @classmethod
    def from_spec(cls, spec: RequestSpec) -> SimRequest:
        """Fresh state for ``spec``."""
        return cls(
            spec=spec,
            record=RequestRecord.for_spec(spec),
            rid=spec.request_id,
            think_target=spec.num_think_tokens,
            entropy=spec.think_entropy,
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the context whose KV a full prefill computes."""
        return self.spec.num_prompt_tokens + self.num_generated

    def blocks_needed(self, num_tokens_after: int, block_size: int) -> int:
        """Local blocks to add so that ``num_tokens_after`` tokens of KV fit (blocks offloaded
        to the KV pool hold their tokens without a local slot)."""
        total = -(-num_tokens_after // block_size)
        return max(0, total - self.num_blocks - self.num_offloaded_blocks)

    def next_token_id(self) -> int:
        """Generate the next token of the stream (and remember it)."""
        if not self.spec.is_reasoning:
            tok = ANSWER_TOKEN_ID
        elif self.num_think < self.think_target:
            tok = THINK_TOKEN_ID
        elif self.record.think_end_ns is None:
            # The engine emits every sampled token in the same step (setting think_end_ns on
            # </think>), so this holds for exactly one token.
            tok = THINK_END_ID
        else:
            tok = ANSWER_TOKEN_ID
        self.num_generated += 1
        self.last_token_id = tok
        return tok

    def current_entropy(self) -> float | None:
        """Entropy (nats) of the think token just generated, when the workload has a trace."""
        if self.entropy is None or self.num_think == 0:
            return None
        return float(self.entropy[self.num_think - 1])
