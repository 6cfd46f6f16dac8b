"""Tests of the phase router: initial-phase rules, marker matching, counting, forcing, lifecycle,
threads, and hypothesis properties checked against a naive reference implementation."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meridian.core.router import (
    DuplicateRequestError,
    PhaseError,
    PhaseRouter,
    ReasoningFormat,
    UnknownRequestError,
    _compile_marker,
)

from meridian.config.boundaries import BUNDLED_MODELS, BoundaryIds
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


def started(model: ReasoningFormat, prompt: Sequence[int], rid: str = "r") -> PhaseRouter:
    router = PhaseRouter()
    router.start(rid, model, prompt)
    return router


# -- ReasoningFormat ----------------------------------------------------------------------------


def test_from_boundaries_keeps_no_think_only_when_supported() -> None:
    ids = BoundaryIds((THINK,), (END,), frozenset({NL}))
    qwen3 = ReasoningFormat.from_boundaries(BUNDLED_MODELS["qwen3"], ids, no_think=NO_THINK)
    assert qwen3.no_think == NO_THINK
    assert qwen3.newline_ids == frozenset({NL})
    assert qwen3.think_starts_in_prompt  # as vLLM's qwen3 parser: reasoning from the start
    r1 = ReasoningFormat.from_boundaries(BUNDLED_MODELS["deepseek_r1"], ids, no_think=NO_THINK)
    assert r1.no_think == ()
    assert r1.think_starts_in_prompt


def test_model_is_hashable_and_coerces_lists() -> None:
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
def test_model_rejects_bad_boundaries(
    start: tuple[int, ...], end: tuple[int, ...], in_prompt: bool, match: str
) -> None:
    with pytest.raises(BoundaryError, match=match):
        ReasoningFormat(think_start=start, think_end=end, think_starts_in_prompt=in_prompt)


def test_marker_automaton_is_cached_and_shared() -> None:
    a = ReasoningFormat(think_start=(1, 2), think_end=(3, 4, 3))
    b = ReasoningFormat(think_start=(9,), think_end=(3, 4, 3))
    assert a._end is b._end
    assert _compile_marker((3, 4, 3)) is a._end


def naive_find(hay: Sequence[int], needle: Sequence[int]) -> int:
    """Index just past the first occurrence of needle in hay, or -1."""
    k = len(needle)
    for i in range(len(hay) - k + 1):
        if list(hay[i : i + k]) == list(needle):
            return i + k
    return -1


def kmp_find(hay: Sequence[int], needle: tuple[int, ...]) -> int:
    marker, state = _compile_marker(needle), 0
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


# -- initial phase -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "prompt", "phase"),
    [
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
    ],
)
def test_initial_phase_rules(model: ReasoningFormat, prompt: list[int], phase: Phase) -> None:
    router = PhaseRouter()
    events = router.start("r", model, prompt)
    assert router.phase("r") is phase
    assert list(events) == ([EnterThink("r")] if phase is Phase.THINK else [])
    router.check_integrity()


@pytest.mark.parametrize(
    ("model", "prompt", "num_prompt_think"),
    [
        (QWEN3, [1, THINK, NL], 0),  # the template's "<think>\n": no reasoning yet
        (QWEN3, [1, THINK, NL, 20, 7, 21], 3),  # "<think>\n20 7;": the newline is not counted
        (QWEN3, [1, THINK, 20, NL, 7], 3),  # a newline inside the reasoning is
        (QWEN3, [THINK, 5, END, 6, THINK, 8, 9], 2),  # only the open block's
        (QWEN3_NT, [*NO_THINK, THINK, 8, 9], 0),  # rule 2 first: no reasoning
        (R1, [1, 2], 0),  # rule 6: the parser's reasoning, none in the prompt
        (GRANITE, [1, HERE, IS, MY, THOUGHT, PROCESS, COLON, NL, 7, 8], 2),
        (GRANITE, [HERE, IS, MY, THOUGHT, PROCESS, COLON, 7, HERE, IS, MY, RESPONSE, COLON, 9], 0),
    ],
)
def test_reasoning_started_in_the_prompt_counts_toward_the_budget(
    model: ReasoningModel, prompt: list[int], num_prompt_think: int
) -> None:
    """The think tokens after the prompt's open think_start: in the budget's count
    (num_reasoning_tokens), not in the generated counts."""
    router = started(model, prompt)
    s = router.state("r")
    assert s.num_prompt_think_tokens == num_prompt_think
    router.observe("r", [5, 6])
    if s.phase is Phase.THINK:
        assert (s.num_think_tokens, s.num_reasoning_tokens) == (2, num_prompt_think + 2)
    router.check_integrity()


def test_prompt_tail_marker_that_itself_ends_with_a_newline_token() -> None:
    model = ReasoningFormat(think_start=(7, NL), think_end=(8,), newline_ids=frozenset({NL}))
    assert started(model, [1, 7, NL]).phase("r") is Phase.THINK
    assert started(model, [1, 7, NL, NL]).phase("r") is Phase.THINK
    assert started(model, [1, 7]).phase("r") is Phase.PREFILL


def test_no_think_tokens_then_generated_think_block_is_plain_output() -> None:
    router = started(QWEN3_NT, [1, *NO_THINK])
    assert router.observe("r", [THINK, NL, END, NL, 5, 6]) == ()
    s = router.state("r")
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 0, 6)


# -- PREFILL -> THINK / OUTPUT ----------------------------------------------------------------


def test_generated_think_start_enters_think_and_is_not_counted() -> None:
    router = started(QWEN3, [1, 2])
    assert router.observe("r", THINK) == (EnterThink("r"),)
    router.observe("r", [5, 6, 7])
    s = router.state("r")
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.THINK, 3, 0)
    router.check_integrity()


def test_think_start_repeated_first_is_a_marker_only_as_the_first_token() -> None:
    # Qwen3 under vLLM's qwen3 parser: THINK from the start; the model still emits <think>.
    model = ReasoningFormat(think_start=(THINK,), think_end=(END,), think_starts_in_prompt=True)
    for feed in ("one", "chunk", "many"):
        router = started(model, [1, 2])
        stream = [THINK, 5, THINK, 6, END, 9]
        if feed == "one":
            for tok in stream:
                router.observe("r", tok)
        elif feed == "chunk":
            router.observe("r", stream)
        else:
            router.observe_many(["r"], [stream[:2]])
            router.observe_many(["r"], [stream[2:]])
        s = router.state("r")
        # The leading <think> is a marker; a later one is an ordinary think token.
        assert (s.num_think_tokens, s.num_marker_tokens, s.num_output_tokens) == (3, 2, 1), feed
        router.check_integrity()


def test_prefill_decides_output_when_first_token_is_not_think_start() -> None:
    router = started(QWEN3, [1, 2])
    assert router.observe("r", 5) == ()
    assert router.phase("r") is Phase.OUTPUT
    router.observe("r", [THINK, END])  # later boundaries are plain output
    s = router.state("r")
    assert (s.num_think_tokens, s.num_output_tokens) == (0, 3)


def test_granite_think_start_split_across_observe_calls() -> None:
    router = started(GRANITE, [1, 2])
    for tok in (HERE, IS, MY):
        assert router.observe("r", tok) == ()
        assert router.phase("r") is Phase.PREFILL
    assert router.observe("r", [THOUGHT, PROCESS]) == ()
    assert router.observe("r", [COLON, 9]) == (EnterThink("r"),)
    s = router.state("r")
    assert (s.phase, s.num_think_tokens, s.num_marker_tokens) == (Phase.THINK, 1, 6)
    router.check_integrity()


def test_granite_partial_think_start_then_mismatch_counts_all_as_output() -> None:
    router = started(GRANITE, [1, 2])
    router.observe("r", [HERE, IS])
    assert router.phase("r") is Phase.PREFILL
    router.check_integrity()
    assert router.observe("r", [MY, RESPONSE, 7]) == ()
    s = router.state("r")
    assert (s.phase, s.num_output_tokens, s.num_think_tokens) == (Phase.OUTPUT, 5, 0)
    router.check_integrity()


# -- THINK -> OUTPUT ---------------------------------------------------------------------------


def test_think_end_exits_with_counts_and_trailing_output() -> None:
    router = started(QWEN3, [1, THINK, NL])
    assert router.observe("r", [5, 6]) == ()
    assert router.observe("r", [7, END, 8, 9]) == (ExitThink("r", 3, False),)
    s = router.state("r")
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 3, 2)
    assert router.observe("r", [END, THINK]) == ()  # ExitThink at most once
    assert router.state("r").num_output_tokens == 4
    router.check_integrity()


def test_one_observe_can_enter_and_exit_think() -> None:
    router = started(QWEN3, [1])
    events = router.observe("r", [THINK, 5, 6, END, 7])
    assert events == (EnterThink("r"), ExitThink("r", 2, False))
    s = router.state("r")
    assert (s.num_think_tokens, s.num_output_tokens, s.num_marker_tokens) == (2, 1, 2)


def test_granite_think_end_split_across_calls() -> None:
    router = started(GRANITE, [1, HERE, IS, MY, THOUGHT, PROCESS, COLON])
    router.observe("r", [5, 6, HERE])
    router.observe("r", IS)
    assert router.phase("r") is Phase.THINK
    router.check_integrity()
    assert router.observe("r", [MY, RESPONSE]) == ()
    assert router.observe("r", [COLON, 8]) == (ExitThink("r", 2, False),)
    s = router.state("r")
    assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (Phase.OUTPUT, 2, 1)


def test_granite_failed_partial_end_match_counts_as_think() -> None:
    router = started(GRANITE, [HERE, IS, MY, THOUGHT, PROCESS, COLON])
    # "Here is my thought" inside the reasoning, then a restart of the marker that completes.
    router.observe("r", [HERE, IS, MY, THOUGHT, HERE])
    assert router.observe("r", [HERE, IS, MY, RESPONSE, COLON]) == (ExitThink("r", 5, False),)


def test_overlapping_end_marker_needs_kmp_fallback() -> None:
    model = ReasoningFormat(think_start=(1,), think_end=(2, 2, 3))
    router = started(model, [1])
    # A naive restart-from-zero matcher misses the match that begins at the second 2.
    router.observe("r", [2, 2])
    assert router.observe("r", [2, 3]) == (ExitThink("r", 1, False),)


def test_no_events_returns_the_shared_empty_tuple() -> None:
    router = started(QWEN3, [THINK])
    first = router.observe("r", 5)
    assert first == () and first is router.observe("r", [6, 7])
    assert first is router.observe_many(["r"], [[8]])[0]


# -- forcing -----------------------------------------------------------------------------------


def test_mark_forced_sets_forced_on_exit() -> None:
    router = started(QWEN3, [THINK])
    router.observe("r", [5, 6])
    assert router.can_mark_forced("r")
    assert router.mark_forced("r", ForceReason.CONVERGED) == ForceBudget("r", ForceReason.CONVERGED)
    assert not router.can_mark_forced("r")
    assert router.state("r").forced is ForceReason.CONVERGED
    assert router.observe("r", END) == (ExitThink("r", 2, True),)
    router.check_integrity()


def test_mark_forced_outside_think_or_twice_raises() -> None:
    router = started(QWEN3, [1])
    with pytest.raises(PhaseError, match="PREFILL, not THINK"):
        router.mark_forced("r", ForceReason.HARD_CAP)
    router.observe("r", [THINK, 5])
    router.mark_forced("r", ForceReason.HARD_CAP)
    with pytest.raises(PhaseError, match="already forced"):
        router.mark_forced("r", ForceReason.OVERTHINKING)
    router.observe("r", END)
    with pytest.raises(PhaseError, match="OUTPUT, not THINK"):
        router.mark_forced("r", ForceReason.CONVERGED)
    assert not router.can_mark_forced("r")


# -- lifecycle and errors ----------------------------------------------------------------------


def test_unknown_and_duplicate_requests_raise_clear_errors() -> None:
    router = started(QWEN3, [1])
    with pytest.raises(DuplicateRequestError, match="already tracked"):
        router.start("r", QWEN3, [1])
    for call in (
        lambda: router.observe("x", 1),
        lambda: router.observe_many(["r", "x"], [[1], [1]]),
        lambda: router.mark_forced("x", ForceReason.CONVERGED),
        lambda: router.phase("x"),
        lambda: router.state("x"),
    ):
        with pytest.raises(UnknownRequestError) as info:
            call()
        assert isinstance(info.value, KeyError) and isinstance(info.value, MeridianError)
        assert str(info.value).startswith("request 'x' is not tracked")


def test_observe_many_rejects_mismatched_lengths() -> None:
    router = started(QWEN3, [1])
    with pytest.raises(ValueError, match="1 request ids but 2 token lists"):
        router.observe_many(["r"], [[1], [2]])


def test_finish_is_idempotent_and_untracks() -> None:
    router = started(QWEN3, [THINK])
    state = router.state("r")
    assert router.tracked_requests == 1
    assert router.finish("r") == Complete("r")
    assert router.finish("r") is None
    assert router.finish("never") is None
    assert router.tracked_requests == 0
    assert state.phase is Phase.COMPLETE
    with pytest.raises(UnknownRequestError):
        router.phase("r")
    router.start("r", QWEN3, [1])  # the id can be reused after finish
    assert router.phase("r") is Phase.PREFILL


def test_check_integrity_detects_corruption() -> None:
    router = started(QWEN3, [THINK])
    router.observe("r", [5, 6])
    router.check_integrity()
    router.state("r").num_think_tokens += 1
    with pytest.raises(AssertionError, match="think \\+ output"):
        router.check_integrity()
    router.state("r").num_think_tokens -= 1
    router.state("r").num_output_tokens = 1
    router.state("r").num_generated_tokens += 1
    with pytest.raises(AssertionError, match="THINK has output tokens"):
        router.check_integrity()


# -- threads -----------------------------------------------------------------------------------


def test_threads_drive_different_requests_concurrently() -> None:
    num_threads, per_thread = 8, 200
    router = PhaseRouter()
    barrier = threading.Barrier(num_threads)
    errors: list[BaseException] = []
    # Per request: events seen, (think, output) counted by the router, and the expected pair.
    results: dict[str, tuple[list[PhaseEvent], tuple[int, int], tuple[int, int]]] = {}

    def worker(t: int) -> None:
        try:
            rng = random.Random(t)
            rids = [f"t{t}-r{i}" for i in range(per_thread)]
            barrier.wait()
            for rid in rids:
                router.start(rid, QWEN3, [1, THINK])
            events: dict[str, list[PhaseEvent]] = {rid: [] for rid in rids}
            expected = {rid: [0, 0] for rid in rids}
            for step in range(12):
                # Step 6 crosses the boundary inside one multi-token delta: 5 | </think> | 6.
                batch = [[5] if step != 6 else [5, END, 6] for _ in rids]
                for rid, evs in zip(rids, router.observe_many(rids, batch), strict=True):
                    events[rid].extend(evs)
                    if step == 6:
                        expected[rid][0] += 1
                        expected[rid][1] += 1
                    else:
                        expected[rid][step > 6] += 1
                for rid in rng.sample(rids, 20):
                    events[rid].extend(router.observe(rid, 7))
                    expected[rid][step >= 6] += 1
            for rid in rids:
                s = router.state(rid)
                got = (s.num_think_tokens, s.num_output_tokens)
                results[rid] = (events[rid], got, (expected[rid][0], expected[rid][1]))
                router.finish(rid)
        except BaseException as exc:
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force frequent thread switches
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert router.tracked_requests == 0
    assert len(results) == num_threads * per_thread
    for rid, (events, got, want) in results.items():
        assert got == want
        assert events == [ExitThink(rid, want[0], False)]


# -- properties --------------------------------------------------------------------------------


@dataclass
class Expected:
    phase: Phase
    num_think: int
    num_output: int
    events: list[PhaseEvent]
    num_prompt_think: int = 0


def reference(model: ReasoningFormat, prompt: list[int], stream: list[int]) -> Expected:
    """The rules of the module docstring, written naively over the whole stream."""
    rid = "r"
    start, end, nl = list(model.think_start), list(model.think_end), model.newline_ids

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

    if not start or (model.no_think and naive_find(prompt, model.no_think) >= 0):
        return Expected(Phase.OUTPUT, 0, len(stream), [])
    events: list[PhaseEvent] = []
    prompt_think = 0
    if tail_is(start):
        think_from = 0
        events.append(EnterThink(rid))
    elif tail_is(end):
        return Expected(Phase.OUTPUT, 0, len(stream), [])
    elif last(start) > last(end) or model.think_starts_in_prompt:
        think_from = 0
        events.append(EnterThink(rid))
        if last(start) > last(end):
            reasoning = prompt[last(start) + len(start) :]
            while reasoning and reasoning[0] in nl:
                reasoning.pop(0)
            prompt_think = len(reasoning)
    else:
        head = stream[: len(start)]
        if head == start:
            think_from = len(start)
            events.append(EnterThink(rid))
        elif head == start[: len(head)]:
            return Expected(Phase.PREFILL, 0, 0, [])
        else:
            return Expected(Phase.OUTPUT, 0, len(stream), [])
    if think_from == 0 and len(start) == 1 and stream[:1] == start:
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
def models(draw: st.DrawFn) -> ReasoningFormat:
    if draw(st.integers(0, 9)) == 0:
        return ReasoningFormat.without_reasoning()
    start = draw(markers)
    end = draw(markers.filter(lambda m: m != start))
    return ReasoningFormat(
        think_start=start,
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


@settings(max_examples=400, deadline=None)
@given(
    model=models(),
    prompt=st.lists(ALPHABET, max_size=8),
    stream=st.lists(ALPHABET, max_size=25),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_router_matches_reference_for_any_chunking(
    model: ReasoningFormat, prompt: list[int], stream: list[int], cuts: list[int]
) -> None:
    want = reference(model, prompt, stream)
    one_by_one, in_chunks, batched = PhaseRouter(), PhaseRouter(), PhaseRouter()
    fast = PhaseRouter()  # observe_thinking first, observe for what it hands back
    routers = (one_by_one, in_chunks, batched, fast)
    runs: list[list[PhaseEvent]] = []
    for router in routers:
        runs.append(list(router.start("r", model, prompt)))
    last = [router.phase("r") for router in routers]

    def step(k: int, router: PhaseRouter, events: Sequence[PhaseEvent]) -> None:
        runs[k].extend(events)
        phase = router.phase("r")
        assert phase >= last[k], "phases only move forward"
        last[k] = phase
        router.check_integrity()

    for tok in stream:
        step(0, one_by_one, one_by_one.observe("r", tok))
    for chunk in chunked(stream, cuts):
        step(1, in_chunks, in_chunks.observe("r", chunk))
        step(2, batched, batched.observe_many(["r"], [chunk])[0])
        before = fast.state("r").num_generated_tokens
        left = fast.observe_thinking({"r": chunk, "skipped": [END]}, skip={"skipped"})
        assert left in ([], ["r"])
        if left:
            assert fast.state("r").num_generated_tokens == before, "handed back, not applied"
            step(3, fast, fast.observe("r", chunk))
        else:
            assert fast.state("r").phase is Phase.THINK and END not in chunk
            step(3, fast, ())

    for router, events in zip(routers, runs, strict=True):
        s = router.state("r")
        assert events == want.events
        assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (
            want.phase,
            want.num_think,
            want.num_output,
        )
        assert s.num_prompt_think_tokens == want.num_prompt_think
        assert sum(isinstance(e, ExitThink) for e in events) <= 1
        # think + output == observed - boundary-marker tokens (- a pending PREFILL prefix).
        pending = s.marker_progress if s.phase is Phase.PREFILL else 0
        assert s.num_think_tokens + s.num_output_tokens == len(stream) - s.num_marker_tokens - (
            pending
        )
        assert router.finish("r") == Complete("r")
        assert router.tracked_requests == 0


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(
        st.tuples(st.lists(ALPHABET, max_size=4), st.lists(ALPHABET, max_size=15)),
        min_size=1,
        max_size=12,
    ),
    model=models(),
    order=st.randoms(use_true_random=False),
)
def test_interleaved_requests_are_independent_and_untracked_after_finish(
    streams: list[tuple[list[int], list[int]]], model: ReasoningFormat, order: random.Random
) -> None:
    router = PhaseRouter()
    rids = [f"r{i}" for i in range(len(streams))]
    for rid, (prompt, _) in zip(rids, streams, strict=True):
        router.start(rid, model, prompt)
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
        router.observe_many(batch, chunks)
        router.check_integrity()
        for rid in batch:
            if cursors[rid] >= len(streams[rids.index(rid)][1]):
                prompt, stream = streams[rids.index(rid)]
                want = reference(model, prompt, stream)
                s = router.state(rid)
                assert (s.phase, s.num_think_tokens, s.num_output_tokens) == (
                    want.phase,
                    want.num_think,
                    want.num_output,
                )
                router.finish(rid)
                live.remove(rid)
    assert router.tracked_requests == 0
