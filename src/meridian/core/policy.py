"""The Meridian scheduling policy: the one object that vLLM's scheduler and the simulator drive.

Engine-neutral (no torch, no vllm, no wall clock of its own: an injected clock, wall time in
vLLM and virtual time in the simulator). An engine adapter reports what happens and asks, before
each step, for a plan; the calls, in a step's order:

==========================  ===================================================================
``track``                   a request arrived (its initial phase from its prompt's tail)
``waiting_order``           the head of the waiting queue in the order it should start
``admissions``              how many of them may start (headroom admission)
``plan``                    the order of the running requests, and who sits the step out
``on_step``                 what the engine scheduled (times the output budget)
``on_preempt``              the engine preempted a request (counted by its phase)
``observe``                 the step's new tokens: phases, think exits, answer gaps
``untrack`` / ``_many``     requests finished or were aborted
``on_idle``                 the engine has nothing to run
==========================  ===================================================================

The adapters are :class:`meridian.vllm.scheduler.MeridianScheduler` (vLLM's real scheduler) and
the simulator's (:mod:`meridian.sim.policies`); whatever one measures, the other ships. The
work is done by one collaborator per job: the table of requests and their token accounting
(:class:`~meridian.core.tracking.Tracker`), the step plan (:class:`~meridian.core.planner.
Planner`: dual queue, victims, answer hold, pacing), admission (:class:`~meridian.core.
admission.Admission`) and the output budget (:class:`~meridian.core.output_budget.OutputBudget`).
:class:`TrackingPolicy` is the part every policy needs (the simulator's Pascal baseline plans on
top of it); :class:`MeridianPolicy` adds Meridian's plan and admission.

A model without reasoning (no think boundaries) has one phase, so none of Meridian's rules
applies: the policy stands aside (``MeridianPolicy.stands_aside``), keeping the engine's order,
preemption and admission, and only tracks and counts (vLLM's own scheduler tests pass unchanged
with it, docs/vllm.md).
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
from meridian.core.ordering import DualQueue
from meridian.core.output_budget import DecodeStepTime, OutputBudget
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
    """What every policy over an engine does: track requests, account their tokens, count
    preemptions by phase. Its plan is the engine's own order, and it admits whatever the engine
    admits; :class:`MeridianPolicy` plans and admits.

    Contract: every tracked request is untracked (``num_tracked`` returns to 0 when the engine is
    idle); ``step`` arguments are the engine's step counter as the call sees it: the number of
    the step about to be scheduled for ``plan``, of the step that produced the tokens for
    ``observe``.
    """

    #: Account one engine step's new tokens, ``observe(request_ids, tokens, step)``:
    #: ``tokens[i]`` are those of ``request_ids[i]``, each request once; ``tokens`` is read only
    #: when needed. It is :meth:`Tracker.observe <meridian.core.tracking.Tracker.observe>`
    #: itself, bound in ``__init__``: a method handing the call on would add a Python call to
    #: every step, on a path the forward pass leaves cold.
    observe: Callable[[list[str], Sequence[Sequence[int]], int], None]
    #: (think, answer) tokens of a tracked request that has generated ``num_output_tokens``
    #: (the engine's count), ``tokens_by_phase(request_id, num_output_tokens)``; ``None`` if it
    #: is not tracked. :meth:`Tracker.tokens_by_phase
    #: <meridian.core.tracking.Tracker.tokens_by_phase>` itself, bound as ``observe`` (an adapter
    #: calls it for every request it counts).
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
        """One signature for every policy (an adapter builds any of them the same way); the
        arguments of planning and admission go to :meth:`_build`."""
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1; got {block_size}, {capacity}")
        self.format = fmt
        self.block_size = block_size
        self.capacity = capacity
        self.clock = clock
        self.stats = PolicyStats()
        self.default_max_think_tokens = int(config.max_think_tokens)
        self.tracker = Tracker(
            fmt,
            self.stats,
            default_cap=self.default_max_think_tokens,
            transition_len=transition_len,
            listener=listener,
            clock=clock,
            history=self._history(config),
            on_phase_change=self._phase_changed,
        )
        self.observe = self.tracker.observe
        self.tokens_by_phase = self.tracker.tokens_by_phase
        self.listener = listener
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
        """The policy as a driver builds it: ``config`` (``scheduler``) and the engine's shape
        (KV block size, running-request cap, tokens per step, clock). ``output_budget``
        overrides ``config.output_budget_rows`` (vLLM's ``$MERIDIAN_OUTPUT_BUDGET_ROWS``)."""
        return cls(
            fmt,
            config,
            block_size=block_size,
            capacity=capacity,
            output_budget=(
                output_budget_setting(config.output_budget_rows)
                if output_budget == "config"
                else output_budget
            ),
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
        """Build what a subclass plans and admits with (the constructor's last step); the
        tracking part alone needs nothing more."""

    def _history(self, config: SchedulerConfig) -> int:
        """Steps of token times to keep (besides a listener's)."""
        return 0

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
        budget: RequestBudget | None = None,
        tracked_at: float | None = None,
    ) -> None:
        """Start tracking a new request: its initial phase from its prompt's tail.

        ``budget`` (the request's knobs) only tells which think length a hard-cap force ends
        at, for the inferred-force counter. ``tracked_at``: when it was added, on the policy's
        clock (its wait for admission counts from there); ``None``: now. ``output_token_ids``:
        tokens it already generated (a request tracked late).
        """
        if budget is None:
            cap: int | None = self.default_max_think_tokens
        elif budget.forcing:
            cap = budget.max_think_tokens or self.default_max_think_tokens
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
        """Forget a finished or aborted request. Unknown ids are ignored.

        ``num_output_tokens`` (what a request that *completed* generated) teaches the length
        model of headroom admission; leave it out for an aborted request. Not a call of
        :meth:`untrack_many`: an adapter whose batch call failed falls back on it request by
        request.
        """
        self.tracker.untrack_many(((request_id, num_output_tokens),), self._untracked)

    def untrack_many(self, finished: Iterable[tuple[str, int | None]]) -> None:
        """:meth:`untrack` for each ``(request id, num_output_tokens)`` of ``finished``, in one
        pass (a batch finishing together)."""
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
        """Count a preemption by the request's phase; returns it. ``num_blocks`` (the KV blocks
        the preemption frees) goes to the listener."""
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
        """The engine's own order (a policy that plans overrides this)."""
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
        """(output queue, think queue) depths and the last step's (output, think) batch sizes:
        zeros for a policy without queues."""
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

    Contract: ``plan`` returns a permutation of its input (the set is never changed) and skips
    only running requests.

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
        block_size, capacity, clock = self.block_size, self.capacity, self.clock
        pace_s = float(config.answer_pace_ms) / 1000.0
        tracker = self.tracker
        self.budget = OutputBudget(
            output_budget, float(config.output_tpot_budget_ms) / 1000.0, capacity
        )
        self.planner = Planner(
            config,
            tracker.states,
            self.stats,
            block_size=block_size,
            capacity=capacity,
            output_budget=self.budget,
            max_step_tokens=max_step_tokens,
            pacer=AnswerPacer(pace_s) if pace_s else None,
            clock=clock,
            last_answer_step=tracker.last_answer_step,
            token_time=tracker.times.at,
        )
        self.admission = Admission(
            config,
            tracker.states,
            tracker.settle,
            self.stats,
            block_size=block_size,
            mode=admission,
        )
        # A model without reasoning: every request is an answer stream, and every rule of the
        # plan and of admission arbitrates between the phases (answers before thinking, thinking
        # preempted first, an answer held rather than another preempted, room kept for growth
        # while reasoning runs long). With one phase there is nothing to arbitrate: the engine's
        # order, preemption and admission stand, as TrackingPolicy's; tracking and counting go on.
        self.stands_aside = not self.format.has_boundaries

    def _history(self, config: SchedulerConfig) -> int:
        return PACE_HISTORY_STEPS if config.answer_pace_ms else 0

    @property
    def queues(self) -> DualQueue:
        """The dual queue (its depths and last batch sizes are gauges)."""
        return self.planner.queues

    def queue_gauges(self) -> tuple[int, int, int, int]:
        queues = self.planner.queues
        served_output, served_think = queues.last_served
        return queues.num_output_queued, queues.num_think_queued, served_output, served_think

    @property
    def max_step_tokens(self) -> int | None:
        """The engine's token budget per step (``None``: unknown; every change is re-planned,
        the lazy order never keeps the engine's)."""
        return self.planner.max_step_tokens

    @max_step_tokens.setter
    def max_step_tokens(self, tokens: int | None) -> None:
        self.planner.max_step_tokens = tokens

    @property
    def step_time(self) -> DecodeStepTime | None:
        """The measured decode step time behind an ``"auto"`` output budget (``None``: fixed)."""
        return self.budget.step_time

    @property
    def output_budget(self) -> int | None:
        """The output budget in force, in rows (``None``: the whole batch)."""
        return self.budget.rows

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
        """A decode-only step (one token per row) is timed until the next ``plan``: its duration
        is what an answer stream waits between tokens, a sample of the output-budget fit
        (standing aside, no plan applies the budget: nothing is timed)."""
        if not self.stands_aside:
            self.planner.scheduled(num_rows, num_tokens)

    def on_idle(self) -> None:
        """The time until the next step is no step's time, and the last step's batch sizes are
        no longer current (they read 0)."""
        self.budget.idle()
        self.planner.idle()

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The plan of the coming step over ``running`` (:mod:`meridian.core.planner`);
        ``num_free_blocks`` is the engine's free KV block count. Standing aside: the engine's."""
        if self.stands_aside:
            return super().plan(running, step, num_free_blocks)
        return self.planner.plan(running, step, num_free_blocks)

    def waiting_order(self, waiting: Sequence[R]) -> list[R] | None:
        """The head of the waiting queue in the order it should start, or ``None`` to keep the
        engine's (:meth:`Admission.waiting_order <meridian.core.admission.Admission.
        waiting_order>`)."""
        if self.stands_aside:
            return None
        return self.admission.waiting_order(waiting, self.clock())

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """How many of ``waiting`` (from the head, in the engine's order) may start this step;
        ``None``: no limit from Meridian (:meth:`Admission.admissions <meridian.core.admission.
        Admission.admissions>`)."""
        if self.stands_aside:
            return None
        return self.admission.admissions(running, waiting, num_blocks)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any: each request's
        state, the dual queue, and every queued request tracked."""
        super().check_integrity()
        queues = self.planner.queues
        queues.check_integrity()
        stray = [rid for rid in queues.ids() if rid not in self.tracker.states]
        if stray:
            raise AssertionError(f"queued but not tracked: {stray}")
