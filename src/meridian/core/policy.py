"""The Meridian scheduling policy: the one object that vLLM's scheduler and the simulator drive.

Engine-neutral (no torch, no vllm, no wall clock of its own): an engine adapter reports what
happens (:meth:`MeridianPolicy.track`, :meth:`~MeridianPolicy.observe_many`,
:meth:`~MeridianPolicy.on_preempt`, :meth:`~MeridianPolicy.untrack`) and asks, before each
step, for a :class:`Plan` over its running requests (:meth:`~MeridianPolicy.plan`). The
adapters are :class:`meridian.vllm.scheduler.MeridianScheduler` (vLLM's real scheduler, wall
time) and the simulator's ``meridian`` policy (:mod:`meridian.sim.policies`, virtual time);
whatever one measures, the other ships.

How one list serves two policies. An engine serves its running list from the front and, under
KV pressure, preempts from the back (vLLM's FCFS ``running[-1]``). The plan's order is
therefore the victim ranking reversed:

1. the dual queue (:class:`~meridian.core.dual_queue.DualQueueScheduler`) plans the step: answer
   streams and prefills first, thinking requests up to the think limit; thinking requests beyond
   it are skipped this step (``Plan.skip``), with a starvation bound;
2. :func:`~meridian.core.preemption.rank_victims` ranks the step's victims, at most
   ``scheduler.preempt_max_fraction`` of the running set: thinking before answering, guarded
   re-admissions after the others, the least computed KV first within a class;
3. ``order = [the others, in plan order] + reversed(victims)``: the first-choice victim is last,
   where the engine takes it. Should it need more victims than were ranked, it takes the end of
   the plan order: thinking requests before answers.

Then the answer hold covers the case ranking cannot: when no thinking request holds KV, the
engine could make room for an answer stream only by preempting another one; the answer streams
that need a fresh block nobody can give are skipped for a step instead (see
:meth:`MeridianPolicy.plan`).

A model without reasoning (no think boundaries) has one phase, so none of this applies: the
policy stands aside (``stands_aside``), keeping the engine's order, preemption and admission,
and only tracks and counts (vLLM's own scheduler tests pass unchanged with it, docs/vllm.md).

The output budget (rows per step that keep answer streams within
``scheduler.output_tpot_budget_ms``) is a number, the whole batch, or ``"auto"``: measured from
the decode-only steps the engine runs, timed by the injected clock
(:class:`~meridian.core.stepfit.DecodeStepTime`), so vLLM measures wall time and the simulator
virtual time with the same code.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, KeysView, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from meridian.config.schema import SchedulerConfig
from meridian.core.budget import RequestBudget
from meridian.core.dual_queue import DualQueueScheduler
from meridian.core.headroom import (
    MIN_REQUESTS_IN_CACHE,
    IntArray,
    Kind,
    LengthModel,
    admissible,
    bounded_admissible,
    bounds_usable,
)
from meridian.core.preemption import VICTIM_CLASS, Candidate, rank_victims
from meridian.core.router import PhaseRouter, ReasoningModel, RequestPhaseState
from meridian.core.rows import SteadyRows
from meridian.core.stepfit import DecodeStepTime
from meridian.core.types import (
    EnterThink,
    ExitThink,
    ForceBudget,
    ForceReason,
    Phase,
    PhaseEvent,
    floor_fraction,
)

__all__ = [
    "BUDGET_REFIT_STEPS",
    "READMIT_GUARD_STEPS",
    "EngineRequest",
    "MeridianPolicy",
    "Plan",
    "PolicyListener",
    "PolicyStats",
    "RequestState",
    "UntrackedRequestsError",
    "output_budget_setting",
]

# A request re-admitted after a preemption enters the running set during step s, after that
# step's preemptions; the guard protects it through step s + 1, so the recompute it just paid for
# is not thrown away at once (ADR-0008). Both engines see the re-admission at the next plan.
READMIT_GUARD_STEPS = 2
# With "auto", decode-step samples are folded into the fit, and the budget re-derived, in
# batches of this many steps.
BUDGET_REFIT_STEPS = 16
# Answer pacing reads the token times of this many recent steps, and the mean step duration
# moves this fraction of the way to each new step's.
PACE_HISTORY_STEPS = 64
# With a listener, the answer gaps it hears are timed over at most this many steps (a stall
# longer than that is counted in steps, not timed).
GAP_HISTORY_STEPS = 4096
STEP_TIME_WEIGHT = 0.1
# Waiting requests headroom admission looks at: the head of the engine's waiting queue (both
# adapters pass this many).
ADMISSION_CANDIDATES = 64
_NO_GUARD = sys.maxsize
_NO_STREAMS: frozenset[str] = frozenset()


def output_budget_setting(rows: int | Literal["auto"]) -> int | Literal["auto"] | None:
    """``scheduler.output_budget_rows`` as the policy takes it: 0 is the whole batch (``None``).

    >>> output_budget_setting(0) is None, output_budget_setting("auto"), output_budget_setting(8)
    (True, 'auto', 8)
    """
    return "auto" if rows == "auto" else (rows or None)


class UntrackedRequestsError(KeyError):
    """Tokens for requests the policy does not track (``request_ids``); the rest of the batch
    was accounted. An adapter that knows the requests can track them and go on."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"tokens for requests Meridian does not track: {request_ids}")
        self.request_ids = request_ids


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
    """One step's decision over the running requests (not frozen: one is built every step, and
    a frozen dataclass is slow to build in the caches a forward pass leaves cold; nothing keeps
    it past the step, so it never outlives the engine's objects it lists).

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

    def request_finished(self, request_id: str) -> None: ...

    def phase_event(self, request_id: str, event: PhaseEvent) -> None: ...

    def preempted(self, phase: Phase, num_blocks: int) -> None: ...

    def think_ended(self, request_id: str, num_think_tokens: int, hard_cap: bool) -> None:
        """A request's think phase ended now (its reasoning time with it) after
        ``num_think_tokens``; ``hard_cap``: at its hard cap, as the token stream tells."""

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
    as a stall. ``num_forced_inferred`` counts think phases that ended exactly at their hard cap
    (plus the transition phrase): hard-cap forces as seen from the token stream (entropy-driven
    forces are known only to the forcing logits processor). ``num_engine_order_steps`` counts
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
    num_forced_inferred: dict[ForceReason, int] = field(
        default_factory=lambda: dict.fromkeys(ForceReason, 0)
    )

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
            "forced_inferred": {r.value: n for r, n in self.num_forced_inferred.items()},
        }


@dataclass(slots=True, eq=False)
class RequestState:
    """The policy's facts about one live request; its phase and token counts are the router's
    (``phase_state``, read-only here), never a copy."""

    request_id: str
    phase_state: RequestPhaseState
    cap: int | None  # the think-token cap a hard-cap force ends at (None: forcing off)
    num_prompt_tokens: int = 0
    readmitted_step: int | None = None
    preempted: bool = False
    tracked_at: float = 0.0  # the policy's clock when tracking began (admission_order)

    @property
    def phase(self) -> Phase:
        """The request's phase (the router's)."""
        return self.phase_state.phase


def _bounds(requests: Sequence[EngineRequest]) -> tuple[IntArray, IntArray]:
    """Each request's tokens now and its bound: its prompt plus ``max_tokens``."""
    tokens = np.fromiter((r.num_tokens for r in requests), np.int64, len(requests))
    bounds = np.fromiter(
        (r.num_prompt_tokens + r.max_tokens for r in requests), np.int64, len(requests)
    )
    return tokens, bounds


