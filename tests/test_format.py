"""Tests of ``meridian.core.format``: a reasoning model's token format (validation, the marker
automata, and the rules for the phase a request starts in)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config.boundaries import BUNDLED_MODELS, BoundaryIds
from meridian.core.format import MULTI, ReasoningFormat
from meridian.core.types import Phase
from meridian.errors import BoundaryError

THINK, END, NL = 151667, 151668, 198
QWEN3 = ReasoningFormat(think_start=(THINK,), think_end=(END,), newline_ids=frozenset({NL}))
R1 = ReasoningFormat(
    think_start=(THINK,), think_end=(END,), newline_ids=frozenset({NL}), think_starts_in_prompt=True
)
NO_THINK = (10, 11)  # "/no_think" as two tokens
QWEN3_NT = ReasoningFormat(
    think_start=(THINK,), think_end=(END,), newline_ids=frozenset({NL}), no_think=NO_THINK
)
# Granite prose markers: "Here is my thought process:" / "Here is my response:".
HERE, IS, MY, THOUGHT, PROCESS, RESPONSE, COLON = 500, 501, 502, 503, 504, 505, 506
GRANITE = ReasoningFormat(
    think_start=(HERE, IS, MY, THOUGHT, PROCESS, COLON),
    think_end=(HERE, IS, MY, RESPONSE, COLON),
    newline_ids=frozenset({NL}),
)


# -- the format itself -------------------------------------------------------------------------


def test_from_boundaries_keeps_no_think_only_when_supported() -> None:
    ids = BoundaryIds((THINK,), (END,), frozenset({NL}))
    qwen3 = ReasoningFormat.from_boundaries(BUNDLED_MODELS["qwen3"], ids, no_think=NO_THINK)
    assert qwen3.no_think == NO_THINK
    assert qwen3.newline_ids == frozenset({NL})
    assert qwen3.think_starts_in_prompt  # as vLLM's qwen3 parser: reasoning from the start
    r1 = ReasoningFormat.from_boundaries(BUNDLED_MODELS["deepseek_r1"], ids, no_think=NO_THINK)
    assert r1.no_think == ()
    assert r1.think_starts_in_prompt


def test_format_is_hashable_and_coerces_lists() -> None:
    a = ReasoningFormat(think_start=[1, 2], think_end=[3], newline_ids={4})  # type: ignore[arg-type]
    b = ReasoningFormat(think_start=(1, 2), think_end=(3,), newline_ids=frozenset({4}))
    assert a == b and hash(a) == hash(b)
    assert a.think_start == (1, 2)


@pytest.mark.parametrize(
    ("start", "end", "in_prompt", "match"),
    [
        ((1,), (), False, "both be set"),
        ((), (2,), False, "both be set"),
        ((1,), (1,), False, "same ids"),
        ((), (), True, "think_starts_in_prompt"),
        ((-1,), (2,), False, ">= 0"),
    ],
)
def test_format_rejects_bad_boundaries(
    start: tuple[int, ...], end: tuple[int, ...], in_prompt: bool, match: str
) -> None:
    with pytest.raises(BoundaryError, match=match):
        ReasoningFormat(think_start=start, think_end=end, think_starts_in_prompt=in_prompt)


def test_boundaries_and_the_single_token_end() -> None:
    assert QWEN3.has_boundaries and QWEN3.single_think_end == END
    assert QWEN3.end_marker.single == END
    assert GRANITE.single_think_end is None and GRANITE.end_marker.single == MULTI
    assert GRANITE.end_marker.alphabet == frozenset({HERE, IS, MY, RESPONSE, COLON})
    plain = ReasoningFormat.without_reasoning()
    assert not plain.has_boundaries and plain.single_think_end is None


def test_marker_automaton_is_cached_and_shared() -> None:
    a = ReasoningFormat(think_start=(1, 2), think_end=(3, 4, 3))
    b = ReasoningFormat(think_start=(9,), think_end=(3, 4, 3))
    c = ReasoningFormat(think_start=(3, 4, 3), think_end=(5,))
    # One automaton per distinct marker, whichever format or role it is compiled for.
    assert a.end_marker is b.end_marker is c.start_marker
    assert a.end_marker.ids == (3, 4, 3)


def naive_find(hay: Sequence[int], needle: Sequence[int]) -> int:
    """Index just past the first occurrence of needle in hay, or -1."""
    k = len(needle)
    for i in range(len(hay) - k + 1):
        if list(hay[i : i + k]) == list(needle):
            return i + k
    return -1


def kmp_find(hay: Sequence[int], needle: tuple[int, ...]) -> int:
    """The same search by the format's compiled ``think_end`` automaton."""
    marker, state = ReasoningFormat(think_start=(99,), think_end=needle).end_marker, 0
    for i, tok in enumerate(hay):
        state = marker.delta[state].get(tok, 0)
        if state == len(needle):
            return i + 1
    return -1


