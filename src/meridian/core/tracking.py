"""The policy's table of live requests, and the one path by which their tokens are accounted.

:class:`Tracker` holds one :class:`~meridian.core.state.RequestState` per tracked request (the
only copy of its phase and counts), starts and stops tracking (``track``, ``untrack_many``), and
accounts each engine step's new tokens (:meth:`Tracker.observe`): phase changes, think exits and
first answers (to the stats and the listener), and the answer streams' gaps between tokens.

One step is ``observe(request_ids, tokens, step)``: ``tokens[i]`` are the new tokens of
``request_ids[i]``. It is the per-step hot path of a live engine, so it takes the cheapest of three
ways through the same accounting:

1. **steady**: the requests are exactly the answer streams served in the step before (the common
   step of a busy engine): their tokens need nothing but their ids, and ``tokens`` is never read;
2. **bulk**: while the same requests get one token each, step after step, the thinking ones are
   counted in bulk (:class:`~meridian.core.rows.SteadyRows`): such a step costs only the requests
   whose token ends their think phase or starts their answer;
3. **general**: every other step. Answer streams that got their previous token in the step before
   are found with set operations; thinking deltas that cannot end a think phase are counted in one
   pass; only the rest (boundaries, first tokens, streams back from a stall) go one by one, in
   the batch's order.

The fast ways earn their place: the general way alone took Meridian to 0.055-0.071 of vLLM's
step in every cell of ``benchmarks/bench_vllm_overhead.py`` (issue 43; warm, 0.026 against 0.004
ms a step at 64 rows). The three agree exactly with a plain reference model
(``tests/test_tracking.py`` replays random engine steps shaped to take each way). Length: the
three ways are one observe path and share its state; they are kept together so that the fast
ways cannot drift from the general one.

Answer tokens are not fed to :func:`~meridian.core.state.advance`: a phase never changes once a
request answers; their count is the engine's, read through
:meth:`RequestState.num_answer_tokens <meridian.core.state.RequestState.num_answer_tokens>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from meridian.core.format import ReasoningFormat
from meridian.core.interface import EngineRequest, PolicyListener, PolicyStats
from meridian.core.memo import plain_paths
from meridian.core.pacing import StepClock, StepTimes
from meridian.core.rows import SteadyRows
from meridian.core.state import (
    RequestState,
    advance,
    advance_many,
    count_think,
    integrity_problem,
    start,
    thinks_on,
)
from meridian.core.types import (
    HARD_CAP,
    OUTPUT,
    PREFILL,
    THINK,
    EnterThink,
    ExitThink,
    ForceBudget,
    PhaseEvent,
)

__all__ = ["GAP_HISTORY_STEPS", "Tracker", "UntrackedRequestsError"]

# With a listener, the answer gaps it hears are timed over at most this many steps (a stall
# longer than that is counted in steps, not timed).
GAP_HISTORY_STEPS = 4096
_NO_STREAMS: frozenset[str] = frozenset()


class UntrackedRequestsError(KeyError):
    """Tokens for requests the policy does not track (``request_ids``); the rest of the step was
    accounted."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"tokens for requests Meridian does not track: {request_ids}")
        self.request_ids = request_ids


