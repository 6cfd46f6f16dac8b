"""A reasoning model's token format: its think boundaries in token ids, their marker automata,
and the phase a prompt starts a request in (:meth:`ReasoningFormat.prompt_start`, by the rules
of the table "The initial phase" in docs/architecture.md, first that applies).

NOTE: a marker is a token-id *sequence* (one id for ``<think>``-style special tokens, several for
Granite's prose markers), matched across token boundaries and across steps by a KMP automaton
compiled once per distinct marker (cached): the per-request state is one int, and each token
costs one dict lookup. Single-token markers take a fast path (an int compare, or one C-level
``in`` over a multi-token delta).

A request's *kind* before it answers follows from that phase, in one place
(:func:`expects_reasoning`): THINK and PREFILL are reasoning, OUTPUT is chat.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from meridian.config.boundaries import BoundaryIds, ModelDefinition
from meridian.core.types import Phase
from meridian.errors import BoundaryError

__all__ = ["MULTI", "Marker", "ReasoningFormat"]

# ``Marker.single`` when the marker has several tokens (token ids are never negative).
MULTI: Final = -1


def expects_reasoning(phase: Phase) -> bool:
    """Whether a request in ``phase``, before it answers, counts as reasoning: THINK, and PREFILL
    (undecided: the model may open a think block itself, as every ``gpt_oss`` and ``granite_3_2``
    request can); a request in OUTPUT from its start is chat. Ordering, admission and routing all
    read a request's kind here.

    >>> expects_reasoning(Phase.PREFILL), expects_reasoning(Phase.OUTPUT)
    (True, False)
    """
    return phase is not Phase.OUTPUT


@dataclass(frozen=True, slots=True)
class Marker:
    """A compiled marker: the KMP automaton of one token-id sequence.

    ``delta[j]`` maps a token to the next state when ``j`` tokens of the marker are matched;
    tokens absent from the dict go to state 0 (a token that does not occur in the marker can
    never extend a match). Reaching ``len(ids)`` means the marker is complete.
    """

    ids: tuple[int, ...]
    delta: tuple[dict[int, int], ...]
    single: int  # the id of a one-token marker, else MULTI
    alphabet: frozenset[int]  # the ids occurring in the marker


@functools.lru_cache(maxsize=256)
def _compile_marker(ids: tuple[int, ...]) -> Marker:
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
    single = ids[0] if m == 1 else MULTI
    return Marker(ids=ids, delta=tuple(delta), single=single, alphabet=frozenset(ids))


# The markers of a format without boundaries: never consulted (its requests are always OUTPUT),
# but they keep ``ReasoningFormat.start_marker``/``end_marker`` non-optional so the hot path needs
# no checks.
_NO_MARKER: Final = Marker(ids=(), delta=(), single=MULTI, alphabet=frozenset())


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


def _check_ids(name: str, ids: tuple[int, ...]) -> None:
    for t in ids:
        if not isinstance(t, int) or t < 0:
            raise BoundaryError(f"ReasoningFormat.{name} must hold token ids >= 0; got {list(ids)}")


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A model family's reasoning boundaries as token ids: how its requests' phases read.

    ``think_start == think_end == ()`` describes a model without reasoning: every request is a
    single-phase OUTPUT request. ``no_think`` is the token sequence of a "/no_think" directive
    (``()`` when the model has none). Instances are immutable and hashable; their marker automata
    are compiled once at construction (and shared between equal markers).

    >>> qwen3 = ReasoningFormat(think_start=(151667,), think_end=(151668,))
    >>> qwen3.has_boundaries
    True
    """

    think_start: tuple[int, ...]
    think_end: tuple[int, ...]
    newline_ids: frozenset[int] = frozenset()
    no_think: tuple[int, ...] = ()
    think_starts_in_prompt: bool = False
    start_marker: Marker = field(init=False, repr=False, compare=False)
    end_marker: Marker = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept lists/sets from callers, but store hashable tuples/frozensets.
        for name in ("think_start", "think_end", "no_think"):
            value = tuple(getattr(self, name))
            _check_ids(name, value)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "newline_ids", frozenset(self.newline_ids))
        if bool(self.think_start) != bool(self.think_end):
            raise BoundaryError(
                "ReasoningFormat: think_start and think_end must both be set or both be empty "
                f"(no reasoning); got {list(self.think_start)} and {list(self.think_end)}"
            )
        if self.think_start and self.think_start == self.think_end:
            raise BoundaryError(
                f"ReasoningFormat: think_start and think_end are the same ids "
                f"{list(self.think_start)}"
            )
        if self.think_starts_in_prompt and not self.think_start:
            raise BoundaryError(
                "ReasoningFormat: think_starts_in_prompt needs think_start/think_end token ids"
            )
        has = bool(self.think_start)
        object.__setattr__(
            self, "start_marker", _compile_marker(self.think_start) if has else _NO_MARKER
        )
        object.__setattr__(
            self, "end_marker", _compile_marker(self.think_end) if has else _NO_MARKER
        )

    @classmethod
    def from_boundaries(
        cls, definition: ModelDefinition, ids: BoundaryIds, no_think: tuple[int, ...] = ()
    ) -> ReasoningFormat:
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
    def without_reasoning(cls) -> ReasoningFormat:
        """A model with no think boundaries: every request is single-phase OUTPUT."""
        return cls(think_start=(), think_end=())

    @property
    def single_think_end(self) -> int | None:
        """The id of a one-token ``think_end`` (``None``: a longer marker, or none)."""
        single = self.end_marker.single
        return None if single == MULTI else single

    @property
    def has_boundaries(self) -> bool:
        """True when the model has a think phase at all."""
        return bool(self.think_start)

    def initial_phase(self, prompt_token_ids: Sequence[int]) -> Phase:
        """The phase a request starts in (pure; :meth:`prompt_start`)."""
        return self.prompt_start(prompt_token_ids)[0]

    def prompt_start(self, prompt_token_ids: Sequence[int]) -> tuple[Phase, int]:
        """The phase a request starts in and the think tokens its prompt already holds (its
        ``num_prompt_think_tokens``), by the rules of docs/architecture.md's "The initial
        phase" table, in its order (pure).

        >>> m = ReasoningFormat(think_start=(7,), think_end=(8,), newline_ids=frozenset({10}))
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
            # NOTE: Meridian's addition. The template opened and closed the block (thinking
            # disabled); without this rule think_starts_in_prompt would keep it in THINK forever.
            return Phase.OUTPUT, 0
        opened = _rfind(prompt, self.think_start)
        # vLLM's last_start > last_end: no think_end begins at or after the last think_start.
        # The reasoning started in the prompt (a raw completion prompt, a client continuing a cut
        # stream): its tokens after the marker (newlines right after it excepted) count toward
        # the think budget, as vLLM's thinking_token_budget counts them, but no think-token count
        # or metric holds them (they were not generated).
        if opened >= 0 and not _contains(prompt[opened:], self.think_end):
            reasoning = opened + len(self.think_start)
            while reasoning < len(prompt) and prompt[reasoning] in self.newline_ids:
                reasoning += 1
            return Phase.THINK, len(prompt) - reasoning
        if self.think_starts_in_prompt:
            return Phase.THINK, 0
        return Phase.PREFILL, 0