@settings(max_examples=300, deadline=None)
@given(
    needle=st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple),
    hay=st.lists(st.integers(0, 2), max_size=30),
)
def test_kmp_automaton_matches_naive_search(needle: tuple[int, ...], hay: list[int]) -> None:
    assert kmp_find(hay, needle) == naive_find(hay, needle)


# -- the initial phase ------------------------------------------------------------------------


# (format, prompt, the phase it starts in), one case per rule of the module docstring.
INITIAL_PHASES: list[tuple[ReasoningFormat, list[int], Phase]] = [
    (ReasoningFormat.without_reasoning(), [1, 2, THINK], Phase.OUTPUT),  # rule 1
    (QWEN3_NT, [1, *NO_THINK, 2, THINK], Phase.OUTPUT),  # rule 2 beats the tail
    (QWEN3, [1, *NO_THINK, 2], Phase.PREFILL),  # no no_think support: ignored
    (QWEN3_NT, [1, NO_THINK[0], 2, NO_THINK[1]], Phase.PREFILL),  # not contiguous
    (QWEN3, [1, 2, THINK], Phase.THINK),  # rule 3
    (QWEN3, [1, 2, THINK, NL], Phase.THINK),  # rule 3 with newline tail
    (QWEN3, [1, 2, THINK, NL, NL], Phase.THINK),
    (QWEN3, [THINK, NL, NL, END, NL, NL], Phase.OUTPUT),  # rule 4: closed in the prompt
    (R1, [THINK, END, NL], Phase.OUTPUT),  # rule 4 beats think_starts_in_prompt
    (QWEN3, [1, THINK, 2], Phase.THINK),  # rule 5: reasoning started in the prompt
    (QWEN3, [1, THINK, END, 2, THINK, NL, 3, 4], Phase.THINK),  # the last block is open
    (QWEN3, [1, THINK, 2, END, 3], Phase.PREFILL),  # the last block is closed: rule 7
    (QWEN3, [1, END, 3], Phase.PREFILL),
    (R1, [1, 2], Phase.THINK),  # rule 6
    (R1, [], Phase.THINK),
    (QWEN3, [1, 2], Phase.PREFILL),  # rule 7
    (QWEN3, [], Phase.PREFILL),
    (GRANITE, [1, HERE, IS, MY, THOUGHT, PROCESS, COLON, NL], Phase.THINK),
    (GRANITE, [1, IS, MY, THOUGHT, PROCESS, COLON], Phase.PREFILL),  # partial marker
]


@pytest.mark.parametrize(("fmt", "prompt", "phase"), INITIAL_PHASES)
def test_initial_phase_rules(fmt: ReasoningFormat, prompt: list[int], phase: Phase) -> None:
    assert fmt.initial_phase(prompt) is phase
    assert fmt.prompt_start(prompt)[0] is phase
    assert fmt.initial_phase(tuple(prompt)) is phase  # any sequence, not only lists


