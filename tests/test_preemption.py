"""Tests of preemption-victim selection (``meridian.core.preemption``, ADR-0008)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.core.preemption import (
    ReclaimMode,
    RunningRequest,
    Victim,
    request_tier,
    select_preemption_victims,
)
from meridian.core.types import Phase, Tier

TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL


def req(
    request_id: str,
    phase: Phase,
    num_blocks: int = 4,
    last_touched: int = 0,
    *,
    readmitted_step: int | None = None,
    think_done: bool = False,
) -> RunningRequest:
    return RunningRequest(request_id, phase, num_blocks, last_touched, readmitted_step, think_done)


def ids(victims: list[Victim]) -> list[str]:
    return [v.request_id for v in victims]


def select(needed: int, running: list[RunningRequest], **kw: object) -> list[Victim]:
    options: dict[str, object] = {"step": 100, "max_fraction": 1.0}
    options.update(kw)
    return select_preemption_victims(needed, running, **options)  # type: ignore[arg-type]


# -- request_tier -----------------------------------------------------------------------------


def test_request_tier_by_phase() -> None:
    assert request_tier(Phase.THINK) is TA
    assert request_tier(Phase.PREFILL) is TA
    assert request_tier(Phase.OUTPUT) is OC
    assert request_tier(Phase.OUTPUT, think_done=True) is TC


def test_request_tier_rejects_impossible_states() -> None:
    with pytest.raises(ValueError, match="COMPLETE"):
        request_tier(Phase.COMPLETE)
    with pytest.raises(ValueError, match="think_done"):
        request_tier(Phase.THINK, think_done=True)
    with pytest.raises(ValueError, match="think_done"):
        request_tier(Phase.PREFILL, think_done=True)


def test_running_request_validates_itself() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        req("a", Phase.THINK, num_blocks=-1)
    with pytest.raises(ValueError, match="COMPLETE"):
        req("a", Phase.COMPLETE)
    with pytest.raises(ValueError, match="think_done"):
        req("a", Phase.THINK, think_done=True)


# -- ordering --------------------------------------------------------------------------------------


def test_tier_order_think_complete_then_think_then_output() -> None:
    running = [
        req("out", Phase.OUTPUT, last_touched=0),
        req("think", Phase.THINK, last_touched=5),
        req("done", Phase.OUTPUT, last_touched=9, think_done=True),
        req("prefill", Phase.PREFILL, last_touched=7),
    ]
    victims = select(100, running)
    assert ids(victims) == ["done", "think", "prefill", "out"]
    assert [v.tier for v in victims] == [TC, TA, TA, OC]


def test_least_recently_touched_first_within_a_tier() -> None:
    running = [req(f"t{i}", Phase.THINK, last_touched=t) for i, t in enumerate([5, 1, 9, 3])]
    assert ids(select(100, running)) == ["t1", "t3", "t0", "t2"]


def test_ties_go_to_the_later_entry_first() -> None:
    running = [req(f"t{i}", Phase.THINK, last_touched=1) for i in range(3)]
    assert ids(select(100, running)) == ["t2", "t1", "t0"]


def test_stops_once_the_need_is_covered() -> None:
    running = [
        req("a", Phase.THINK, num_blocks=3, last_touched=1),
        req("b", Phase.THINK, num_blocks=3, last_touched=2),
        req("c", Phase.THINK, num_blocks=3, last_touched=3),
    ]
    assert ids(select(3, running)) == ["a"]
    assert ids(select(4, running)) == ["a", "b"]
    assert ids(select(6, running)) == ["a", "b"]


def test_output_only_as_last_resort() -> None:
    running = [
        req("out", Phase.OUTPUT, num_blocks=50, last_touched=0),
        req("think", Phase.THINK, num_blocks=2, last_touched=10),
    ]
    assert ids(select(2, running)) == ["think"]
    assert ids(select(3, running)) == ["think", "out"]


def test_requests_without_blocks_are_never_victims() -> None:
    running = [req("empty", Phase.THINK, num_blocks=0), req("out", Phase.OUTPUT, num_blocks=1)]
    assert ids(select(1, running)) == ["out"]


def test_nothing_needed_or_nothing_running() -> None:
    running = [req("a", Phase.THINK)]
    assert select(0, running) == []
    assert select(-3, running) == []
    assert select(5, []) == []


def test_partial_result_when_the_need_cannot_be_covered() -> None:
    running = [req("a", Phase.THINK, num_blocks=2), req("b", Phase.OUTPUT, num_blocks=2)]
    victims = select(100, running)
    assert ids(victims) == ["a", "b"]
    assert sum(v.num_blocks for v in victims) == 4


# -- fraction cap ----------------------------------------------------------------------------------


def test_at_most_the_fraction_of_running_requests() -> None:
    running = [req(f"t{i}", Phase.THINK, num_blocks=1, last_touched=i) for i in range(10)]
    assert ids(select(100, running, max_fraction=0.25)) == ["t0", "t1"]  # floor(2.5)
    assert len(select(100, running, max_fraction=0.5)) == 5


def test_fraction_cap_is_not_lowered_by_float_rounding() -> None:
    # 0.29 * 100 is 28.999999999999996 in binary floating point; the cap is 29.
    running = [req(f"t{i}", Phase.THINK, num_blocks=1) for i in range(100)]
    assert len(select(1000, running, max_fraction=0.29)) == 29
    assert len(select(1000, running[:10], max_fraction=0.29)) == 2  # floor(2.9)


def test_at_least_one_victim_even_for_a_tiny_fraction() -> None:
    running = [req("a", Phase.THINK), req("b", Phase.THINK)]
    assert len(select(100, running, max_fraction=0.01)) == 1


def test_invalid_arguments_are_rejected() -> None:
    running = [req("a", Phase.THINK)]
    for bad in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="max_fraction must be in"):
            select(1, running, max_fraction=bad)
    with pytest.raises(ValueError, match="readmit_guard_steps"):
        select(1, running, readmit_guard_steps=-1)


# -- re-admission guard ----------------------------------------------------------------------------


def test_recently_readmitted_requests_are_skipped_when_others_cover() -> None:
    running = [
        req("fresh", Phase.THINK, last_touched=0, readmitted_step=100),
        req("old", Phase.THINK, last_touched=5),
    ]
    assert ids(select(4, running, step=100)) == ["old"]
    # The guard lasts readmit_guard_steps steps, starting with the re-admission step.
    assert ids(select(4, running, step=101)) == ["fresh"]
    assert ids(select(4, running, step=101, readmit_guard_steps=2)) == ["old"]
    assert ids(select(4, running, step=100, readmit_guard_steps=0)) == ["fresh"]


def test_guarded_requests_become_eligible_last() -> None:
    running = [
        req("g_done", Phase.OUTPUT, last_touched=0, readmitted_step=100, think_done=True),
        req("g_think", Phase.THINK, last_touched=1, readmitted_step=100),
        req("think", Phase.THINK, last_touched=9),
        req("out", Phase.OUTPUT, last_touched=0),
        req("g_out", Phase.OUTPUT, last_touched=0, readmitted_step=99),
    ]
    victims = select(100, running, step=100, readmit_guard_steps=2)
    # A guarded think request still goes before any answer stream: a stall is user-visible.
    assert ids(victims) == ["think", "g_done", "g_think", "out", "g_out"]
    assert [v.tier for v in victims] == [TA, TC, TA, OC, OC]


# -- reclaim modes ---------------------------------------------------------------------------------


def test_reclaim_modes() -> None:
    running = [
        req("done", Phase.OUTPUT, num_blocks=1, think_done=True),
        req("think", Phase.THINK, num_blocks=1),
        req("out", Phase.OUTPUT, num_blocks=1),
    ]
    without = {v.request_id: v.reclaim for v in select(10, running)}
    assert set(without.values()) == {ReclaimMode.RECOMPUTE}
    with_fabric = {v.request_id: v.reclaim for v in select(10, running, fabric_attached=True)}
    assert with_fabric == {
        "done": ReclaimMode.OFFLOAD,
        "think": ReclaimMode.RECOMPUTE,
        "out": ReclaimMode.RECOMPUTE,
    }


def test_victim_carries_block_count_and_tier() -> None:
    [victim] = select(1, [req("a", Phase.OUTPUT, num_blocks=7, think_done=True)])
    assert victim == Victim("a", TC, ReclaimMode.RECOMPUTE, 7)


# -- properties ------------------------------------------------------------------------------------

STEP = 50


@st.composite
def running_requests(draw: st.DrawFn) -> list[RunningRequest]:
    n = draw(st.integers(0, 30))
    out: list[RunningRequest] = []
    for i in range(n):
        phase = draw(st.sampled_from([Phase.PREFILL, Phase.THINK, Phase.OUTPUT]))
        think_done = phase is Phase.OUTPUT and draw(st.booleans())
        readmitted = draw(st.one_of(st.none(), st.integers(STEP - 4, STEP)))
        out.append(
            RunningRequest(
                f"r{i}",
                phase,
                draw(st.integers(0, 8)),
                draw(st.integers(0, 20)),
                readmitted,
                think_done,
            )
        )
    return out


def reference(
    needed: int,
    running: list[RunningRequest],
    *,
    max_fraction: float,
    guard: int,
    fabric: bool,
) -> list[Victim]:
    """A direct transcription of ADR-0008 with one full sort."""
    if needed <= 0 or not running:
        return []

    def key(item: tuple[int, RunningRequest]) -> tuple[int, int, int, int, int]:
        index, r = item
        tier = request_tier(r.phase, think_done=r.think_done)
        guarded = r.readmitted_step is not None and STEP - r.readmitted_step < guard
        return (tier is OC, guarded, tier, r.last_touched, -index)

    ranked = sorted(((i, r) for i, r in enumerate(running) if r.num_blocks > 0), key=key)
    limit = max(1, math.floor(max_fraction * len(running)))
    victims: list[Victim] = []
    for _, r in ranked:
        if sum(v.num_blocks for v in victims) >= needed or len(victims) == limit:
            break
        tier = request_tier(r.phase, think_done=r.think_done)
        mode = ReclaimMode.OFFLOAD if fabric and tier is TC else ReclaimMode.RECOMPUTE
        victims.append(Victim(r.request_id, tier, mode, r.num_blocks))
    return victims


@settings(max_examples=400, deadline=None)
@given(
    running=running_requests(),
    needed=st.integers(-1, 80),
    max_fraction=st.sampled_from([0.05, 0.25, 0.5, 1.0]),
    guard=st.integers(0, 3),
    fabric=st.booleans(),
)
def test_selection_properties(
    running: list[RunningRequest], needed: int, max_fraction: float, guard: int, fabric: bool
) -> None:
    victims = select_preemption_victims(
        needed,
        running,
        step=STEP,
        max_fraction=max_fraction,
        readmit_guard_steps=guard,
        fabric_attached=fabric,
    )
    by_id = {r.request_id: r for r in running}
    chosen = set(ids(victims))
    assert len(chosen) == len(victims), "no request is chosen twice"
    assert len(victims) <= max(1, math.floor(max_fraction * len(running)))
    candidates = [r for r in running if r.num_blocks > 0]

    def guarded(r: RunningRequest) -> bool:
        return r.readmitted_step is not None and STEP - r.readmitted_step < guard

    covered = sum(v.num_blocks for v in victims)
    if victims:
        # Minimal: dropping the last victim would leave the need uncovered.
        assert covered - victims[-1].num_blocks < needed
    for v in victims:
        r = by_id[v.request_id]
        assert v.num_blocks == r.num_blocks > 0
        assert v.tier is request_tier(r.phase, think_done=r.think_done)
        want = ReclaimMode.OFFLOAD if fabric and v.tier is TC else ReclaimMode.RECOMPUTE
        assert v.reclaim is want
        if v.tier is OC:
            # Never an answer stream while a think-side request was left untouched.
            assert all(c.request_id in chosen for c in candidates if c.phase is not Phase.OUTPUT)
            assert all(
                c.request_id in chosen
                for c in candidates
                if c.phase is Phase.OUTPUT and c.think_done
            )
        if guarded(r):
            # A guarded request only once every unguarded one of its class is taken.
            same_class = [
                c
                for c in candidates
                if (request_tier(c.phase, think_done=c.think_done) is OC) == (v.tier is OC)
                and not guarded(c)
            ]
            assert all(c.request_id in chosen for c in same_class)
    if covered < needed and len(victims) < max(1, math.floor(max_fraction * len(running))):
        assert chosen == {c.request_id for c in candidates}, "short only when nothing is left"
    assert victims == reference(
        needed, running, max_fraction=max_fraction, guard=guard, fabric=fabric
    )
