"""Meridian's plan of each step: the order of the running requests, and who sits the step out.

How one list serves two policies. An engine serves its running list from the front and, under
KV pressure, preempts from the back (vLLM's FCFS ``running[-1]``). The plan's order is therefore
the victim ranking reversed:

1. the dual queue (:class:`~meridian.core.ordering.DualQueue`) plans the step: answer streams
   and prefills first, thinking requests up to the think limit; thinking requests beyond it are
   skipped this step (``Plan.skip``), with a starvation bound;
2. :func:`~meridian.core.victims.rank_victims` ranks the step's victims (the rule and why:
   :mod:`meridian.core.victims`), at most ``scheduler.preempt_max_fraction`` of the running set;
3. ``order = [the others, in plan order] + reversed(victims)``: the first-choice victim is last,
   where the engine takes it. Should it need more victims than were ranked, it takes the end of
   the plan order: thinking requests before answers.

Then the answer hold covers what ranking cannot (:func:`~meridian.core.victims.hold_answers`),
and answer pacing, when on, skips streams ahead of their pace (:mod:`meridian.core.pacing`).

The lazy order. Most steps change nothing that matters: planning them again would cost a pass
over every running request for the order it already has. The order set last time still holds
while no phase changed, nobody was preempted or finished, no re-admission guard expired, nobody
joined the running set, the last plan deferred nobody (engines only remove from and append to
it) and the last step computed one token for each request planned (so the computed KV victims
are ranked by grew alike): then ``plan`` returns the running list itself. (A request that
begins to answer while the order is moot, below, changes nothing: one answer stream more never
makes it matter.) A plan that deferred requests is made again every step: their deferral counts
(the starvation guard) and skips advance only in a new plan. And no order is computed at all
while none could change what the step does (``_order_is_moot``): every request will be
scheduled in full and has the KV it can need, so the engine's own order serves as well.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

from meridian.config.schema import SchedulerConfig
from meridian.core.interface import EngineRequest, Plan, PolicyStats, R
from meridian.core.memo import plain_paths
from meridian.core.ordering import DualQueue
from meridian.core.output_budget import OutputBudget
from meridian.core.pacing import AnswerPacer, StepClock
from meridian.core.state import RequestState
from meridian.core.types import OUTPUT, THINK, floor_fraction
from meridian.core.victims import VICTIM_CLASS, Candidate, hold_answers, rank_victims

__all__ = ["READMIT_GUARD_STEPS", "Planner"]

# A request re-admitted after a preemption enters the running set during step s, after that
# step's preemptions; the guard protects it through step s + 1, so the recompute it just paid for
# is not thrown away at once (ADR-0008). Both engines see the re-admission at the next plan.
READMIT_GUARD_STEPS = 2
_NO_GUARD = sys.maxsize


class Planner:
    """The plan of each step over the running requests (module docstring).

    ``states`` is the policy's table (read only here, but for the preemption marks);
    ``last_answer_step`` and ``token_time`` are the tracker's, for pacing.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        states: Mapping[str, RequestState],
        stats: PolicyStats,
        *,
        block_size: int,
        capacity: int,
        output_budget: OutputBudget,
        max_step_tokens: int | None,
        step_clock: StepClock,
        last_answer_step: Callable[[str], int | None],
        token_time: Callable[[int], float | None],
    ) -> None:
        self.states = states
        self.stats = stats
        self.block_size = block_size
        self.capacity = capacity
        self.output_budget = output_budget
        self.queues = DualQueue(config)
        self.preempt_max_fraction = float(config.preempt_max_fraction)
        # The engine's token budget per step; None: unknown, every change is re-planned.
        self.max_step_tokens = max_step_tokens
        pace_s = float(config.answer_pace_ms) / 1000.0
        self.pacer = AnswerPacer(pace_s) if pace_s else None
        self.step_clock = step_clock
        self._last_answer_step = last_answer_step
        self._token_time = token_time
        # Plain paths (meridian.core.memo): every step's order computed in full, no plan kept.
        self.plain = plain_paths()
        # NOTE: the lazy and moot orders earn their place: every order in full took Meridian to
        # 0.150-0.194 of vLLM's step in bench_vllm_overhead.py, against 0.031-0.080 (issue 43).
        # The lazy order's memory (module docstring): whether anything that matters changed since
        # the last order was set (dirty), whether that plan deferred requests, the running set it
        # was made for (its ids, and the id of the request it ended with: an id, not the request,
        # which the engine frees when it finishes), its ranked victims and the step its first
        # re-admission guard expires.
        self._dirty = True
        self._num_planned = 0  # the running requests the last plan ordered
        self._deferring = False
        self._last_ids: frozenset[str] = frozenset()
        self._last_tail: str | None = None
        self._num_ranked = 0
        self._next_guard_expiry = _NO_GUARD
        # The running list is in the engine's own order, kept because no order could change
        # what the next step does (_order_is_moot); checked again every step.
        self._moot = False
        # Running requests with more than one token to compute, by id (_order_is_moot).
        self._partial: dict[str, EngineRequest] = {}
        # The running set's size when _order_is_moot last found the order moot with no partial
        # request (-1: not so). While nothing changes, the same size gives the same answer.
        self._moot_size = -1
        # A request began to answer since the last plan, which kept the engine's order
        # (phase_changed): the batch sizes by phase are recorded anew.
        self._sizes_moved = False

    # -- what the policy tells it --------------------------------------------------------------

    def phase_changed(self, st: RequestState) -> None:
        """A tracked request's phase changed: the next step is planned anew, unless the order is
        moot and the request now answers. One answer stream more never makes a moot order
        matter (the think queue only shrinks, and tokens and blocks do not depend on phases):
        then only the batch sizes by phase move, recorded at the next plan."""
        self.queues.moved(st)
        if self._moot and st.phase is OUTPUT:
            self._sizes_moved = True
        else:
            self._dirty = True

    def scheduled(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled the planned step: ``num_rows`` rows computing ``num_tokens``
        tokens (the policy's ``on_step``). The output budget times it."""
        if num_tokens != num_rows or num_rows != self._num_planned:
            self._dirty = True  # not one token each: the ranking by computed KV may have moved
        self.output_budget.scheduled(num_rows, num_tokens)

    def preempted(self, request_id: str) -> None:
        """A running request was preempted (it leaves the running set)."""
        self.queues.remove(request_id)
        self._partial.pop(request_id, None)
        self._dirty = True

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests left for good (finished or aborted)."""
        remove, partial = self.queues.remove, self._partial
        for rid in request_ids:
            remove(rid)
            partial.pop(rid, None)
            # A smaller running set ranks fewer victims, and a ranked one may have left.
            self._dirty = True

    def idle(self) -> None:
        """The engine has nothing to run: the batch sizes read 0, and the time until the next
        step is no step's time."""
        self.queues.serve_all()

    # -- the plan -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the dual queue is broken or holds an untracked request."""
        self.queues.check_integrity()
        stray = [rid for rid in self.queues.ids() if rid not in self.states]
        if stray:
            raise AssertionError(f"queued but not tracked: {stray}")

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The plan of the coming step over ``running``; ``num_free_blocks`` is the engine's free
        KV block count. Steps where nothing that matters changed keep the previous order and
        return ``running`` itself as the order (``stats.num_reordered_steps`` counts the
        others)."""
        # The step starts (the core's one clock read a step, for every reader of its time); the
        # last step's time (StepClock.took), for the output budget's fit and the answer pacer.
        step_clock = self.step_clock
        now = step_clock.start()
        took = step_clock.took
        if self.output_budget.planned(took):
            self._dirty = True
        pacer = self.pacer
        if pacer is not None and took is not None:
            pacer.step_took(took)
        stats = self.stats
        stats.num_plans += 1
        self._num_planned = len(running)
        order: Sequence[R] = running
        skip: Sequence[R] = ()
        if len(running) >= 2 and self.plain:
            order, skip = self._full_order(running, step)
        elif len(running) >= 2:
            # Engines append every request they admit and otherwise only remove, so a newcomer,
            # if any, is last: checking the tail avoids touching every request.
            # (The tail the last order was set with is still there: nobody came.)
            tail = running[-1].request_id
            newcomer = len(running) > len(self._last_ids) or (
                tail is not self._last_tail and tail not in self._last_ids
            )
            changed = newcomer or self._dirty or self._deferring or step >= self._next_guard_expiry
            if not changed and self._moot_size == len(running) <= num_free_blocks:
                # The steady state: the same running set, none of them with more than one token
                # to compute, and a block for each; the order stays moot.
                stats.num_engine_order_steps += 1
            elif changed or self._moot:
                if self._order_is_moot(running, num_free_blocks, newcomer or not self._moot):
                    stats.num_engine_order_steps += 1
                    if changed:
                        self._keep_engine_order(running, step, newcomer)
                    self._moot_size = -1 if self._partial else len(running)
                else:
                    order, skip = self._full_order(running, step)
                    self._moot_size = -1
        if self._sizes_moved:
            self._sizes_moved = False
            if self._moot:
                self.queues.serve_all()
        held: Sequence[R] = ()
        if num_free_blocks < len(order):
            held = hold_answers(order, self.states, num_free_blocks, self.block_size)
            if held:
                stats.num_answer_holds += len(held)
                skip = [*skip, *held] if skip else held
        if pacer is not None and len(order) > 1:
            paced = pacer.paced(order, now, held, self._last_answer_step, self._token_time)
            if paced:
                stats.num_paced += len(paced)
                skip = [*skip, *paced] if skip else paced
        # NOTE: a new plan each step, none kept (a kept one saved 0.2 us a step, issue 43): the
        # planner holds nothing of the engine's running list once the plan is read.
        return Plan(order, skip, self._num_ranked)

    def _order_is_moot(self, running: Sequence[R], num_free_blocks: int, rescan: bool) -> bool:
        """Whether the coming step does the same whatever the order of ``running``.

        It does when the engine will schedule every running request in full: nobody can be
        deferred (the dual queue would serve all), their tokens fit the step's token budget, and
        the free blocks cover the most each can need (a request computing ``n`` new tokens after
        ``c`` opens at most ``ceil((c + n) / block_size) - ceil(c / block_size)`` blocks; a decode
        at most 1, counted as 1 token even where an asynchronous engine already counted it).
        Then no request is preempted or left out and the engine's own order serves as well.
        Unknown token budget (``max_step_tokens`` None): never.

        Cost: decodes stay decodes until they leave the running set, so only the requests with
        more than one token to compute (prefill chunks, recomputes) are looked at, kept in
        ``_partial``; ``rescan`` (a newcomer, or the last step was planned) rebuilds it.
        """
        budget = self.max_step_tokens
        n = len(running)
        if (
            budget is None
            or num_free_blocks < n
            or budget < n
            or not self.queues.defers_none(n, self.capacity, self.output_budget.rows)
        ):
            return False
        partial = self._partial
        if rescan:
            partial.clear()
            for request in running:
                if request.num_tokens - request.num_computed_tokens > 1:
                    partial[request.request_id] = request
        bs = self.block_size
        tokens = blocks = n  # one token and at most one block each, and for the partial ones:
        for rid, part in list(partial.items()):
            computed = part.num_computed_tokens
            new = part.num_tokens - computed
            if new <= 1:
                del partial[rid]
                continue
            tokens += new - 1
            blocks += (computed + new + bs - 1) // bs - (computed + bs - 1) // bs - 1
        return tokens <= budget and blocks <= num_free_blocks

    def _keep_engine_order(self, running: Sequence[R], step: int, newcomer: bool) -> None:
        """Keep the engine's order: the dual queue takes in newcomers and records a step that
        served everyone."""
        if newcomer or not self._moot:
            self._last_ids = frozenset(self._sync_queued(running, step))
            self._last_tail = running[-1].request_id
        self.queues.serve_all()
        self._moot = True
        self._dirty = False
        self._deferring = False
        self._next_guard_expiry = _NO_GUARD
        self._num_ranked = 0

    def _sync_queued(self, running: Sequence[R], step: int) -> dict[str, R]:
        """The dual queue holds exactly ``running``: leavers removed, newcomers queued in the
        engine's order (the order it admitted them). Returns ``running`` by id."""
        queues = self.queues
        by_id = {r.request_id: r for r in running}
        queued = queues.ids()
        if len(queues) != len(by_id) or not queued >= by_id.keys():
            for rid in [rid for rid in queued if rid not in by_id]:
                queues.remove(rid)
            self._admit([r.request_id for r in running if r.request_id not in queues], step)
        return by_id

    def _admit(self, rids: list[str], step: int) -> None:
        """Requests joined the running set (new, or back after a preemption), in this order."""
        states = self.states
        joined = [states[rid] for rid in rids]
        for st in joined:
            if st.preempted:
                # It re-entered the running set during the previous step.
                st.preempted = False
                st.readmitted_step = step - 1
        self.queues.add_many(joined)

    def _full_order(self, running: Sequence[R], step: int) -> tuple[list[R], list[R]]:
        states = self.states
        by_id = self._sync_queued(running, step)
        self._moot = False
        plan = self.queues.schedule(
            capacity=max(self.capacity, len(by_id)), output_budget=self.output_budget.rows
        )
        skip = [by_id[rid] for rid in plan.deferred if states[rid].phase is THINK]
        self.stats.num_deferred += len(skip)
        planned = plan.served + plan.deferred if plan.deferred else plan.served
        guard_expiry = _NO_GUARD
        candidates: list[Candidate] = []
        for rid in planned:
            st = states[rid]
            readmitted = st.readmitted_step
            guarded = readmitted is not None and step - readmitted < READMIT_GUARD_STEPS
            if guarded:
                assert readmitted is not None
                guard_expiry = min(guard_expiry, readmitted + READMIT_GUARD_STEPS)
            computed = by_id[rid].num_computed_tokens
            if computed > 0:  # preempting a request without KV frees nothing: never ranked
                candidates.append(Candidate(rid, VICTIM_CLASS[st.phase, guarded], computed))
        max_victims = max(1, floor_fraction(self.preempt_max_fraction, len(by_id)))
        victims = rank_victims(candidates, max_victims=max_victims)
        ranked = {v.request_id for v in victims}
        order = [by_id[rid] for rid in planned if rid not in ranked]
        order.extend(by_id[v.request_id] for v in reversed(victims))
        if len(order) != len(by_id):
            raise AssertionError(f"ordered {len(order)} of {len(by_id)} running requests")
        self._num_ranked = len(victims)
        self._next_guard_expiry = guard_expiry
        self._dirty = False
        self._deferring = bool(plan.deferred)
        self._last_ids = frozenset(by_id)
        self._last_tail = order[-1].request_id
        self.stats.num_reordered_steps += 1
        return order, skip
