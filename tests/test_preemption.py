"""Victim ranking: classes in order, the least computed KV first, ties to later entries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meridian.core.preemption import Candidate, VictimClass, rank_victims

from meridian.core.types import Phase

T, TG, A, AG = (
    VictimClass.THINKING,
    VictimClass.THINKING_GUARDED,
    VictimClass.ANSWERING,
    VictimClass.ANSWERING_GUARDED,
)


def ids(ranked: list[Candidate]) -> list[str]:
    return [c.request_id for c in ranked]


def test_class_of_each_phase() -> None:
    assert VictimClass.of(Phase.PREFILL, guarded=False) is T
    assert VictimClass.of(Phase.THINK, guarded=False) is T
    assert VictimClass.of(Phase.THINK, guarded=True) is TG
    assert VictimClass.of(Phase.OUTPUT, guarded=False) is A
    assert VictimClass.of(Phase.OUTPUT, guarded=True) is AG
    with pytest.raises(ValueError, match="COMPLETE request is not running"):
        VictimClass.of(Phase.COMPLETE, guarded=False)


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
