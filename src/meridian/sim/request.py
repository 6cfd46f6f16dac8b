"""What the simulator is asked to serve: one immutable spec per request.

Workloads (``meridian.bench.workloads``) and trace files produce these; the engine never
mutates them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# The longest request (prompt plus think plus answer tokens) the simulator serves: the context of
# its stand-in model (vLLM's engine refuses a longer one), 128 Ki tokens, as Qwen3's and
# DeepSeek-R1's served context; a trace line over it is refused.
MAX_REQUEST_TOKENS = 131_072


class RequestKind(enum.Enum):
    """Chat requests have no think phase; reasoning requests think, then answer."""

    CHAT = "chat"
    REASONING = "reasoning"


@dataclass(frozen=True, slots=True, eq=False)
class RequestSpec:
    """One request of a workload.

    Invariants: ``num_think_tokens == 0`` for chat; ``think_entropy`` is ``None`` or has exactly
    ``num_think_tokens`` float32 values (nats); ``settle_token`` (reasoning only) is the think-token
    index after which the answer is settled, the ground truth of the entropy model: a forced stop
    before it is *premature* (the accuracy-risk proxy).
    """

    request_id: str
    arrival_ns: int
    num_prompt_tokens: int
    num_think_tokens: int
    num_answer_tokens: int
    kind: RequestKind
    think_entropy: npt.NDArray[np.float32] | None = None
    settle_token: int | None = None

    def __post_init__(self) -> None:
        if self.arrival_ns < 0 or self.num_prompt_tokens < 1 or self.num_answer_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: arrival_ns >= 0, prompt and answer tokens >= 1 "
                f"required; got {self.arrival_ns}, {self.num_prompt_tokens}, "
                f"{self.num_answer_tokens}"
            )
        if self.kind is RequestKind.CHAT and self.num_think_tokens != 0:
            raise ValueError(f"request {self.request_id}: a chat request has no think tokens")
        if self.think_entropy is not None and len(self.think_entropy) != self.num_think_tokens:
            raise ValueError(
                f"request {self.request_id}: think_entropy has {len(self.think_entropy)} values "
                f"for {self.num_think_tokens} think tokens"
            )

    @property
    def is_reasoning(self) -> bool:
        """True when the request has a think phase."""
        return self.kind is RequestKind.REASONING
