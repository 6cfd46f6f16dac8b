"""The output budget: how many rows a step may hold while answer streams stay on time.

The dual queue serves answer streams first and lets thinking requests fill the step up to
``think_batch_multiplier`` times the *output budget*: the rows a step can hold while its time
stays within ``scheduler.output_tpot_budget_ms`` (an answer token per step, so the step time is
the answer streams' inter-token latency). :class:`OutputBudget` holds it: a fixed number of
rows, the whole batch, or, with ``[scheduler] output_budget_rows = "auto"``, measured from the
steps the engine runs, timed by the policy's injected clock (wall time in vLLM, virtual time in
the simulator), with :class:`DecodeStepTime`:

- a sample is one decode-only step (every scheduled row computes one token): its row count
  and its time, from one plan to the next (the model's forward pass, sampling and the
  scheduler's own work: what an answer stream waits);
- the model is ``t = a + b * rows``, fitted by exponentially weighted least squares (recent
  steps weigh more: the mix of context lengths drifts);
- the budget is the largest row count whose predicted time fits; ``None`` (the whole batch, no
  deferral) while every observed batch size fits, before enough samples were seen, and when not
  even one row fits (no cap could help then).

Pure Python: unit-tested with synthetic step times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from meridian.core.types import floor_fraction

__all__ = ["BUDGET_REFIT_STEPS", "DecodeStepTime", "OutputBudget"]

# With "auto", decode-step samples are folded into the fit, and the budget re-derived, in
# batches of this many steps (one fold of many samples runs hot; one a step would run in the
# cold caches the engine's forward pass leaves).
BUDGET_REFIT_STEPS = 16


class DecodeStepTime:
    """Online fit of decode step time against batch rows (module docstring).

    ``decay`` is the weight kept by past samples at each new one (0.98: a half-life of about 34
    steps); ``min_samples`` decode steps are needed before any budget is given.
    """

    def __init__(self, *, decay: float = 0.98, min_samples: int = 32) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1); got {decay}")
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2; got {min_samples}")
        self.decay = decay
        self.min_samples = min_samples
        self.num_samples = 0
        # Weighted sums of 1, x, y, x^2 and x*y (x: rows, y: seconds).
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._max_rows = 0

    def observe(self, rows: int, seconds: float) -> None:
        """One decode-only step of ``rows`` rows took ``seconds``."""
        self.observe_many(((rows, seconds),))

    def observe_many(self, samples: Iterable[tuple[int, float]]) -> None:
        """Decode-only steps in order, each ``(rows, seconds)``: one fold. A bad sample raises
        ``ValueError`` and none of ``samples`` is counted."""
        d = self.decay
        w, x, y, xx, xy = self._w, self._x, self._y, self._xx, self._xy
        max_rows, n = self._max_rows, self.num_samples
        for rows, seconds in samples:
            if rows < 1 or not seconds > 0.0 or not math.isfinite(seconds):
                raise ValueError(
                    f"a step needs rows >= 1 and a positive time; got {rows}, {seconds}"
                )
            w = w * d + 1.0
            x = x * d + rows
            y = y * d + seconds
            xx = xx * d + rows * rows
            xy = xy * d + rows * seconds
            if rows > max_rows:
                max_rows = rows
            n += 1
        self._w, self._x, self._y, self._xx, self._xy = w, x, y, xx, xy
        self._max_rows, self.num_samples = max_rows, n

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``t = a + b * rows`` in seconds; ``None`` before ``min_samples``.

        Without a physical line to trust (a single batch size seen, so no spread to fit a
        slope; a slope that is not positive, which on small spreads is noise; or a negative
        time at zero rows) the time is taken as proportional to the rows (``a = 0``): the
        conservative reading, which never grants more rows than the fitted line would. So the
        budget cannot flip between a cap and none with the sign of a noisy slope.
        """
        if self.num_samples < self.min_samples:
            return None
        w, x, y = self._w, self._x, self._y
        mean_x, mean_y = x / w, y / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x > 1e-9 * max(1.0, mean_x * mean_x):
            slope = (self._xy / w - mean_x * mean_y) / var_x
            intercept = mean_y - slope * mean_x
            if slope > 0.0 and intercept >= 0.0:
                return intercept, slope
        return 0.0, mean_y / mean_x

    def rows_within(self, budget_s: float, max_rows: int) -> int | None:
        """The most rows whose step fits ``budget_s``; ``None`` when no cap is due.

        ``None`` (serve the whole batch) before enough samples; while the fitted time of the
        largest batch seen (or ``max_rows``, if smaller) fits the budget (the budget never binds
        on evidence the steps have not shown); and when not even one row fits it: then no batch
        size meets the budget, so holding rows back would slow reasoning without bringing any
        step under the budget (a large model whose weights alone take longer to read than the
        budget, on this hardware).
        """
        fitted = self.fit()
        if fitted is None:
            return None
        a, b = fitted
        largest = min(max(self._max_rows, 1), max_rows)
        if a + b * largest <= budget_s or a + b > budget_s:
            return None
        # floor((budget - a) / b) without float noise: (6 ms - 2 ms) / 0.1 ms is 40 rows.
        return min(max_rows, floor_fraction((budget_s - a) / b, 1))


class OutputBudget:
    """The output budget in force: ``rows`` (``None``: the whole batch), fixed or measured.

    ``setting`` is a number of rows, ``None`` or ``"auto"`` (measured: :class:`DecodeStepTime`
    against ``tpot_s``, at most ``capacity`` rows). The policy tells it when each step was
    planned (:meth:`planned`, which returns whether ``rows`` changed) and what the engine
    scheduled (:meth:`scheduled`): a decode-only step (one token per row) is timed until the
    next plan.
    """

    __slots__ = ("_samples", "_timed", "capacity", "rows", "step_time", "tpot_s")

    def __init__(self, setting: int | Literal["auto"] | None, tpot_s: float, capacity: int) -> None:
        self.rows: int | None = None if setting == "auto" else setting
        self.step_time = DecodeStepTime() if setting == "auto" else None
        self.tpot_s = tpot_s
        self.capacity = capacity
        # The rows of the last step if it was decode-only: a sample in the making.
        self._timed: int | None = None
        self._samples: list[tuple[int, float]] = []

    def planned(self, took: float | None) -> bool:
        """A step is being planned; the last one ``took`` seconds from plan to plan (``None``:
        no step's time, the engine idled; the planner measures it once for every reader).
        Whether ``rows`` changed."""
        timed = self._timed
        if timed is None:
            return False
        self._timed = None
        if took is None:
            return False
        samples = self._samples
        samples.append((timed, took))
        return len(samples) >= BUDGET_REFIT_STEPS and self._refit()

    def scheduled(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled the step last :meth:`planned`: ``num_rows`` rows computing
        ``num_tokens`` tokens."""
        if self.step_time is not None:
            decode_only = num_rows > 0 and num_tokens == num_rows
            self._timed = num_rows if decode_only else None

    def idle(self) -> None:
        """The engine has nothing to run: the time until the next step is no step's time."""
        self._timed = None

    def set(self, rows: int | None) -> bool:
        """Change the budget (rows; ``None``: the whole batch); whether it changed."""
        if rows == self.rows:
            return False
        self.rows = rows
        return True

    def _refit(self) -> bool:
        """Fold the collected samples into the fit and derive the budget."""
        samples, self._samples = self._samples, []
        step_time = self.step_time
        if step_time is None:
            return False
        step_time.observe_many([sample for sample in samples if sample[1] > 0.0])
        return self.set(step_time.rows_within(self.tpot_s, self.capacity))
