"""A live request's state, and the one function that moves it along its token stream.

:class:`RequestState` is the only owner of a request's phase and token counts: the policy's
table holds one per tracked request, the forcer one per row of the logits processor's batch, and
everything else (the dual queue, victim ranking, admission) reads them there, never a copy.
:func:`advance` is the single implementation of the phase rules; :func:`advance_many` is its
batched form with the common cases (no boundary possible in a delta) counted inline, and
:func:`count_think` the increment the bulk paths apply.

Counting and transitions:

- A request starts in the phase :meth:`~meridian.core.format.ReasoningFormat.initial_phase`
  gives (:func:`start`).
- PREFILL: the first generated tokens decide. If they spell ``think_start`` the request enters
  THINK (``EnterThink``); these marker tokens are counted neither as think nor as output. As soon
  as they cannot be a prefix of ``think_start`` the request is OUTPUT (no event), and every token
  generated so far counts as output.
- A one-token ``think_start`` generated as a THINK request's very first token is a marker token,
  not a think token: vLLM's reasoning parsers drop a ``<think>`` the model repeats (Qwen3 emits
  it itself; with the prompt rule the request is already in THINK). Longer markers are not
  absorbed.
- THINK counts every generated token as a think token until ``think_end`` completes; then the
  marker's own tokens are taken back out, ``ExitThink(think_tokens, forced)`` is emitted
  (``forced`` when :func:`mark_forced` was called in this think phase) and the request is
  OUTPUT. Tokens after the marker in the same delta are output tokens. While a multi-token
  marker is only partly matched, its tokens are (provisionally) think tokens.
- OUTPUT counts output tokens. Boundary tokens seen there are plain output: phases only move
  forward (PREFILL < THINK < OUTPUT < COMPLETE) and ``ExitThink`` happens at most once.
- Invariant (:func:`integrity_problem`): ``num_generated_tokens == num_think_tokens +
  num_output_tokens + num_marker_tokens`` plus, in PREFILL, the ``marker_progress`` tokens still
  pending.

Nothing here allocates on the common path: a delta that causes no event returns a shared empty
tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from meridian.core.format import MULTI, ReasoningFormat
from meridian.core.types import (
    OUTPUT,
    PREFILL,
    THINK,
    EnterThink,
    ExitThink,
    ForceReason,
    Phase,
    PhaseEvent,
)
from meridian.errors import MeridianError

__all__ = [
    "NO_EVENTS",
    "PhaseError",
    "RequestState",
    "advance",
    "advance_many",
    "count_think",
    "integrity_problem",
    "mark_forced",
    "reasoned",
    "set_thought",
    "start",
    "thinks_on",
]

# Returned whenever a delta caused no event: the hot path must not allocate.
NO_EVENTS: Final[tuple[PhaseEvent, ...]] = ()


class PhaseError(MeridianError, ValueError):
    """An action that is not valid in the request's current phase (e.g. forcing outside THINK)."""


@dataclass(slots=True, eq=False)
class RequestState:
    """Everything Meridian knows about one live request.

    Phase and counts (moved only by the functions of this module): ``phase`` only moves forward;
    ``num_marker_tokens`` are the tokens of generated ``think_start``/``think_end`` markers
    (counted neither as think nor as output); ``marker_progress`` is, in PREFILL, the
    ``think_start`` tokens matched so far and, in THINK, the KMP state of the ``think_end``
    match; ``forced`` is set (only in THINK) when the budget fired.

    The scheduling policy's facts (unused by the forcer): ``cap``, the think length a hard-cap
    force ends at (``None``: forcing off); ``num_prompt_tokens``; ``tracked_at``, its clock when
    tracking began (the admission order's wait); ``preempted`` and ``readmitted_step`` (the
    re-admission guard).
    """

    request_id: str
    format: ReasoningFormat
    phase: Phase
    num_think_tokens: int = 0
    num_output_tokens: int = 0
    num_marker_tokens: int = 0
    num_generated_tokens: int = 0
    marker_progress: int = 0
    forced: ForceReason | None = None
    # Think tokens the prompt already holds (ReasoningFormat rule 5): not generated, not in the
    # counts above, but part of the reasoning a think budget bounds (num_reasoning_tokens).
    num_prompt_think_tokens: int = 0
    cap: int | None = None
    num_prompt_tokens: int = 0
    tracked_at: float = 0.0
    preempted: bool = False
    readmitted_step: int | None = None

    def num_after_think(self, num_output_tokens: int) -> int:
        """Of the ``num_output_tokens`` the request generated (the engine's count), those after
        its think tokens: boundary markers and answer (what the length model calls the rest).

        NOTE: the engine's count, not ``num_output_tokens`` here: once a request answers, its
        tokens are no longer fed through :func:`advance` (a phase never changes again; the
        tracker counts answer streams in bulk), so this state's own output count stops there.
        """
        return num_output_tokens - self.num_think_tokens

    def num_answer_tokens(self, num_output_tokens: int) -> int:
        """Of the ``num_output_tokens`` the request generated (the engine's count), its answer
        tokens: neither think nor boundary-marker tokens, nor tokens still deciding a PREFILL
        request's phase."""
        pending = self.marker_progress if self.phase is PREFILL else 0
        return max(0, self.num_after_think(num_output_tokens) - self.num_marker_tokens - pending)

    @property
    def num_reasoning_tokens(self) -> int:
        """The think tokens a think budget counts: the prompt's and the generated ones (the one
        count the logits processor's forcing and the scheduler's policy both go by)."""
        return self.num_prompt_think_tokens + self.num_think_tokens


