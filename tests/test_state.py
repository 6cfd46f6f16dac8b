"""Tests of ``meridian.core.state``: a request's phase and counts and the one function that moves
them (``advance``), its batched form (``advance_many``) and the bulk count (``thinks_on`` /
``count_think``), forcing, the integrity check, and hypothesis properties checked against a
naive reference implementation over any chunking of a token stream."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.core.format import ReasoningFormat
from meridian.core.state import (
    NO_EVENTS,
    PhaseError,
    RequestState,
    advance,
    advance_many,
    count_think,
    integrity_problem,
    mark_forced,
    reasoned,
    set_thought,
    start,
    thinks_on,
)
from meridian.core.types import EnterThink, ExitThink, ForceReason, Phase, PhaseEvent
from meridian.errors import MeridianError
from test_format import (
    COLON,
    END,
    GRANITE,
    HERE,
    INITIAL_PHASES,
    IS,
    MY,
    NL,
    NO_THINK,
    PROCESS,
    PROMPT_THINK,
    QWEN3,
    QWEN3_NT,
    RESPONSE,
    THINK,
    THOUGHT,
    naive_find,
)


def intact(st: RequestState) -> None:
    assert integrity_problem(st) is None, integrity_problem(st)


# -- start ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "prompt", "phase"), INITIAL_PHASES)
def test_a_request_starts_in_the_phase_its_prompt_gives(
    fmt: ReasoningFormat, prompt: list[int], phase: Phase
) -> None:
    s = start("r", fmt, prompt)
    assert (s.request_id, s.format, s.phase) == ("r", fmt, phase)
    assert s.num_generated_tokens == s.num_think_tokens == s.num_output_tokens == 0
    intact(s)


@pytest.mark.parametrize(("fmt", "prompt", "num_prompt_think"), PROMPT_THINK)
def test_reasoning_started_in_the_prompt_counts_toward_the_budget(
    fmt: ReasoningFormat, prompt: list[int], num_prompt_think: int
) -> None:
    """The think tokens after the prompt's open think_start: in the budget's count
    (num_reasoning_tokens), not in the generated counts."""
    s = start("r", fmt, prompt)
    assert s.num_prompt_think_tokens == num_prompt_think
    advance(s, [5, 6])
    if s.phase is Phase.THINK:
        assert (s.num_think_tokens, s.num_reasoning_tokens) == (2, num_prompt_think + 2)
    intact(s)


def test_no_think_tokens_then_generated_think_block_is_plain_output() -> None:
    s = start("r", QWEN3_NT, [1, *NO_THINK])
    assert advance(s, [THINK, NL, END, NL, 5, 6]) == ()
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 0, 6)
    assert not reasoned(s)


# -- PREFILL -> THINK / OUTPUT ----------------------------------------------------------------


def test_generated_think_start_enters_think_and_is_not_counted() -> None:
    s = start("r", QWEN3, [1, 2])
    assert advance(s, [THINK]) == (EnterThink("r"),)
    advance(s, [5, 6, 7])
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.THINK, 3, 0)
    intact(s)


def feed_bulk(s: RequestState, toks: Sequence[int]) -> Sequence[PhaseEvent]:
    """The tracker's general way: a delta that only adds think tokens is counted in bulk, any
    other is advanced."""
    if thinks_on(s, toks):
        count_think(s, len(toks))
        return NO_EVENTS
    return advance(s, toks)


def test_think_start_repeated_first_is_a_marker_only_as_the_first_token() -> None:
    # Qwen3 under vLLM's qwen3 parser: THINK from the start; the model still emits <think>.
    fmt = ReasoningFormat(think_start=(THINK,), think_end=(END,), think_starts_in_prompt=True)
    stream = [THINK, 5, THINK, 6, END, 9]
    for feed in ("one", "chunk", "many", "bulk"):
        s = start("r", fmt, [1, 2])
        if feed == "one":
            for tok in stream:
                advance(s, [tok])
        elif feed == "chunk":
            advance(s, stream)
        elif feed == "many":
            advance_many([s], [stream[:2]])
            advance_many([s], [stream[2:]])
        else:
            for tok in stream:
                feed_bulk(s, [tok])
        # The leading <think> is a marker; a later one is an ordinary think token.
        assert (s.num_think_tokens, s.num_marker_tokens, s.num_output_tokens) == (3, 2, 1), feed
        intact(s)


def test_prefill_decides_output_when_first_token_is_not_think_start() -> None:
    s = start("r", QWEN3, [1, 2])
    assert advance(s, [5]) == ()
    assert s.phase is Phase.OUTPUT
    advance(s, [THINK, END])  # later boundaries are plain output
    assert (s.num_think_tokens, s.num_output_tokens) == (0, 3)


def test_granite_think_start_split_across_deltas() -> None:
    s = start("r", GRANITE, [1, 2])
    for tok in (HERE, IS, MY):
        assert advance(s, [tok]) == ()
        assert s.phase is Phase.PREFILL
        intact(s)
    assert advance(s, [THOUGHT, PROCESS]) == ()
    assert advance(s, [COLON, 9]) == (EnterThink("r"),)
    assert (s.phase, s.num_think_tokens, s.num_marker_tokens) == (Phase.THINK, 1, 6)
    intact(s)


def test_granite_partial_think_start_then_mismatch_counts_all_as_output() -> None:
    s = start("r", GRANITE, [1, 2])
    advance(s, [HERE, IS])
    assert s.phase is Phase.PREFILL
    intact(s)
    assert advance(s, [MY, RESPONSE, 7]) == ()
    assert (s.phase, s.num_output_tokens, s.num_think_tokens) == (Phase.OUTPUT, 5, 0)
    intact(s)


# -- THINK -> OUTPUT ---------------------------------------------------------------------------


def test_think_end_exits_with_counts_and_trailing_output() -> None:
    s = start("r", QWEN3, [1, THINK, NL])
    assert advance(s, [5, 6]) == ()
    assert advance(s, [7, END, 8, 9]) == (ExitThink("r", 3, False),)
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 3, 2)
    assert advance(s, [END, THINK]) == ()  # ExitThink at most once
    assert s.num_output_tokens == 4
    assert reasoned(s)
    intact(s)


def test_one_delta_can_enter_and_exit_think() -> None:
    s = start("r", QWEN3, [1])
    assert advance(s, [THINK, 5, 6, END, 7]) == (EnterThink("r"), ExitThink("r", 2, False))
    assert (s.num_think_tokens, s.num_output_tokens, s.num_marker_tokens) == (2, 1, 2)


def test_an_empty_think_phase_still_reasoned() -> None:
    s = start("r", QWEN3, [1, THINK])
    assert advance(s, [END, 9]) == (ExitThink("r", 0, False),)
    assert s.num_think_tokens == 0 and reasoned(s)  # it opened and closed a think phase


def test_granite_think_end_split_across_deltas() -> None:
    s = start("r", GRANITE, [1, HERE, IS, MY, THOUGHT, PROCESS, COLON])
    advance(s, [5, 6, HERE])
    advance(s, [IS])
    assert s.phase is Phase.THINK
    intact(s)
    assert advance(s, [MY, RESPONSE]) == ()
    assert advance(s, [COLON, 8]) == (ExitThink("r", 2, False),)
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 2, 1)


def test_granite_failed_partial_end_match_counts_as_think() -> None:
    s = start("r", GRANITE, [HERE, IS, MY, THOUGHT, PROCESS, COLON])
    # "Here is my thought" inside the reasoning, then a restart of the marker that completes.
    advance(s, [HERE, IS, MY, THOUGHT, HERE])
    assert advance(s, [HERE, IS, MY, RESPONSE, COLON]) == (ExitThink("r", 5, False),)


def test_overlapping_end_marker_needs_kmp_fallback() -> None:
    s = start("r", ReasoningFormat(think_start=(1,), think_end=(2, 2, 3)), [1])
    # A naive restart-from-zero matcher misses the match that begins at the second 2.
    advance(s, [2, 2])
    assert advance(s, [2, 3]) == (ExitThink("r", 1, False),)


def test_no_events_returns_the_shared_empty_tuple() -> None:
    s = start("r", QWEN3, [THINK])
    first = advance(s, [5])
    assert first == () and first is NO_EVENTS and first is advance(s, [6, 7])
    other = start("o", QWEN3, [1])
    advance(other, [9])
    assert all(events is NO_EVENTS for events in advance_many([s, other], [[8], [9, 9]]))


def test_advance_many_needs_one_delta_per_state() -> None:
    s = start("r", QWEN3, [THINK])
    with pytest.raises(ValueError, match="zip"):
        advance_many([s], [[1], [2]])


# -- the bulk count ---------------------------------------------------------------------------


def test_thinks_on_clears_only_deltas_that_cannot_end_the_think_phase() -> None:
    s = start("r", QWEN3, [THINK])
    assert not thinks_on(s, [5]), "the first token may repeat think_start: advance decides"
    advance(s, [5])
    assert thinks_on(s, [5, 6]) and thinks_on(s, [THINK])
    assert not thinks_on(s, [5, END])
    count_think(s, 2)
    assert (s.num_think_tokens, s.num_generated_tokens) == (3, 3)
    intact(s)
    advance(s, [END])
    assert not thinks_on(s, [5]), "an answer is no think token"
    assert not thinks_on(start("p", QWEN3, [1]), [5]), "nor a prompt still deciding"
    g = start("g", GRANITE, [HERE, IS, MY, THOUGHT, PROCESS, COLON, NL])
    advance(g, [5])
    assert thinks_on(g, [5, 6]) and not thinks_on(g, [5, MY])  # a token of the end marker
    advance(g, [HERE])
    assert not thinks_on(g, [5]), "a partial end-marker match pending"


# -- forcing -----------------------------------------------------------------------------------


def test_mark_forced_sets_forced_on_exit() -> None:
    s = start("r", QWEN3, [THINK])
    advance(s, [5, 6])
    mark_forced(s, ForceReason.CONVERGED)
    assert s.forced is ForceReason.CONVERGED
    assert advance(s, [END]) == (ExitThink("r", 2, True),)
    intact(s)


def test_mark_forced_outside_think_or_twice_raises() -> None:
    s = start("r", QWEN3, [1])
    with pytest.raises(PhaseError, match="PREFILL, not THINK"):
        mark_forced(s, ForceReason.HARD_CAP)
    advance(s, [THINK, 5])
    mark_forced(s, ForceReason.HARD_CAP)
    with pytest.raises(PhaseError, match="already forced"):
        mark_forced(s, ForceReason.OVERTHINKING)
    advance(s, [END])
    with pytest.raises(PhaseError, match="OUTPUT, not THINK") as info:
        mark_forced(s, ForceReason.CONVERGED)
    assert isinstance(info.value, MeridianError) and isinstance(info.value, ValueError)
    assert s.forced is ForceReason.HARD_CAP


# -- integrity ---------------------------------------------------------------------------------


def test_integrity_problem_detects_corruption() -> None:
    s = start("r", QWEN3, [THINK])
    advance(s, [5, 6])
    intact(s)
    s.num_think_tokens += 1
    assert "think + output" in str(integrity_problem(s))
    s.num_think_tokens -= 1
    s.num_output_tokens = 1
    s.num_generated_tokens += 1
    assert "THINK has output tokens" in str(integrity_problem(s))
    o = start("o", QWEN3, [1, 2])
    advance(o, [9])
    o.forced = ForceReason.HARD_CAP
    assert "forced but think_end never seen" in str(integrity_problem(o))
    p = start("p", QWEN3, [1, 2])
    p.num_prompt_think_tokens = 3
    assert "prompt think tokens" in str(integrity_problem(p))
    p.num_prompt_think_tokens = 0
    p.phase = Phase.COMPLETE
    assert "live request in phase COMPLETE" in str(integrity_problem(p))


# -- properties --------------------------------------------------------------------------------


@dataclass
class Expected:
    phase: Phase
    num_think: int
    num_output: int
    events: list[PhaseEvent]
    num_prompt_think: int = 0


def reference(fmt: ReasoningFormat, prompt: list[int], stream: list[int]) -> Expected:
    """The rules of the modules' docstrings, written naively over the whole stream. The
    ``EnterThink`` of a request that starts thinking is listed first (the tracker reports it)."""
    rid = "r"
    begin, end, nl = list(fmt.think_start), list(fmt.think_end), fmt.newline_ids

    def tail_is(marker: list[int]) -> bool:
        p = list(prompt)
        while True:
            if len(p) >= len(marker) and p[len(p) - len(marker) :] == marker:
                return True
            if not p or p[-1] not in nl:
                return False
            p.pop()

    def last(marker: list[int]) -> int:
        found = [i for i in range(len(prompt)) if prompt[i : i + len(marker)] == marker]
        return found[-1] if found else -1

    if not begin or (fmt.no_think and naive_find(prompt, fmt.no_think) >= 0):
        return Expected(Phase.OUTPUT, 0, len(stream), [])
    events: list[PhaseEvent] = []
    prompt_think = 0
    if tail_is(begin):
        think_from = 0
        events.append(EnterThink(rid))
    elif tail_is(end):
        return Expected(Phase.OUTPUT, 0, len(stream), [])
    elif last(begin) > last(end) or fmt.think_starts_in_prompt:
        think_from = 0
        events.append(EnterThink(rid))
        if last(begin) > last(end):
            reasoning = prompt[last(begin) + len(begin) :]
            while reasoning and reasoning[0] in nl:
                reasoning.pop(0)
            prompt_think = len(reasoning)
    else:
        head = stream[: len(begin)]
        if head == begin:
            think_from = len(begin)
            events.append(EnterThink(rid))
        elif head == begin[: len(head)]:
            return Expected(Phase.PREFILL, 0, 0, [])
        else:
            return Expected(Phase.OUTPUT, 0, len(stream), [])
    if think_from == 0 and len(begin) == 1 and stream[:1] == begin:
        think_from = 1  # a THINK request's first token repeating think_start: a marker
    done = naive_find(stream[think_from:], end)
    if done < 0:
        return Expected(Phase.THINK, len(stream) - think_from, 0, events, prompt_think)
    num_think = done - len(end)
    events.append(ExitThink(rid, num_think, False))
    return Expected(Phase.OUTPUT, num_think, len(stream) - think_from - done, events, prompt_think)


ALPHABET = st.integers(0, 4)
markers = st.lists(ALPHABET, min_size=1, max_size=3).map(tuple)


@st.composite
def formats(draw: st.DrawFn) -> ReasoningFormat:
    if draw(st.integers(0, 9)) == 0:
        return ReasoningFormat.without_reasoning()
    begin = draw(markers)
    end = draw(markers.filter(lambda m: m != begin))
    return ReasoningFormat(
        think_start=begin,
        think_end=end,
        newline_ids=frozenset(draw(st.sets(ALPHABET, max_size=1))),
        no_think=draw(st.one_of(st.just(()), markers)),
        think_starts_in_prompt=draw(st.booleans()),
    )


def chunked(stream: list[int], cuts: list[int]) -> Iterator[list[int]]:
    """Split ``stream`` at the (sorted, deduplicated) cut points; empty chunks allowed."""
    prev = 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts):
        yield stream[prev:cut]
        prev = cut
    yield stream[prev:]


def started_events(s: RequestState) -> list[PhaseEvent]:
    """What a request that starts thinking reports at its start."""
    return [EnterThink(s.request_id)] if s.phase is Phase.THINK else []


@settings(max_examples=400, deadline=None)
@given(
    fmt=formats(),
    prompt=st.lists(ALPHABET, max_size=8),
    stream=st.lists(ALPHABET, max_size=25),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_state_matches_reference_for_any_chunking(
    fmt: ReasoningFormat, prompt: list[int], stream: list[int], cuts: list[int]
) -> None:
    """Token by token, in chunks, batched beside another request (``advance_many``), and
    with the bulk count first (``thinks_on`` / ``count_think``, else ``advance``): the same
    phase, counts and events as the reference."""
    want = reference(fmt, prompt, stream)
    other = start("other", fmt, prompt)

    def batched(s: RequestState, chunk: Sequence[int]) -> Sequence[PhaseEvent]:
        return advance_many([other, s], [chunk[:1], chunk])[1]

    def bulk(s: RequestState, chunk: Sequence[int]) -> Sequence[PhaseEvent]:
        cleared = thinks_on(s, chunk)
        if cleared:
            assert s.phase is Phase.THINK and naive_find(chunk, fmt.think_end) < 0
        return feed_bulk(s, chunk)

    feeds: list[tuple[str, Callable[[RequestState, Sequence[int]], Sequence[PhaseEvent]]]] = [
        ("chunks", advance),
        ("batched", batched),
        ("bulk", bulk),
    ]
    runs: list[tuple[str, RequestState, list[PhaseEvent]]] = []
    s = start("r", fmt, prompt)
    events = started_events(s)
    for tok in stream:
        before = s.phase
        events.extend(advance(s, [tok]))
        assert s.phase >= before, "phases only move forward"
        intact(s)
    runs.append(("one by one", s, events))
    for name, feed in feeds:
        s = start("r", fmt, prompt)
        events = started_events(s)
        for chunk in chunked(stream, cuts):
            before = s.phase
            events.extend(feed(s, chunk))
            assert s.phase >= before, "phases only move forward"
            intact(s)
        runs.append((name, s, events))

    for name, s, events in runs:
        assert events == want.events, name
        assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (
            want.phase,
            want.num_think,
            want.num_output,
        ), name
        assert s.num_prompt_think_tokens == want.num_prompt_think
        assert s.num_generated_tokens == len(stream)
        assert sum(isinstance(e, ExitThink) for e in events) <= 1
        # think + output == observed - boundary-marker tokens (- a pending PREFILL prefix).
        pending = s.marker_progress if s.phase is Phase.PREFILL else 0
        assert s.num_think_tokens + s.num_output_tokens == len(stream) - s.num_marker_tokens - (
            pending
        )
        # It reasoned: its think phase ended, or it is thinking and generated something of it.
        exited = any(isinstance(e, ExitThink) for e in events)
        thought = s.phase is Phase.THINK and s.num_generated_tokens > 0
        assert reasoned(s) == (exited or thought), name


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(
        st.tuples(st.lists(ALPHABET, max_size=4), st.lists(ALPHABET, max_size=15)),
        min_size=1,
        max_size=12,
    ),
    fmt=formats(),
    order=st.randoms(use_true_random=False),
)
def test_interleaved_requests_are_independent(
    streams: list[tuple[list[int], list[int]]], fmt: ReasoningFormat, order: random.Random
) -> None:
    """Random batches of random deltas through ``advance_many``: each request ends as the
    reference says, whatever the others in its batches did."""
    rids = [f"r{i}" for i in range(len(streams))]
    states = {rid: start(rid, fmt, prompt) for rid, (prompt, _) in zip(rids, streams, strict=True)}
    cursors = dict.fromkeys(rids, 0)
    live = list(rids)
    while live:
        batch = order.sample(live, order.randint(1, len(live)))
        chunks = []
        for rid in batch:
            stream = streams[rids.index(rid)][1]
            n = order.randint(0, 3)
            chunks.append(stream[cursors[rid] : cursors[rid] + n])
            cursors[rid] += n
        advance_many([states[rid] for rid in batch], chunks)
        for rid in batch:
            intact(states[rid])
            if cursors[rid] >= len(streams[rids.index(rid)][1]):
                prompt, stream = streams[rids.index(rid)]
                want = reference(fmt, prompt, stream)
                s = states[rid]
                assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (
                    want.phase,
                    want.num_think,
                    want.num_output,
                )
                live.remove(rid)


def test_the_answer_count_of_the_engines_output_count() -> None:
    """Answer tokens are the engine's output count less think and marker tokens: the tokens fed
    through ``advance`` (which stops at the first answer tokens) agree with it."""
    fmt = ReasoningFormat(think_start=(7,), think_end=(8,))
    rs = start("r", fmt, [1, 7])
    stream = [20, 21, 22, 8, 30, 31]
    advance(rs, stream)
    assert rs.num_after_think(len(stream)) == 3  # the marker and two answer tokens
    assert rs.num_answer_tokens(len(stream)) == 2 == rs.num_output_tokens
    assert rs.num_answer_tokens(len(stream) + 5) == 7  # later answer tokens, counted by the engine
    pending = start("p", ReasoningFormat(think_start=(7, 9), think_end=(8,)), [1])
    advance(pending, [7])  # half a think_start: undecided, neither think nor answer
    assert pending.phase is Phase.PREFILL and pending.num_answer_tokens(1) == 0


def test_set_thought_only_moves_a_request_that_has_only_thought() -> None:
    fmt = ReasoningFormat(think_start=(7,), think_end=(8,))
    rs = RequestState("r", fmt, Phase.THINK)
    set_thought(rs, 5)
    assert (rs.num_think_tokens, rs.num_generated_tokens) == (5, 5)
    assert integrity_problem(rs) is None
    advance(rs, [8, 30])
    with pytest.raises(PhaseError, match="not a request that has only thought"):
        set_thought(rs, 9)
