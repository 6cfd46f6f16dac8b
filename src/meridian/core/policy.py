"""The Meridian scheduling policy: the one object vLLM's scheduler and the simulator drive.

Engine-neutral (no torch, no vllm, an injected clock). Both adapters
(:class:`meridian.vllm.scheduler.MeridianScheduler`, :mod:`meridian.sim.policies`) build it with
:meth:`TrackingPolicy.from_config` and call, in a step's order: ``track``, ``waiting_order``,
``admissions``, ``plan``, ``on_step``, ``on_preempt``, ``observe``, ``untrack``/``untrack_many``,
``on_idle``. One collaborator per job does the work: :class:`~meridian.core.tracking.Tracker`
(requests and their tokens), :class:`~meridian.core.planner.Planner` (the step plan),
:class:`~meridian.core.admission.Admission` and
:class:`~meridian.core.output_budget.OutputBudget`. :class:`TrackingPolicy` is what every policy
needs (the simulator's Pascal baseline plans on top of it); :class:`MeridianPolicy` adds
Meridian's plan and admission.

NOTE: a model without think boundaries has one phase, so no rule of Meridian's applies: the
policy stands aside (``MeridianPolicy.stands_aside``), keeping the engine's order, preemption and
admission, and only tracks and counts (vLLM's own scheduler tests pass with it, docs/vllm.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, Self

from meridian.config.schema import SchedulerConfig
from meridian.core.admission import ADMISSION_CANDIDATES, Admission
from meridian.core.budget import RequestBudget
from meridian.core.format import ReasoningFormat
from meridian.core.interface import (
    EngineRequest,
    Plan,
    PolicyListener,
    PolicyStats,
    R,
    output_budget_setting,
)
from meridian.core.output_budget import OutputBudget
from meridian.core.pacing import PACE_HISTORY_STEPS, AnswerPacer
from meridian.core.planner import READMIT_GUARD_STEPS, Planner
from meridian.core.state import RequestState, advance
from meridian.core.tracking import Tracker, UntrackedRequestsError
from meridian.core.types import Phase

__all__ = [
    "ADMISSION_CANDIDATES",
    "READMIT_GUARD_STEPS",
    "EngineRequest",
    "MeridianPolicy",
    "Plan",
    "PolicyListener",
    "PolicyStats",
    "RequestState",
    "TrackingPolicy",
    "UntrackedRequestsError",
    "output_budget_setting",
]

#: ``scheduler.output_budget_rows`` as the policy takes it: rows, ``None`` (the whole batch) or
#: ``"auto"`` (measured).
OutputBudgetSetting = int | Literal["auto"] | None


class TrackingPolicy:
    """Track requests, account their tokens, count preemptions by phase; plan and admit as the
    engine does (:class:`MeridianPolicy` plans and admits).

    Contract: every tracked request is untracked (``num_tracked`` is 0 when the engine idles);
    ``step`` is the engine's counter: the step about to be scheduled for ``plan``, the step that
    produced the tokens for ``observe``.
    """

    #: ``observe(request_ids, tokens, step)``: one step's new tokens (``tokens[i]`` those of
    #: ``request_ids[i]``). The tracker's method itself, not a method handing the call on: on a
    #: path the forward pass leaves cold, one Python call less per step.
    observe: Callable[[list[str], Sequence[Sequence[int]], int], None]
    #: ``tokens_by_phase(request_id, num_output_tokens)``: (think, answer) tokens of a tracked
    #: request (``None``: not tracked); the tracker's method itself, as ``observe``.
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
        admission: Literal["headroom", "vllm"] = "headroom",
        max_step_tokens: int | None = None,
    ) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1; got {block_size}, {capacity}")
        self.format, self.block_size, self.capacity, self.clock = fmt, block_size, capacity, clock
        self.stats = PolicyStats()
        self.listener = listener
        self.default_max_think_tokens = int(config.max_think_tokens)
        self.tracker = Tracker(
            fmt,
            self.stats,
            default_cap=self.default_max_think_tokens,
            transition_len=transition_len,
            listener=listener,
            clock=clock,
            history=PACE_HISTORY_STEPS if config.answer_pace_ms else 0,
            on_phase_change=self._phase_changed,
        )
        self.observe = self.tracker.observe
        self.tokens_by_phase = self.tracker.tokens_by_phase
        self._build(config, output_budget, admission, max_step_tokens)

    @classmethod
    def from_config(
        cls,
        fmt: ReasoningFormat,
        config: SchedulerConfig,
        *,
        block_size: int,
        capacity: int,
        clock: Callable[[], float],
        max_step_tokens: int | None,
        transition_len: int = 0,
        listener: PolicyListener | None = None,
        output_budget: OutputBudgetSetting | Literal["config"] = "config",
    ) -> Self:
        """The policy as a driver builds it: ``config`` and the engine's shape (KV block size,
        running-request cap, tokens per step, clock). ``output_budget`` overrides
        ``config.output_budget_rows`` (vLLM's ``$MERIDIAN_OUTPUT_BUDGET_ROWS``)."""
        if output_budget == "config":
            output_budget = output_budget_setting(config.output_budget_rows)
        return cls(
            fmt,
            config,
            block_size=block_size,
            capacity=capacity,
            output_budget=output_budget,
            clock=clock,
            transition_len=transition_len,
            listener=listener,
            admission=config.admission,
            max_step_tokens=max_step_tokens,
        )

    def _build(
        self,
        config: SchedulerConfig,
        output_budget: OutputBudgetSetting,
        admission: Literal["headroom", "vllm"],
        max_step_tokens: int | None,
    ) -> None:
        """Build what a subclass plans and admits with (tracking alone needs nothing more)."""

    # -- tracking -------------------------------------------------------------------------

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
        """Start tracking a new request, in the phase its prompt's tail starts it in.

        ``request_budget`` (its knobs) tells where a hard-cap force ends, for the inferred-force
        counter; ``tracked_at``: when it was added, on the policy's clock (``None``: now);
        ``output_token_ids``: tokens it already generated (a request tracked late).
        """
        if request_budget is None:
            cap: int | None = self.default_max_think_tokens
        elif request_budget.forcing:
            cap = request_budget.max_think_tokens or self.default_max_think_tokens
        else:
            cap = None
        st = self.tracker.track(
            request_id, prompt_token_ids or (), cap, self._tracked_at(tracked_at)
        )
        if output_token_ids:
            advance(st, list(output_token_ids))

    def _tracked_at(self, tracked_at: float | None) -> float:
        return self.clock() if tracked_at is None else tracked_at

    def untrack(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """Forget a finished or aborted request (unknown ids are ignored). ``num_output_tokens``,
        of a request that *completed*, teaches headroom admission's length model. (An adapter
        whose :meth:`untrack_many` failed falls back on this, request by request.)"""
        self.tracker.untrack_many(((request_id, num_output_tokens),), self._untracked)

    def untrack_many(self, finished: Iterable[tuple[str, int | None]]) -> None:
        """:meth:`untrack` of each ``(request id, num_output_tokens)``, in one pass."""
        self.tracker.untrack_many(finished, self._untracked)

    def _untracked(self, gone: list[tuple[RequestState, int | None]]) -> None:
        """Requests left the table, ``(state, num_output_tokens)`` each (counts up to date)."""

    def _phase_changed(self, st: RequestState) -> None:
        """A tracked request's phase changed (or a PREFILL request's was decided)."""

    def phase(self, request_id: str) -> Phase:
        """The tracked phase of a live request."""
        return self.tracker.states[request_id].phase

    # -- what happens ---------------------------------------------------------------------

    def on_preempt(self, request_id: str, num_blocks: int = 0) -> Phase:
        """Count a preemption by the request's phase (returned); ``num_blocks``, the KV blocks
        it frees, goes to the listener."""
        st = self.tracker.states[request_id]
        phase = st.phase
        self.stats.num_preemptions[phase] += 1
        if self.listener is not None:
            self.listener.preempted(phase, num_blocks)
        st.preempted = True
        return phase

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled the planned step: ``num_rows`` rows computing ``num_tokens``."""

    def on_idle(self) -> None:
        """The engine has nothing to run."""

    # -- the step -------------------------------------------------------------------------

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

    # -- reading --------------------------------------------------------------------------

    def queue_gauges(self) -> tuple[int, int, int, int]:
        """(output, think) queue depths and the last step's (output, think) batch sizes."""
        return 0, 0, 0, 0

    def blocks_by_phase(self, requests: Sequence[EngineRequest]) -> tuple[int, int]:
        """KV blocks ``requests`` hold for their computed tokens: (not answering, answering)."""
        states, output, block_size = self.tracker.states, Phase.OUTPUT, self.block_size
        thinking = answering = 0
        for request in requests:
            blocks = -(-request.num_computed_tokens // block_size)
            st = states.get(request.request_id)
            if st is not None and st.phase is output:
                answering += blocks
            else:
                thinking += blocks
        return thinking, answering

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        self.tracker.check_integrity()


class MeridianPolicy(TrackingPolicy):
    """Phase tracking, step plans, victim ranking and admission: what ships (module docstring).

    Contract: ``plan`` returns a permutation of its input and skips only running requests.

    >>> from meridian.config import SchedulerConfig
    >>> fmt = ReasoningFormat(think_start=(7,), think_end=(8,))
    >>> policy = MeridianPolicy(fmt, SchedulerConfig(), block_size=16, capacity=8)
    >>> policy.track("a", [1, 7])
    >>> policy.phase("a")
    <Phase.THINK: 1>
    """

    def _build(
        self,
        config: SchedulerConfig,
        output_budget: OutputBudgetSetting,
        admission: Literal["headroom", "vllm"],
        max_step_tokens: int | None,
    ) -> None:
        pace_s = float(config.answer_pace_ms) / 1000.0
        tpot_s = float(config.output_tpot_budget_ms) / 1000.0
        self.output_budget = OutputBudget(output_budget, tpot_s, self.capacity)
        tracker = self.tracker
        self.planner = Planner(
            config,
            tracker.states,
            self.stats,
            block_size=self.block_size,
            capacity=self.capacity,
            output_budget=self.output_budget,
            max_step_tokens=max_step_tokens,
            pacer=AnswerPacer(pace_s) if pace_s else None,
            clock=self.clock,
            last_answer_step=tracker.last_answer_step,
            token_time=tracker.times.at,
        )
        self.admission = Admission(
            config,
            tracker.states,
            tracker.settle,
            self.stats,
            block_size=self.block_size,
            mode=admission,
        )
        # NOTE: with one phase (no boundaries) there is nothing to arbitrate between phases:
        # the engine's order, preemption and admission stand; tracking and counting go on.
        self.stands_aside = not self.format.has_boundaries

    def queue_gauges(self) -> tuple[int, int, int, int]:
        queues = self.planner.queues
        served_output, served_think = queues.last_served
        return queues.num_output_queued, queues.num_think_queued, served_output, served_think

    def _tracked_at(self, tracked_at: float | None) -> float:
        return self.admission.wait_start(tracked_at, self.clock)

    def _phase_changed(self, st: RequestState) -> None:
        self.planner.phase_changed(st)

    def _untracked(self, gone: list[tuple[RequestState, int | None]]) -> None:
        self.planner.forget([st.request_id for st, _ in gone])
        finished = self.admission.finished
        for st, num_output_tokens in gone:
            if num_output_tokens is not None:
                finished(st, num_output_tokens)

    def on_preempt(self, request_id: str, num_blocks: int = 0) -> Phase:
        phase = super().on_preempt(request_id, num_blocks)
        self.planner.preempted(request_id)
        return phase

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        """A decode-only step is timed until the next ``plan``: a sample of the output budget's
        fit (standing aside, no plan applies the budget: nothing is timed)."""
        if not self.stands_aside:
            self.planner.scheduled(num_rows, num_tokens)

    def on_idle(self) -> None:
        """The time until the next step is no step's; the last batch sizes read 0."""
        self.output_budget.idle()
        self.planner.idle()

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The coming step's plan over ``running`` (:mod:`meridian.core.planner`), given the
        engine's free KV blocks. Standing aside: the engine's."""
        if self.stands_aside:
            return super().plan(running, step, num_free_blocks)
        return self.planner.plan(running, step, num_free_blocks)

    def waiting_order(self, waiting: Sequence[R]) -> list[R] | None:
        """The head of the waiting queue in the order it should start (``None``: the engine's;
        :meth:`Admission.waiting_order <meridian.core.admission.Admission.waiting_order>`)."""
        if self.stands_aside:
            return None
        return self.admission.waiting_order(waiting, self.clock())

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """How many of ``waiting`` may start this step (``None``: no limit from Meridian;
        :meth:`Admission.admissions <meridian.core.admission.Admission.admissions>`)."""
        if self.stands_aside:
            return None
        return self.admission.admissions(running, waiting, num_blocks)

    def check_integrity(self) -> None:
        """Also: the dual queue, and every queued request tracked."""
        super().check_integrity()
        queues = self.planner.queues
        queues.check_integrity()
        stray = [rid for rid in queues.ids() if rid not in self.tracker.states]
        if stray:
            raise AssertionError(f"queued but not tracked: {stray}")
