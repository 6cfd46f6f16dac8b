"""The phase router: tracks where each request is (PREFILL, THINK, OUTPUT) from its token stream.

The simulator and the vLLM scheduler drive the same :class:`PhaseRouter`: ``start`` when a
request is admitted, ``observe`` (or the batched ``observe_many``) with each step's new tokens,
``mark_forced`` when the budget policy decides to inject ``think_end``, ``finish`` when the
request ends. Each call returns the :mod:`meridian.core.types` phase events it caused, in order.

Initial phase, decided at ``start`` from the model and the prompt (first rule that applies):

1. the model has no boundaries (``think_start == ()``): OUTPUT, a single-phase request;
2. the model has a ``no_think`` directive and the prompt contains that token sequence: OUTPUT;
3. the prompt ends with ``think_start``, optionally followed by ``newline_ids`` tokens: THINK,
   emitting ``EnterThink``;
4. the prompt ends with ``think_end`` (optionally followed by newlines): OUTPUT. The chat template
   opened *and closed* the think block (thinking disabled), so no think phase follows. NOTE: this
   rule is Meridian's addition; without it rule 6 would leave such a request in THINK forever;
5. the prompt's last ``think_start`` is not followed by a ``think_end`` (vLLM's own test of a
   prompt, ``last_start > last_end``, as its reasoning parsers' ``is_reasoning_end`` and its
   ``thinking_token_budget`` read it): THINK, emitting ``EnterThink``. The reasoning started in
   the prompt (a raw completion prompt ``… <think>\n20 7;``, a client continuing a cut
   stream), and the tokens after that ``think_start`` (newline tokens right after it excepted)
   are the request's ``num_prompt_think_tokens``: they count toward its think budget, as vLLM's
   ``thinking_token_budget`` counts them, but they were not generated (no think-token count or
   metric holds them);
6. ``think_starts_in_prompt``: THINK, emitting ``EnterThink`` (the template opened the block, or
   the family's vLLM reasoning parser reads the output as reasoning until ``think_end``, as
   ``qwen3``'s does);
7. otherwise PREFILL: the first generated tokens decide. If they spell ``think_start`` the request
   enters THINK (``EnterThink``); these marker tokens are counted neither as think nor as output.
   As soon as they cannot be a prefix of ``think_start`` the request is OUTPUT (no event), and
   every token generated so far counts as output.

Counting and transitions:

- A one-token ``think_start`` generated as a THINK request's very first token is a marker token,
  not a think token: vLLM's reasoning parsers drop a ``<think>`` the model repeats (Qwen3 emits
  it itself; with rule 6 Meridian is already in THINK). Longer markers are not absorbed.
- THINK counts every generated token as a think token until ``think_end`` completes; then the
  marker's own tokens are taken back out, ``ExitThink(think_tokens, forced)`` is emitted (``forced``
  is true when :meth:`PhaseRouter.mark_forced` was called in this think phase) and the request is
  OUTPUT. Tokens after the marker in the same ``observe`` call are output tokens. While a
  multi-token marker is only partly matched, its tokens are (provisionally) think tokens.
- OUTPUT counts output tokens. Boundary tokens seen there are plain output: phases only move
  forward (PREFILL < THINK < OUTPUT < COMPLETE) and ``ExitThink`` happens at most once.
- Invariant (checked by :meth:`PhaseRouter.check_integrity`): ``num_generated_tokens ==
  num_think_tokens + num_output_tokens + num_marker_tokens`` plus, in PREFILL, the
  ``marker_progress`` tokens still pending.

Matching: a marker is a token-id *sequence* (one id for ``<think>``-style special tokens, several
for Granite's prose markers). It is matched across token boundaries and across ``observe`` calls
by a KMP automaton compiled once per distinct marker (cached): the per-request state is one int,
and each token costs one dict lookup. Single-token markers take a fast path (an int compare, or
one C-level ``in`` over a multi-token delta). ``observe`` returns a shared empty tuple when
nothing happened, so the common path allocates nothing.

Threads: several threads may call ``start``/``observe``/``mark_forced``/``finish`` at once as long
as each request is driven by one thread at a time. ``start`` and ``finish`` take a lock around
the request table; ``observe`` only reads the table (atomic in CPython) and mutates
its own request's state, so the hot path takes no global lock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from meridian.config.boundaries import BoundaryIds, ModelDefinition
from meridian.core.types import (
    Complete,
    EnterThink,
    ExitThink,
    ForceBudget,
    ForceReason,
    Phase,
    PhaseEvent,
)
from meridian.errors import BoundaryError, MeridianError

__all__ = [
    "DuplicateRequestError",
    "PhaseError",
    "PhaseRouter",
    "ReasoningModel",
    "RequestPhaseState",
    "UnknownRequestError",
]

# Returned whenever a call caused no event: the hot path must not allocate.
_NO_EVENTS: Final[tuple[PhaseEvent, ...]] = ()
# ``_Marker.single`` when the marker has several tokens (token ids are never negative).
_MULTI: Final = -1


class UnknownRequestError(MeridianError, KeyError):
    """A request id that the router does not track (never started, or finished)."""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(MeridianError, ValueError):
    """``start`` was called for a request id that is already tracked."""


class PhaseError(MeridianError, ValueError):
    """An action that is not valid in the request's current phase (e.g. forcing outside THINK)."""


