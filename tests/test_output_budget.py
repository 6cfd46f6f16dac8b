"""The output budget (``meridian.core.output_budget``): the step-time fit and the budget in force,
on synthetic step times."""

from __future__ import annotations

from typing import Any

import pytest

from meridian.core.output_budget import BUDGET_REFIT_STEPS, DecodeStepTime, OutputBudget


def _fed(samples: list[tuple[int, float]], **kw: Any) -> DecodeStepTime:
    model = DecodeStepTime(**kw)
    for rows, seconds in samples:
        model.observe(rows, seconds)
    return model


def test_step_time_fit_recovers_a_linear_model() -> None:
    # t = 2 ms + 0.1 ms per row, rows cycling 10..80.
    samples = [(r, 0.002 + 0.0001 * r) for r in range(10, 81, 10)] * 6
    model = _fed(samples)
    fitted = model.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.002) and fitted[1] == pytest.approx(0.0001)
    # 20 ms fits (20 - 2) / 0.1 = 180 rows, more than were ever seen: no cap.
    assert model.rows_within(0.020, 256) is None
    # 6 ms fits 40 rows (batches of up to 80 were seen, at 10 ms).
    assert model.rows_within(0.006, 256) == 40
    # 2.1 ms fits exactly one row; no cap when the largest possible batch (max_rows) fits.
    assert model.rows_within(0.0021, 256) == 1
    assert model.rows_within(0.006, 30) is None
    # 0.1 ms: the 2 ms per step alone is over the budget, so no batch size can meet it and
    # holding rows back would only slow reasoning: no cap.
    assert model.rows_within(0.0001, 256) is None


def test_step_time_needs_samples_and_uses_proportion_for_one_batch_size() -> None:
    assert _fed([(64, 0.04)] * 31).rows_within(0.02, 256) is None  # too few samples yet
    model = _fed([(64, 0.04)] * 32)
    assert model.fit() == pytest.approx((0.0, 0.04 / 64))
    assert model.rows_within(0.02, 256) == 32  # half the time: half the rows
    assert _fed([(64, 0.01)] * 32).rows_within(0.02, 256) is None  # it fits already


def test_step_time_without_a_positive_slope_is_read_as_proportional() -> None:
    # Fixed cost dominating, noise makes small batches look slower: no evidence that rows cost
    # time, so the conservative reading (time proportional to rows) decides: a budget between
    # one row's and the largest batch's time caps the rows (it does not flip to "no cap" with
    # the sign of a noisy slope); a budget not even one row meets gives no cap.
    model = _fed([(8, 0.0030), (3, 0.0031)] * 20)
    assert model.fit() == pytest.approx((0.0, 0.00305 * 2 / 11), rel=0.05)
    assert model.rows_within(0.0015, 256) == 2
    assert model.rows_within(1e-6, 256) is None
    assert _fed([(8, 0.0030), (3, 0.0031)] * 20).rows_within(0.020, 256) is None
    # A line through negative time at zero rows is no physical model either.
    steep = _fed([(r, 0.001 * r - 0.002) for r in (4, 6, 8)] * 12)
    assert steep.fit() == pytest.approx((0.0, 0.004 / 6), rel=0.05)


def test_step_time_follows_a_change_in_speed() -> None:
    slow = [(r, 0.0002 * r) for r in (20, 40, 60, 80)] * 10
    fast = [(r, 0.00005 * r) for r in (20, 40, 60, 80)] * 40
    model = _fed(slow)
    assert model.rows_within(0.008, 256) == 40
    for rows, seconds in fast:
        model.observe(rows, seconds)
    assert model.rows_within(0.008, 256) is None  # 80 rows now take 4 ms


def test_step_time_rejects_bad_samples_and_settings() -> None:
    with pytest.raises(ValueError, match="rows >= 1 and a positive time"):
        DecodeStepTime().observe(0, 0.01)
    with pytest.raises(ValueError, match="rows >= 1 and a positive time"):
        DecodeStepTime().observe(4, float("nan"))
    with pytest.raises(ValueError, match="decay must be in"):
        DecodeStepTime(decay=1.0)
    with pytest.raises(ValueError, match="min_samples must be"):
        DecodeStepTime(min_samples=1)


# -- the budget in force ----------------------------------------------------------------------


