"""The dual queue (``meridian.core.ordering``) over request states: ordering, limits, phase
moves, starvation, removal and its invariants."""

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

from meridian.config.schema import SchedulerConfig
from meridian.core.format import ReasoningFormat
from meridian.core.ordering import DualQueue, QueuePlan
from meridian.core.state import RequestState, advance
from meridian.core.types import Phase

START, END = 3, 4
FMT = ReasoningFormat(think_start=(START,), think_end=(END,))
PHASES = {"P": Phase.PREFILL, "T": Phase.THINK, "O": Phase.OUTPUT}


def make(multiplier: float = 2.5, starvation_steps: int = 8) -> DualQueue:
    return DualQueue(
        SchedulerConfig(think_batch_multiplier=multiplier, think_starvation_steps=starvation_steps)
    )


def states(spec: str, first: int = 0) -> list[RequestState]:
    """Requests named r0, r1, ... from a phase string: P=prefill, T=think, O=output."""
    return [RequestState(f"r{i}", FMT, PHASES[code]) for i, code in enumerate(spec, start=first)]


def add_all(q: DualQueue, spec: str) -> dict[str, RequestState]:
    """Queue the requests of ``spec`` (:func:`states`); their states by id."""
    queued = states(spec)
    q.add_many(queued)
    return {s.request_id: s for s in queued}


def move(q: DualQueue, s: RequestState, phase: Phase) -> None:
    """Generate the token that moves ``s`` to ``phase`` and tell the queue."""
    if s.phase is Phase.PREFILL:
        advance(s, [START] if phase is Phase.THINK else [9])
    elif s.phase is Phase.THINK and phase is Phase.OUTPUT:
        advance(s, [END])
    assert s.phase is phase
    q.moved(s)


# -- ordering ---------------------------------------------------------------------------------


def test_output_queue_first_then_think_each_fcfs() -> None:
    q = make()
    add_all(q, "TOTPOT")
    plan = q.schedule(capacity=16)
    assert plan.served == ["r1", "r3", "r4", "r0", "r2", "r5"]
    assert plan.deferred == []
    assert q.last_served == (3, 3)


def test_prefill_shares_the_output_queue_and_is_not_deferred_for_think() -> None:
    q = make(multiplier=1.0)
    add_all(q, "TTP")
    plan = q.schedule(capacity=2, output_budget=2)
    # The prefill request's user waits for the first token: it goes ahead of older think.
    assert plan.served == ["r2", "r0"]
    assert plan.deferred == ["r1"]
    assert (q.num_output_queued, q.num_think_queued) == (1, 2)


# -- limits -----------------------------------------------------------------------------------


def test_think_limit_is_multiplier_times_output_budget() -> None:
    q = make(multiplier=2.5)
    add_all(q, "O" + "T" * 10)
    plan = q.schedule(capacity=100, output_budget=2)
    assert q.last_served == (1, 5)
    assert plan.served == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert plan.deferred == ["r6", "r7", "r8", "r9", "r10"]


def test_think_limit_floor_is_not_fooled_by_float_rounding() -> None:
    # 2.3 * 100 == 229.99999999999997 in binary floating point.
    q = make(multiplier=2.3)
    add_all(q, "T" * 300)
    assert len(q.schedule(capacity=1000, output_budget=100).served) == 230


def test_a_huge_multiplier_is_no_limit_not_an_overflow() -> None:
    q = make(multiplier=1e308)  # 1e308 * 100 is inf as a float
    add_all(q, "T" * 30)
    assert len(q.schedule(capacity=1000, output_budget=100).served) == 30
    assert q.defers_none(30, capacity=1000, output_budget=100)


def test_think_limit_is_what_capacity_leaves_after_output() -> None:
    q = make(multiplier=4.0)
    add_all(q, "OOO" + "T" * 10)
    plan = q.schedule(capacity=5, output_budget=10)
    assert q.last_served == (3, 2)
    assert len(plan.served) == 5


