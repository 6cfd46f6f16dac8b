"""Dual-queue policy: ordering, limits, phase moves, starvation, removal and its invariants."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)
from meridian.core.dual_queue import DualQueueScheduler, SchedulePlan

from meridian.config.schema import SchedulerConfig
from meridian.core.types import Phase


def make(multiplier: float = 2.5, starvation_steps: int = 8) -> DualQueueScheduler:
    return DualQueueScheduler(
        SchedulerConfig(think_batch_multiplier=multiplier, think_starvation_steps=starvation_steps)
    )


def add_all(s: DualQueueScheduler, spec: str) -> None:
    """Add requests named r0, r1, ... from a phase string: P=prefill, T=think, O=output."""
    phases = {"P": Phase.PREFILL, "T": Phase.THINK, "O": Phase.OUTPUT}
    for i, code in enumerate(spec):
        s.add(f"r{i}", phases[code])


# -- ordering ---------------------------------------------------------------------------------


def test_output_queue_first_then_think_each_fcfs() -> None:
    s = make()
    add_all(s, "TOTPOT")
    plan = s.schedule(capacity=16)
    assert plan.served == ["r1", "r3", "r4", "r0", "r2", "r5"]
    assert plan.deferred == []
    assert (plan.num_output, plan.num_think, plan.num_starving_served) == (3, 3, 0)


def test_prefill_shares_the_output_queue_and_is_not_deferred_for_think() -> None:
    s = make(multiplier=1.0)
    add_all(s, "TTP")
    plan = s.schedule(capacity=2, output_budget=2)
    # The prefill request's user waits for the first token: it goes ahead of older think.
    assert plan.served == ["r2", "r0"]
    assert plan.deferred == ["r1"]
    assert s.queue_depths() == {Phase.OUTPUT: 1, Phase.THINK: 2}


# -- limits -----------------------------------------------------------------------------------


def test_think_limit_is_multiplier_times_output_budget() -> None:
    s = make(multiplier=2.5)
    add_all(s, "O" + "T" * 10)
    plan = s.schedule(capacity=100, output_budget=2)
    assert plan.num_think == 5
    assert plan.served == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert plan.deferred == ["r6", "r7", "r8", "r9", "r10"]


def test_think_limit_floor_is_not_fooled_by_float_rounding() -> None:
    # 2.3 * 100 == 229.99999999999997 in binary floating point.
    s = make(multiplier=2.3)
    add_all(s, "T" * 300)
    assert s.schedule(capacity=1000, output_budget=100).num_think == 230


def test_a_huge_multiplier_is_no_limit_not_an_overflow() -> None:
    s = make(multiplier=1e308)  # 1e308 * 100 is inf as a float
    add_all(s, "T" * 30)
    assert s.schedule(capacity=1000, output_budget=100).num_think == 30
    assert s.defers_none(30, capacity=1000, output_budget=100)


def test_think_limit_is_what_capacity_leaves_after_output() -> None:
    s = make(multiplier=4.0)
    add_all(s, "OOO" + "T" * 10)
    plan = s.schedule(capacity=5, output_budget=10)
    assert (plan.num_output, plan.num_think) == (3, 2)
    assert len(plan.served) == 5


def test_output_budget_defaults_to_capacity() -> None:
    s = make(multiplier=1.0)
    add_all(s, "T" * 10)
    assert s.schedule(capacity=4).num_think == 4


def test_output_over_capacity_defers_the_newest_output_and_all_think() -> None:
    s = make()
    add_all(s, "OTOOT")
    plan = s.schedule(capacity=2)
    assert plan.served == ["r0", "r2"]
    assert plan.deferred == ["r3", "r1", "r4"]
    assert s.deferred_steps("r3") == 1


def test_zero_output_budget_serves_no_think() -> None:
    s = make()
    add_all(s, "OT")
    plan = s.schedule(capacity=8, output_budget=0)
    assert plan.served == ["r0"]
    assert plan.deferred == ["r1"]


def test_enough_capacity_defers_nothing() -> None:
    s = make(multiplier=1.0)
    add_all(s, "TPOTTOTP")
    plan = s.schedule(capacity=8, output_budget=8)
    assert sorted(plan.served) == sorted(f"r{i}" for i in range(8))
    assert plan.deferred == []


# -- phase changes ----------------------------------------------------------------------------


def test_set_phase_moves_queues_at_the_next_step_keeping_arrival_order() -> None:
    s = make(multiplier=1.0)
    add_all(s, "TTO")
    first = s.schedule(capacity=2, output_budget=1)
    assert first.served == ["r2", "r0"]
    s.set_phase("r1", Phase.OUTPUT)
    # The plan already returned does not change.
    assert first.served == ["r2", "r0"]
    assert s.queue_depths() == {Phase.OUTPUT: 2, Phase.THINK: 1}
    second = s.schedule(capacity=2, output_budget=1)
    # r1 arrived before r2, so it goes ahead of it in the output queue.
    assert second.served == ["r1", "r2"]
    assert second.deferred == ["r0"]


def test_prefill_to_think_joins_think_queue_in_arrival_order() -> None:
    s = make(multiplier=1.0)
    add_all(s, "PTT")
    s.schedule(capacity=8)
    s.set_phase("r0", Phase.THINK)
    plan = s.schedule(capacity=8, output_budget=1)
    assert plan.served == ["r0"]
    assert plan.deferred == ["r1", "r2"]


def test_complete_removes_and_backward_move_is_rejected() -> None:
    s = make()
    add_all(s, "TO")
    s.set_phase("r0", Phase.COMPLETE)
    assert "r0" not in s
    assert len(s) == 1
    with pytest.raises(ValueError, match="only move forward"):
        s.set_phase("r1", Phase.THINK)
    s.set_phase("r1", Phase.OUTPUT)  # same phase: no-op
    assert s.phase_of("r1") is Phase.OUTPUT
    s.check_integrity()


def test_deferral_count_entering_think_is_capped_at_the_guard() -> None:
    s = make(multiplier=1.0, starvation_steps=2)
    add_all(s, "OP")
    for _ in range(5):
        s.schedule(capacity=1, output_budget=1)
    assert s.deferred_steps("r1") == 5
    s.set_phase("r1", Phase.THINK)
    assert s.deferred_steps("r1") == 2
    s.check_integrity()
    plan = s.schedule(capacity=1, output_budget=1)
    assert plan.served == ["r0", "r1"]
    assert plan.num_starving_served == 1


# -- starvation -------------------------------------------------------------------------------


def test_starving_think_request_is_served_beyond_limit_and_capacity() -> None:
    s = make(multiplier=1.0, starvation_steps=3)
    add_all(s, "OTT")
    # Capacity is all taken by the output request: think is deferred 3 steps...
    for step in range(3):
        plan = s.schedule(capacity=1, output_budget=1)
        assert plan.served == ["r0"]
        assert s.deferred_steps("r1") == step + 1
    # ...then the guard serves both, after the output request, beyond capacity.
    plan = s.schedule(capacity=1, output_budget=1)
    assert plan.served == ["r0", "r1", "r2"]
    assert (plan.num_output, plan.num_think, plan.num_starving_served) == (1, 2, 2)
    assert s.deferred_steps("r1") == 0


def test_starving_requests_go_before_fcfs_think() -> None:
    s = make(multiplier=1.0, starvation_steps=1)
    add_all(s, "TT")
    assert s.schedule(capacity=8, output_budget=1).served == ["r0"]
    # r1 is now starving; r0 (older) is not: r1 first, and it uses the single think slot.
    plan = s.schedule(capacity=8, output_budget=1)
    assert plan.served == ["r1"]
    assert plan.deferred == ["r0"]
    assert plan.num_starving_served == 1


def test_no_think_request_waits_longer_than_the_guard() -> None:
    n = 4
    s = make(multiplier=1.0, starvation_steps=n)
    add_all(s, "O" * 3 + "T" * 20)
    waits = {f"r{i}": 0 for i in range(3, 23)}
    for _ in range(60):
        plan = s.schedule(capacity=4, output_budget=1)
        for rid in plan.deferred:
            waits[rid] += 1
            assert waits[rid] <= n
        for rid in plan.served:
            waits[rid] = 0
        s.check_integrity()


# -- removal and errors -----------------------------------------------------------------------


def test_remove_is_idempotent_and_forgets_the_request() -> None:
    s = make()
    add_all(s, "TOT")
    s.schedule(capacity=1)
    s.remove("r0")
    s.remove("r0")
    s.remove("never-added")
    assert "r0" not in s
    assert s.num_think_queued == 1
    assert s.num_output_queued == 1
    with pytest.raises(KeyError):
        s.deferred_steps("r0")
    # Re-adding after removal is a new arrival with a fresh count.
    s.add("r0", Phase.THINK)
    assert s.deferred_steps("r0") == 0
    assert s.schedule(capacity=8).served == ["r1", "r2", "r0"]
    s.check_integrity()


def test_input_errors_are_actionable() -> None:
    s = make()
    s.add("a", Phase.THINK)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add("a", Phase.OUTPUT)
    with pytest.raises(ValueError, match="COMPLETE"):
        s.add("b", Phase.COMPLETE)
    with pytest.raises(KeyError, match="not scheduled"):
        s.set_phase("b", Phase.OUTPUT)
    with pytest.raises(ValueError, match="capacity must be a non-negative integer; got -1"):
        s.schedule(capacity=-1)
    with pytest.raises(ValueError, match="output_budget"):
        s.schedule(capacity=4, output_budget=-2)
    with pytest.raises(ValueError, match="capacity"):
        s.schedule(capacity=True)


def test_observers_before_and_after_a_step() -> None:
    s = make()
    assert s.last_plan is None
    assert s.last_batch_sizes == {Phase.OUTPUT: 0, Phase.THINK: 0}
    add_all(s, "PTO")
    plan = s.schedule(capacity=8)
    assert s.last_plan is plan
    assert s.last_batch_sizes == {Phase.OUTPUT: 2, Phase.THINK: 1}
    assert len(s) == 3


def test_check_integrity_detects_corruption() -> None:
    s = make(starvation_steps=2)
    add_all(s, "TT")
    s._entries["r0"].num_deferred = 3
    with pytest.raises(AssertionError, match="think_starvation_steps"):
        s.check_integrity()
    s._entries["r0"].num_deferred = 0
    s._num_think_queued = 5
    with pytest.raises(AssertionError, match="think counter"):
        s.check_integrity()


# -- properties -------------------------------------------------------------------------------


def reference_plan(
    entries: list[tuple[str, Phase, int]],
    capacity: int,
    output_budget: int,
    multiplier: float,
    starvation_steps: int,
) -> SchedulePlan:
    """The policy written the slow, obvious way: entries are (id, phase, deferred) by arrival."""
    output = [rid for rid, phase, _ in entries if phase is not Phase.THINK]
    starving = [rid for rid, phase, d in entries if phase is Phase.THINK and d >= starvation_steps]
    rest = [rid for rid, phase, d in entries if phase is Phase.THINK and d < starvation_steps]
    num_output = min(len(output), capacity)
    limit = min(math.floor(round(multiplier * output_budget, 6)), capacity - num_output)
    num_fill = max(0, min(len(rest), limit - len(starving)))
    return SchedulePlan(
        served=output[:num_output] + starving + rest[:num_fill],
        deferred=output[num_output:] + rest[num_fill:],
        num_output=num_output,
        num_think=len(starving) + num_fill,
        num_starving_served=len(starving),
    )


@dataclass
class ModelRow:
    phase: Phase
    waited: int = 0


class DualQueueMachine(RuleBasedStateMachine):
    """Random add/set_phase/remove/schedule against a model of arrivals, phases and waits."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: DualQueueScheduler | None = None
        self.multiplier = 1.0
        self.starvation_steps = 1
        # Model of the tracked requests; insertion order = arrival order.
        self.model: dict[str, ModelRow] = {}
        self.next_id = 0

    @initialize(
        multiplier=st.sampled_from([1.0, 1.5, 2.3, 2.5, 4.0]),
        starvation_steps=st.integers(1, 5),
    )
    def configure(self, multiplier: float, starvation_steps: int) -> None:
        self.multiplier = multiplier
        self.starvation_steps = starvation_steps
        self.scheduler = make(multiplier, starvation_steps)

    @rule(target=ids, phase=st.sampled_from([Phase.PREFILL, Phase.THINK, Phase.OUTPUT]))
    def add(self, phase: Phase) -> str:
        assert self.scheduler is not None
        rid = f"q{self.next_id}"
        self.next_id += 1
        self.scheduler.add(rid, phase)
        self.model[rid] = ModelRow(phase)
        return rid

    @rule(rid=ids, phase=st.sampled_from(list(Phase)))
    def set_phase(self, rid: str, phase: Phase) -> None:
        assert self.scheduler is not None
        if rid not in self.model:
            with pytest.raises(KeyError):
                self.scheduler.set_phase(rid, phase)
            return
        current = self.model[rid].phase
        if phase < current:
            with pytest.raises(ValueError):
                self.scheduler.set_phase(rid, phase)
            return
        self.scheduler.set_phase(rid, phase)
        if phase is Phase.COMPLETE:
            del self.model[rid]
            return
        row = self.model[rid]
        if phase is Phase.THINK and current is not Phase.THINK:
            row.waited = min(row.waited, self.starvation_steps)
        row.phase = phase

    @rule(rid=consumes(ids))
    def remove(self, rid: str) -> None:
        assert self.scheduler is not None
        self.scheduler.remove(rid)
        self.scheduler.remove(rid)
        self.model.pop(rid, None)

    @rule(capacity=st.integers(0, 12), budget=st.one_of(st.none(), st.integers(0, 8)))
    def schedule(self, capacity: int, budget: int | None) -> None:
        assert self.scheduler is not None
        entries = [(rid, row.phase, row.waited) for rid, row in self.model.items()]
        expected = reference_plan(
            entries,
            capacity,
            capacity if budget is None else budget,
            self.multiplier,
            self.starvation_steps,
        )
        plan = self.scheduler.schedule(capacity, budget)
        assert plan == expected

        queued = set(self.model)
        output_ids = {rid for rid, row in self.model.items() if row.phase is not Phase.THINK}
        # No duplicates; served and deferred partition the queued requests.
        assert len(plan.served) == len(set(plan.served))
        assert len(plan.deferred) == len(set(plan.deferred))
        assert set(plan.served).isdisjoint(plan.deferred)
        assert set(plan.served) | set(plan.deferred) == queued
        # Never an output-queue request after a think-queue one.
        kinds = [rid in output_ids for rid in plan.served]
        assert kinds == sorted(kinds, reverse=True)
        assert plan.num_output == sum(kinds)
        assert plan.num_think == len(plan.served) - plan.num_output
        # With enough room nothing waits.
        num_think = len(queued) - len(output_ids)
        think_budget = self.multiplier * (capacity if budget is None else budget)
        if capacity >= len(queued) and think_budget >= num_think:
            assert plan.deferred == []

        for rid in plan.served:
            self.model[rid].waited = 0
        for rid in plan.deferred:
            self.model[rid].waited += 1

    @invariant()
    def matches_model(self) -> None:
        s = self.scheduler
        if s is None:
            return
        s.check_integrity()
        assert len(s) == len(self.model)
        num_think = sum(1 for row in self.model.values() if row.phase is Phase.THINK)
        assert s.queue_depths() == {
            Phase.OUTPUT: len(self.model) - num_think,
            Phase.THINK: num_think,
        }
        for rid, row in self.model.items():
            assert rid in s
            assert s.phase_of(rid) is row.phase
            assert s.deferred_steps(rid) == row.waited
            if row.phase is Phase.THINK:
                assert row.waited <= self.starvation_steps


DualQueueMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestDualQueueMachine = DualQueueMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    phases=st.lists(st.sampled_from([Phase.PREFILL, Phase.THINK, Phase.OUTPUT]), max_size=40),
    steps=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 8)), min_size=1, max_size=30),
    starvation_steps=st.integers(1, 6),
    multiplier=st.sampled_from([1.0, 1.25, 2.5, 3.0]),
)
def test_think_wait_never_exceeds_guard_and_output_never_after_think(
    phases: list[Phase],
    steps: list[tuple[int, int]],
    starvation_steps: int,
    multiplier: float,
) -> None:
    s = make(multiplier, starvation_steps)
    for i, phase in enumerate(phases):
        s.add(f"r{i}", phase)
    think_ids = {f"r{i}" for i, p in enumerate(phases) if p is Phase.THINK}
    waits = dict.fromkeys(think_ids, 0)
    for capacity, budget in steps:
        plan = s.schedule(capacity, budget)
        seen_think = False
        for rid in plan.served:
            if rid in think_ids:
                seen_think = True
                waits[rid] = 0
            else:
                assert not seen_think
        for rid in plan.deferred:
            if rid in think_ids:
                waits[rid] += 1
                assert waits[rid] <= starvation_steps
        assert sorted(plan.served + plan.deferred) == sorted(f"r{i}" for i in range(len(phases)))


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="PTO", max_size=12),
    st.integers(0, 6),
    st.integers(1, 16),
    st.one_of(st.none(), st.integers(0, 8)),
    st.sampled_from([1.0, 1.5, 2.5]),
)
def test_defers_none_is_a_promise_schedule_keeps(
    queued: str, newcomers: int, capacity: int, budget: int | None, multiplier: float
) -> None:
    """Whatever phases the newcomers turn out to have, ``defers_none`` never promises a step
    that ``schedule`` then defers someone in; and with no newcomers and no output queue over
    capacity it is exact for think-only queues."""
    s = make(multiplier)
    add_all(s, queued)
    n = len(queued) + newcomers
    promised = s.defers_none(n, capacity, budget)
    for phases in ("P" * newcomers, "T" * newcomers, "O" * newcomers):
        trial = make(multiplier)
        add_all(trial, queued + phases)
        plan = trial.schedule(capacity=capacity, output_budget=budget)
        if promised:
            assert plan.deferred == []
    if not newcomers and set(queued) <= {"T"}:
        plan = make(multiplier)
        add_all(plan, queued)
        assert promised == (plan.schedule(capacity=capacity, output_budget=budget).deferred == [])


def test_serve_all_is_a_step_that_deferred_nobody() -> None:
    s = make(multiplier=1.0)
    add_all(s, "TTTO")
    plan = s.schedule(capacity=8, output_budget=1)  # think limit 1: r1 and r2 deferred
    assert plan.deferred == ["r1", "r2"]
    s.serve_all()
    assert s.last_batch_sizes == {Phase.OUTPUT: 1, Phase.THINK: 3}
    assert s.last_plan is plan, "the last schedule() result stays"
    # Deferral counts restart: r1, deferred once before serve_all, starves only after two more.
    s2 = make(multiplier=1.0, starvation_steps=2)
    add_all(s2, "TT")
    s2.schedule(capacity=8, output_budget=1)
    s2.serve_all()
    starving = [s2.schedule(capacity=8, output_budget=1).num_starving_served for _ in range(3)]
    assert starving == [0, 0, 1]
