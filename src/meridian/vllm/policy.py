"""The engine-side scheduling policy: phase tracking and the order of vLLM's running list.

Pure Python over duck-typed requests (vLLM's ``Request`` has every attribute used here:
``request_id``, ``prompt_token_ids``, ``output_token_ids``, ``sampling_params``,
``num_computed_tokens``, ``num_tokens``, ``next_decode_eligible_step``), so that it is unit-
and property-tested without vLLM. :class:`~meridian.vllm.scheduler.MeridianScheduler` calls it
from vLLM's hooks and adds the fail-open wrapper.

How one list serves two policies. vLLM serves ``running`` from the front and, under FCFS,
preempts from the back (``running[-1]``). :meth:`RunningOrder.order` therefore builds the list
as the core's victim ranking reversed:

1. the dual queue (:class:`~meridian.core.dual_queue.DualQueueScheduler`, kept in step with
   ``running``) plans the step: answer streams and prefills first, thinking requests up to the
   think limit; think requests beyond it are deferred one step (``next_decode_eligible_step``);
2. :func:`~meridian.core.preemption.select_preemption_victims` picks the victims of the step,
   at most ``scheduler.preempt_max_fraction`` of the running set, fed with equal recency by
   falling computed tokens, so within a tier the request with the least KV to recompute is the
   earlier victim (ties: the later-planned one);
3. ``order = [the others, in plan order] + reversed(victims)``: the first-choice victim is last,
   where vLLM takes it, the second next to last, and so on. Should vLLM need more victims than
   the core picked, it takes the end of the plan order: thinking requests before answers.
   Answer streams are served first and preempted last.

Then :meth:`RunningOrder.hold_answers` covers the case the ranking cannot: when no think-side
request holds KV, vLLM could only make room for an answer stream by preempting another one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meridian.config import SchedulerConfig
from meridian.core.dual_queue import DualQueueScheduler
from meridian.core.preemption import RunningRequest, select_preemption_victims
from meridian.core.router import PhaseRouter, ReasoningModel, RequestPhaseState
from meridian.core.types import ExitThink, ForceBudget, ForceReason, Phase, PhaseEvent
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import Tracer
from meridian.vllm.runtime import parse_request_budget

__all__ = ["READMIT_GUARD_STEPS", "RunningOrder", "SchedulerStats"]

# A request re-admitted after a preemption re-enters ``running`` inside schedule() of step s,
# after that step's preemption loop; the guard protects it through step s + 1, so the
# recompute it just paid for is not thrown away at once (ADR-0008's re-admission guard).
READMIT_GUARD_STEPS = 2
_ALL_BLOCKS = sys.maxsize


@dataclass(slots=True)
class SchedulerStats:
    """What the scheduler measured so far (read by tests, benchmarks and the stat logger).

    ``num_scheduled_tokens`` is the engine's work: every token computed, recomputation after
    preemptions included. Meridian's own time: ``schedule_overhead_s`` before each
    ``schedule()`` (ordering, gauges), ``update_overhead_s`` in token accounting and request
    tracking; vLLM's: ``stock_schedule_s`` in ``schedule()``, ``stock_update_s`` in
    ``update_from_output()`` (Meridian's part taken out).
    ``max_answer_gap_steps`` is the largest number of scheduler steps between two consecutive
    answer tokens of one request (1 = a token every step): a preempted or held answer stream
    shows here as a stall. ``num_forced_inferred`` counts think phases that ended exactly at
    their hard cap (plus the transition phrase, if configured): hard-cap forces as seen from
    the token stream (entropy-driven forces are known only to the worker's logits processor).
    The cap is the request's ``meridian_max_think_tokens``, else ``scheduler.max_think_tokens``.
    """

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    policy_errors: int = 0
    schedule_overhead_s: float = 0.0
    stock_schedule_s: float = 0.0
    update_overhead_s: float = 0.0
    stock_update_s: float = 0.0
    num_reordered_steps: int = 0
    num_deferred: int = 0
    num_answer_holds: int = 0
    num_preemptions: dict[Phase, int] = field(default_factory=lambda: dict.fromkeys(Phase, 0))
    max_answer_gap_steps: int = 0
    num_answer_gaps_over_2: int = 0
    num_think_exits: int = 0
    think_tokens_total: int = 0
    num_forced_inferred: dict[ForceReason, int] = field(
        default_factory=lambda: dict.fromkeys(ForceReason, 0)
    )

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy (enum keys become their lower-case names or values)."""
        return {
            "num_steps": self.num_steps,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "policy_errors": self.policy_errors,
            "schedule_overhead_s": self.schedule_overhead_s,
            "stock_schedule_s": self.stock_schedule_s,
            "update_overhead_s": self.update_overhead_s,
            "stock_update_s": self.stock_update_s,
            "num_reordered_steps": self.num_reordered_steps,
            "num_deferred": self.num_deferred,
            "num_answer_holds": self.num_answer_holds,
            "preemptions": {p.name.lower(): n for p, n in self.num_preemptions.items() if n},
            "max_answer_gap_steps": self.max_answer_gap_steps,
            "num_answer_gaps_over_2": self.num_answer_gaps_over_2,
            "num_think_exits": self.num_think_exits,
            "think_tokens_total": self.think_tokens_total,
            "forced_inferred": {r.value: n for r, n in self.num_forced_inferred.items()},
        }


@dataclass(slots=True)
class _Tracked:
    """Engine-side facts about one live request, beyond what the router keeps."""

    state: RequestPhaseState  # the router's live state (read-only here)
    cap: int | None  # the request's meridian_max_think_tokens, if any
    readmitted_step: int | None = None
    preempted: bool = False


class RunningOrder:
    """Tracks every request's phase and orders vLLM's running list (module docstring).

    Contract: ``order`` returns a permutation of its input (the set is never changed) and
    only ever raises ``next_decode_eligible_step``. Every tracked request is untracked by
    ``untrack``: ``num_tracked`` returns to 0 when the engine is idle.

    ``step`` arguments are vLLM's ``current_step`` as the hook sees it: before ``schedule()``
    increments it for ``order``, after for ``observe``.
    """

    def __init__(
        self,
        model: ReasoningModel,
        config: SchedulerConfig,
        *,
        block_size: int,
        capacity: int,
        output_budget: int | None = None,
        metrics: MeridianMetrics | None = None,
        transition_len: int = 0,
    ) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1; got {block_size}, {capacity}")
        self.model = model
        self.block_size = block_size
        self.capacity = capacity
        self.output_budget = output_budget
        self.router = PhaseRouter()
        self.queues = DualQueueScheduler(config)
        self.preempt_max_fraction = float(config.preempt_max_fraction)
        self.default_max_think_tokens = int(config.max_think_tokens)
        self.metrics = metrics
        # A forced think phase ends transition_len think tokens after its cap (the phrase).
        self.transition_len = transition_len
        # OTLP spans and phase events ([telemetry] otlp_enabled); the no-op tracer costs nothing.
        self.tracer: Tracer = Tracer()
        self.stats = SchedulerStats()
        self._tracked: dict[str, _Tracked] = {}
        # The step of each answer stream's latest answer token (answer gaps).
        self._answered: dict[str, int] = {}
        # The fast path: while no phase changed, nobody was preempted, no re-admission guard
        # expired, nobody joined `running` and the last plan deferred nobody, the order set
        # last time still holds (vLLM only removes from and appends to `running`). A plan that
        # deferred requests is made again every step: their deferral counts (the starvation
        # guard) and one-step skips advance only in a new plan.
        self._dirty = True
        self._deferring = False
        # Bumped whenever a gauge the scheduler publishes may change (tracked count, queue
        # depths, batch sizes): tracking, phase changes, preemptions, new plans.
        self.revision = 0
        self._last_ids: frozenset[str] = frozenset()
        self._guard_expiries: list[int] = []
        # Preemption candidates by request id, rebuilt when marked stale (phase change,
        # (re-)admission) or while they hold no KV yet.
        self._candidate_cache: dict[str, RunningRequest] = {}
        self._stale: set[str] = set()
        # Ids in the dual queue: a C-level set beside it for the per-step membership checks.
        self._queued: set[str] = set()

    # -- tracking -------------------------------------------------------------------------

    @property
    def num_tracked(self) -> int:
        """Requests tracked (added and not yet freed)."""
        return self.router.tracked_requests

    def track(self, request: Any) -> None:
        """Start tracking a new request: initial phase from its prompt's tail."""
        rid = request.request_id
        start_events = self.router.start(rid, self.model, request.prompt_token_ids or ())
        tracer = self.tracer
        if tracer.enabled:
            tracer.request_started(rid)
            for event in start_events:
                tracer.phase_event(rid, event)
        params = request.sampling_params
        try:
            budget = parse_request_budget(getattr(params, "extra_args", None))
        except ValueError:
            # The logits processor rejects such requests at admission; here the knob only
            # feeds the inferred-force counter, so a bad value is simply not used.
            budget = None
        if budget is None:
            cap: int | None = self.default_max_think_tokens
        elif budget.forcing:
            cap = budget.max_think_tokens or self.default_max_think_tokens
        else:
            cap = None
        self._tracked[rid] = _Tracked(self.router.state(rid), cap)
        self.revision += 1
        if request.output_token_ids:
            self.router.observe(rid, list(request.output_token_ids))

    def untrack(self, request_id: str) -> None:
        """Forget a finished or aborted request. Unknown ids are ignored."""
        self.revision += 1
        if self.router.finish(request_id) is not None and self.tracer.enabled:
            self.tracer.request_finished(request_id)
        self.queues.remove(request_id)
        self._queued.discard(request_id)
        self._tracked.pop(request_id, None)
        self._answered.pop(request_id, None)
        self._candidate_cache.pop(request_id, None)
        self._stale.discard(request_id)

    def observe(self, request: Any, new_token_ids: Sequence[int], step: int) -> None:
        """Account the request's new tokens generated in ``step`` (one-request ``observe_many``)."""
        self.observe_many(((request, new_token_ids),), step)

    def observe_many(self, batch: Iterable[tuple[Any, Sequence[int]]], step: int) -> None:
        """Account every ``(request, new token ids)`` of one engine step, generated in ``step``.

        The per-step hot path: vLLM's scheduler collects a step's deltas and hands them over
        once. An answer stream that got its previous token in the step before costs one look-up
        (the common case); thinking requests go through the router in one ``observe_many``
        call; only deltas that end a think phase, first tokens (PREFILL) and answer streams
        back from a stall take the per-request path. A request not tracked does not stop the
        others: the batch is applied, then ``KeyError`` names it.

        Answer streams' tokens are not fed to the router: a request's phase never changes once
        it answers, and the scheduler needs only their steps (answer gaps).
        """
        tracked_map = self._tracked
        prev = step - 1
        rest: list[tuple[Any, Sequence[int], _Tracked | None]] = []
        hits = 0
        answered = self._answered
        for request, toks in batch:
            rid = request.request_id
            if answered.get(rid) == prev:
                answered[rid] = step
                hits += 1
            else:
                rest.append((request, toks, tracked_map.get(rid)))
        stats = self.stats
        if hits and not stats.max_answer_gap_steps:
            stats.max_answer_gap_steps = 1
        if rest:
            self._observe_rest(rest, step)

    def _observe_rest(
        self, rest: list[tuple[Any, Sequence[int], _Tracked | None]], step: int
    ) -> None:
        """``observe_many`` beyond its common case."""
        think = Phase.THINK
        rids: list[str] = []
        deltas: list[Sequence[int]] = []
        others: list[tuple[str, Sequence[int]]] = []
        unknown: list[str] = []
        stats = self.stats
        answered = self._answered
        for request, toks, tracked in rest:
            rid = request.request_id
            if tracked is None:
                unknown.append(rid)
                continue
            last = answered.get(rid)
            if last is not None:
                # An answer stream after a gap of more than one step (a stall).
                gap = step - last
                stats.max_answer_gap_steps = max(stats.max_answer_gap_steps, gap)
                stats.num_answer_gaps_over_2 += gap > 2
                answered[rid] = step
            elif tracked.state.phase is think:
                rids.append(rid)
                deltas.append(toks)
            elif tracked.state.phase is Phase.OUTPUT:
                # Its think phase ended with the previous delta; these are its first answers.
                answered[rid] = step
            else:
                others.append((rid, toks))
        if rids:
            for rid, events in zip(rids, self.router.observe_many(rids, deltas), strict=True):
                if events:
                    self._after_events(rid, events, step)
        for rid, toks in others:
            self._after_events(rid, self.router.observe(rid, toks), step)
        if unknown:
            raise KeyError(f"tokens for requests Meridian does not track: {unknown}")

    def _after_events(self, rid: str, events: Sequence[PhaseEvent], step: int) -> None:
        """Phase events of a non-answering request's delta: stats, tracer, rank, first answer.

        Called for every PREFILL request's delta (PREFILL -> OUTPUT emits no event but
        changes the request's rank) and for thinking requests whose delta had events.
        """
        for event in events:
            if isinstance(event, ExitThink):
                self._on_think_exit(rid, event)
            if self.tracer.enabled:
                self.tracer.phase_event(rid, event)
        tracked = self._tracked[rid]
        st = tracked.state
        if st.phase is not Phase.PREFILL:
            # The phase changed (or it left PREFILL on this delta's first token).
            self._dirty = True
            self.revision += 1
            self._stale.add(rid)
            if rid in self._queued:
                self.queues.set_phase(rid, st.phase)
        if st.num_output_tokens:
            # Its first answer tokens (a delta can end the think phase and start the answer).
            self._answered[rid] = step

    def _on_think_exit(self, rid: str, event: ExitThink) -> None:
        stats = self.stats
        stats.num_think_exits += 1
        stats.think_tokens_total += event.think_tokens
        cap = self._tracked[rid].cap
        forced = cap is not None and event.think_tokens == cap + self.transition_len
        if forced:
            stats.num_forced_inferred[ForceReason.HARD_CAP] += 1
            if self.tracer.enabled:
                self.tracer.phase_event(rid, ForceBudget(rid, ForceReason.HARD_CAP))
        if self.metrics is not None:
            self.metrics.observe_think_tokens(event.think_tokens)
            if forced:
                self.metrics.count_force(ForceReason.HARD_CAP)

    def on_preempt(self, request_id: str, num_blocks: int = 0) -> Phase:
        """Count a preemption by the request's phase; it leaves the dual queue. Returns it.

        ``num_blocks`` (the KV blocks the preemption frees) feeds the OutputCritical-loss
        counter when the victim was answering.
        """
        phase = self.router.phase(request_id)
        self.stats.num_preemptions[phase] += 1
        if self.metrics is not None:
            self.metrics.count_preemption(phase)
            if phase is Phase.OUTPUT and num_blocks:
                self.metrics.count_output_critical_eviction(num_blocks)
        self._tracked[request_id].preempted = True
        self.revision += 1
        self.queues.remove(request_id)
        self._queued.discard(request_id)
        self._dirty = True
        return phase

    def phase(self, request_id: str) -> Phase:
        """The tracked phase of a live request."""
        return self.router.phase(request_id)

    # -- ordering -------------------------------------------------------------------------

    def order(self, running: Sequence[Any], step: int, num_free_blocks: int) -> Sequence[Any]:
        """The order to serve ``running`` in the coming ``schedule()`` (module docstring).

        ``step`` is vLLM's ``current_step`` before ``schedule()`` increments it;
        ``num_free_blocks`` is the KV block pool's free count. Steps where nothing that
        matters changed keep the previous order and return ``running`` itself
        (``stats.num_reordered_steps`` counts the others).
        """
        now = step + 1
        expired = bool(self._guard_expiries) and min(self._guard_expiries) <= now
        if (
            self._dirty
            or expired
            or self._deferring
            # vLLM appends every request it admits to `running` (and only removes otherwise),
            # so a newcomer, if any, is last: checking the tail avoids touching every request.
            or len(running) > len(self._last_ids)
            or (running and running[-1].request_id not in self._last_ids)
        ):
            order: Sequence[Any] = self._full_order(running, step)
            if expired:
                self._guard_expiries = [e for e in self._guard_expiries if e > now]
        else:
            order = running
        self.hold_answers(order, step, num_free_blocks)
        return order

    def _full_order(self, running: Sequence[Any], step: int) -> list[Any]:
        now = step + 1
        queues, queued = self.queues, self._queued
        by_id = {r.request_id: r for r in running}
        if len(queued) != len(by_id) or not queued.issuperset(by_id):
            for rid in queued - by_id.keys():
                queues.remove(rid)
                queued.discard(rid)
            # New and re-admitted requests, in vLLM's order (the order they were admitted).
            for request in running:
                if request.request_id not in queued:
                    self._admit(request, now)
        plan = queues.schedule(
            capacity=max(self.capacity, len(by_id)), output_budget=self.output_budget
        )
        for rid in plan.deferred:
            if queues.phase_of(rid) is Phase.THINK:
                _skip_one_step(by_id[rid], step)
                self.stats.num_deferred += 1
        planned = plan.served + plan.deferred if plan.deferred else plan.served
        # vLLM reclaims by recompute: within a class the cheapest victim is the request with
        # the least computed KV. The core breaks ties toward later entries, so the candidates
        # go in by falling computed tokens (stable: equal work keeps plan order).
        by_work = sorted(planned, key=lambda rid: -by_id[rid].num_computed_tokens)
        victims = select_preemption_victims(
            _ALL_BLOCKS,
            self._candidates(by_work, by_id),
            step=now,
            max_fraction=self.preempt_max_fraction,
            readmit_guard_steps=READMIT_GUARD_STEPS,
        )
        ranked = {v.request_id for v in victims}
        order = [by_id[rid] for rid in planned if rid not in ranked]
        order.extend(by_id[v.request_id] for v in reversed(victims))
        if len(order) != len(by_id):
            raise AssertionError(f"ordered {len(order)} of {len(by_id)} running requests")
        self._dirty = False
        self._deferring = bool(plan.deferred)
        self.revision += 1
        self._last_ids = frozenset(by_id)
        self.stats.num_reordered_steps += 1
        return order

    def set_output_budget(self, rows: int | None) -> None:
        """Change the output budget (rows; ``None``: the whole batch); the next step re-plans."""
        if rows != self.output_budget:
            self.output_budget = rows
            self._dirty = True

    def hold_answers(self, order: Sequence[Any], step: int, num_free_blocks: int) -> int:
        """Hold answer streams that need a KV block nobody can give this step; how many.

        When no think-side request holds KV, vLLM could make room for an answer stream only
        by preempting another one, by recompute: that one stalls until re-admitted and then
        recomputes its prompt, reasoning and answer so far. Holding the streams that need a
        fresh block for one step instead (the newest first) costs the same wait without the
        recompute, and each keeps its KV. Never all of them: if every running request would
        be held, nothing could finish and free blocks, so vLLM preempts as usual.
        NOTE: Meridian's addition on top of ADR-0008's last resort.
        """
        if num_free_blocks >= len(order):
            return 0  # even if every request needed a block, there is one for each
        router = self.router
        block_size = self.block_size
        needy: list[Any] = []
        for request in order:
            computed = request.num_computed_tokens
            if router.phase(request.request_id) is not Phase.OUTPUT:
                if computed > 0:
                    return 0  # a think-side request holds KV: vLLM preempts it, as planned
                continue
            # A decode step writes position `computed`; at a block boundary it opens a block.
            if request.num_tokens - computed == 1 and computed % block_size == 0:
                needy.append(request)
        surplus = len(needy) - num_free_blocks
        if surplus <= 0 or surplus >= len(order):
            return 0
        for request in needy[-surplus:]:
            _skip_one_step(request, step)
        self.stats.num_answer_holds += surplus
        return surplus

    def _admit(self, request: Any, now: int) -> None:
        rid = request.request_id
        tracked = self._tracked.get(rid)
        if tracked is None:
            # Added where this policy could not see it (e.g. a streaming-input session).
            self.track(request)
            tracked = self._tracked[rid]
        if tracked.preempted:
            # It re-entered `running` during the previous schedule() call.
            tracked.preempted = False
            tracked.readmitted_step = now - 1
            self._guard_expiries.append(now - 1 + READMIT_GUARD_STEPS)
        self.queues.add(rid, self.router.phase(rid))
        self._queued.add(rid)
        self._stale.add(rid)

    def _candidates(self, request_ids: list[str], by_id: dict[str, Any]) -> list[RunningRequest]:
        cache = self._candidate_cache
        for rid in self._stale:
            if rid in by_id:
                cache[rid] = self._candidate(rid, by_id[rid])
        self._stale.clear()
        out: list[RunningRequest] = []
        for rid in request_ids:
            cached = cache.get(rid)
            if cached is None or cached.num_blocks == 0:
                cached = cache[rid] = self._candidate(rid, by_id[rid])
            out.append(cached)
        return out

    def _candidate(self, rid: str, request: Any) -> RunningRequest:
        return RunningRequest(
            request_id=rid,
            phase=self.router.phase(rid),
            # Victim selection only asks whether a request holds KV (it frees nothing
            # otherwise); the exact block count does not change the ranking.
            num_blocks=1 if request.num_computed_tokens > 0 else 0,
            last_touched=0,
            readmitted_step=self._tracked[rid].readmitted_step,
            # NOTE: ADR-0008 ranks a request whose think phase just ended (no answer KV yet)
            # THINK_COMPLETE, the cheapest victim, because a fabric could offload its KV.
            # vLLM reclaims by recompute: preempting it would throw away its whole reasoning
            # right before its first answer token, so without a fabric it ranks as an answer
            # stream, like every OUTPUT request.
            think_done=False,
        )

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any.

        The router and the dual queue check themselves; every queued request is tracked,
        and the router and the tracking table hold the same requests.
        """
        self.router.check_integrity()
        self.queues.check_integrity()
        if self.router.tracked_requests != len(self._tracked):
            raise AssertionError(
                f"router tracks {self.router.tracked_requests}, table {len(self._tracked)}"
            )
        if len(self.queues) > len(self._tracked):
            raise AssertionError(f"{len(self.queues)} queued but {len(self._tracked)} tracked")
        if len(self._queued) != len(self.queues) or any(r not in self.queues for r in self._queued):
            raise AssertionError("the queued-id set differs from the dual queue")


def _skip_one_step(request: Any, step: int) -> None:
    """Make vLLM skip ``request`` in the coming ``schedule()`` call only.

    ``schedule()`` increments ``current_step`` (now ``step``) and then skips a request while
    ``current_step < next_decode_eligible_step``, so ``step + 2`` skips exactly one call.
    """
    request.next_decode_eligible_step = max(request.next_decode_eligible_step, step + 2)