@dataclass(frozen=True, slots=True)
class _Marker:
    """A compiled marker: the KMP automaton of one token-id sequence.

    ``delta[j]`` maps a token to the next state when ``j`` tokens of the marker are matched;
    tokens absent from the dict go to state 0 (a token that does not occur in the marker can
    never extend a match). Reaching ``len(ids)`` means the marker is complete.
    """

    ids: tuple[int, ...]
    delta: tuple[dict[int, int], ...]
    single: int  # the id of a one-token marker, else _MULTI
    alphabet: frozenset[int]  # the ids occurring in the marker


@functools.lru_cache(maxsize=256)
def _compile_marker(ids: tuple[int, ...]) -> _Marker:
    """Build the KMP automaton of ``ids`` from its failure (prefix) function; cached per marker."""
    m = len(ids)
    failure = [0] * m  # failure[j]: longest proper border of ids[: j + 1]
    k = 0
    for j in range(1, m):
        while k > 0 and ids[j] != ids[k]:
            k = failure[k - 1]
        if ids[j] == ids[k]:
            k += 1
        failure[j] = k
    delta: list[dict[int, int]] = [{ids[0]: 1}]
    for j in range(1, m):
        # On a mismatch in state j the automaton behaves as in state failure[j - 1].
        row = dict(delta[failure[j - 1]])
        row[ids[j]] = j + 1
        delta.append(row)
    single = ids[0] if m == 1 else _MULTI
    return _Marker(ids=ids, delta=tuple(delta), single=single, alphabet=frozenset(ids))


# The markers of a model without boundaries: never consulted (its requests are always OUTPUT),
# but they keep ``ReasoningModel._start``/``_end`` non-optional so the hot path needs no checks.
_NO_MARKER: Final = _Marker(ids=(), delta=(), single=_MULTI, alphabet=frozenset())


def _ends_with(seq: Sequence[int], end: int, marker: tuple[int, ...]) -> bool:
    """True when ``seq[:end]`` ends with ``marker``."""
    k = len(marker)
    if end < k:
        return False
    if k == 1:  # a special token (the common marker): no slice
        return seq[end - 1] == marker[0]
    return tuple(seq[end - k : end]) == marker


def _ends_with_marker(
    seq: Sequence[int], marker: tuple[int, ...], newlines: frozenset[int]
) -> bool:
    """True when ``seq`` ends with ``marker`` followed by zero or more ``newlines`` tokens."""
    end = len(seq)
    while True:
        # Try before stripping: the marker itself may end with a newline token.
        if _ends_with(seq, end, marker):
            return True
        if end == 0 or seq[end - 1] not in newlines:
            return False
        end -= 1


def _rfind(seq: Sequence[int], needle: tuple[int, ...]) -> int:
    """Where the last occurrence of the token sequence ``needle`` in ``seq`` begins; -1 if none."""
    hay = seq if isinstance(seq, list) else list(seq)
    last, k = needle[-1], len(needle)
    if last not in hay:  # the common case, one C-level scan
        return -1
    backwards = hay[::-1]
    i = 0
    # Jump between occurrences of the last token, from the end, with C-level index().
    while True:
        try:
            i = backwards.index(last, i)
        except ValueError:
            return -1
        end = len(hay) - i  # just past the candidate occurrence
        if end >= k and (k == 1 or tuple(hay[end - k : end]) == needle):
            return end - k
        i += 1