def test_output_budget_defaults_to_capacity() -> None:
    q = make(multiplier=1.0)
    add_all(q, "T" * 10)
    assert len(q.schedule(capacity=4).served) == 4


def test_output_over_capacity_defers_the_newest_output_and_all_think() -> None:
    q = make()
    add_all(q, "OTOOT")
    plan = q.schedule(capacity=2)
    assert plan.served == ["r0", "r2"]
    assert plan.deferred == ["r3", "r1", "r4"]


def test_zero_output_budget_serves_no_think() -> None:
    q = make()
    add_all(q, "OT")
    plan = q.schedule(capacity=8, output_budget=0)
    assert plan.served == ["r0"]
    assert plan.deferred == ["r1"]


def test_enough_capacity_defers_nothing() -> None:
    q = make(multiplier=1.0)
    add_all(q, "TPOTTOTP")
    plan = q.schedule(capacity=8, output_budget=8)
    assert sorted(plan.served) == sorted(f"r{i}" for i in range(8))
    assert plan.deferred == []


# -- phase changes ----------------------------------------------------------------------------


def test_a_moved_request_changes_queues_at_the_next_step_keeping_arrival_order() -> None:
    q = make(multiplier=1.0)
    queued = add_all(q, "TTO")
    first = q.schedule(capacity=2, output_budget=1)
    assert first.served == ["r2", "r0"]
    move(q, queued["r1"], Phase.OUTPUT)
    # The plan already returned does not change.
    assert first.served == ["r2", "r0"]
    assert (q.num_output_queued, q.num_think_queued) == (2, 1)
    second = q.schedule(capacity=2, output_budget=1)
    # r1 arrived before r2, so it goes ahead of it in the output queue.
    assert second.served == ["r1", "r2"]
    assert second.deferred == ["r0"]


def test_prefill_to_think_joins_think_queue_in_arrival_order() -> None:
    q = make(multiplier=1.0)
    queued = add_all(q, "PTT")
    q.schedule(capacity=8)
    move(q, queued["r0"], Phase.THINK)
    plan = q.schedule(capacity=8, output_budget=1)
    assert plan.served == ["r0"]
    assert plan.deferred == ["r1", "r2"]


def test_moved_without_a_phase_change_or_for_an_unknown_request_changes_nothing() -> None:
    q = make(multiplier=1.0)
    queued = add_all(q, "TO")
    advance(queued["r0"], [7, 7])  # think tokens: still THINK
    q.moved(queued["r0"])
    q.moved(queued["r1"])
    q.moved(RequestState("never-added", FMT, Phase.THINK))
    assert (len(q), q.num_output_queued, q.num_think_queued) == (2, 1, 1)
    assert "never-added" not in q
    q.check_integrity()


def test_deferral_count_entering_think_is_capped_at_the_guard() -> None:
    q = make(multiplier=1.0, starvation_steps=2)
    queued = add_all(q, "OP")
    for _ in range(5):  # the prefill request waits behind r0 (capacity 1): 5 deferrals
        assert q.schedule(capacity=1, output_budget=1).deferred == ["r1"]
    move(q, queued["r1"], Phase.THINK)
    q.check_integrity()  # its count is within the think bound at once
    # Starving at once (its 5 deferrals count, capped at 2): served beyond capacity.
    plan = q.schedule(capacity=1, output_budget=1)
    assert plan.served == ["r0", "r1"]
    # Served: its count restarts, so the next step defers it again (capacity 1).
    assert q.schedule(capacity=1, output_budget=1).deferred == ["r1"]


# -- starvation -------------------------------------------------------------------------------


