"""What an engine and the policy exchange: the requests it shows, the plan it gets back, and
what the policy reports (a listener) and counts (its stats).

An engine adapter (vLLM's scheduler, the simulator's engines) hands the policy its running and
waiting requests as :class:`EngineRequest` s (vLLM's ``Request`` has every field), reports what
happens, and before each step asks for a :class:`Plan` over its running requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NotRequired, Protocol, TypedDict, TypeVar

from meridian.core.types import Phase, PhaseEvent

__all__ = [
    "EngineRequest",
    "EngineShape",
    "Plan",
    "PolicyListener",
    "PolicyStats",
    "R",
    "output_budget_setting",
]


def output_budget_setting(rows: int | Literal["auto"]) -> int | Literal["auto"] | None:
    """``scheduler.output_budget_rows`` as the policy takes it: 0 is the whole batch (``None``).

    >>> output_budget_setting(0) is None, output_budget_setting("auto"), output_budget_setting(8)
    (True, 'auto', 8)
    """
    return "auto" if rows == "auto" else (rows or None)


class EngineShape(TypedDict):
    """What a driver tells the policy of its engine (``TrackingPolicy.from_config``): the KV block
    size, the running-request cap, the policy's clock, the tokens one step can schedule
    (``None``: plan every change), the think-end marker's length, the listener."""

    block_size: int
    capacity: int
    clock: Callable[[], float]
    max_step_tokens: int | None
    transition_len: NotRequired[int]
    listener: NotRequired[PolicyListener | None]


class EngineRequest(Protocol):
    """What the policy reads of an engine's running request (vLLM's ``Request`` has it all).

    ``num_computed_tokens`` are the tokens whose KV the engine holds; ``num_tokens`` is prompt
    plus generated tokens (a decode step computes ``num_tokens - 1`` and samples one more);
    ``max_tokens`` bounds the generated tokens (the request's own limit).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


R = TypeVar("R", bound=EngineRequest)


@dataclass(slots=True, eq=False)
class Plan(Generic[R]):
    """One step's decision over the running requests (not frozen: a frozen dataclass is slow to
    build in the caches a forward pass leaves cold). ``order`` may be the engine's running list
    itself (the order unchanged).

    ``order`` is a permutation of them (serve from the front, preempt from the back); ``skip``
    are requests the engine must not schedule this step (vLLM: ``next_decode_eligible_step``);
    the last ``num_ranked`` of ``order`` are the ranked victims (:attr:`victims`).
    """

    order: Sequence[R]
    skip: Sequence[R]
    num_ranked: int

    @property
    def victims(self) -> list[R]:
        """The ranked victims, first choice first (the tail of ``order``, reversed)."""
        order = self.order
        return [order[-1 - i] for i in range(min(self.num_ranked, len(order)))]


class PolicyListener(Protocol):
    """Where the policy reports what operators watch (metrics, traces); the adapter decides.

    ``phase_events``: whether the listener wants every phase event (``request_started`` and
    ``phase_event``, e.g. for traces); when False the policy neither builds nor sends them (the
    rest is reported either way).
    """

    phase_events: bool

    def request_started(self, request_id: str) -> None: ...

    def requests_finished(self, request_ids: list[str]) -> None:
        """The policy stopped tracking ``request_ids`` (finished or aborted together)."""

    def phase_event(self, request_id: str, event: PhaseEvent) -> None: ...

    def preempted(self, phase: Phase, num_blocks: int) -> None: ...

    def think_ended(self, request_id: str, num_think_tokens: int, hard_cap: bool) -> None:
        """A request's think phase ended now (its reasoning time with it) after
        ``num_think_tokens``; ``hard_cap``: at its hard cap, as the token stream tells."""

    def force_cut_short(self, request_id: str) -> None:
        """A request finished inside its hard-cap force: its max_tokens (or a stop) ran out
        while the transition phrase or ``think_end`` was being forced, so its think phase never
        ended; the force happened all the same (counted as one)."""

    def reasoning_started(self, request_id: str) -> None:
        """A request's first reasoning token arrived (its first generated token, or a generated
        ``think_start``); its reasoning lasts until the ``ExitThink`` event."""

    def first_answer(self, request_id: str) -> None:
        """A request that reasoned produced its first answer token (its TTFVT is now)."""

    def answer_gaps(self, seconds: float, count: int) -> None:
        """``count`` answer tokens each came ``seconds`` after their stream's previous one."""


@dataclass(slots=True)
class PolicyStats:
    """What the policy counted so far (read by tests, benchmarks and reports).

    ``max_answer_gap_steps`` is the largest number of steps between two consecutive answer
    tokens of one request (1 = a token every step): a preempted or held answer stream shows here
    as a stall. ``num_forced_inferred`` counts hard-cap forces as seen from the token stream: think
    phases that ended exactly at their hard cap (plus the transition phrase), and requests that
    finished inside that force (entropy-driven forces are known only to the forcing logits
    processor, so the hard cap is the one reason it can count). ``num_engine_order_steps`` counts
    the plans that kept the engine's order because no order could change the step.
    ``num_admissions_held`` counts the steps on which headroom admission held a waiting request
    back, ``num_bounded_holds`` those of them decided by the requests' bounds (prompt plus
    ``max_tokens``) rather than the length model's projection.
    """

    num_plans: int = 0
    num_reordered_steps: int = 0
    num_engine_order_steps: int = 0
    num_admissions_held: int = 0
    num_bounded_holds: int = 0
    num_deferred: int = 0
    num_answer_holds: int = 0
    num_paced: int = 0
    num_preemptions: dict[Phase, int] = field(default_factory=lambda: dict.fromkeys(Phase, 0))
    max_answer_gap_steps: int = 0
    num_answer_gaps_over_2: int = 0
    num_think_exits: int = 0
    think_tokens_total: int = 0
    num_forced_inferred: int = 0

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy (enum keys become their lower-case names or values)."""
        return {
            "num_plans": self.num_plans,
            "num_reordered_steps": self.num_reordered_steps,
            "num_engine_order_steps": self.num_engine_order_steps,
            "num_admissions_held": self.num_admissions_held,
            "num_bounded_holds": self.num_bounded_holds,
            "num_deferred": self.num_deferred,
            "num_answer_holds": self.num_answer_holds,
            "num_paced": self.num_paced,
            "preemptions": {p.name.lower(): n for p, n in self.num_preemptions.items() if n},
            "max_answer_gap_steps": self.max_answer_gap_steps,
            "num_answer_gaps_over_2": self.num_answer_gaps_over_2,
            "num_think_exits": self.num_think_exits,
            "think_tokens_total": self.think_tokens_total,
            "num_forced_inferred": self.num_forced_inferred,
        }