def _contains(seq: Sequence[int], needle: tuple[int, ...]) -> bool:
    """True when the token sequence ``needle`` occurs contiguously in ``seq``."""
    hay = seq if isinstance(seq, list | tuple) else list(seq)
    first, k = needle[0], len(needle)
    if first not in hay:  # the common case, without index()'s exception
        return False
    i = 0
    # Jump between occurrences of the first token with C-level index(); needles are short.
    while True:
        try:
            i = hay.index(first, i)
        except ValueError:
            return False
        if all(i + j < len(hay) and hay[i + j] == needle[j] for j in range(1, k)):
            return True
        i += 1


def _no_think_end(st: RequestPhaseState, toks: Sequence[int]) -> bool:
    """Whether ``toks``, the next tokens of a THINK request, can neither complete ``think_end``
    nor leave it partly matched: the hot paths' test (no event, only counting)."""
    end = st.model._end
    single = end.single
    if single != _MULTI:
        return single not in toks
    # No partial match pending and no marker token: cannot complete here.
    return st.marker_progress == 0 and end.alphabet.isdisjoint(toks)


def _check_ids(name: str, ids: tuple[int, ...]) -> None:
    for t in ids:
        if not isinstance(t, int) or t < 0:
            raise BoundaryError(f"ReasoningModel.{name} must hold token ids >= 0; got {list(ids)}")


@dataclass(frozen=True, slots=True)
class ReasoningModel:
    """Token-level description of a model family's reasoning boundaries.

    ``think_start == think_end == ()`` describes a model without reasoning: every request is a
    single-phase OUTPUT request. ``no_think`` is the token sequence of a "/no_think" directive
    (``()`` when the model has none). Instances are immutable and hashable; their marker automata
    are compiled once at construction (and shared between equal markers).

    >>> qwen3 = ReasoningModel(think_start=(151667,), think_end=(151668,))
    >>> qwen3.has_boundaries
    True
    """

    think_start: tuple[int, ...]
    think_end: tuple[int, ...]
    newline_ids: frozenset[int] = frozenset()
    no_think: tuple[int, ...] = ()
    think_starts_in_prompt: bool = False
    _start: _Marker = field(init=False, repr=False, compare=False)
    _end: _Marker = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept lists/sets from callers, but store hashable tuples/frozensets.
        for name in ("think_start", "think_end", "no_think"):
            value = tuple(getattr(self, name))
            _check_ids(name, value)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "newline_ids", frozenset(self.newline_ids))
        if bool(self.think_start) != bool(self.think_end):
            raise BoundaryError(
                "ReasoningModel: think_start and think_end must both be set or both be empty "
                f"(no reasoning); got {list(self.think_start)} and {list(self.think_end)}"
            )
        if self.think_start and self.think_start == self.think_end:
            raise BoundaryError(
                f"ReasoningModel: think_start and think_end are the same ids "
                f"{list(self.think_start)}"
            )
        if self.think_starts_in_prompt and not self.think_start:
            raise BoundaryError(
                "ReasoningModel: think_starts_in_prompt needs think_start/think_end token ids"
            )
        has = bool(self.think_start)
        object.__setattr__(self, "_start", _compile_marker(self.think_start) if has else _NO_MARKER)
        object.__setattr__(self, "_end", _compile_marker(self.think_end) if has else _NO_MARKER)

    @classmethod
    def from_boundaries(
        cls, definition: ModelDefinition, ids: BoundaryIds, no_think: tuple[int, ...] = ()
    ) -> ReasoningModel:
        """The router's view of a configured model; ``no_think`` is kept only when
        ``definition.supports_think_disable``.
        """
        return cls(
            think_start=ids.think_start,
            think_end=ids.think_end,
            newline_ids=ids.newline_ids,
            no_think=tuple(no_think) if definition.supports_think_disable else (),
            think_starts_in_prompt=definition.think_starts_in_prompt,
        )

    @classmethod
    def without_reasoning(cls) -> ReasoningModel:
        """A model with no think boundaries: every request is single-phase OUTPUT."""
        return cls(think_start=(), think_end=())

    @property
    def single_think_end(self) -> int | None:
        """The id of a one-token ``think_end`` (``None``: a longer marker, or none)."""
        single = self._end.single
        return None if single == _MULTI else single

    @property
    def has_boundaries(self) -> bool:
        """True when the model has a think phase at all."""
        return bool(self.think_start)

    def initial_phase(self, prompt_token_ids: Sequence[int]) -> Phase:
        """The phase a request starts in, by the rules in the module docstring (pure)."""
        return self.prompt_start(prompt_token_ids)[0]

    def prompt_start(self, prompt_token_ids: Sequence[int]) -> tuple[Phase, int]:
        """The phase a request starts in and the think tokens its prompt already holds (its
        ``num_prompt_think_tokens``), by the rules in the module docstring (pure).

        >>> m = ReasoningModel(think_start=(7,), think_end=(8,), newline_ids=frozenset({10}))
        >>> m.prompt_start([1, 7, 10]), m.prompt_start([1, 7, 10, 20, 21, 22])
        ((<Phase.THINK: 1>, 0), (<Phase.THINK: 1>, 3))
        """
        prompt = prompt_token_ids
        if not self.think_start:
            return Phase.OUTPUT, 0
        if self.no_think and _contains(prompt, self.no_think):
            return Phase.OUTPUT, 0
        if _ends_with_marker(prompt, self.think_start, self.newline_ids):
            return Phase.THINK, 0
        if _ends_with_marker(prompt, self.think_end, self.newline_ids):
            return Phase.OUTPUT, 0
        opened = _rfind(prompt, self.think_start)
        # vLLM's last_start > last_end: no think_end begins at or after the last think_start.
        if opened >= 0 and not _contains(prompt[opened:], self.think_end):
            reasoning = opened + len(self.think_start)
            while reasoning < len(prompt) and prompt[reasoning] in self.newline_ids:
                reasoning += 1
            return Phase.THINK, len(prompt) - reasoning
        if self.think_starts_in_prompt:
            return Phase.THINK, 0
        return Phase.PREFILL, 0


