"""When the step under way started (:class:`StepClock`, the core's one clock read a step), when
each recent step's tokens came (:class:`StepTimes`), and answer pacing (:class:`AnswerPacer`):
skip an answer stream that is ahead of pace."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meridian.core.interface import R

__all__ = ["PACE_HISTORY_STEPS", "STEP_TIME_WEIGHT", "AnswerPacer", "StepClock", "StepTimes"]

# Answer pacing reads the token times of this many recent steps.
PACE_HISTORY_STEPS = 64
STEP_TIME_WEIGHT = 0.1


class StepClock:
    """When the step under way started, on the policy's ``clock``: read once a step, by the plan
    (:meth:`start`); the step's other readers (the waiting order, the tracker stamping the step's
    tokens) get that time (:meth:`now`) until its tokens are observed (:meth:`observed`). A step
    nobody planned (a policy standing aside, a baseline) reads the clock where it is asked.
    ``took``: the last step's time, start to start (``None`` after an idle spell): every reader
    of a step's duration reads it here."""

    __slots__ = ("_now", "_started", "clock", "took")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._now: float | None = None
        self._started: float | None = None
        self.took: float | None = None

    def start(self) -> float:
        """A step is being planned: the clock, read for the step."""
        now = self._now = self.clock()
        started, self._started = self._started, now
        self.took = None if started is None else now - started
        return now

    def now(self) -> float:
        """The time of the step under way."""
        now = self._now
        return self.clock() if now is None else now

    def observed(self) -> float:
        """The step's tokens are observed: its time; the next step reads the clock anew."""
        now = self._now
        self._now = None
        return self.clock() if now is None else now

    def idle(self) -> None:
        """The engine has nothing to run: no step is under way, and the time until the next is
        no step's."""
        self._now = self._started = None


class StepTimes:
    """The clock when each of the last ``size`` steps' tokens were observed (``size`` 0: none
    kept). The tracker stamps it as it observes each step; answer gaps (what a stream waited
    between two tokens) and pacing read it.

    NOTE: a ring indexed by step, two list stores a step, where a dict would hash, insert, delete
    and now and then rebuild.
    """

    __slots__ = ("size", "steps", "times")

    def __init__(self, size: int) -> None:
        self.size = size
        self.steps = [-1] * size  # the step each slot was stamped for
        self.times = [0.0] * size

    def stamp(self, step: int, now: float) -> float | None:
        """``step``'s tokens were observed at ``now``; returns the clock of ``step - 1``'s
        tokens while kept (``None``: not kept), what an answer stream served in both waited."""
        size, steps, times = self.size, self.steps, self.times
        i = step % size
        steps[i] = step
        times[i] = now
        i = (step - 1) % size
        return times[i] if steps[i] == step - 1 else None

    def at(self, step: int) -> float | None:
        """The clock of ``step``'s tokens, while kept (``None``: not kept)."""
        size = self.size
        if size:
            i = step % size
            if self.steps[i] == step:
                return self.times[i]
        return None


class AnswerPacer:
    """Answer streams that can sit out a step and stay within ``pace_s``
    (``scheduler.answer_pace_ms``; 0, the default, turns pacing off; ADR-0013).

    A stream that sat out this step would get its next token at the end of the next one (now + 2
    mean steps); if that is still within the pace of its last token, it is skipped, leaving the
    step to others. The mean step moves ``STEP_TIME_WEIGHT`` of the way to each new
    plan-to-plan interval.

    NOTE: a token's time is its step's (:class:`StepClock`): when the step started, or, where the
    engine plans a step before it observes the last (asynchronous scheduling), when that one
    ended. Read as when the token came, the first makes a stream look a step older: it is paced
    less, never past its pace.
    """

    __slots__ = ("mean_step_s", "pace_s")

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        self.mean_step_s = 0.0

    def step_took(self, seconds: float) -> None:
        """One more plan-to-plan interval of a busy engine."""
        self.mean_step_s += STEP_TIME_WEIGHT * (seconds - self.mean_step_s)

    def paced(
        self,
        order: Sequence[R],
        now: float,
        held: Sequence[R],
        last_answer_step: Callable[[str], int | None],
        token_time: Callable[[int], float | None],
    ) -> list[R]:
        """Answer streams of ``order`` to skip this step: each can skip it and still get its next
        token within the pace of its last one. Never all of them with ``held`` (nothing would
        run); ``held`` ones are not listed again."""
        deadline = now + 2.0 * self.mean_step_s - self.pace_s
        paced: list[R] = []
        for request in order:
            last = last_answer_step(request.request_id)
            if last is not None:
                t = token_time(last)
                if (
                    t is not None
                    and t >= deadline
                    and request.num_tokens - request.num_computed_tokens == 1
                ):
                    paced.append(request)
        if not paced or len(paced) + len(held) >= len(order):
            return []
        if held:
            held_ids = {id(r) for r in held}
            paced = [r for r in paced if id(r) not in held_ids]
        return paced
