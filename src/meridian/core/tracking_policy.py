"""The policy every driver tracks requests with: phases, counts by phase, preemptions by phase;
the engine's own order and admission (:class:`TrackingPolicy`, subclassed by
:class:`~meridian.core.policy.MeridianPolicy` and the simulator's baselines).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Self, Unpack

from meridian.config.schema import SchedulerConfig
from meridian.core.budget import RequestBudget, think_cap
from meridian.core.format import ReasoningFormat
from meridian.core.interface import (
    EngineRequest,
    EngineShape,
    Plan,
    PolicyListener,
    PolicyStats,
    R,
    output_budget_setting,
)
from meridian.core.pacing import PACE_HISTORY_STEPS, StepClock
from meridian.core.state import RequestState, advance
from meridian.core.tracking import Tracker
from meridian.core.types import Phase

__all__ = ["Admit", "OutputBudgetSetting", "TrackingPolicy"]

#: ``scheduler.output_budget_rows`` as the policy takes it: rows, ``None`` (all) or ``"auto"``.
OutputBudgetSetting = int | Literal["auto"] | None
Admit = Literal["headroom", "vllm"]


class TrackingPolicy:
    """Track requests and count by phase; plan and admit as the engine does.

    Contract: every tracked request is untracked (``num_tracked`` is 0 when the engine idles);
    ``step`` is the engine's: the step about to run for ``plan``, the one that ran for ``observe``.
    """

    #: ``observe(request_ids, tokens, step)``: one step's new tokens, aligned. NOTE: the
    #: tracker's bound method itself, one Python call less per step on a cold path.
    observe: Callable[[list[str], Sequence[Sequence[int]], int], None]
    #: ``tokens_by_phase(request_id, num_output_tokens)``: (think, answer), ``None`` if untracked.
    tokens_by_phase: Callable[[str, int], tuple[int, int] | None]

    def __init__(
        self,
        fmt: ReasoningFormat,
        config: SchedulerConfig,
        *,
        block_size: int,
        capacity: int,
        output_budget: OutputBudgetSetting = None,
        clock: Callable[[], float] = time.monotonic,
        transition_len: int = 0,
        listener: PolicyListener | None = None,
        admission: Admit = "headroom",
        max_step_tokens: int | None = None,
    ) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1; got {block_size}, {capacity}")
        self.format, self.block_size, self.capacity, self.clock = fmt, block_size, capacity, clock
        self.config = config
        self.stats = PolicyStats()
        self.listener = listener
        self.step_clock = StepClock(clock)
        self.default_max_think_tokens = int(config.max_think_tokens)
        self.tracker = Tracker(
            fmt,
            self.stats,
            default_cap=self.default_max_think_tokens,
            transition_len=transition_len,
            listener=listener,
            step_clock=self.step_clock,
            history=PACE_HISTORY_STEPS if config.answer_pace_ms else 0,
            on_phase_change=self._phase_changed,
        )
        self.observe = self.tracker.observe
        self.tokens_by_phase = self.tracker.tokens_by_phase
        self._build(output_budget, admission, max_step_tokens)

    @classmethod
    def from_config(
        cls,
        fmt: ReasoningFormat,
        config: SchedulerConfig,
        output_budget: OutputBudgetSetting | Literal["config"] = "config",
        **engine: Unpack[EngineShape],
    ) -> Self:
        """The policy from ``config`` and the engine's shape; ``output_budget`` overrides the
        config's rows (vLLM's ``$MERIDIAN_OUTPUT_BUDGET_ROWS``)."""
        if output_budget == "config":
            output_budget = output_budget_setting(config.output_budget_rows)
        return cls(fmt, config, output_budget=output_budget, admission=config.admission, **engine)

    def _build(
        self, output_budget: OutputBudgetSetting, admission: Admit, max_steps: int | None
    ) -> None:
        """Build, from ``self.config``, what a subclass plans and admits with."""

    @property
    def num_tracked(self) -> int:
        """Requests tracked (added and not yet untracked)."""
        return len(self.tracker.states)

    def track(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | None,
        output_token_ids: Sequence[int] = (),
        request_budget: RequestBudget | None = None,
        tracked_at: float | None = None,
    ) -> None:
        """Track a new request from its prompt's tail (``tracked_at``: on the clock, ``None``:
        now; ``output_token_ids``: what a request tracked late already generated)."""
        cap = think_cap(request_budget, self.default_max_think_tokens)
        st = self.tracker.track(
            request_id, prompt_token_ids or (), cap, self._tracked_at(tracked_at)
        )
        if output_token_ids:
            advance(st, list(output_token_ids))

    def _tracked_at(self, tracked_at: float | None) -> float:
        return self.clock() if tracked_at is None else tracked_at

    def untrack(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """Forget a request (unknown ids ignored); a *completed* one's ``num_output_tokens``
        teaches headroom admission."""
        self.tracker.untrack_many(((request_id, num_output_tokens),), self._untracked)

    def untrack_many(self, finished: Iterable[tuple[str, int | None]]) -> None:
        """:meth:`untrack` of each ``(request id, num_output_tokens)``, in one pass."""
        self.tracker.untrack_many(finished, self._untracked)

    def _untracked(self, gone: list[tuple[RequestState, int | None]]) -> None:
        """Requests left the table: ``(state, num_output_tokens)`` each."""

    def _phase_changed(self, st: RequestState) -> None:
        """A tracked request's phase changed (or a PREFILL request's was decided)."""

    def phase(self, request_id: str) -> Phase:
        """The tracked phase of a live request."""
        return self.tracker.states[request_id].phase

    def on_preempt(self, request_id: str, num_blocks: int = 0) -> Phase:
        """Count a preemption by the request's phase (returned); ``num_blocks`` it frees."""
        st = self.tracker.states[request_id]
        phase = st.phase
        self.stats.num_preemptions[phase] += 1
        if self.listener is not None:
            self.listener.preempted(phase, num_blocks)
        st.preempted = True
        return phase

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled the planned step: ``num_rows`` rows, ``num_tokens`` tokens."""

    def on_idle(self) -> None:
        """The engine has nothing to run."""
        self.step_clock.idle()

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The engine's own order."""
        self.stats.num_plans += 1
        return Plan(running, (), 0)

    def waiting_order(self, waiting: Sequence[R]) -> list[R] | None:
        """The engine's own order (``None``)."""
        return None

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """No limit from the policy (``None``)."""
        return None

    def queue_gauges(self) -> tuple[int, int, int, int]:
        """(output, think) queue depths and the last step's (output, think) batch sizes."""
        return 0, 0, 0, 0

    def blocks_by_phase(self, requests: Sequence[EngineRequest]) -> tuple[int, int]:
        """KV blocks ``requests`` hold for their computed tokens: (not answering, answering)."""
        return self.tracker.blocks_by_phase(requests, self.block_size)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        self.tracker.check_integrity()