@dataclass(slots=True, eq=False)
class RequestPhaseState:
    """Per-request phase state. A read-only view for callers: only the router mutates it.

    Invariants (see :meth:`PhaseRouter.check_integrity`): ``phase`` only moves forward;
    ``num_generated_tokens == num_think_tokens + num_output_tokens + num_marker_tokens``
    (+ ``marker_progress`` in PREFILL, tokens not yet known to be output or ``think_start``);
    ``forced`` is only set in THINK or later.
    """

    request_id: str
    model: ReasoningModel
    phase: Phase
    num_think_tokens: int = 0
    num_output_tokens: int = 0
    forced: ForceReason | None = None
    num_generated_tokens: int = 0
    # Tokens of generated think_start / think_end markers (counted neither as think nor output).
    num_marker_tokens: int = 0
    # PREFILL: think_start tokens matched so far; THINK: KMP state of the think_end match.
    marker_progress: int = 0
    # Think tokens the prompt already holds (initial-phase rule 5): not generated, not in the
    # counts above, but part of the reasoning a think budget bounds (num_reasoning_tokens).
    num_prompt_think_tokens: int = 0

    @property
    def num_reasoning_tokens(self) -> int:
        """The think tokens a think budget counts: the prompt's and the generated ones (the one
        count the logits processor's forcing and the scheduler's policy both go by)."""
        return self.num_prompt_think_tokens + self.num_think_tokens