def test_starving_think_request_is_served_beyond_limit_and_capacity() -> None:
    q = make(multiplier=1.0, starvation_steps=3)
    add_all(q, "OTT")
    # Capacity is all taken by the output request: think is deferred 3 steps...
    for _ in range(3):
        plan = q.schedule(capacity=1, output_budget=1)
        assert plan.served == ["r0"]
        assert plan.deferred == ["r1", "r2"]
    # ...then the guard serves both, after the output request, beyond capacity.
    plan = q.schedule(capacity=1, output_budget=1)
    assert plan.served == ["r0", "r1", "r2"]
    assert q.last_served == (1, 2)
    # Their counts restart: three more deferrals before the guard serves them again.
    assert [q.schedule(capacity=1, output_budget=1).served for _ in range(4)] == [
        ["r0"],
        ["r0"],
        ["r0"],
        ["r0", "r1", "r2"],
    ]


def test_starving_requests_go_before_fcfs_think() -> None:
    q = make(multiplier=1.0, starvation_steps=1)
    add_all(q, "TT")
    assert q.schedule(capacity=8, output_budget=1).served == ["r0"]
    # r1 is now starving; r0 (older) is not: r1 first, and it uses the single think slot.
    plan = q.schedule(capacity=8, output_budget=1)
    assert plan.served == ["r1"]
    assert plan.deferred == ["r0"]


def test_no_think_request_waits_longer_than_the_guard() -> None:
    n = 4
    q = make(multiplier=1.0, starvation_steps=n)
    add_all(q, "O" * 3 + "T" * 20)
    waits = {f"r{i}": 0 for i in range(3, 23)}
    for _ in range(60):
        plan = q.schedule(capacity=4, output_budget=1)
        for rid in plan.deferred:
            waits[rid] += 1
            assert waits[rid] <= n
        for rid in plan.served:
            waits[rid] = 0
        q.check_integrity()


# -- removal and errors -----------------------------------------------------------------------


def test_remove_is_idempotent_and_forgets_the_request() -> None:
    q = make(multiplier=1.0, starvation_steps=1)
    queued = add_all(q, "TOT")
    assert q.schedule(capacity=1).deferred == ["r0", "r2"]  # r0 is starving now
    q.remove("r0")
    q.remove("r0")
    q.remove("never-added")
    assert "r0" not in q and list(q.ids()) == ["r1", "r2"]
    assert q.num_think_queued == 1
    assert q.num_output_queued == 1
    # Re-adding after removal is a new arrival with a fresh count: r2 (starving) goes first,
    # r0 waits its turn behind it.
    q.add_many([queued["r0"]])
    assert list(q.ids()) == ["r1", "r2", "r0"]
    plan = q.schedule(capacity=8, output_budget=1)
    assert plan.served == ["r1", "r2"] and plan.deferred == ["r0"]
    q.check_integrity()


def test_input_errors_are_actionable() -> None:
    q = make()
    a = RequestState("a", FMT, Phase.THINK)
    q.add_many([a])
    with pytest.raises(ValueError, match="'a' is already queued"):
        q.add_many([RequestState("a", FMT, Phase.OUTPUT)])
    b, c = RequestState("b", FMT, Phase.THINK), RequestState("c", FMT, Phase.COMPLETE)
    with pytest.raises(ValueError, match="'c' is complete"):
        q.add_many([b, c])
    assert "b" in q and "c" not in q, "the ones before the bad one are queued"
    with pytest.raises(ValueError, match="capacity must be a non-negative integer; got -1"):
        q.schedule(capacity=-1)
    with pytest.raises(ValueError, match="output_budget"):
        q.schedule(capacity=4, output_budget=-2)
    with pytest.raises(ValueError, match="capacity"):
        q.schedule(capacity=True)


def test_observers_before_and_after_a_step() -> None:
    q = make()
    assert q.last_served == (0, 0)
    add_all(q, "PTO")
    q.schedule(capacity=8)
    assert q.last_served == (2, 1)
    assert len(q) == 3 and "r1" in q and "r9" not in q


