"""The Meridian scheduling policy: the one object vLLM's scheduler and the simulator drive.

Engine-neutral (no torch, no vllm, an injected clock). A driver builds it with
:meth:`TrackingPolicy.from_config` and calls, in a step's order: ``track``, ``waiting_order``,
``admissions``, ``plan``, ``on_step``, ``on_preempt``, ``observe``, ``untrack``/``untrack_many``,
``on_idle``. The work is the collaborators': :class:`~meridian.core.tracking.Tracker`,
:class:`~meridian.core.planner.Planner`, :class:`~meridian.core.admission.Admission`,
:class:`~meridian.core.output_budget.OutputBudget`.
"""

from __future__ import annotations

from collections.abc import Sequence

from meridian.core.admission import Admission
from meridian.core.interface import Plan, R
from meridian.core.output_budget import OutputBudget
from meridian.core.planner import Planner
from meridian.core.state import RequestState
from meridian.core.tracking_policy import Admit, OutputBudgetSetting, TrackingPolicy
from meridian.core.types import Phase

__all__ = ["MeridianPolicy", "TrackingPolicy"]


class MeridianPolicy(TrackingPolicy):
    """Phase tracking, step plans, victims and admission: what ships. Contract: ``plan``
    returns a permutation of its input and skips only running requests.

    >>> from meridian.config import SchedulerConfig
    >>> from meridian.core.format import ReasoningFormat
    >>> fmt = ReasoningFormat(think_start=(7,), think_end=(8,))
    >>> policy = MeridianPolicy(fmt, SchedulerConfig(), block_size=16, capacity=8)
    >>> policy.track("a", [1, 7])
    >>> policy.phase("a")
    <Phase.THINK: 1>
    """

    def _build(
        self, output_budget: OutputBudgetSetting, admission: Admit, max_steps: int | None
    ) -> None:
        config = self.config
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
            max_step_tokens=max_steps,
            step_clock=self.step_clock,
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
            step_clock=self.step_clock,
        )
        # NOTE: one phase (no boundaries), nothing to arbitrate: the engine's order, preemption
        # and admission stand; tracking and counting go on (vLLM's own scheduler tests pass).
        self.stands_aside = not self.format.has_boundaries

    def queue_gauges(self) -> tuple[int, int, int, int]:
        return self.planner.queues.gauges()

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
        """Time the step until the next ``plan`` (the output budget's fit; not standing aside)."""
        if not self.stands_aside:
            self.planner.scheduled(num_rows, num_tokens)
            self.admission.scheduled(num_rows, num_tokens)

    def on_idle(self) -> None:
        """The time until the next step is no step's."""
        super().on_idle()
        self.output_budget.idle()
        self.planner.idle()

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The coming step's plan (:mod:`meridian.core.planner`); standing aside, the engine's."""
        if self.stands_aside:
            return super().plan(running, step, num_free_blocks)
        return self.planner.plan(running, step, num_free_blocks)

    def waiting_order(self, waiting: Sequence[R]) -> list[R] | None:
        """The waiting head in start order (``None``: the engine's); :class:`Admission`'s."""
        if self.stands_aside:
            return None
        return self.admission.waiting_order(waiting, self.step_clock.now())

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """How many of ``waiting`` may start (``None``: no limit); :class:`Admission`'s."""
        if self.stands_aside:
            return None
        return self.admission.admissions(running, waiting, num_blocks)

    def check_integrity(self) -> None:
        """Also: the dual queue, and every queued request tracked."""
        super().check_integrity()
        self.planner.check_integrity()
