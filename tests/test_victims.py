"""Who loses KV under pressure (``meridian.core.victims``): victim ranking (classes in order, the
least computed KV first, ties to later entries) and the answer hold."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.core.format import ReasoningFormat
from meridian.core.state import RequestState
from meridian.core.types import Phase
from meridian.core.victims import VICTIM_CLASS, Candidate, VictimClass, hold_answers, rank_victims

T, TG, A, AG = (
    VictimClass.THINKING,
    VictimClass.THINKING_GUARDED,
    VictimClass.ANSWERING,
    VictimClass.ANSWERING_GUARDED,
)
FMT = ReasoningFormat(think_start=(3,), think_end=(4,))


def ids(ranked: list[Candidate]) -> list[str]:
    return [c.request_id for c in ranked]


# -- victim classes and ranking -----------------------------------------------------------


def test_class_of_each_phase() -> None:
    assert VICTIM_CLASS[Phase.PREFILL, False] is T
    assert VICTIM_CLASS[Phase.PREFILL, True] is TG
    assert VICTIM_CLASS[Phase.THINK, False] is T
    assert VICTIM_CLASS[Phase.THINK, True] is TG
    assert VICTIM_CLASS[Phase.OUTPUT, False] is A
    assert VICTIM_CLASS[Phase.OUTPUT, True] is AG
    assert (Phase.COMPLETE, False) not in VICTIM_CLASS, "a COMPLETE request is not running"


def test_classes_in_order_whatever_the_size() -> None:
    ranked = rank_victims(
        [
            Candidate("ag", AG, 1),
            Candidate("a", A, 2),
            Candidate("tg", TG, 3),
            Candidate("t", T, 4000),
        ],
        max_victims=4,
    )
    assert ids(ranked) == ["t", "tg", "a", "ag"]


def test_least_computed_kv_first_within_a_class() -> None:
    # vLLM recomputes a victim: the cheapest goes first, and re-admits it at the head of its
    # waiting queue, where a small request blocks the queue for the shortest time.
    ranked = rank_victims(
        [Candidate("big", T, 900), Candidate("small", T, 40), Candidate("mid", T, 300)],
        max_victims=3,
    )
    assert ids(ranked) == ["small", "mid", "big"]


def test_ties_go_to_the_later_entry_first() -> None:
    ranked = rank_victims(
        [Candidate("first", T, 64), Candidate("second", T, 64), Candidate("third", T, 64)],
        max_victims=3,
    )
    assert ids(ranked) == ["third", "second", "first"]


def test_at_most_max_victims_and_none_for_zero() -> None:
    candidates = [Candidate(f"t{i}", T, 10 + i) for i in range(5)] + [Candidate("a", A, 1)]
    assert ids(rank_victims(candidates, max_victims=2)) == ["t0", "t1"]
    assert rank_victims(candidates, max_victims=0) == []
    with pytest.raises(ValueError, match="max_victims must be >= 0"):
        rank_victims(candidates, max_victims=-1)


def test_requests_without_computed_kv_are_never_victims() -> None:
    ranked = rank_victims([Candidate("new", T, 0), Candidate("a", A, 8)], max_victims=2)
    assert ids(ranked) == ["a"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(list(VictimClass)), st.integers(0, 50)), min_size=0, max_size=40
    ),
    st.integers(0, 45),
)
def test_ranking_properties(entries: list[tuple[VictimClass, int]], max_victims: int) -> None:
    """Against a straightforward reference: the sort by (class, computed, -index)."""
    candidates = [Candidate(f"r{i}", cls, n) for i, (cls, n) in enumerate(entries)]
    ranked = rank_victims(candidates, max_victims=max_victims)
    eligible = [(c.victim_class, c.num_computed_tokens, -i, c) for i, c in enumerate(candidates)]
    reference = [c for cls, n, _, c in sorted(eligible, key=lambda e: e[:3]) if n > 0]
    assert ranked == reference[:max_victims]


# -- the answer hold ------------------------------------------------------------------------


@dataclass
class Running:
    """A running request as the engine shows it (vLLM's names)."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int = 1
    max_tokens: int = 1 << 20


BLOCK = 4


def running(spec: list[tuple[Phase, int, int]]) -> tuple[list[Running], dict[str, RequestState]]:
    """Requests r0, r1, ... of (phase, computed tokens, tokens), and their states."""
    order = [Running(f"r{i}", c, n) for i, (_, c, n) in enumerate(spec)]
    states = {f"r{i}": RequestState(f"r{i}", FMT, p) for i, (p, _, _) in enumerate(spec)}
    return order, states


def held(spec: list[tuple[Phase, int, int]], num_free_blocks: int) -> list[str]:
    order, states = running(spec)
    return [r.request_id for r in hold_answers(order, states, num_free_blocks, BLOCK)]


OUT, TH = Phase.OUTPUT, Phase.THINK
AT_BOUNDARY = (OUT, 8, 9)  # decodes position 8: opens a fresh block of 4
MID_BLOCK = (OUT, 9, 10)  # decodes position 9: room in its block


def test_the_newest_answers_that_need_a_block_nobody_can_give_are_held() -> None:
    # Four answer streams, three at a block boundary, one free block: the two newest of those
    # three sit the step out, keeping their KV (no preemption by recompute).
    assert held([MID_BLOCK, AT_BOUNDARY, AT_BOUNDARY, AT_BOUNDARY], 1) == ["r2", "r3"]
    assert held([AT_BOUNDARY, AT_BOUNDARY, MID_BLOCK, AT_BOUNDARY], 1) == ["r1", "r3"]


def test_no_hold_while_there_is_a_block_for_each_or_a_thinking_request_holds_kv() -> None:
    assert held([AT_BOUNDARY, AT_BOUNDARY], 2) == []
    assert held([AT_BOUNDARY, AT_BOUNDARY, AT_BOUNDARY], 2) == ["r2"]
    # A thinking request with KV is the victim instead, wherever it is in the order.
    assert held([AT_BOUNDARY, AT_BOUNDARY, (TH, 8, 9), AT_BOUNDARY], 1) == []
    # One without KV frees nothing: the hold decides as if it were not there.
    assert held([AT_BOUNDARY, AT_BOUNDARY, (TH, 0, 9), AT_BOUNDARY], 1) == ["r1", "r3"]
    # A prefill chunk (more than one token to compute) needs no fresh decode block.
    assert held([AT_BOUNDARY, AT_BOUNDARY, (OUT, 8, 12)], 1) == ["r1"]


def test_never_every_running_request_is_held() -> None:
    # Nothing could finish and free blocks: the engine preempts as usual.
    assert held([AT_BOUNDARY, AT_BOUNDARY], 0) == []
    assert held([AT_BOUNDARY, AT_BOUNDARY, MID_BLOCK], 0) == ["r0", "r1"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([Phase.PREFILL, TH, OUT]), st.integers(0, 13), st.integers(1, 3)),
        max_size=12,
    ),
    st.integers(0, 12),
)
def test_hold_properties(spec: list[tuple[Phase, int, int]], num_free_blocks: int) -> None:
    """Held requests are answer streams at a block boundary, the newest of them, exactly as
    many as the free blocks cannot cover; none while a thinking request holds KV; never all."""
    rows = [(p, c, c + new) for p, c, new in spec]
    got = held(rows, num_free_blocks)
    needy = [f"r{i}" for i, (p, c, n) in enumerate(rows) if p is OUT and n - c == 1 and c % 4 == 0]
    thinking_kv = any(p is not OUT and c > 0 for p, c, _ in rows)
    surplus = len(needy) - num_free_blocks
    if num_free_blocks >= len(rows) or thinking_kv or surplus <= 0 or surplus >= len(rows):
        assert got == []
    else:
        assert got == needy[-surplus:]
