"""The ``[entropy]`` sweep's pure parts (no server; the served sweep is
``tests/vllm_e2e/test_entropy_sweep.py``)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from meridian.bench import entropy_sweep
from meridian.bench.accuracy import ForcingSummary
from meridian.bench.entropy_sweep import (
    FULL_GRID,
    HARD_CAPS,
    QUICK_GRID,
    SweepSetting,
    forces_by_reason,
    predicted_think_tokens,
    settings_markdown,
)
from meridian.config.loading import parse_config_text
from meridian.errors import ConfigError


def test_docstring_examples() -> None:
    assert doctest.testmod(entropy_sweep).failed == 0


def test_setting_config_round_trips_through_the_loader() -> None:
    setting = SweepSetting("s", {"eat_probe_interval_tokens": 4, "ema_alpha": 0.5,
                                 "eat_ema_variance_threshold": 1e-9})  # fmt: skip
    parsed = parse_config_text(setting.config_text())
    assert parsed.entropy.eat_probe_interval_tokens == 4
    assert parsed.entropy.ema_alpha == 0.5
    assert parsed.entropy.eat_ema_variance_threshold == 1e-9
    assert (parsed.scheduler.min_think_tokens, parsed.scheduler.max_think_tokens) == (16, 1000)
    assert setting.label() == "eat_probe_interval_tokens=4, ema_alpha=0.5, "\
        "eat_ema_variance_threshold=1e-09"  # fmt: skip


def test_bad_settings_fail_when_defined() -> None:
    with pytest.raises(ConfigError, match=r"entropy\.ema_alpha"):
        SweepSetting("bad", {"ema_alpha": 1.5})
    with pytest.raises(ConfigError, match=r"unknown|extra|not permitted"):
        SweepSetting("typo", {"ema_alhpa": 0.5})
    with pytest.raises(ValueError, match="policies"):
        SweepSetting("p", {}, ("eat", "cap"))


def test_grid_names_are_unique_and_the_quick_grid_is_a_slice() -> None:
    names = [s.name for s in FULL_GRID]
    assert len(set(names)) == len(names)
    assert {s.name for s in QUICK_GRID} <= set(names)
    assert FULL_GRID[0].entropy == {}  # the shipped defaults are the sweep's first point
    assert HARD_CAPS == (16, 47, 95, 175, 255)


@pytest.mark.parametrize("setting", [s for s in FULL_GRID if "eat" in s.policies])
def test_eat_on_a_flat_trace_stops_at_its_earliest_point(setting: SweepSetting) -> None:
    # A model certain of every token: interval means identical, variance 0 < any threshold.
    flat = np.full(400, 0.0007, dtype=np.float32)
    kept = predicted_think_tokens(flat, setting, "eat")
    assert kept == min(setting.eat_fire_tokens(), 400)
    assert predicted_think_tokens(flat, setting, "rpdi") == 400


def test_defaults_never_fire_on_chains_this_short() -> None:
    rng = np.random.default_rng(0)
    for n in (20, 160, 300):
        trace = rng.exponential(0.0007, n).astype(np.float32)
        assert predicted_think_tokens(trace, FULL_GRID[0]) == n


def test_rpdi_fires_on_a_burst_of_transitions() -> None:
    setting = SweepSetting("r", {"rpdi_window_tokens": 16, "rpdi_threshold": 1.5,
                                 "transition_entropy_threshold": 0.0015}, ("rpdi",))  # fmt: skip
    trace = np.full(200, 0.0005, dtype=np.float32)
    trace[::20] = 0.002  # a sparse background of transitions ...
    trace[100:110] = 0.002  # ... then a burst
    kept = predicted_think_tokens(trace, setting, "rpdi")
    assert 100 <= kept < 120
    assert predicted_think_tokens(trace, setting, "eat") == 200
    with pytest.raises(ValueError, match="signals"):
        predicted_think_tokens(trace, setting, "none")


def test_forces_by_reason_reads_a_scrape() -> None:
    text = (
        "# HELP meridian_budget_forces_total Forces.\n"
        "# TYPE meridian_budget_forces_total counter\n"
        'meridian_budget_forces_total{reason="converged"} 58.0\n'
        'meridian_budget_forces_total{reason="hard_cap"} 2.0\n'
        'meridian_other_total{reason="converged"} 7.0\n'
    )
    assert forces_by_reason(text) == {"converged": 58, "overthinking": 0, "hard_cap": 2}
    assert forces_by_reason("") == {"converged": 0, "overthinking": 0, "hard_cap": 0}


def _row(policy: str, correct: int, think: float) -> ForcingSummary:
    return ForcingSummary(policy, 20, correct, 0, correct / 20, 0.1, 0.9, think, think, think,
                          3.0, 1 - think / 160, 1.0)  # fmt: skip


def test_settings_markdown_marks_the_front_and_the_forces() -> None:
    setting = SweepSetting("e", {"eat_probe_interval_tokens": 8}, ("eat",))
    rows = [_row("none", 20, 160.0), _row("eat@e", 2, 47.0), _row("hard-cap:95", 1, 95.0)]
    text = settings_markdown([setting], rows, {"eat@e": {"converged": 18}})
    lines = text.splitlines()
    assert lines[2].startswith("| `none` | — | 20/20") and lines[2].endswith("| yes |")
    assert "eat_probe_interval_tokens=8" in lines[3] and "| 18 / 0 / 0 |" in lines[3]
    assert lines[4].endswith("|  |")  # hard-cap:95 is dominated by eat@e