def test_check_integrity_detects_a_state_changed_behind_its_back() -> None:
    q = make(starvation_steps=2)
    queued = add_all(q, "TTO")
    q.check_integrity()
    advance(queued["r0"], [END])  # the phase changed, and the queue was not told
    with pytest.raises(AssertionError, match="'r0' counted in the wrong queue"):
        q.check_integrity()
    q.moved(queued["r0"])
    q.check_integrity()
    queued["r2"].phase = Phase.COMPLETE
    with pytest.raises(AssertionError, match="'r2' is queued but complete"):
        q.check_integrity()
    queued["r2"].phase = Phase.OUTPUT
    queued["r1"].request_id = "x"
    with pytest.raises(AssertionError, match="keyed 'r1' holds 'x'"):
        q.check_integrity()


# -- properties -------------------------------------------------------------------------------


def reference_plan(
    entries: list[tuple[str, Phase, int]],
    capacity: int,
    output_budget: int,
    multiplier: float,
    starvation_steps: int,
) -> QueuePlan:
    """The policy written the slow, obvious way: entries are (id, phase, deferred) by arrival."""
    output = [rid for rid, phase, _ in entries if phase is not Phase.THINK]
    starving = [rid for rid, phase, d in entries if phase is Phase.THINK and d >= starvation_steps]
    rest = [rid for rid, phase, d in entries if phase is Phase.THINK and d < starvation_steps]
    num_output = min(len(output), capacity)
    limit = min(math.floor(round(multiplier * output_budget, 6)), capacity - num_output)
    num_fill = max(0, min(len(rest), limit - len(starving)))
    return QueuePlan(
        served=output[:num_output] + starving + rest[:num_fill],
        deferred=output[num_output:] + rest[num_fill:],
    )


@dataclass
class ModelRow:
    phase: Phase
    waited: int = 0