def start(request_id: str, fmt: ReasoningFormat, prompt_token_ids: Sequence[int]) -> RequestState:
    """A new request's state, in the phase its prompt starts it in."""
    phase, num_prompt_think_tokens = fmt.prompt_start(prompt_token_ids)
    return RequestState(request_id, fmt, phase, num_prompt_think_tokens=num_prompt_think_tokens)


def reasoned(st: RequestState) -> bool:
    """The request had a think phase (it thought, or at least opened and closed one)."""
    return st.num_think_tokens > 0 or st.num_marker_tokens > 0


def thinks_on(st: RequestState, toks: Sequence[int]) -> bool:
    """Whether ``toks``, the next tokens of a request, only add think tokens: it is in THINK past
    its first token and they can neither complete ``think_end`` nor continue a partial match.
    The bulk paths' test: such a delta is :func:`count_think`, no event."""
    if st.phase is not THINK or not st.num_generated_tokens:
        return False
    end = st.format.end_marker
    single = end.single
    if single != MULTI:
        return single not in toks
    return st.marker_progress == 0 and end.alphabet.isdisjoint(toks)


def count_think(st: RequestState, n: int) -> None:
    """Count ``n`` think tokens that :func:`thinks_on` cleared (no event)."""
    st.num_think_tokens += n
    st.num_generated_tokens += n


def advance_many(
    states: Sequence[RequestState], token_ids: Sequence[Sequence[int]]
) -> list[Sequence[PhaseEvent]]:
    """:func:`advance` of each ``states[i]`` over ``token_ids[i]``; one event sequence each
    (mostly the shared empty one). The common cases are counted inline."""
    think, output = THINK, OUTPUT
    out: list[Sequence[PhaseEvent]] = []
    append = out.append
    for st, toks in zip(states, token_ids, strict=True):
        phase = st.phase
        if phase is output:
            n = len(toks)
            st.num_output_tokens += n
            st.num_generated_tokens += n
            append(NO_EVENTS)
            continue
        if phase is think:
            end = st.format.end_marker
            single = end.single
            no_end = (
                single not in toks
                if single != MULTI
                else st.marker_progress == 0 and end.alphabet.isdisjoint(toks)
            )
            if no_end and (
                st.num_generated_tokens or not toks or toks[0] != st.format.start_marker.single
            ):
                n = len(toks)
                st.num_think_tokens += n
                st.num_generated_tokens += n
                append(NO_EVENTS)
                continue
        append(advance(st, toks))
    return out


