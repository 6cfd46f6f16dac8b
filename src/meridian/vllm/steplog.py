# mypy: disable-error-code="import-not-found"
"""A live engine's steps as the simulator's step-time CSV: calibrate the simulator to a GPU.

``meridian serve --step-log steps.csv`` (``$MERIDIAN_STEP_LOG``, inherited by vLLM's
engine-core process) makes the scheduler write one row per engine step: the step's shape, as
:class:`~meridian.sim.steptime.BatchShape` counts it, and its duration. ``meridian bench sim
--step-time-csv steps.csv`` then fits the simulator's step-time model to them
(:class:`~meridian.sim.steptime.FittedStepTime`) instead of the roofline's assumptions.

A step's duration is the time from its ``schedule()`` call to the next one while the engine
stays busy: the engine's period, which is what a request waits per step (with asynchronous
scheduling the next step is scheduled while this one runs, so under load the period is the
forward pass; synchronously it also holds the scheduler's own work). An interval during which
the engine went idle is no step's time and is dropped.

:func:`step_shape` is also how the simulator's vLLM engine measures the steps it times, so a
recorded step and a simulated one are counted the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

__all__ = ["CSV_HEADER", "ENV_STEP_LOG", "StepLog", "step_shape"]

ENV_STEP_LOG = "MERIDIAN_STEP_LOG"
CSV_HEADER = "num_prefill_tokens,num_decode_seqs,num_kv_tokens_read,num_seqs,step_time_ms"


def step_shape(
    num_scheduled_tokens: Mapping[str, int], requests: Mapping[str, Any]
) -> tuple[int, int, int, int]:
    """(prefill tokens, decode rows, KV tokens read, requests) of a step vLLM just scheduled.

    ``num_scheduled_tokens`` is the ``SchedulerOutput``'s, ``requests`` the scheduler's table,
    read after ``schedule()`` (each request's ``num_computed_tokens`` then includes this step's
    tokens: the context it attends over). A decode row is one token past the prompt; every other
    scheduled token (prompt chunks, recomputation) is prefill.
    """
    num_prefill = num_decode = kv_read = 0
    for rid, n in num_scheduled_tokens.items():
        request = requests[rid]
        computed = request.num_computed_tokens
        kv_read += computed
        if n == 1 and computed - 1 >= request.num_prompt_tokens:
            num_decode += 1
        else:
            num_prefill += n
    return num_prefill, num_decode, kv_read, len(num_scheduled_tokens)


class StepLog:
    """Rows of the step-time CSV, one per busy engine step (module docstring)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = Path(path)
        self.clock = clock
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: TextIO = self.path.open("a", encoding="utf-8", buffering=1)
        if new:
            self._file.write(CSV_HEADER + "\n")
        # The last scheduled step's shape and when it was scheduled (None: none pending).
        self._pending: tuple[tuple[int, int, int, int], float] | None = None
        self.num_rows = 0

    def scheduled(self, output: Any, requests: Mapping[str, Any]) -> None:
        """A step was scheduled now: the pending one ran until now (a row), this one pends."""
        now = self.clock()
        pending = self._pending
        if pending is not None:
            (p, d, kv, s), start = pending
            self._file.write(f"{p},{d},{kv},{s},{(now - start) * 1000.0:.4f}\n")
            self.num_rows += 1
        scheduled = output.num_scheduled_tokens
        self._pending = (step_shape(scheduled, requests), now) if scheduled else None

    def idle(self) -> None:
        """The engine has nothing to run: the pending step's interval would include the wait
        for the next request, so it is dropped."""
        self._pending = None

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()