class DualQueueMachine(RuleBasedStateMachine):
    """Random add/move/remove/schedule against a model of arrivals, phases and waits."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.queue: DualQueue | None = None
        self.multiplier = 1.0
        self.starvation_steps = 1
        # Model of the queued requests; insertion order = arrival order.
        self.model: dict[str, ModelRow] = {}
        self.states: dict[str, RequestState] = {}
        self.next_id = 0
        self.last_served = (0, 0)

    @initialize(
        multiplier=st.sampled_from([1.0, 1.5, 2.3, 2.5, 4.0]),
        starvation_steps=st.integers(1, 5),
    )
    def configure(self, multiplier: float, starvation_steps: int) -> None:
        self.multiplier = multiplier
        self.starvation_steps = starvation_steps
        self.queue = make(multiplier, starvation_steps)

    @rule(target=ids, phases=st.lists(st.sampled_from("PTO"), min_size=1, max_size=3))
    def add(self, phases: list[str]) -> list[str]:
        assert self.queue is not None
        added = states("".join(phases), first=self.next_id)
        self.next_id += len(added)
        self.queue.add_many(added)
        for s in added:
            self.model[s.request_id] = ModelRow(s.phase)
            self.states[s.request_id] = s
        return [s.request_id for s in added]

    @rule(rids=ids, phase=st.sampled_from([Phase.THINK, Phase.OUTPUT]), which=st.integers(0, 2))
    def move(self, rids: list[str], phase: Phase, which: int) -> None:
        assert self.queue is not None
        rid = rids[which % len(rids)]
        s = self.states[rid]
        if phase <= s.phase:
            advance(s, [7])  # a token that moves nothing
            self.queue.moved(s)
        else:
            move(self.queue, s, phase)
        row = self.model.get(rid)
        if row is None:
            return  # removed: the queue ignores it
        if s.phase is Phase.THINK and row.phase is not Phase.THINK:
            row.waited = min(row.waited, self.starvation_steps)
        row.phase = s.phase

    @rule(rids=consumes(ids))
    def remove(self, rids: list[str]) -> None:
        assert self.queue is not None
        for rid in rids:
            self.queue.remove(rid)
            self.queue.remove(rid)
            self.model.pop(rid, None)

    @rule(capacity=st.integers(0, 12), budget=st.one_of(st.none(), st.integers(0, 8)))
    def schedule(self, capacity: int, budget: int | None) -> None:
        assert self.queue is not None
        entries = [(rid, row.phase, row.waited) for rid, row in self.model.items()]
        expected = reference_plan(
            entries,
            capacity,
            capacity if budget is None else budget,
            self.multiplier,
            self.starvation_steps,
        )
        plan = self.queue.schedule(capacity, budget)
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
        self.last_served = (sum(kinds), len(plan.served) - sum(kinds))
        # With enough room nothing waits.
        num_think = len(queued) - len(output_ids)
        think_budget = self.multiplier * (capacity if budget is None else budget)
        if capacity >= len(queued) and think_budget >= num_think:
            assert plan.deferred == []

        for rid in plan.served:
            self.model[rid].waited = 0
        for rid in plan.deferred:
            self.model[rid].waited += 1

    @rule()
    def serve_all(self) -> None:
        assert self.queue is not None
        self.queue.serve_all()
        for row in self.model.values():
            row.waited = 0
        num_think = sum(1 for row in self.model.values() if row.phase is Phase.THINK)
        self.last_served = (len(self.model) - num_think, num_think)

    @invariant()
    def matches_model(self) -> None:
        q = self.queue
        if q is None:
            return
        q.check_integrity()
        assert len(q) == len(self.model)
        assert list(q.ids()) == list(self.model)
        num_think = sum(1 for row in self.model.values() if row.phase is Phase.THINK)
        assert (q.num_output_queued, q.num_think_queued) == (len(self.model) - num_think, num_think)
        assert q.last_served == self.last_served
        for rid, row in self.model.items():
            assert rid in q
            if row.phase is Phase.THINK:
                assert row.waited <= self.starvation_steps


DualQueueMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestDualQueueMachine = DualQueueMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    spec=st.text(alphabet="PTO", max_size=40),
    steps=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 8)), min_size=1, max_size=30),
    starvation_steps=st.integers(1, 6),
    multiplier=st.sampled_from([1.0, 1.25, 2.5, 3.0]),
)
def test_think_wait_never_exceeds_guard_and_output_never_after_think(
    spec: str,
    steps: list[tuple[int, int]],
    starvation_steps: int,
    multiplier: float,
) -> None:
    q = make(multiplier, starvation_steps)
    add_all(q, spec)
    think_ids = {f"r{i}" for i, code in enumerate(spec) if code == "T"}
    waits = dict.fromkeys(think_ids, 0)
    for capacity, budget in steps:
        plan = q.schedule(capacity, budget)
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
        assert sorted(plan.served + plan.deferred) == sorted(f"r{i}" for i in range(len(spec)))


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
    q = make(multiplier)
    add_all(q, queued)
    n = len(queued) + newcomers
    promised = q.defers_none(n, capacity, budget)
    for phases in ("P" * newcomers, "T" * newcomers, "O" * newcomers):
        trial = make(multiplier)
        add_all(trial, queued + phases)
        plan = trial.schedule(capacity=capacity, output_budget=budget)
        if promised:
            assert plan.deferred == []
    if not newcomers and set(queued) <= {"T"}:
        exact = make(multiplier)
        add_all(exact, queued)
        assert promised == (exact.schedule(capacity=capacity, output_budget=budget).deferred == [])


def test_serve_all_is_a_step_that_deferred_nobody() -> None:
    q = make(multiplier=1.0)
    add_all(q, "TTTO")
    plan = q.schedule(capacity=8, output_budget=1)  # think limit 1: r1 and r2 deferred
    assert plan.deferred == ["r1", "r2"]
    q.serve_all()
    assert q.last_served == (1, 3)
    # Deferral counts restart: r1, deferred once before serve_all, starves only after two more.
    q2 = make(multiplier=1.0, starvation_steps=2)
    add_all(q2, "TT")
    assert q2.schedule(capacity=8, output_budget=1).deferred == ["r1"]
    q2.serve_all()
    served = [q2.schedule(capacity=8, output_budget=1).served for _ in range(3)]
    assert served == [["r0"], ["r0"], ["r1"]]