def advance(st: RequestState, toks: Sequence[int]) -> Sequence[PhaseEvent]:
    """Advance ``st`` over its next generated tokens ``toks``; the events they caused, in order
    (the rules are in the module docstring)."""
    n = len(toks)
    st.num_generated_tokens += n
    phase = st.phase
    if phase is OUTPUT:
        st.num_output_tokens += n
        return NO_EVENTS
    events: list[PhaseEvent] | None = None
    i = 0
    if phase is PREFILL:
        ids, k = st.format.start_marker.ids, st.marker_progress
        while i < n and toks[i] == ids[k]:
            i += 1
            k += 1
            if k == len(ids):
                break
        if k == len(ids):
            st.num_marker_tokens += k
            st.marker_progress = 0
            st.phase = phase = THINK
            events = [EnterThink(st.request_id)]
        elif i < n:
            # toks[i] cannot continue think_start: single-phase OUTPUT, pending tokens too.
            st.num_output_tokens += k
            st.marker_progress = 0
            st.phase = phase = OUTPUT
        else:
            st.marker_progress = k
            return NO_EVENTS
    if phase is THINK:
        fmt = st.format
        if i == 0 < n == st.num_generated_tokens and toks[0] == fmt.start_marker.single:
            # The model opened the block the prompt (or the parser) already opened: a marker.
            i = 1
            st.num_marker_tokens += 1
        end = fmt.end_marker
        done = -1  # index just past the completed think_end, if any
        if end.single != MULTI:
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
            return NO_EVENTS if events is None else tuple(events)
        m = len(end.ids)
        # The marker's tokens were provisionally counted as think tokens; take them back.
        st.num_think_tokens += done - i - m
        st.num_marker_tokens += m
        st.marker_progress = 0
        st.phase = OUTPUT
        exit_event = ExitThink(st.request_id, st.num_think_tokens, st.forced is not None)
        st.num_output_tokens += n - done
        return (exit_event,) if events is None else (*events, exit_event)
    st.num_output_tokens += n - i
    return NO_EVENTS if events is None else tuple(events)


def set_thought(st: RequestState, num_think_tokens: int) -> None:
    """Set a THINK request that has generated only think tokens to ``num_think_tokens`` of them
    (the forcer's replay jumps from one decision to the next)."""
    if st.phase is not THINK or st.num_generated_tokens != st.num_think_tokens:
        raise PhaseError(f"set_thought({st.request_id!r}): not a request that has only thought")
    st.num_think_tokens = st.num_generated_tokens = num_think_tokens


def mark_forced(st: RequestState, reason: ForceReason) -> None:
    """Record that the budget fired; the coming ``ExitThink`` will have ``forced``.

    Raises :class:`PhaseError` outside THINK or when the request was already forced (the budget
    fires once per think phase).
    """
    if st.phase is not THINK:
        raise PhaseError(
            f"mark_forced({st.request_id!r}, {reason.value}): the request is in "
            f"{st.phase.name}, not THINK; only a thinking request can be forced"
        )
    if st.forced is not None:
        raise PhaseError(
            f"mark_forced({st.request_id!r}, {reason.value}): already forced "
            f"({st.forced.value}); the budget fires once per request"
        )
    st.forced = reason


def integrity_problem(st: RequestState) -> str | None:
    """What is wrong with a live request's phase and counts, or ``None``."""
    fmt = st.format
    len_start, len_end = len(fmt.think_start), len(fmt.think_end)
    if min(st.num_think_tokens, st.num_output_tokens, st.num_marker_tokens) < 0:
        return "negative token count"
    if st.num_prompt_think_tokens < 0 or (st.num_prompt_think_tokens and st.phase is PREFILL):
        return "prompt think tokens negative, or held by a request that did not start thinking"
    pending = st.marker_progress if st.phase is PREFILL else 0
    counted = st.num_think_tokens + st.num_output_tokens + st.num_marker_tokens + pending
    if counted != st.num_generated_tokens:
        return f"think + output + marker + pending = {counted} != {st.num_generated_tokens}"
    if st.phase is PREFILL:
        if not fmt.has_boundaries or not 0 <= st.marker_progress < len_start:
            return "PREFILL needs boundaries and a partial think_start match"
        if st.num_think_tokens or st.num_output_tokens or st.num_marker_tokens or st.forced:
            return "PREFILL has counted tokens or a force"
    elif st.phase is THINK:
        if not fmt.has_boundaries or not 0 <= st.marker_progress < len_end:
            return "THINK needs boundaries and a partial think_end match"
        if st.num_output_tokens or st.num_marker_tokens not in (0, len_start):
            return "THINK has output tokens or end-marker tokens"
    elif st.phase is OUTPUT:
        if st.marker_progress:
            return "OUTPUT has a pending marker match"
        allowed = {0, len_end, len_start + len_end}
        if st.num_marker_tokens not in allowed:
            return f"OUTPUT marker tokens {st.num_marker_tokens} not in {sorted(allowed)}"
        if st.forced is not None and st.num_marker_tokens == 0:
            return "forced but think_end never seen"
    else:
        return f"live request in phase {st.phase.name}"
    return None