def test_a_fixed_setting_is_the_budget_and_is_never_measured() -> None:
    for setting in (8, None):
        budget = OutputBudget(setting, tpot_s=0.020, capacity=64)
        assert budget.rows == setting and budget.step_time is None
        for _ in range(3 * BUDGET_REFIT_STEPS):
            assert not budget.planned(0.040)
            budget.scheduled(num_rows=64, num_tokens=64)
        assert budget.rows == setting


def test_set_says_whether_the_budget_changed() -> None:
    budget = OutputBudget(None, tpot_s=0.020, capacity=64)
    assert budget.set(4) and budget.rows == 4
    assert not budget.set(4)
    assert budget.set(None) and budget.rows is None


def run(
    budget: OutputBudget, steps: list[tuple[int, int, float]], took: float | None = None
) -> float | None:
    """Plan and schedule ``steps`` of (rows, tokens, seconds), the step before them having taken
    ``took``; the time of the last one (what the next plan hears)."""
    for rows, tokens, seconds in steps:
        budget.planned(took)
        budget.scheduled(num_rows=rows, num_tokens=tokens)
        took = seconds
    return took


def test_auto_measures_decode_only_steps_from_plan_to_plan() -> None:
    # Decode-only steps of 8 rows taking 40 ms against a 20 ms budget (time proportional to rows
    # at one batch size): once enough samples are folded in, the budget is 4 rows.
    budget = OutputBudget("auto", tpot_s=0.020, capacity=64)
    assert budget.rows is None and budget.step_time is not None
    took = run(budget, [(8, 8, 0.040)] * 32)
    assert budget.rows is None, "samples are folded in batches: not yet"
    changed = [budget.planned(took)]
    for _ in range(BUDGET_REFIT_STEPS):
        budget.scheduled(num_rows=8, num_tokens=8)
        changed.append(budget.planned(0.040))
    # One refit derived the budget, and planned() said so exactly then.
    assert budget.rows == 4 and changed.count(True) == 1
    assert budget.step_time.num_samples >= 32


def test_prefill_steps_and_idle_time_are_no_samples() -> None:
    # Were the 5 s prefill step or the 60 s idle gap folded in (8 rows each), the proportional
    # fit would cap the budget at 1 row: they are not samples.
    budget = OutputBudget("auto", tpot_s=0.020, capacity=64)
    took = run(budget, [(8, 8, 0.040)] * (32 + BUDGET_REFIT_STEPS))
    budget.planned(took)
    assert budget.rows == 4
    took = run(budget, [(8, 500, 5.0)])  # a prefill step: 500 tokens for 8 rows
    budget.planned(took)
    budget.scheduled(num_rows=8, num_tokens=8)
    budget.idle()  # the engine ran out of work: the time until the next plan is no step's
    budget.planned(60.0)
    budget.scheduled(num_rows=8, num_tokens=8)
    budget.planned(None)  # (the planner's word for the same: no step's time)
    took = run(budget, [(8, 8, 0.040)] * (BUDGET_REFIT_STEPS + 1))
    budget.planned(took)
    assert budget.rows == 4
    assert budget.step_time is not None
    assert budget.step_time.num_samples == 32 + 2 * BUDGET_REFIT_STEPS


def test_a_budget_no_batch_can_meet_is_no_budget() -> None:
    # 25 ms per step before the first row, against a 20 ms budget: no row count meets it.
    budget = OutputBudget("auto", tpot_s=0.020, capacity=64)
    run(budget, [(2 + i % 7, 2 + i % 7, 0.025 + 0.0001 * (2 + i % 7)) for i in range(120)])
    assert budget.step_time is not None and budget.step_time.num_samples >= 32
    assert budget.rows is None


def test_a_batch_of_samples_folds_as_one_by_one_and_a_bad_one_counts_none() -> None:
    samples = [(r, 0.0001 * r + 0.002) for r in (8, 16, 24, 32, 64)] * 8
    one_by_one, batch = DecodeStepTime(), DecodeStepTime()
    for rows, seconds in samples:
        one_by_one.observe(rows, seconds)
    batch.observe_many(samples)
    assert batch.fit() == one_by_one.fit() is not None
    assert batch.rows_within(0.004, 256) == one_by_one.rows_within(0.004, 256) == 20
    with pytest.raises(ValueError, match="rows >= 1 and a positive time"):
        batch.observe_many([(80, 0.05), (4, -1.0)])
    assert batch.num_samples == len(samples)
    assert batch.fit() == one_by_one.fit()