def _bounds_fit(requests: Iterable[EngineRequest], num_blocks: int, block_size: int) -> bool:
    """Whether ``requests`` fit in ``num_blocks`` together, each at its bound (prompt plus
    ``max_tokens``): then admitting them can never leave one short of KV. The plain sum, not
    :func:`~meridian.core.headroom.bounded_peak` (tighter, but a pass over every request each
    step): it stops at the first request past the cache (under load, with loose bounds, after
    a few)."""
    left = num_blocks
    for request in requests:
        left -= -(-(request.num_prompt_tokens + request.max_tokens) // block_size)
        if left < 0:
            return False
    return True


def _reasoned(st: RequestPhaseState) -> bool:
    """The request had a think phase (it thought, or at least opened and closed one)."""
    return st.num_think_tokens > 0 or st.num_marker_tokens > 0


class MeridianPolicy:
    """Phase tracking, step plans and victim ranking (module docstring).

    Contract: ``plan`` returns a permutation of its input (the set is never changed) and skips
    only running requests. Every tracked request is untracked by ``untrack``: ``num_tracked``
    returns to 0 when the engine is idle. ``step`` arguments are the engine's step counter as the
    call sees it: the number of the step about to be scheduled for ``plan``, of the step that
    produced the tokens for ``observe_many``.

    >>> from meridian.config import SchedulerConfig
    >>> model = ReasoningModel(think_start=(7,), think_end=(8,))
    >>> policy = MeridianPolicy(model, SchedulerConfig(), block_size=16, capacity=8)
    >>> policy.track("a", [1, 7])
    >>> policy.phase("a")
    <Phase.THINK: 1>
    """

    def __init__(
        self,
        model: ReasoningModel,
        config: SchedulerConfig,
        *,
        block_size: int,
        capacity: int,
        output_budget: int | Literal["auto"] | None = None,
        clock: Callable[[], float] = time.monotonic,
        transition_len: int = 0,
        listener: PolicyListener | None = None,
        admission: Literal["headroom", "vllm"] = "headroom",
        max_step_tokens: int | None = None,
    ) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1; got {block_size}, {capacity}")
        self.model = model
        # A model without reasoning: every request is an answer stream, and every rule of the
        # plan and of admission arbitrates between the phases (answers before thinking, thinking
        # preempted first, an answer held rather than another preempted, room kept for growth
        # while reasoning runs long). With one phase there is nothing to arbitrate: the engine's
        # order, preemption and admission stand, as stock vLLM's; tracking and counting go on.
        self.stands_aside = not model.has_boundaries
        self.block_size = block_size
        self.capacity = capacity
        self.clock = clock
        self.router = PhaseRouter()
        self.queues = DualQueueScheduler(config)
        self.preempt_max_fraction = float(config.preempt_max_fraction)
        self.default_max_think_tokens = int(config.max_think_tokens)
        # A forced think phase ends transition_len think tokens after its cap (the phrase).
        self.transition_len = transition_len
        self.listener = listener
        # "headroom": admit only what the projected KV growth leaves room for (core.headroom).
        self.admission = admission
        self.admission_reserve = float(config.admission_reserve)
        # Which new requests start first (waiting_order): reasoning ones (True), chat ones
        # (False), or None: the engine's order.
        self._reasoning_first: bool | None = {"reasoning-first": True, "chat-first": False}.get(
            config.admission_order
        )
        self._max_wait_s = float(config.admission_order_max_wait_s)
        # The engine's token budget per step; None: unknown, every change is re-planned.
        self.max_step_tokens = max_step_tokens
        self.lengths = LengthModel()
        # Whether admission went by the requests' bounds last time (headroom.bounds_usable).
        self._bounded = False
        self.stats = PolicyStats()
        self._states: dict[str, RequestState] = {}
        # Answer gaps. The answer streams served at step _served_step (the last observed), and
        # the step of the latest answer token of every other stream that has answered.
        self._served: set[str] = set()
        self._served_step = -1
        # _served as the engine listed it at the last observe_steady, while still exactly it
        # (None once _served changes): comparing lists costs no set look-ups in cold memory.
        self._served_ids: Sequence[str] | None = None
        self._answered: dict[str, int] = {}
        # The output budget: measured ("auto"), fixed rows, or None (the whole batch).
        self.output_budget: int | None = None if output_budget == "auto" else output_budget
        self.step_time = DecodeStepTime() if output_budget == "auto" else None
        self._output_tpot_s = float(config.output_tpot_budget_ms) / 1000.0
        self._plan_time = 0.0
        # Answer pacing: the pace (s; 0 off), the clock at each recent step's tokens, and the
        # mean step duration (plan to plan, exponentially weighted).
        self._answer_pace_s = float(config.answer_pace_ms) / 1000.0
        # Steps of token times kept: for pacing, and for the answer gaps a listener hears. A
        # ring indexed by step: the step each slot was stamped for, and its clock (two list
        # stores a step, where a dict would hash, insert, delete and now and then rebuild).
        self._time_history = max(
            PACE_HISTORY_STEPS if self._answer_pace_s else 0,
            GAP_HISTORY_STEPS if listener is not None else 0,
        )
        self._stamped_steps = [-1] * self._time_history
        self._stamped_times = [0.0] * self._time_history
        self._mean_step_s = 0.0
        self._idle = True
        # (rows, start time) of the last step if it was decode-only: a step-time sample.
        self._timed_step: tuple[int, float] | None = None
        self._step_samples: list[tuple[int, float]] = []
        # The fast path: while no phase changed, nobody was preempted, no re-admission guard
        # expired, nobody joined the running set and the last plan deferred nobody, the order set
        # last time still holds (engines only remove from and append to it). A plan that
        # deferred requests is made again every step: their deferral counts (the starvation
        # guard) and skips advance only in a new plan.
        self._dirty = True
        self._deferring = False
        self._last_ids: frozenset[str] = frozenset()
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
        # Bumped whenever a gauge an adapter publishes may change (tracked count, queue depths,
        # batch sizes): tracking, phase changes, preemptions, new plans.
        self.revision = 0
        # Ids in the dual queue: a C-level set beside it for the per-step membership checks.
        self._queued: set[str] = set()
        # observe_rows: the last step's request ids, and the batch armed for bulk counting
        # once the same requests got tokens two steps running (a one-token think_end only).
        self._last_rows: list[str] | None = None
        self._rows: SteadyRows | None = None
        self._think_end = model.single_think_end

    # -- tracking -------------------------------------------------------------------------

    @property
    def num_tracked(self) -> int:
        """Requests tracked (added and not yet untracked)."""
        return len(self._states)

    @property
    def tracked_ids(self) -> KeysView[str]:
        """The ids of the requests tracked (a live view)."""
        return self._states.keys()

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
        clock (its wait for admission counts from there); ``None``: now.
        """
        if self._reasoning_first is None:
            tracked_at = 0.0  # admission in the engine's order: the wait is never read
        elif tracked_at is None:
            tracked_at = self.clock()
        listener = self.listener
        if listener is not None and listener.phase_events:
            events = self.router.start(request_id, self.model, prompt_token_ids or ())
            st = self.router.state(request_id)
            listener.request_started(request_id)
            for event in events:
                listener.phase_event(request_id, event)
        else:
            st = self.router.start_state(request_id, self.model, prompt_token_ids or ())
        if budget is None:
            cap: int | None = self.default_max_think_tokens
        elif budget.forcing:
            cap = budget.max_think_tokens or self.default_max_think_tokens
        else:
            cap = None
        self._states[request_id] = RequestState(
            request_id,
            st,
            cap,
            len(prompt_token_ids or ()),
            tracked_at=tracked_at,
        )
        self.revision += 1
        if output_token_ids:
            self.router.observe(request_id, list(output_token_ids))

    def untrack(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """Forget a finished or aborted request. Unknown ids are ignored.

        ``num_output_tokens`` (what a request that *completed* generated) teaches the length
        model of headroom admission; leave it out for an aborted request.
        """
        self.untrack_many(((request_id, num_output_tokens),))

    def untrack_many(self, finished: Iterable[tuple[str, int | None]]) -> None:
        """:meth:`untrack` for each ``(request id, num_output_tokens)`` of ``finished``, in one
        pass (a batch finishing together)."""
        # The batch changes with them (the next step's requests would not match it anyway), and
        # no bulk step may count a state it holds for an id that is tracked again.
        self._disarm()
        states, lengths, listener = self._states, self.lengths, self.listener
        finish, remove = self.router.finish, self.queues.remove
        queued, partial, served, answered = (
            self._queued,
            self._partial,
            self._served,
            self._answered,
        )
        for request_id, num_output_tokens in finished:
            state = states.pop(request_id, None)
            if state is not None and num_output_tokens is not None:
                st = state.phase_state
                think = st.num_think_tokens if _reasoned(st) else None
                rest = max(0, num_output_tokens - st.num_think_tokens)
                lengths.finished(think, rest, state.num_prompt_tokens)
            remove(request_id)
            queued.discard(request_id)
            partial.pop(request_id, None)
            served.discard(request_id)
            answered.pop(request_id, None)
            # The listener last: if it fails, the request is untracked all the same.
            if finish(request_id) is not None and listener is not None:
                listener.request_finished(request_id)
        self.revision += 1
        self._served_ids = None

    def phase(self, request_id: str) -> Phase:
        """The tracked phase of a live request."""
        return self.router.phase(request_id)

    def state(self, request_id: str) -> RequestState:
        """The live state of a tracked request (read-only for callers)."""
        self._settle()
        return self._states[request_id]

    def _settle(self) -> None:
        """Bring the counts of thinking rows counted in bulk up to date (before reading any)."""
        if self._rows is not None:
            self._rows.settle()

    def _disarm(self) -> None:
        """Stop counting the armed batch in bulk, its counts brought up to date."""
        self._settle()
        self._rows = None

    # -- tokens -----------------------------------------------------------------------------

    def observe_many(
        self,
        batch: Mapping[str, Sequence[int]] | Iterable[tuple[str, Sequence[int]]],
        step: int,
        request_ids: Sequence[str] | None = None,
    ) -> None:
        """Account the new tokens of one engine step: ``{request id: new token ids}`` (or the
        ``(request id, new token ids)`` pairs).

        The per-step hot path. Answer streams that got their previous token in the step before
        (the common case) are found with set operations, without a Python loop over them;
        thinking requests' deltas go through the router's batched fast path in one pass; only
        deltas that may end a think phase, first tokens and answer streams back from a stall
        take the per-request path, in the batch's order. Answer tokens are not fed to the
        router: a phase never changes once a request answers. A request not tracked does not
        stop the others: the batch is applied, then :class:`UntrackedRequestsError` names it.

        ``request_ids``: every request that got tokens at ``step``, for a caller that left the
        :meth:`continuing_streams` of ``step`` out of ``batch`` (their tokens need nothing but
        their ids; leaving them out spares building and walking their entries).
        """
        self._disarm()  # the armed batch's counts first (observe_rows)
        deltas = batch if isinstance(batch, dict) else dict(batch)
        served, answered = self._served, self._answered
        self._served_ids = None
        if self._served_step != step - 1:
            hits: set[str] = set()
        elif request_ids is None:
            hits = served & deltas.keys()
        elif len(request_ids) - len(deltas) == len(served):
            hits = served  # every one of them got tokens
        else:
            hits = served.intersection(request_ids)
        if len(hits) != len(served):
            # Streams served last time and not now stall: remember their last answer step.
            last = self._served_step
            for rid in served - hits:
                answered[rid] = last
        self._served = hits
        self._served_again(step, len(hits))
        if len(deltas) != (len(hits) if request_ids is None else 0):
            # Thinking requests' deltas without a boundary are counted in one pass; the rest
            # (boundaries, first tokens, answer streams back from a stall) one by one.
            rest = self.router.observe_thinking(deltas, hits if request_ids is None else ())
            if rest:
                self._observe_rest(rest, deltas, step)

    def observe_rows(
        self, request_ids: list[str], tokens: Sequence[Sequence[int]], step: int
    ) -> None:
        """:meth:`observe_many` for a caller that holds a step's tokens as two aligned lists:
        ``tokens[i]`` are the new tokens of ``request_ids[i]`` (vLLM's adapter).

        While the same requests get one token each, step after step, the thinking ones are
        counted in bulk (:mod:`meridian.core.rows`): such a step costs the requests that need
        the per-request path (a think phase ending, a first answer) and no pass over the rest.
        The accounting is :meth:`observe_many`'s.
        """
        rows = self._rows
        if rows is not None:
            if self._served_step == step - 1 and request_ids == rows.ids:
                flat = rows.single_tokens(tokens)
                if flat is not None:
                    self._observe_bulk(rows, tokens, flat, step)
                    return
            self._disarm()
        served = self.continuing_streams(step)
        self.observe_many(
            {rid: t for rid, t in zip(request_ids, tokens, strict=True) if rid not in served},
            step,
            request_ids,
        )
        if self._think_end is not None and request_ids == self._last_rows:
            self._arm(request_ids)
        self._last_rows = request_ids

    def _arm(self, request_ids: list[str]) -> None:
        """Count the rows of ``request_ids`` in bulk from the next step on (they got tokens
        in the last two steps)."""
        states, served, think = self._states, self._served, Phase.THINK
        thinking: list[RequestPhaseState | None] = []
        for rid in request_ids:
            state = states.get(rid)
            st = None if state is None else state.phase_state
            thinking.append(
                st if st is not None and st.phase is think and st.num_generated_tokens else None
            )
        self._rows = SteadyRows.arm(request_ids, thinking, [rid in served for rid in request_ids])

    def _observe_bulk(
        self, rows: SteadyRows, tokens: Sequence[Sequence[int]], flat: list[int], step: int
    ) -> None:
        """A step of the armed batch, one token each: the answer streams were served again,
        the lazy thinking rows got one more token, and the special rows and those whose token
        ends their think phase take the per-request path."""
        self._served_again(step, len(self._served))
        think_end = self._think_end
        ending = rows.ending(flat, think_end) if think_end is not None and think_end in flat else []
        if not rows.special and not ending:
            rows.step_done()
            return
        ids, states, answered = rows.ids, self._states, self._answered
        self._served_ids = None
        for i in ending:
            rows.settle_row(i)  # its tokens before this one
        firsts = [
            state
            for state in map(states.get, [ids[i] for i in rows.special])
            if state is not None
            and state.phase_state.phase is Phase.OUTPUT
            and state.request_id not in answered
        ]
        try:
            if len(firsts) == len(rows.special):
                # The common cases directly, in _observe_rest's order: first answer tokens,
                # then the think phases these tokens end.
                for state in firsts:
                    self._first_answer(state.request_id, state, step)
                for i in ending:
                    st = rows.states[i]
                    assert st is not None
                    self._after_events(ids[i], self.router.observe_state(st, tokens[i]), step)
            else:  # (a stall's end, a prompt still deciding its phase, an unknown id)
                picked = sorted([*rows.special, *ending])
                self._observe_rest(
                    [ids[i] for i in picked], {ids[i]: tokens[i] for i in picked}, step
                )
        finally:
            served = self._served
            special: list[int] = []
            for i in [*rows.special, *ending]:
                row = states.get(ids[i])
                st = None if row is None else row.phase_state
                if rows.reclassify(i, st, ids[i] in served):
                    special.append(i)
            special.sort()
        rows.special = special
        rows.step_done()

    def continuing_streams(self, step: int) -> AbstractSet[str]:
        """The answer streams whose tokens at ``step`` continue without a gap (those served at
        ``step - 1``): what a caller of :meth:`observe_many` with ``request_ids`` leaves out of
        its batch. Read-only; valid until the next call that observes tokens."""
        return self._served if self._served_step == step - 1 else _NO_STREAMS

    def observe_steady(self, request_ids: Sequence[str], step: int) -> bool:
        """The common step, checked and accounted without a token batch: when
        ``request_ids`` (the requests that got tokens at ``step``, each once) are exactly the
        answer streams served in the step before, account their tokens as :meth:`observe_many`
        would and return True; otherwise change nothing and return False (the caller then
        passes the step's tokens to :meth:`observe_many`)."""
        served = self._served
        if self._served_step != step - 1:
            return False
        if request_ids != self._served_ids:  # (the same list: a sweep of pointer compares)
            if len(request_ids) != len(served) or not served.issuperset(request_ids):
                return False
            self._served_ids = request_ids
        self._served_again(step, len(served))
        return True

    def _served_again(self, step: int, num_streams: int) -> None:
        """Stamp ``step``'s time and count ``num_streams`` answer streams served in it and in
        the step before (a gap of one step, the step's duration)."""
        history = self._time_history
        if history:
            now = self.clock()
            i = step % history
            self._stamped_steps[i] = step
            self._stamped_times[i] = now
        self._served_step = step
        if num_streams:
            if not self.stats.max_answer_gap_steps:
                self.stats.max_answer_gap_steps = 1
            if self.listener is not None and history:  # (a listener keeps a history)
                i = (step - 1) % history
                if self._stamped_steps[i] == step - 1:
                    # Every stream served in both steps waited the same step time.
                    self.listener.answer_gaps(now - self._stamped_times[i], num_streams)

    def _token_time(self, step: int) -> float | None:
        """The clock when ``step``'s tokens were observed, while kept (``None``: not kept)."""
        history = self._time_history
        if history:
            i = step % history
            if self._stamped_steps[i] == step:
                return self._stamped_times[i]
        return None

    def _observe_rest(
        self, rest: list[str], deltas: Mapping[str, Sequence[int]], step: int
    ) -> None:
        """``observe_many`` beyond its common case: the ids in ``rest``, with their new tokens in
        ``deltas``."""
        think, output = Phase.THINK, Phase.OUTPUT
        rids: list[str] = []
        thinking: list[RequestPhaseState] = []
        thinking_deltas: list[Sequence[int]] = []
        others: list[str] = []
        unknown: list[str] = []
        stats, answered, states = self.stats, self._answered, self._states
        served, listener = self._served, self.listener
        for rid in rest:
            state = states.get(rid)
            if state is None:
                unknown.append(rid)
                continue
            st = state.phase_state
            last = answered.pop(rid, None)
            if last is not None:
                # An answer stream after a gap of more than one step (a stall).
                gap = step - last
                stats.max_answer_gap_steps = max(stats.max_answer_gap_steps, gap)
                stats.num_answer_gaps_over_2 += gap > 2
                served.add(rid)
                if listener is not None:
                    then, now = self._token_time(last), self._token_time(step)
                    if then is not None and now is not None:
                        listener.answer_gaps(now - then, 1)
            elif st.phase is think:
                rids.append(rid)
                thinking.append(st)
                thinking_deltas.append(deltas[rid])
                if listener is not None and not st.num_generated_tokens:
                    listener.reasoning_started(rid)  # its first tokens, all reasoning
            elif st.phase is output:
                # Its think phase ended with the previous delta; these are its first answers.
                self._first_answer(rid, state, step)
            else:
                others.append(rid)
        if rids:
            for i, events in enumerate(self.router.observe_states(thinking, thinking_deltas)):
                if events:
                    self._after_events(rids[i], events, step)
        for rid in others:
            self._after_events(rid, self.router.observe(rid, deltas[rid]), step)
        if unknown:
            raise UntrackedRequestsError(unknown)

    def _after_events(self, rid: str, events: Sequence[PhaseEvent], step: int) -> None:
        """Phase events of a non-answering request's delta: stats, listener, rank, first answer.

        Called for every PREFILL request's delta (PREFILL -> OUTPUT emits no event but changes
        the request's rank) and for thinking requests whose delta had events.
        """
        listener, state = self.listener, self._states[rid]
        for event in events:
            if isinstance(event, ExitThink):
                self._on_think_exit(rid, state, event)
            elif isinstance(event, EnterThink) and listener is not None:
                listener.reasoning_started(rid)  # a generated think_start
            if listener is not None and listener.phase_events:
                listener.phase_event(rid, event)
        phase = state.phase_state.phase
        if phase is not Phase.PREFILL:
            # The phase changed (or it left PREFILL on this delta's first token).
            self._dirty = True
            self.revision += 1
            if rid in self._queued:
                self.queues.set_phase(rid, phase)
        if state.phase_state.num_output_tokens and not self._has_answered(rid):
            # Its first answer tokens (a delta can end the think phase and start the answer).
            self._first_answer(rid, state, step)

    def _has_answered(self, rid: str) -> bool:
        return rid in self._served or rid in self._answered

    def _last_answer_step(self, rid: str) -> int | None:
        """The step of the answer stream's latest answer token (``None``: none yet)."""
        return self._served_step if rid in self._served else self._answered.get(rid)

    def _first_answer(self, rid: str, state: RequestState, step: int) -> None:
        self._served.add(rid)  # called while observing `step`: _served holds that step's streams
        if self.listener is not None and _reasoned(state.phase_state):
            self.listener.first_answer(rid)

    def _on_think_exit(self, rid: str, state: RequestState, event: ExitThink) -> None:
        stats = self.stats
        stats.num_think_exits += 1
        stats.think_tokens_total += event.think_tokens
        cap = state.cap
        forced = cap is not None and event.think_tokens == cap + self.transition_len
        if forced:
            stats.num_forced_inferred[ForceReason.HARD_CAP] += 1
        listener = self.listener
        if listener is not None:
            if forced and listener.phase_events:
                listener.phase_event(rid, ForceBudget(rid, ForceReason.HARD_CAP))
            listener.think_ended(rid, event.think_tokens, forced)

    def on_preempt(self, request_id: str, num_blocks: int = 0) -> Phase:
        """Count a preemption by the request's phase (it leaves the dual queue); returns it.

        ``num_blocks`` (the KV blocks the preemption frees) goes to the listener.
        """
        state = self._states[request_id]
        phase = state.phase
        self.stats.num_preemptions[phase] += 1
        if self.listener is not None:
            self.listener.preempted(phase, num_blocks)
        state.preempted = True
        self.revision += 1
        self.queues.remove(request_id)
        self._queued.discard(request_id)
        self._partial.pop(request_id, None)
        self._dirty = True
        return phase

    # -- step time --------------------------------------------------------------------------

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled the planned step: ``num_rows`` rows computing ``num_tokens``.

        A decode-only step (one token per row) is timed until the next ``plan``: its duration is
        what an answer stream waits between tokens, a sample of the output-budget fit.
        """
        if self.step_time is not None:
            decode_only = num_rows > 0 and num_tokens == num_rows
            self._timed_step = (num_rows, self._plan_time) if decode_only else None

    def on_idle(self) -> None:
        """The engine has nothing to run: the time until the next step is no step's time, and
        the last step's batch sizes are no longer current (they read 0)."""
        self._timed_step = None
        self._idle = True
        self.queues.serve_all()
        self.revision += 1

    def _refit_output_budget(self) -> None:
        """Fold the collected samples into the fit and derive the output budget."""
        samples, self._step_samples = self._step_samples, []
        step_time = self.step_time
        if step_time is None:
            return
        for rows, seconds in samples:
            if seconds > 0.0:
                step_time.observe(rows, seconds)
        self.set_output_budget(step_time.rows_within(self._output_tpot_s, self.capacity))

    def set_output_budget(self, rows: int | None) -> None:
        """Change the output budget (rows; ``None``: the whole batch); the next step re-plans."""
        if rows != self.output_budget:
            self.output_budget = rows
            self._dirty = True

    # -- the plan -----------------------------------------------------------------------------

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        """The plan of the coming step over ``running`` (module docstring).

        ``num_free_blocks`` is the engine's free KV block count. Steps where nothing that matters
        changed keep the previous order and return ``running`` itself as the order
        (``stats.num_reordered_steps`` counts the others).
        """
        if self.stands_aside:
            return Plan(running, (), 0)
        now_time = self.clock()
        timed = self._timed_step
        if timed is not None:
            # The last step's time, a sample of the output-budget fit. Kept and folded in
            # batches: one fold of many samples runs hot, one a step would run in the cold
            # caches the engine's forward pass leaves.
            self._timed_step = None
            samples = self._step_samples
            samples.append((timed[0], now_time - timed[1]))
            if len(samples) >= BUDGET_REFIT_STEPS:
                self._refit_output_budget()
        if self._answer_pace_s:
            if not self._idle:
                dt = now_time - self._plan_time
                self._mean_step_s += STEP_TIME_WEIGHT * (dt - self._mean_step_s)
            self._idle = False
        self._plan_time = now_time
        self.stats.num_plans += 1
        order: Sequence[R] = running
        skip: Sequence[R] = ()
        if len(running) >= 2:
            # Engines append every request they admit and otherwise only remove, so a
            # newcomer, if any, is last: checking the tail avoids touching every request.
            newcomer = (
                len(running) > len(self._last_ids) or running[-1].request_id not in self._last_ids
            )
            changed = newcomer or self._dirty or self._deferring or step >= self._next_guard_expiry
            if not changed and self._moot_size == len(running) <= num_free_blocks:
                # The steady state: the same running set, none of them with more than one token
                # to compute, and a block for each; the order stays moot (_order_is_moot).
                self.stats.num_engine_order_steps += 1
            elif changed or self._moot:
                if self._order_is_moot(running, num_free_blocks, newcomer or not self._moot):
                    self.stats.num_engine_order_steps += 1
                    if changed:
                        self._keep_engine_order(running, step, newcomer)
                    self._moot_size = -1 if self._partial else len(running)
                else:
                    order, skip = self._full_order(running, step)
                    self._moot_size = -1
        held: Sequence[R] = ()
        if num_free_blocks < len(order):
            held = self._hold_answers(order, num_free_blocks)
            if held:
                skip = [*skip, *held] if skip else held
        if self._answer_pace_s and len(order) > 1:
            paced = self._pace_answers(order, now_time, held)
            if paced:
                skip = [*skip, *paced] if skip else paced
        return Plan(order, skip, self._num_ranked)

    def _pace_answers(self, order: Sequence[R], now: float, held: Sequence[R]) -> list[R]:
        """Answer streams that can skip this step and still get their next token within the
        pace of their last one (it would come at the end of the next step: now + 2 steps)."""
        deadline = now + 2.0 * self._mean_step_s - self._answer_pace_s
        last_answer, token_time = self._last_answer_step, self._token_time
        paced: list[R] = []
        for request in order:
            last = last_answer(request.request_id)
            if last is not None:
                t = token_time(last)
                if (
                    t is not None
                    and t >= deadline
                    and request.num_tokens - request.num_computed_tokens == 1
                ):
                    paced.append(request)
        if not paced or len(paced) + len(held) >= len(order):
            return []
        if held:
            held_ids = {id(r) for r in held}
            paced = [r for r in paced if id(r) not in held_ids]
        self.stats.num_paced += len(paced)
        return paced

    def _order_is_moot(self, running: Sequence[R], num_free_blocks: int, rescan: bool) -> bool:
        """Whether the coming step does the same whatever the order of ``running``.

        It does when the engine will schedule every running request in full: nobody can be
        deferred (the dual queue would serve all), their tokens fit the step's token budget,
        and the free blocks cover the most each can need (a request computing ``n`` new tokens
        after ``c`` opens at most ``ceil((c + n) / block_size) - ceil(c / block_size)`` blocks;
        a decode at most 1, counted as 1 token even where an asynchronous engine already counted
        it). Then no request is preempted or left out and the engine's own order serves as well:
        planning it would cost a re-plan per phase change for nothing (the lazy order,
        ADR-0013). Unknown token budget (``max_step_tokens`` None): never.

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
            or not self.queues.defers_none(n, self.capacity, self.output_budget)
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
            self._sync_queued(running, step)
            self._last_ids = frozenset(r.request_id for r in running)
        self.queues.serve_all()
        self._moot = True
        self._dirty = False
        self._deferring = False
        self._next_guard_expiry = _NO_GUARD
        self._num_ranked = 0
        self.revision += 1

    def _sync_queued(self, running: Sequence[R], step: int) -> dict[str, R]:
        """The dual queue holds exactly ``running``: leavers removed, newcomers admitted in the
        engine's order (the order it admitted them). Returns ``running`` by id."""
        queues, queued = self.queues, self._queued
        by_id = {r.request_id: r for r in running}
        if len(queued) != len(by_id) or not queued.issuperset(by_id):
            for rid in queued - by_id.keys():
                queues.remove(rid)
                queued.discard(rid)
            self._admit([r.request_id for r in running if r.request_id not in queued], step)
        return by_id

    def _full_order(self, running: Sequence[R], step: int) -> tuple[list[R], list[R]]:
        queues, states = self.queues, self._states
        by_id = self._sync_queued(running, step)
        self._moot = False
        plan = queues.schedule(
            capacity=max(self.capacity, len(by_id)), output_budget=self.output_budget
        )
        skip = [by_id[rid] for rid in plan.deferred if states[rid].phase is Phase.THINK]
        self.stats.num_deferred += len(skip)
        planned = plan.served + plan.deferred if plan.deferred else plan.served
        guard_expiry = _NO_GUARD
        candidates: list[Candidate] = []
        for rid in planned:
            state = states[rid]
            readmitted = state.readmitted_step
            guarded = readmitted is not None and step - readmitted < READMIT_GUARD_STEPS
            if guarded:
                assert readmitted is not None
                guard_expiry = min(guard_expiry, readmitted + READMIT_GUARD_STEPS)
            computed = by_id[rid].num_computed_tokens
            if computed > 0:  # preempting a request without KV frees nothing: never ranked
                victim_class = VICTIM_CLASS[state.phase_state.phase, guarded]
                candidates.append(Candidate(rid, victim_class, computed))
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
        self.revision += 1
        self._last_ids = frozenset(by_id)
        self.stats.num_reordered_steps += 1
        return order, skip

    def _admit(self, rids: list[str], step: int) -> None:
        """Requests joined the running set (new, or back after a preemption), in this order."""
        states = self._states
        for rid in rids:
            state = states[rid]
            if state.preempted:
                # It re-entered the running set during the previous step.
                state.preempted = False
                state.readmitted_step = step - 1
        queues = self.queues
        try:
            queues.add_many([(rid, states[rid].phase) for rid in rids])
        finally:
            self._queued.update(rid for rid in rids if rid in queues)

    def _hold_answers(self, order: Sequence[R], num_free_blocks: int) -> list[R]:
        """Answer streams to skip this step because they need a KV block nobody can give.

        When no thinking request holds KV, the engine could make room for an answer stream only
        by preempting another one, by recompute: that one stalls until re-admitted and then
        recomputes its prompt, reasoning and answer so far. Holding the streams that need a
        fresh block for one step instead (the newest first) costs the same wait without the
        recompute, and each keeps its KV. Never all of them: if every running request were
        held, nothing could finish and free blocks, so the engine preempts as usual.
        NOTE: Meridian's addition on top of ADR-0008's last resort.
        """
        if num_free_blocks >= len(order):
            return []  # even if every request needed a block, there is one for each
        states, block_size = self._states, self.block_size
        needy: list[R] = []
        for request in order:
            computed = request.num_computed_tokens
            if states[request.request_id].phase is not Phase.OUTPUT:
                if computed > 0:
                    return []  # a thinking request holds KV: it is preempted, as planned
                continue
            # A decode step writes position `computed`; at a block boundary it opens a block.
            if request.num_tokens - computed == 1 and computed % block_size == 0:
                needy.append(request)
        surplus = len(needy) - num_free_blocks
        if surplus <= 0 or surplus >= len(order):
            return []
        self.stats.num_answer_holds += surplus
        return needy[-surplus:]

    # -- admission ----------------------------------------------------------------------------

    def waiting_order(self, waiting: Sequence[R]) -> list[R] | None:
        """The head of the waiting queue in the order it should start, or ``None`` to keep the
        engine's (``scheduler.admission_order``): preempted requests and those that have waited
        ``admission_order_max_wait_s`` (the starvation bound) first, then new requests of the
        preferred kind (reasoning: thinking from their prompt on; chat: the others), then the
        rest, each group in the engine's order."""
        reasoning_first = self._reasoning_first
        if reasoning_first is None or len(waiting) < 2 or self.stands_aside:
            return None
        states, think = self._states, Phase.THINK
        starved = self.clock() - self._max_wait_s
        ranks = []
        for request in waiting:
            state = states.get(request.request_id)
            if state is None or state.preempted or state.tracked_at <= starved:
                ranks.append(0)
            else:
                ranks.append(1 if (state.phase is think) is reasoning_first else 2)
        if all(a <= b for a, b in itertools.pairwise(ranks)):
            return None
        order = sorted(range(len(waiting)), key=ranks.__getitem__)
        return [waiting[i] for i in order]

    def reorder_waiting(self, queue: deque[R], head: list[R]) -> list[R]:
        """Put ``head``, the first requests of the engine's waiting ``queue`` (vLLM's FCFS queue
        is a deque), in :meth:`waiting_order`, in place; returns the head as it now stands."""
        reordered = self.waiting_order(head)
        if reordered is None:
            return head
        for _ in head:
            queue.popleft()
        queue.extendleft(reversed(reordered))
        return reordered

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """How many of ``waiting`` (from the head, in the engine's order) may start this step;
        ``None``: no limit from Meridian (the engine's own rules decide).

        With ``admission = "headroom"``, once the length model has seen enough finished
        requests: as many as keep the running set's projected KV peak within ``num_blocks``
        (:func:`~meridian.core.headroom.admissible`), in a cache that holds at least
        :data:`~meridian.core.headroom.MIN_REQUESTS_IN_CACHE` finished requests' mean size.
        Before that, and in smaller caches: as many as keep every request's bound (prompt plus
        ``max_tokens``) within the cache, while the bounds are tight
        (:func:`~meridian.core.headroom.bounded_admissible`). First of all, and cheaply: all
        of them, when the running and waiting requests fit the cache together at their bounds
        (no projection can then save a preemption, and none is built).
        """
        if self.admission != "headroom" or not waiting or self.stands_aside:
            return None
        lengths, bs = self.lengths, self.block_size
        if _bounds_fit(itertools.chain(running, waiting), num_blocks, bs):
            return len(waiting)  # all of them at their bounds fit: nothing to hold back
        count: int | None
        mean_size = lengths.mean_request_tokens
        if lengths.ready and num_blocks * bs >= MIN_REQUESTS_IN_CACHE * mean_size:
            blocks = lengths.expected_blocks(*self._progress([*running, *waiting]), bs)
            grown, candidates = blocks[: len(running)], blocks[len(running) :]
            count = admissible(grown, candidates, num_blocks * (1.0 - self.admission_reserve))
        else:
            run, wait = _bounds(running), _bounds(waiting)
            mean_bound = float(run[1].sum() + wait[1].sum()) / (len(running) + len(waiting))
            self._bounded = bounds_usable(num_blocks * bs, mean_bound, mean_size, self._bounded)
            if not self._bounded:
                return None
            count = bounded_admissible(run, wait, num_blocks, bs)
            if count < len(waiting):
                self.stats.num_bounded_holds += 1
        if count < len(waiting):
            self.stats.num_admissions_held += 1
        return count

    def _progress(
        self, requests: Sequence[EngineRequest]
    ) -> tuple[list[int], list[int], list[int]]:
        """Each request's :class:`~meridian.core.headroom.Kind`, progress and tokens now."""
        self._settle()
        kinds: list[int] = []
        progress: list[int] = []
        tokens: list[int] = []
        states, output = self._states, Phase.OUTPUT
        for request in requests:
            num_tokens = request.num_tokens
            tokens.append(num_tokens)
            state = states.get(request.request_id)
            if state is None:
                kinds.append(Kind.THINKING)
                progress.append(0)
                continue
            st = state.phase_state
            if st.phase is not output:
                kinds.append(Kind.THINKING)
                progress.append(st.num_think_tokens)
            else:
                kinds.append(Kind.ANSWERING if _reasoned(st) else Kind.CHAT)
                progress.append(num_tokens - state.num_prompt_tokens - st.num_think_tokens)
        return kinds, progress, tokens

    def tokens_by_phase(self, request_id: str, num_output_tokens: int) -> tuple[int, int] | None:
        """(think, answer) tokens of a request that has generated ``num_output_tokens`` (the
        engine's count: the router is not fed answer tokens); ``None`` if it is not tracked.
        Boundary markers, and tokens still deciding a PREFILL request's phase, are in neither."""
        self._settle()
        state = self._states.get(request_id)
        if state is None:
            return None
        st = state.phase_state
        pending = st.marker_progress if st.phase is Phase.PREFILL else 0
        think = st.num_think_tokens
        return think, max(0, num_output_tokens - think - st.num_marker_tokens - pending)

    def blocks_by_phase(self, requests: Sequence[EngineRequest]) -> tuple[int, int]:
        """KV blocks ``requests`` hold for their computed tokens: (not answering, answering)."""
        states, output, bs = self._states, Phase.OUTPUT, self.block_size
        thinking = answering = 0
        for request in requests:
            blocks = -(-request.num_computed_tokens // bs)
            state = states.get(request.request_id)
            if state is not None and state.phase_state.phase is output:
                answering += blocks
            else:
                thinking += blocks
        return thinking, answering

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any.

        The router and the dual queue check themselves; every queued request is tracked, and
        the router and the state table hold the same requests.
        """
        self._settle()
        self.router.check_integrity()
        self.queues.check_integrity()
        if self.router.tracked_requests != len(self._states):
            raise AssertionError(
                f"router tracks {self.router.tracked_requests}, table {len(self._states)}"
            )
        for rid, state in self._states.items():
            if self.router.state(rid) is not state.phase_state:
                raise AssertionError(f"{rid!r}: the state's phase is not the router's")
        if len(self.queues) > len(self._states):
            raise AssertionError(f"{len(self.queues)} queued but {len(self._states)} tracked")
        if len(self._queued) != len(self.queues) or any(r not in self.queues for r in self._queued):
            raise AssertionError("the queued-id set differs from the dual queue")