class PhaseRouter:
    """Tracks the phase of every live request from its token stream.

    >>> r = PhaseRouter()
    >>> m = ReasoningModel(think_start=(7,), think_end=(8,))
    >>> r.start("a", m, [1, 2, 7])
    (EnterThink(request_id='a'),)
    >>> r.observe("a", [5, 5, 8, 9])
    (ExitThink(request_id='a', think_tokens=2, forced=False),)
    >>> r.state("a").num_output_tokens
    1
    """

    def __init__(self) -> None:
        self._states: dict[str, RequestPhaseState] = {}
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(
        self, request_id: str, model: ReasoningModel, prompt_token_ids: Sequence[int]
    ) -> Sequence[PhaseEvent]:
        """Begin tracking ``request_id``; returns ``(EnterThink,)`` if it starts in THINK.

        Raises :class:`DuplicateRequestError` if the id is already tracked.
        """
        st = self.start_state(request_id, model, prompt_token_ids)
        return (EnterThink(request_id),) if st.phase is Phase.THINK else _NO_EVENTS

    def start_state(
        self, request_id: str, model: ReasoningModel, prompt_token_ids: Sequence[int]
    ) -> RequestPhaseState:
        """:meth:`start` for a caller that takes no events: returns the request's live state
        (:meth:`state`)."""
        phase, num_prompt_think_tokens = model.prompt_start(prompt_token_ids)
        st = RequestPhaseState(
            request_id, model, phase, num_prompt_think_tokens=num_prompt_think_tokens
        )
        with self._lock:
            if request_id in self._states:
                raise DuplicateRequestError(
                    f"request {request_id!r} is already tracked by the phase router; "
                    "finish() it before starting it again"
                )
            self._states[request_id] = st
        return st

    def finish(self, request_id: str) -> Complete | None:
        """Stop tracking ``request_id`` (finished or aborted). Idempotent: ``None`` if unknown."""
        with self._lock:
            st = self._states.pop(request_id, None)
        if st is None:
            return None
        st.phase = Phase.COMPLETE
        return Complete(request_id)

    # -- the hot path --------------------------------------------------------------------------

    def observe(self, request_id: str, token_ids: Sequence[int] | int) -> Sequence[PhaseEvent]:
        """Feed one request's newly generated token(s); returns the events caused, in order.

        ``token_ids`` may be one id or several (speculative decoding, multi-token deltas).
        Returns a shared empty tuple when nothing happened.
        """
        st = self._get(request_id)
        if isinstance(token_ids, int):
            # One token, no boundary: count it without building a sequence.
            phase = st.phase
            if phase is Phase.OUTPUT:
                st.num_output_tokens += 1
                st.num_generated_tokens += 1
                return _NO_EVENTS
            single = st.model._end.single
            if (
                phase is Phase.THINK
                and single != _MULTI
                and token_ids != single
                and (st.num_generated_tokens or token_ids != st.model._start.single)
            ):
                st.num_think_tokens += 1
                st.num_generated_tokens += 1
                return _NO_EVENTS
            return self._feed(st, (token_ids,))
        return self._feed(st, token_ids)

    def observe_many(
        self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
    ) -> list[Sequence[PhaseEvent]]:
        """The batched ``observe``: ``token_ids[i]`` are the new tokens of ``request_ids[i]``.

        Returns one event sequence per request (mostly the shared empty tuple). On an unknown
        id, :class:`UnknownRequestError` is raised and the requests before it in the batch have
        already been applied.
        """
        if len(request_ids) != len(token_ids):
            raise ValueError(
                f"observe_many: {len(request_ids)} request ids but {len(token_ids)} token lists"
            )
        get = self._states.get
        states: list[RequestPhaseState] = []
        for rid in request_ids:
            st = get(rid)
            if st is None:
                self.observe_states(states, token_ids[: len(states)])
                raise self._unknown(rid)
            states.append(st)
        return self.observe_states(states, token_ids)

    def observe_states(
        self, states: Sequence[RequestPhaseState], token_ids: Sequence[Sequence[int]]
    ) -> list[Sequence[PhaseEvent]]:
        """``observe_many`` for callers that hold the requests' live states (:meth:`state`):
        ``token_ids[i]`` are the new tokens of ``states[i]``'s request, which must be tracked."""
        think, output = Phase.THINK, Phase.OUTPUT
        out: list[Sequence[PhaseEvent]] = []
        append = out.append
        for st, toks in zip(states, token_ids, strict=True):
            phase = st.phase
            # Inlined fast paths of _feed (the common cases: no boundary in this delta).
            if phase is output:
                n = len(toks)
                st.num_output_tokens += n
                st.num_generated_tokens += n
                append(_NO_EVENTS)
                continue
            if (
                phase is think
                and _no_think_end(st, toks)
                and (st.num_generated_tokens or not toks or toks[0] != st.model._start.single)
            ):
                n = len(toks)
                st.num_think_tokens += n
                st.num_generated_tokens += n
                append(_NO_EVENTS)
                continue
            append(self._feed(st, toks))
        return out

    def observe_state(
        self, st: RequestPhaseState, token_ids: Sequence[int]
    ) -> Sequence[PhaseEvent]:
        """``observe`` for a caller that holds the request's live state (:meth:`state`)."""
        return self._feed(st, token_ids)

    def observe_thinking(
        self, deltas: Mapping[str, Sequence[int]], skip: Container[str] = ()
    ) -> list[str]:
        """The batched fast path for thinking requests: ``deltas`` maps request ids to new
        tokens. Every request in THINK past its first delta whose tokens can neither complete
        ``think_end`` nor continue a partial match (no event possible) is counted here; the
        others are returned in ``deltas``' order, not yet applied (for :meth:`observe` or
        :meth:`observe_states`), unknown ids included. Ids in ``skip`` are neither counted nor
        returned."""
        get = self._states.get
        think = Phase.THINK
        others: list[str] = []
        for rid, toks in deltas.items():
            if rid in skip:
                continue
            st = get(rid)
            if (
                st is not None
                and st.phase is think
                and st.num_generated_tokens
                and _no_think_end(st, toks)
            ):
                n = len(toks)
                st.num_think_tokens += n
                st.num_generated_tokens += n
                continue
            others.append(rid)
        return others

    def _feed(self, st: RequestPhaseState, toks: Sequence[int]) -> Sequence[PhaseEvent]:
        """Advance ``st`` over ``toks``; the single implementation of the phase rules."""
        n = len(toks)
        st.num_generated_tokens += n
        phase = st.phase
        if phase is Phase.OUTPUT:
            st.num_output_tokens += n
            return _NO_EVENTS
        events: list[PhaseEvent] | None = None
        i = 0
        if phase is Phase.PREFILL:
            start = st.model._start
            ids, k = start.ids, st.marker_progress
            while i < n and toks[i] == ids[k]:
                i += 1
                k += 1
                if k == len(ids):
                    break
            if k == len(ids):
                st.num_marker_tokens += k
                st.marker_progress = 0
                st.phase = phase = Phase.THINK
                events = [EnterThink(st.request_id)]
            elif i < n:
                # toks[i] cannot continue think_start: single-phase OUTPUT, pending tokens too.
                st.num_output_tokens += k
                st.marker_progress = 0
                st.phase = phase = Phase.OUTPUT
            else:
                st.marker_progress = k
                return _NO_EVENTS
        if phase is Phase.THINK:
            if i == 0 < n == st.num_generated_tokens and toks[0] == st.model._start.single:
                # The model opened the block the prompt (or the parser) already opened: a marker.
                i = 1
                st.num_marker_tokens += 1
            end = st.model._end
            done = -1  # index just past the completed think_end, if any
            if end.single != _MULTI:
                single = end.single
                for j in range(i, n):
                    if toks[j] == single:
                        done = j + 1
                        break
            else:
                delta, m, state = end.delta, len(end.ids), st.marker_progress
                for j in range(i, n):
                    state = delta[state].get(toks[j], 0)
                    if state == m:
                        done = j + 1
                        break
                st.marker_progress = state
            if done < 0:
                st.num_think_tokens += n - i
                return _NO_EVENTS if events is None else tuple(events)
            m = len(end.ids)
            # The marker's tokens were provisionally counted as think tokens; take them back.
            st.num_think_tokens += done - i - m
            st.num_marker_tokens += m
            st.marker_progress = 0
            st.phase = Phase.OUTPUT
            exit_event = ExitThink(st.request_id, st.num_think_tokens, st.forced is not None)
            if events is None:
                events = [exit_event]
            else:
                events.append(exit_event)
            i = done
        st.num_output_tokens += n - i
        return _NO_EVENTS if events is None else tuple(events)

    # -- budget forcing ------------------------------------------------------------------------

    def can_mark_forced(self, request_id: str) -> bool:
        """True when ``mark_forced`` is allowed: the request is in THINK and not yet forced."""
        st = self._get(request_id)
        return st.phase is Phase.THINK and st.forced is None

    def mark_forced(self, request_id: str, reason: ForceReason) -> ForceBudget:
        """Record that the budget policy fired; the coming ``ExitThink`` will have ``forced``.

        Raises :class:`PhaseError` outside THINK or when the request was already forced (the
        policy fires once per think phase; check :meth:`can_mark_forced`).
        """
        st = self._get(request_id)
        if st.phase is not Phase.THINK:
            raise PhaseError(
                f"mark_forced({request_id!r}, {reason.value}): the request is in "
                f"{st.phase.name}, not THINK; only a thinking request can be forced"
            )
        if st.forced is not None:
            raise PhaseError(
                f"mark_forced({request_id!r}, {reason.value}): already forced "
                f"({st.forced.value}); the budget policy fires once per request"
            )
        st.forced = reason
        return ForceBudget(request_id, reason)

    # -- queries -------------------------------------------------------------------------------

    def phase(self, request_id: str) -> Phase:
        """The current phase of a tracked request."""
        return self._get(request_id).phase

    def state(self, request_id: str) -> RequestPhaseState:
        """The live state of a tracked request (read-only for callers)."""
        return self._get(request_id)

    @property
    def tracked_requests(self) -> int:
        """How many requests are tracked (started and not yet finished)."""
        return len(self._states)

    def check_integrity(self) -> None:
        """Assert the router's invariants (raises ``AssertionError``, also under ``python -O``)."""
        with self._lock:
            items = list(self._states.items())
        for rid, st in items:
            problem = _integrity_problem(rid, st)
            if problem is not None:
                raise AssertionError(f"phase router, request {rid!r}: {problem} ({st!r})")

    # -- helpers -------------------------------------------------------------------------------

    def _get(self, request_id: str) -> RequestPhaseState:
        st = self._states.get(request_id)
        if st is None:
            raise self._unknown(request_id)
        return st

    @staticmethod
    def _unknown(request_id: str) -> UnknownRequestError:
        return UnknownRequestError(
            f"request {request_id!r} is not tracked by the phase router "
            "(never started, or already finished); call start() first"
        )


