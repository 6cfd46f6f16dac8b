"""The entropy-trace model: trace invariants, its statistics, and calibration against the detector.

The detector is re-implemented here in a few lines from its specification (EAT stream proxy over
32-token interval means, RPDI over a 256-token window, the 512-token floor) so that this test
does not depend on ``meridian.core.entropy`` while it is written; ``test_detector_helper_matches``
cross-checks the two when the core module is importable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.entropy_model import (
    EntropyModelError,
    EntropyModelParams,
    EntropyTrace,
    EntropyTraceModel,
    load_data_file,
)
from meridian.bench.workloads import workload_definition

INTERVAL = 32
ALPHA = 0.05
DELTA = 1e-3
MIN_DISTANCE = 40
FLOOR_TOKENS = 512
THRESHOLD = 2.5
WINDOW = 256
RPDI_THRESHOLD = 3.0
NUM_CHAINS = 300

F32 = npt.NDArray[np.float32]


def interval_means(entropy: F32) -> npt.NDArray[np.float64]:
    """Means of the complete 32-token intervals."""
    k = entropy.size // INTERVAL
    means: npt.NDArray[np.float64] = (
        entropy[: k * INTERVAL].astype(np.float64).reshape(k, INTERVAL).mean(axis=1)
    )
    return means


def eat_fire_tokens(entropy: F32) -> int | None:
    """Think tokens seen when the EAT rule first fires (None: never within the chain)."""
    x = interval_means(entropy)
    if x.size == 0:
        return None
    m, v = float(x[0]), 0.0
    for n in range(1, x.size):
        m = ALPHA * x[n] + (1 - ALPHA) * m
        v = ALPHA * (x[n] - m) ** 2 + (1 - ALPHA) * v
        tokens = (n + 1) * INTERVAL
        if n >= MIN_DISTANCE and v < DELTA and tokens >= FLOOR_TOKENS:
            return tokens
    return None


def rpdi_series(entropy: F32) -> npt.NDArray[np.float64]:
    """RPDI after each token (0 until the chain holds two windows and one transition)."""
    flags = (entropy > THRESHOLD).astype(np.int64)
    total = np.cumsum(flags)
    shifted = np.concatenate([np.zeros(WINDOW, dtype=np.int64), total[:-WINDOW]])[: total.size]
    recent = total - shifted
    seen = np.arange(1, entropy.size + 1)
    ok = (seen >= max(2 * WINDOW, FLOOR_TOKENS)) & (total > 0)
    return np.where(ok, recent * seen / (WINDOW * np.maximum(total, 1)), 0.0)


def rpdi_fire_tokens(entropy: F32) -> int | None:
    over = np.flatnonzero(rpdi_series(entropy) > RPDI_THRESHOLD)
    return int(over[0]) + 1 if over.size else None


def first_fire(entropy: F32) -> int | None:
    fires = [t for t in (eat_fire_tokens(entropy), rpdi_fire_tokens(entropy)) if t is not None]
    return min(fires) if fires else None


@dataclass
class Calibration:
    after_settle: float
    before_end: float
    median_delay: float
    episode_hit: float
    num_episodes: int


def calibrate(workload: str, seed: int) -> Calibration:
    rng = np.random.default_rng(seed)
    think = workload_definition(workload).think
    assert think is not None
    lengths = think.sample(rng, NUM_CHAINS)
    model = EntropyTraceModel()
    after = before_end = hits = episodes = 0
    delays: list[int] = []
    for n in lengths.tolist():
        entropy, settle, eps = model.sample(n, rng)
        fire = first_fire(entropy)
        if fire is None or fire > settle:
            after += 1
        if fire is not None:
            delays.append(fire - settle)
            before_end += fire < n
        series = rpdi_series(entropy)
        for start, end in eps:
            episodes += 1
            hits += bool((series[start:end] > RPDI_THRESHOLD).any())
    return Calibration(
        after_settle=after / NUM_CHAINS,
        before_end=before_end / NUM_CHAINS,
        median_delay=float(np.median(delays)),
        episode_hit=hits / max(episodes, 1),
        num_episodes=episodes,
    )


@pytest.fixture(scope="module")
def model() -> EntropyTraceModel:
    return EntropyTraceModel(EntropyModelParams.default())


@pytest.fixture(scope="module")
def chains(model: EntropyTraceModel) -> list[tuple[int, EntropyTrace]]:
    rng = np.random.default_rng(7)
    lengths = rng.integers(4000, 14000, size=150)
    return [(n, model.sample(n, rng)) for n in lengths.tolist()]


# ---------------------------------------------------------------------------------------------
# Trace invariants


def check_trace(trace: EntropyTrace, n: int, p: EntropyModelParams) -> None:
    entropy, settle, episodes = trace
    assert entropy.dtype == np.float32
    assert entropy.shape == (n,)
    assert np.isfinite(entropy).all()
    assert entropy.min() >= 0.0
    assert entropy.max() <= p.transition_entropy_max
    assert 0 <= settle <= n - 1
    assert settle >= int(p.settle_fraction_min * n) - 1
    assert settle <= max(int(p.settle_fraction_max * n), 0)
    # Plain tokens stay below the threshold, transitions start above threshold + margin.
    gap = (entropy > p.transition_threshold - 0.05 + 1e-6) & (
        entropy < p.transition_threshold + p.transition_margin - 1e-6
    )
    assert not gap.any()
    previous_end = settle + 1
    total = 0
    for start, end in episodes:
        assert start >= previous_end
        assert end <= n
        assert p.episode_tokens_min <= end - start <= p.episode_tokens_max
        previous_end = end
        total += end - start
    assert len(episodes) <= p.episodes_max
    assert total <= p.episode_max_share * n


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=1, max_value=20000), seed=st.integers(0, 2**32 - 1))
def test_trace_invariants(n: int, seed: int) -> None:
    p = EntropyModelParams.default()
    check_trace(EntropyTraceModel(p).sample(n, np.random.default_rng(seed)), n, p)


def test_sample_unpacks_as_a_tuple(model: EntropyTraceModel) -> None:
    entropy, settle, episodes = model.sample(5000, np.random.default_rng(0))
    assert isinstance(settle, int)
    assert isinstance(episodes, list)
    assert len(entropy) == 5000


def test_same_seed_same_trace_different_seed_differs(model: EntropyTraceModel) -> None:
    a = model.sample(6000, np.random.default_rng(11))
    b = model.sample(6000, np.random.default_rng(11))
    c = model.sample(6000, np.random.default_rng(12))
    assert np.array_equal(a.entropy, b.entropy)
    assert (a.settle_token, a.episodes) == (b.settle_token, b.episodes)
    assert not np.array_equal(a.entropy, c.entropy)


def test_sample_rejects_bad_lengths(model: EntropyTraceModel) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(EntropyModelError, match="num_tokens must be >= 1; got 0"):
        model.sample(0, rng)
    with pytest.raises(EntropyModelError, match="must be an integer"):
        model.sample(True, rng)
    with pytest.raises(EntropyModelError, match="must be an integer"):
        model.sample(12.5, rng)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Statistics the brief asks for


def test_settle_points_spread_over_the_configured_fractions(
    chains: list[tuple[int, EntropyTrace]],
) -> None:
    fractions = np.array([t.settle_token / n for n, t in chains])
    assert fractions.min() >= 0.35 - 1e-3
    assert fractions.max() <= 0.90
    assert 0.55 < float(np.median(fractions)) < 0.70
    assert fractions.std() > 0.1


def test_post_settle_interval_means_are_steady(chains: list[tuple[int, EntropyTrace]]) -> None:
    stds = []
    for _n, (entropy, settle, episodes) in chains:
        x = interval_means(entropy)
        keep = np.ones(x.size, dtype=bool)
        keep[: settle // INTERVAL + 1] = False
        for start, end in episodes:
            keep[start // INTERVAL : end // INTERVAL + 1] = False
        if keep.sum() >= 10:
            stds.append(x[keep].std())
    assert 0.008 < float(np.median(stds)) < 0.02
    assert float(np.percentile(stds, 90)) < 0.03


def test_pre_settle_interval_means_wander(
    chains: list[tuple[int, EntropyTrace]], model: EntropyTraceModel
) -> None:
    p = model.params
    steps = []
    drops = []
    for _n, (entropy, settle, episodes) in chains:
        x = interval_means(entropy)
        calm = min(p.calm_tokens, p.calm_share_max * settle)
        exploring_end = int((settle - calm - p.fade_tokens) // INTERVAL)
        if exploring_end >= 10:
            steps.append(np.diff(x[:exploring_end]).std())
        post = x[settle // INTERVAL + 1 :]
        if not episodes and post.size:
            drops.append(x[: settle // INTERVAL].mean() - post.mean())
    # Consecutive exploring intervals differ by about 0.2 nats; the settled mean is lower.
    assert 0.17 < float(np.median(steps)) < 0.3
    assert float(np.mean(np.array(drops) > 0)) > 0.9


def test_transition_rates(chains: list[tuple[int, EntropyTrace]]) -> None:
    exploring_rate = []
    chain_rate = []
    post_rate = []
    for _n, (entropy, settle, episodes) in chains:
        flags = entropy > THRESHOLD
        chain_rate.append(flags.mean())
        exploring_rate.append(flags[: max(settle // 4, 1)].mean())
        if not episodes:
            post_rate.append(flags[settle + 1 :].mean())
    # A few % while exploring, about zero once settled.
    assert 0.03 < float(np.mean(exploring_rate)) < 0.05
    assert 0.01 < float(np.mean(chain_rate)) < 0.04
    assert float(np.mean(post_rate)) < 0.002


def test_overthinking_episodes(chains: list[tuple[int, EntropyTrace]]) -> None:
    with_episodes = 0
    for _n, (entropy, _settle, episodes) in chains:
        flags = entropy > THRESHOLD
        overall = flags.mean()
        with_episodes += bool(episodes)
        for start, end in episodes:
            rate = flags[start:end].mean()
            assert rate >= 4.0 * overall, (rate, overall)
            assert 0.2 < rate < 0.6
    # overthinking_fraction = 0.3; every chain here is long enough to hold an episode.
    assert 0.2 < with_episodes / len(chains) < 0.4


def test_short_chains_get_no_episode_that_would_dominate(model: EntropyTraceModel) -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        _, _, episodes = model.sample(1000, rng)
        assert episodes == []  # 15 % of 1,000 tokens cannot hold a 200-token episode


# ---------------------------------------------------------------------------------------------
# Calibration against the detector


def test_calibration_math500_lengths() -> None:
    cal = calibrate("math500", seed=1)
    assert cal.after_settle >= 0.9, cal
    assert cal.median_delay > 0, cal
    assert cal.before_end >= 0.6, cal
    assert cal.num_episodes >= 30, cal
    assert cal.episode_hit >= 0.8, cal


def test_calibration_aime_lengths() -> None:
    cal = calibrate("aime", seed=1)
    assert cal.after_settle >= 0.9, cal
    assert cal.median_delay > 0, cal
    assert cal.before_end >= 0.9, cal
    assert cal.num_episodes >= 50, cal
    assert cal.episode_hit >= 0.8, cal


def test_detector_helper_matches_core_when_available(model: EntropyTraceModel) -> None:
    from meridian.config.schema import EntropyConfig
    from meridian.core.signals import EntropyProbe

    entropy, _settle, _ = model.sample(9000, np.random.default_rng(3))
    probe = EntropyProbe(EntropyConfig())
    core_eat = None
    core_rpdi = None
    for i, h in enumerate(entropy.tolist(), start=1):
        probe.observe(h)
        if core_eat is None and probe.converged and i >= FLOOR_TOKENS:
            core_eat = i
        if core_rpdi is None and probe.rpdi > RPDI_THRESHOLD:
            core_rpdi = i
    assert core_eat == eat_fire_tokens(entropy)
    assert core_rpdi == rpdi_fire_tokens(entropy)


# ---------------------------------------------------------------------------------------------
# Parameters


def test_default_params_come_from_the_data_file() -> None:
    table = load_data_file()["entropy_model"]
    p = EntropyModelParams.default()
    for key, value in asdict(p).items():
        assert table[key] == value, key


def test_params_reject_unknown_and_missing_keys() -> None:
    table = dict(asdict(EntropyModelParams.default()))
    with pytest.raises(EntropyModelError, match=r"unknown entropy_model parameter.*settle_frac"):
        EntropyModelParams.from_mapping({**table, "settle_frac": 0.5})
    del table["calm_tokens"]
    with pytest.raises(EntropyModelError, match="missing calm_tokens"):
        EntropyModelParams.from_mapping(table)


def test_params_accept_documentation_keys_and_int_for_float() -> None:
    table = {**asdict(EntropyModelParams.default()), "source": "x", "assumption": "y"}
    table["pre_drop_min"] = 0
    p = EntropyModelParams.from_mapping(table)
    assert p.pre_drop_min == 0.0 and isinstance(p.pre_drop_min, float)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("settle_fraction_max", 0.2, "settle_fraction_max must be in"),
        ("settle_beta_a", 0.0, "settle_beta_a must be > 0"),
        ("pre_wander_phi", 1.0, "pre_wander_phi must be in"),
        ("transition_rate_pre", 1.5, "transition_rate_pre must be in"),
        ("episode_tokens_max", 10, "episode_tokens_max must be >= episode_tokens_min"),
        ("transition_entropy_max", 2.0, "transition_entropy_max must be >"),
        ("interval_tokens", 0, "interval_tokens must be >= 1"),
        ("calm_tokens", 1.5, "calm_tokens must be an integer"),
        ("exploration_end", True, "exploration_end must be a number"),
        ("post_wander_std", float("nan"), "post_wander_std must be finite"),
    ],
)
def test_params_validation(field: str, value: Any, message: str) -> None:
    changes: dict[str, Any] = {field: value}
    with pytest.raises(EntropyModelError, match=message):
        replace(EntropyModelParams.default(), **changes)


def test_parameters_change_the_traces() -> None:
    p = EntropyModelParams.default()
    never = replace(p, overthinking_fraction=0.0)
    always = replace(p, overthinking_fraction=1.0)
    rng = np.random.default_rng(9)
    assert all(EntropyTraceModel(never).sample(8000, rng).episodes == [] for _ in range(20))
    assert all(EntropyTraceModel(always).sample(8000, rng).episodes for _ in range(20))


def test_no_negative_zero(model: EntropyTraceModel) -> None:
    rng = np.random.default_rng(2)
    for _ in range(50):
        entropy = model.sample(6000, rng).entropy
        assert not np.signbit(entropy).any()