class Tracker:
    """The table of live requests and their token accounting (module docstring).

    ``default_cap`` is the think length a hard-cap force ends at for a request without its own
    (``scheduler.max_think_tokens``), ``transition_len`` the tokens forced before ``think_end``;
    together they tell the think exits that were hard-cap forces. ``on_phase_change(state)`` is
    called when a request's delta changed its phase (or decided a PREFILL request's).
    ``history`` steps of token times are kept (``times``): for pacing and for the gaps a listener
    hears, stamped with the step's time from ``step_clock`` (the core reads the clock once a
    step).
    """

    def __init__(
        self,
        fmt: ReasoningFormat,
        stats: PolicyStats,
        *,
        default_cap: int,
        transition_len: int,
        listener: PolicyListener | None,
        step_clock: StepClock,
        history: int,
        on_phase_change: Callable[[RequestState], None],
    ) -> None:
        self.format = fmt
        self.stats = stats
        self.default_cap = default_cap
        self.transition_len = transition_len
        self.listener = listener
        self.step_clock = step_clock
        self.on_phase_change = on_phase_change
        self.states: dict[str, RequestState] = {}
        self.times = StepTimes(max(history, GAP_HISTORY_STEPS if listener is not None else 0))
        # The answer streams served at step served_step (the last observed), and the step of the
        # latest answer token of every other stream that has answered.
        self.served: set[str] = set()
        self.served_step = -1
        # `served` as the engine listed it at the last steady step, while still exactly it (None
        # once it changes): comparing lists costs no set look-ups in cold memory.
        self._served_ids: Sequence[str] | None = None
        self.answered: dict[str, int] = {}
        # The bulk way: the last step's request ids, and the batch armed for bulk counting once
        # the same requests got tokens two steps running (a one-token think_end only).
        self._last_rows: list[str] | None = None
        self._rows: SteadyRows | None = None
        # Plain paths (meridian.core.memo): every step the general way, never armed, never steady.
        self.plain = plain_paths()
        self._think_end = None if self.plain else fmt.single_think_end

    # -- the table ------------------------------------------------------------------------------

    def track(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cap: int | None,
        tracked_at: float,
    ) -> RequestState:
        """Start tracking a request; its state (its initial phase from its prompt)."""
        if request_id in self.states:
            raise ValueError(f"request {request_id!r} is already tracked; untrack it first")
        st = start(request_id, self.format, prompt_token_ids)
        st.cap = cap
        st.num_prompt_tokens = len(prompt_token_ids)
        st.tracked_at = tracked_at
        self.states[request_id] = st
        listener = self.listener
        if listener is not None and listener.phase_events:
            listener.request_started(request_id)
            if st.phase is THINK:
                listener.phase_event(request_id, EnterThink(request_id))
        return st

    def untrack_many(
        self,
        finished: Iterable[tuple[str, int | None]],
        on_untracked: Callable[[list[tuple[RequestState, int | None]]], None],
    ) -> None:
        """Stop tracking each ``(request id, num_output_tokens)`` of ``finished`` (unknown ids are
        ignored); ``on_untracked(gone)`` is told of the tracked ones, ``(state,
        num_output_tokens)`` each, their counts up to date, before the listener is (once for the
        batch: one call, not one a request, on the step's path)."""
        # The batch changes with them (the next step's requests would not match it anyway), and
        # no bulk step may count a state it holds for an id that is tracked again.
        self._disarm()
        states, served, answered = self.states, self.served, self.answered
        self._served_ids = None
        gone: list[tuple[RequestState, int | None]] = []
        for request_id, num_output_tokens in finished:
            st = states.pop(request_id, None)
            served.discard(request_id)
            answered.pop(request_id, None)
            if st is not None:
                gone.append((st, num_output_tokens))
                if st.phase is THINK and self._inside_force(st):
                    self._on_force_cut_short(st)
        if not gone:
            return
        try:
            on_untracked(gone)
        finally:
            # The listener last, and told even if on_untracked failed: if it fails, the requests
            # are untracked all the same.
            if self.listener is not None:
                self.listener.requests_finished([st.request_id for st, _ in gone])

    def settle(self) -> None:
        """Bring the counts of thinking rows counted in bulk up to date (before reading any)."""
        if self._rows is not None:
            self._rows.settle()

    def _disarm(self) -> None:
        """Stop counting the armed batch in bulk, its counts brought up to date."""
        self.settle()
        self._rows = None

    def tokens_by_phase(self, request_id: str, num_output_tokens: int) -> tuple[int, int] | None:
        """(think, answer) tokens of a request that has generated ``num_output_tokens`` (the
        engine's count); ``None`` if it is not tracked. Boundary markers, and tokens still
        deciding a PREFILL request's phase, are in neither."""
        self.settle()
        st = self.states.get(request_id)
        if st is None:
            return None
        return st.num_think_tokens, st.num_answer_tokens(num_output_tokens)

    def blocks_by_phase(
        self, requests: Iterable[EngineRequest], block_size: int
    ) -> tuple[int, int]:
        """KV blocks ``requests`` hold for their computed tokens: (not answering, answering)."""
        states, output = self.states, OUTPUT
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
        """Raise ``AssertionError`` naming the first request whose state is inconsistent."""
        self.settle()
        for rid, st in self.states.items():
            problem = integrity_problem(st) if st.request_id == rid else "stored under another id"
            if problem is not None:
                raise AssertionError(f"request {rid!r}: {problem} ({st!r})")

    # -- answer streams -------------------------------------------------------------------------

    def continuing_streams(self, step: int) -> AbstractSet[str]:
        """The answer streams whose tokens at ``step`` continue without a gap (those served at
        ``step - 1``). Read-only; valid until the next ``observe``."""
        return self.served if self.served_step == step - 1 else _NO_STREAMS

    def last_answer_step(self, request_id: str) -> int | None:
        """The step of an answer stream's latest answer token (``None``: none yet)."""
        return self.served_step if request_id in self.served else self.answered.get(request_id)

    # -- the one observe path -------------------------------------------------------------------

    def observe(self, request_ids: list[str], tokens: Sequence[Sequence[int]], step: int) -> None:
        """Account one engine step (module docstring): ``tokens[i]`` are the new tokens of
        ``request_ids[i]``, each request once. ``tokens`` is read only when needed (a caller may
        pass a lazy sequence). An untracked request does not stop the others: the step is
        accounted, then :class:`UntrackedRequestsError` names it."""
        served = self.served
        if (
            self.served_step == step - 1
            and not self.plain
            and (
                request_ids == self._served_ids  # (the same list: a sweep of pointer compares)
                or (len(request_ids) == len(served) and self._same_streams(request_ids))
            )
        ):
            # The steady way: exactly the answer streams served in the step before.
            self._served_again(step, len(served))
            return
        rows = self._rows
        if rows is not None:
            if self.served_step == step - 1 and request_ids == rows.ids:
                flat = rows.single_tokens(tokens)
                if flat is not None:
                    self._observe_bulk(rows, tokens, flat, step)
                    return
            self._disarm()
        continuing = self.continuing_streams(step)
        self._observe_general(
            {rid: t for rid, t in zip(request_ids, tokens, strict=True) if rid not in continuing},
            step,
            request_ids,
        )
        if self._think_end is not None and request_ids == self._last_rows:
            self._arm(request_ids)
        self._last_rows = request_ids

    def _same_streams(self, request_ids: Sequence[str]) -> bool:
        """Whether ``request_ids``, as many as the answer streams served in the step before, are
        those streams; if so, kept as their list (the next steady step compares pointers)."""
        if not self.served.issuperset(request_ids):
            return False
        self._served_ids = request_ids
        return True

    def _served_again(self, step: int, num_streams: int) -> None:
        """Stamp ``step``'s time and count ``num_streams`` answer streams served in it and in the
        step before (a gap of one step, the step's duration)."""
        times = self.times
        then = None
        if times.size:
            now = self.step_clock.observed()
            then = times.stamp(step, now)
        self.served_step = step
        if num_streams:
            stats = self.stats
            if not stats.max_answer_gap_steps:
                stats.max_answer_gap_steps = 1
            if then is not None and self.listener is not None:
                # Every stream served in both steps waited the same step time.
                self.listener.answer_gaps(now - then, num_streams)

    def _observe_general(
        self, deltas: dict[str, Sequence[int]], step: int, request_ids: Sequence[str]
    ) -> None:
        """The general way: ``deltas`` holds every request of ``request_ids`` but the
        :meth:`continuing_streams` of ``step``, whose tokens need nothing but their ids."""
        self._disarm()  # the armed batch's counts first
        served, answered = self.served, self.answered
        self._served_ids = None
        if self.served_step != step - 1:
            hits: set[str] = set()
        elif len(request_ids) - len(deltas) == len(served):
            hits = served  # every one of them got tokens
        else:
            hits = served.intersection(request_ids)
        if len(hits) != len(served):
            # Streams served last time and not now stall: remember their last answer step.
            last = self.served_step
            for rid in served - hits:
                answered[rid] = last
        self.served = hits
        self._served_again(step, len(hits))
        if deltas:
            # Thinking requests' deltas without a boundary are counted in one pass; the rest
            # (boundaries, first tokens, answer streams back from a stall) one by one.
            get = self.states.get
            rest: list[str] = []
            for rid, toks in deltas.items():
                st = get(rid)
                if st is not None and thinks_on(st, toks):
                    count_think(st, len(toks))
                else:
                    rest.append(rid)
            if rest:
                self._observe_rest(rest, deltas, step)

    def _observe_rest(
        self, rest: list[str], deltas: Mapping[str, Sequence[int]], step: int
    ) -> None:
        """The ids in ``rest`` one by one, with their new tokens in ``deltas``."""
        think, output = THINK, OUTPUT
        rids: list[str] = []
        thinking: list[RequestState] = []
        thinking_deltas: list[Sequence[int]] = []
        others: list[str] = []
        unknown: list[str] = []
        stats, answered, states = self.stats, self.answered, self.states
        served, listener = self.served, self.listener
        for rid in rest:
            st = states.get(rid)
            if st is None:
                unknown.append(rid)
                continue
            last = answered.pop(rid, None)
            if last is not None:
                # An answer stream after a gap of more than one step (a stall).
                gap = step - last
                stats.max_answer_gap_steps = max(stats.max_answer_gap_steps, gap)
                stats.num_answer_gaps_over_2 += gap > 2
                served.add(rid)
                if listener is not None:
                    then, now = self.times.at(last), self.times.at(step)
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
                self._first_answer(st, step)
            else:
                others.append(rid)
        if rids:
            for i, events in enumerate(advance_many(thinking, thinking_deltas)):
                if events:
                    self._after_events(thinking[i], events, step)
        for rid in others:
            st = states[rid]
            self._after_events(st, advance(st, deltas[rid]), step)
        if unknown:
            raise UntrackedRequestsError(unknown)

    def _after_events(self, st: RequestState, events: Sequence[PhaseEvent], step: int) -> None:
        """Phase events of a non-answering request's delta: stats, listener, first answer.

        Called for every PREFILL request's delta (PREFILL -> OUTPUT emits no event but changes
        the request's phase) and for thinking requests whose delta had events.
        """
        listener, rid = self.listener, st.request_id
        for event in events:
            if isinstance(event, ExitThink):
                self._on_think_exit(st, event)
            elif isinstance(event, EnterThink) and listener is not None:
                listener.reasoning_started(rid)  # a generated think_start
            if listener is not None and listener.phase_events:
                listener.phase_event(rid, event)
        if st.phase is not PREFILL:
            # The phase changed (or it left PREFILL on this delta's first token).
            self.on_phase_change(st)
        if st.num_output_tokens and rid not in self.served and rid not in self.answered:
            # Its first answer tokens (a delta can end the think phase and start the answer).
            self._first_answer(st, step)

    def _first_answer(self, st: RequestState, step: int) -> None:
        self.served.add(st.request_id)  # (while observing `step`: its streams)
        if self.listener is not None:
            self.listener.first_answer(st.request_id)

    def _on_think_exit(self, st: RequestState, event: ExitThink) -> None:
        stats = self.stats
        stats.num_think_exits += 1
        stats.think_tokens_total += event.think_tokens
        cap = st.cap
        # Forced once the reasoning (the prompt's think tokens, if any, and the generated ones)
        # reached the cap, at once if the prompt's alone did; then the transition phrase.
        forced = (
            cap is not None
            and st.num_reasoning_tokens
            == max(cap, st.num_prompt_think_tokens) + self.transition_len
        )
        if forced:
            stats.num_forced_inferred += 1
        listener = self.listener
        if listener is not None:
            if forced and listener.phase_events:
                listener.phase_event(st.request_id, ForceBudget(st.request_id, HARD_CAP))
            listener.think_ended(st.request_id, event.think_tokens, forced)

    def _inside_force(self, st: RequestState) -> bool:
        """Whether a thinking request is inside its hard-cap force: once its reasoning reached
        the cap, the transition phrase is forced, then ``think_end`` (a multi-token one is
        counted as think tokens until it completes; a marker the model began at the cap is
        completed without the phrase). So: past the cap by at most the phrase, not counting a
        partial ``think_end``, or at the cap with ``think_end`` begun. (Where no forcing logits
        processor runs, a request that thinks past its cap and stops within the phrase's length
        of it would be taken for a forced one, as a think exit there is.)"""
        if st.cap is None:
            return False
        base = max(st.cap, st.num_prompt_think_tokens)
        thought = st.num_reasoning_tokens - st.marker_progress
        return base < thought <= base + self.transition_len or (
            thought == base and st.marker_progress > 0
        )

    def _on_force_cut_short(self, st: RequestState) -> None:
        """A request finished inside its hard-cap force (:meth:`_inside_force`): counted as the
        force it was, since no think exit will count it."""
        self.stats.num_forced_inferred += 1
        listener = self.listener
        if listener is not None:
            if listener.phase_events:
                listener.phase_event(st.request_id, ForceBudget(st.request_id, HARD_CAP))
            listener.force_cut_short(st.request_id)

    # -- the bulk way ---------------------------------------------------------------------------

    def _arm(self, request_ids: list[str]) -> None:
        """Count the rows of ``request_ids`` in bulk from the next step on (they got tokens in
        the last two steps)."""
        states, served, think = self.states, self.served, THINK
        thinking: list[RequestState | None] = []
        for rid in request_ids:
            st = states.get(rid)
            thinking.append(
                st if st is not None and st.phase is think and st.num_generated_tokens else None
            )
        self._rows = SteadyRows.arm(request_ids, thinking, [rid in served for rid in request_ids])

    def _observe_bulk(
        self, rows: SteadyRows, tokens: Sequence[Sequence[int]], flat: list[int], step: int
    ) -> None:
        """A step of the armed batch, one token each: the answer streams were served again, the
        lazy thinking rows got one more token, and the special rows and those whose token ends
        their think phase take the per-request way."""
        self._served_again(step, len(self.served))
        think_end = self._think_end
        ending = rows.ending(flat, think_end) if think_end is not None and think_end in flat else []
        if not rows.special and not ending:
            rows.step_done()
            return
        ids, states, answered = rows.ids, self.states, self.answered
        self._served_ids = None
        for i in ending:
            rows.settle_row(i)  # its tokens before this one
        firsts = (
            [
                st
                for i in rows.special
                if (st := states.get(ids[i])) is not None
                and st.phase is OUTPUT
                and st.request_id not in answered
            ]
            if rows.special
            else []  # (a think exit's step: no comprehension to enter)
        )
        try:
            if len(firsts) == len(rows.special):
                # The common cases directly, in _observe_rest's order: first answer tokens, then
                # the think phases these tokens end.
                for st in firsts:
                    self._first_answer(st, step)
                for i in ending:
                    lazy = rows.states[i]
                    assert lazy is not None
                    self._after_events(lazy, advance(lazy, tokens[i]), step)
            else:  # (a stall's end, a prompt still deciding its phase, an unknown id)
                picked = sorted([*rows.special, *ending])
                self._observe_rest(
                    [ids[i] for i in picked], {ids[i]: tokens[i] for i in picked}, step
                )
        finally:
            served = self.served
            special: list[int] = []
            for i in [*rows.special, *ending]:
                if rows.reclassify(i, states.get(ids[i]), ids[i] in served):
                    special.append(i)
            special.sort()
        rows.special = special
        rows.step_done()