# (format, prompt, the think tokens it holds): rule 5's count.
PROMPT_THINK: list[tuple[ReasoningFormat, list[int], int]] = [
    (QWEN3, [1, THINK, NL], 0),  # the template's "<think>\n": no reasoning yet
    (QWEN3, [1, THINK, NL, 20, 7, 21], 3),  # "<think>\n20 7;": the newline is not counted
    (QWEN3, [1, THINK, 20, NL, 7], 3),  # a newline inside the reasoning is
    (QWEN3, [THINK, 5, END, 6, THINK, 8, 9], 2),  # only the open block's
    (QWEN3_NT, [*NO_THINK, THINK, 8, 9], 0),  # rule 2 first: no reasoning
    (R1, [1, 2], 0),  # rule 6: the parser's reasoning, none in the prompt
    (GRANITE, [1, HERE, IS, MY, THOUGHT, PROCESS, COLON, NL, 7, 8], 2),
    (GRANITE, [HERE, IS, MY, THOUGHT, PROCESS, COLON, 7, HERE, IS, MY, RESPONSE, COLON, 9], 0),
]


@pytest.mark.parametrize(("fmt", "prompt", "num_prompt_think"), PROMPT_THINK)
def test_the_think_tokens_a_prompt_already_holds(
    fmt: ReasoningFormat, prompt: list[int], num_prompt_think: int
) -> None:
    """Rule 5: the tokens after the prompt's open think_start (newlines right after it
    excepted) are the request's prompt think tokens."""
    assert fmt.prompt_start(prompt)[1] == num_prompt_think


def ends_with_marker(
    prompt: Sequence[int], marker: tuple[int, ...], newlines: frozenset[int]
) -> bool:
    """Rules 3 and 4 read plainly: ``prompt`` ends with ``marker``, newlines after it aside."""
    for end in range(len(prompt), -1, -1):
        if end >= len(marker) and tuple(prompt[end - len(marker) : end]) == marker:
            return True
        if end == 0 or prompt[end - 1] not in newlines:
            return False
    return False


@settings(max_examples=400, deadline=None)
@given(
    fmt=st.sampled_from(
        [
            QWEN3,  # one-token markers: the prompt's last token that is not a newline decides
            ReasoningFormat(think_start=(THINK, NL), think_end=(END,), newline_ids={NL}),
            ReasoningFormat(think_start=(NL,), think_end=(END,), newline_ids={NL}),
            ReasoningFormat(think_start=(THINK, 5), think_end=(5, END), newline_ids={NL}),
        ]
    ),
    prompt=st.lists(st.sampled_from([1, 5, THINK, END, NL]), max_size=12),
)
def test_a_prompt_ending_with_a_marker_starts_in_its_phase(
    fmt: ReasoningFormat, prompt: list[int]
) -> None:
    """Rules 3 and 4 (think_start, then think_end, at the prompt's tail) for one-token markers and
    longer ones alike."""
    phase, num_think = fmt.prompt_start(prompt)
    if ends_with_marker(prompt, fmt.think_start, fmt.newline_ids):
        assert (phase, num_think) == (Phase.THINK, 0)
    elif ends_with_marker(prompt, fmt.think_end, fmt.newline_ids):
        assert (phase, num_think) == (Phase.OUTPUT, 0)
    else:
        assert (phase, num_think) != (Phase.OUTPUT, 0)  # rules 5-7 never make it answer


def test_prompt_tail_marker_that_itself_ends_with_a_newline_token() -> None:
    fmt = ReasoningFormat(think_start=(7, NL), think_end=(8,), newline_ids=frozenset({NL}))
    assert fmt.initial_phase([1, 7, NL]) is Phase.THINK
    assert fmt.initial_phase([1, 7, NL, NL]) is Phase.THINK
    assert fmt.initial_phase([1, 7]) is Phase.PREFILL
