"""One clock read a step: the plan reads it, the step's other readers (the waiting order, the
tracker's token stamps and answer gaps) reuse it; a step nobody plans reads it where asked."""

from __future__ import annotations

from meridian.config import SchedulerConfig
from meridian.core.format import ReasoningFormat
from meridian.core.pacing import StepClock
from meridian.core.policy import MeridianPolicy

START, END = 3, 4
MODEL = ReasoningFormat(think_start=(START,), think_end=(END,))


class CountingClock:
    """A clock that moves 1 s at every read and counts the reads."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += 1.0
        return self.now


class Gaps:
    """A listener that writes down the answer gaps it hears."""

    phase_events = False

    def __init__(self) -> None:
        self.gaps: list[tuple[float, int]] = []

    def answer_gaps(self, seconds: float, count: int) -> None:
        self.gaps.append((seconds, count))

    def __getattr__(self, name: str) -> object:
        return lambda *args: None


class Request:
    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.num_computed_tokens = len(prompt)
        self.num_tokens = len(prompt) + 1
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = 1 << 20


def test_the_core_reads_the_clock_once_a_step_and_stamps_tokens_with_the_plans_time() -> None:
    clock, listener = CountingClock(), Gaps()
    config = SchedulerConfig(answer_pace_ms=40.0)  # pacing on: token times are kept
    policy = MeridianPolicy(
        MODEL,
        config,
        block_size=4,
        capacity=64,
        clock=clock,
        listener=listener,  # type: ignore[arg-type]
    )
    answers = [Request(f"o{i}", [10, 11, 12]) for i in range(3)]
    for r in answers:
        policy.track(r.request_id, r.prompt, tracked_at=0.0)
    waiting = [Request("w", [10, 11, START])]
    policy.track("w", waiting[0].prompt, tracked_at=0.0)
    planned_at = []
    for step in range(1, 30):
        before = clock.reads
        policy.plan(answers, step, num_free_blocks=100)
        planned_at.append(policy.step_clock.now())  # the step's time, no clock read
        policy.waiting_order(waiting)
        policy.on_step(len(answers), len(answers))
        policy.observe([r.request_id for r in answers], [[9]] * len(answers), step)
        assert clock.reads - before == 1, f"step {step} read the clock {clock.reads - before} times"
        assert policy.tracker.times.at(step) == planned_at[-1]
    # Answer gaps are plan to plan: every step's, 1 s (one read a step).
    assert listener.gaps and all(s == 1.0 and n == 3 for s, n in listener.gaps[1:])


def test_a_step_nobody_planned_reads_the_clock_where_asked() -> None:
    clock = CountingClock()
    step_clock = StepClock(clock)
    assert step_clock.now() == 1.0 and step_clock.now() == 2.0  # nothing planned: read
    assert step_clock.start() == 3.0 and step_clock.now() == 3.0
    assert step_clock.observed() == 3.0 and step_clock.observed() == 4.0
    step_clock.start()
    step_clock.idle()
    assert step_clock.now() == 6.0
    # A policy standing aside (no boundaries) plans nothing: its tracker reads the clock itself.
    listener = Gaps()
    policy = MeridianPolicy(
        ReasoningFormat.without_reasoning(),
        SchedulerConfig(),
        block_size=4,
        capacity=64,
        clock=clock,
        listener=listener,  # type: ignore[arg-type]
    )
    policy.track("o", [10], tracked_at=0.0)
    before = clock.reads
    for step in range(1, 4):
        policy.observe(["o"], [[9]], step)
    assert clock.reads - before == 3
    assert [n for _, n in listener.gaps] == [1, 1]