def _integrity_problem(rid: str, st: RequestPhaseState) -> str | None:
    """What is wrong with one tracked request's state, or ``None``."""
    model = st.model
    len_start, len_end = len(model.think_start), len(model.think_end)
    if st.request_id != rid:
        return f"stored under {rid!r} but named {st.request_id!r}"
    if min(st.num_think_tokens, st.num_output_tokens, st.num_marker_tokens) < 0:
        return "negative token count"
    if st.num_prompt_think_tokens < 0 or (st.num_prompt_think_tokens and st.phase is Phase.PREFILL):
        return "prompt think tokens negative, or held by a request that did not start thinking"
    pending = st.marker_progress if st.phase is Phase.PREFILL else 0
    counted = st.num_think_tokens + st.num_output_tokens + st.num_marker_tokens + pending
    if counted != st.num_generated_tokens:
        return f"think + output + marker + pending = {counted} != {st.num_generated_tokens}"
    if st.phase is Phase.PREFILL:
        if not model.has_boundaries or not 0 <= st.marker_progress < len_start:
            return "PREFILL needs boundaries and a partial think_start match"
        if st.num_think_tokens or st.num_output_tokens or st.num_marker_tokens or st.forced:
            return "PREFILL has counted tokens or a force"
    elif st.phase is Phase.THINK:
        if not model.has_boundaries or not 0 <= st.marker_progress < len_end:
            return "THINK needs boundaries and a partial think_end match"
        if st.num_output_tokens or st.num_marker_tokens not in (0, len_start):
            return "THINK has output tokens or end-marker tokens"
    elif st.phase is Phase.OUTPUT:
        if st.marker_progress:
            return "OUTPUT has a pending marker match"
        allowed = {0, len_end, len_start + len_end}
        if st.num_marker_tokens not in allowed:
            return f"OUTPUT marker tokens {st.num_marker_tokens} not in {sorted(allowed)}"
        if st.forced is not None and st.num_marker_tokens == 0:
            return "forced but think_end never seen"
    else:
        return f"tracked request in phase {st.phase.name}"
    return None
