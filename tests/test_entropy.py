"""Entropy reference kernel, EAT and RPDI trackers, and the per-request EntropyProbe."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meridian.config.schema import EntropyConfig
from meridian.core.entropy import entropy_nats
from meridian.core.signals import EatTracker, EntropyProbe, RpdiTracker

ATOL = 1e-5


def brute_entropy(logits: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Float64 textbook entropy: p = softmax(x); H = -sum_{p > 0} p log p (written out by hand)."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    result = np.empty(x.shape[0])
    for i, row in enumerate(x):
        finite = row[np.isfinite(row)]
        w = np.exp(finite - finite.max())
        p = w / w.sum()
        p = p[p > 0]
        result[i] = -float(np.sum(p * np.log(p)))
    return result


def rng_logits(rows: int, vocab: int, scale: float, seed: int = 0) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)


# ---------------------------------------------------------------- entropy_nats


def test_single_row_returns_0d_float32() -> None:
    h = entropy_nats(np.zeros(8, dtype=np.float32))
    assert isinstance(h, np.ndarray) and h.shape == () and h.dtype == np.float32
    assert float(h) == pytest.approx(math.log(8), abs=1e-6)


def test_batch_returns_rows_float32() -> None:
    x = rng_logits(5, 100, 2.0)
    h = entropy_nats(x)
    assert h.shape == (5,) and h.dtype == np.float32
    np.testing.assert_allclose(h, brute_entropy(x), atol=ATOL, rtol=0)
    for i in range(5):
        assert float(entropy_nats(x[i])) == pytest.approx(float(h[i]), abs=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 30.0])
def test_dtypes_match_float64_reference(dtype: Any, scale: float) -> None:
    x = rng_logits(6, 3000, scale, seed=int(scale * 10)).astype(dtype)
    # The reference sees exactly the values the kernel sees (the float16-rounded ones).
    np.testing.assert_allclose(entropy_nats(x), brute_entropy(x), atol=ATOL, rtol=0)


def test_full_qwen_vocab_matches_reference() -> None:
    x = rng_logits(4, 151936, 3.0, seed=7)
    x[1] = 0.0  # uniform row: log(V)
    x[2, 17] += 25.0  # peaked row
    np.testing.assert_allclose(entropy_nats(x), brute_entropy(x), atol=ATOL, rtol=0)
    assert float(entropy_nats(x)[1]) == pytest.approx(math.log(151936), abs=ATOL)


@pytest.mark.parametrize("vocab", [1, 2, 7, 1000, 50000])
def test_uniform_logits_give_log_vocab(vocab: int) -> None:
    for value in (0.0, -3.5, 1e4, -1e4):
        x = np.full(vocab, value, dtype=np.float32)
        assert float(entropy_nats(x)) == pytest.approx(math.log(vocab), abs=ATOL)


def test_one_hot_gives_zero() -> None:
    x = np.full((3, 500), -np.inf, dtype=np.float32)
    x[0, 3] = 0.0
    x[1, 499] = 1e4
    x[2] = 0.0
    x[2, 42] = 1e4  # finite gap of 1e4: exp(-1e4) underflows, so exactly one-hot
    assert entropy_nats(x).tolist() == [0.0, 0.0, 0.0]


def test_extreme_logits_are_stable() -> None:
    rng = np.random.default_rng(3)
    x = rng.uniform(-1e4, 1e4, size=(4, 2000)).astype(np.float32)
    x[1, :2] = 1e4
    x[1, 2:] = -1e4  # two tied maxima -> log 2
    x[2] = np.where(rng.random(2000) < 0.5, 1e4, -1e4).astype(np.float32)
    x[3] = rng.uniform(1e4 - 5.0, 1e4, size=2000).astype(np.float32)  # near-top cluster
    h = entropy_nats(x)
    assert np.isfinite(h).all()
    np.testing.assert_allclose(h, brute_entropy(x), atol=ATOL, rtol=0)
    assert float(h[1]) == pytest.approx(math.log(2), abs=ATOL)
    # Extreme float32 range: x - max overflows to -inf and must count as probability 0.
    big = np.array([3e38, -3e38, 3e38], dtype=np.float32)
    assert float(entropy_nats(big)) == pytest.approx(math.log(2), abs=ATOL)


def test_masked_rows_match_reference_on_the_finite_subset() -> None:
    x = rng_logits(6, 4000, 2.0, seed=11)
    rng = np.random.default_rng(12)
    x[0, rng.random(4000) < 0.7] = -np.inf
    x[2, :3990] = -np.inf
    x[4, 1:] = -np.inf  # one finite logit -> 0
    h = entropy_nats(x)
    np.testing.assert_allclose(h, brute_entropy(x), atol=ATOL, rtol=0)
    assert h[4] == 0.0
    # The masked rows do not disturb unmasked rows in the same chunk.
    np.testing.assert_allclose(h[[1, 3, 5]], entropy_nats(x[[1, 3, 5]]), atol=0, rtol=0)


def test_small_vocab_many_rows_chunks_across_rows() -> None:
    x = rng_logits(3000, 50, 1.5, seed=5)
    x[1234, :49] = -np.inf
    h = entropy_nats(x)
    np.testing.assert_allclose(h, brute_entropy(x), atol=ATOL, rtol=0)
    assert h[1234] == 0.0


def test_strided_input() -> None:
    x = rng_logits(200, 64, 2.0, seed=9)
    np.testing.assert_allclose(entropy_nats(x.T), brute_entropy(x.T), atol=ATOL, rtol=0)
    np.testing.assert_allclose(entropy_nats(x[::3, ::2]), brute_entropy(x[::3, ::2]), atol=ATOL)


def test_all_masked_row_raises_naming_the_row() -> None:
    x = np.zeros((4, 10), dtype=np.float32)
    x[2] = -np.inf
    with pytest.raises(ValueError, match=r"row 2 has no finite logit"):
        entropy_nats(x)
    with pytest.raises(ValueError, match=r"row 0 has no finite logit"):
        entropy_nats(np.full(5, -np.inf, dtype=np.float32))
    # Far from the start of a multi-row chunk too.
    y = np.zeros((5000, 8), dtype=np.float32)
    y[4321] = -np.inf
    with pytest.raises(ValueError, match=r"row 4321 "):
        entropy_nats(y)


def test_nan_and_posinf_rows_raise() -> None:
    x = np.zeros((3, 10), dtype=np.float32)
    x[1, 4] = np.nan
    with pytest.raises(ValueError, match=r"row 1 contains NaN"):
        entropy_nats(x)
    x[1, 4] = np.inf
    with pytest.raises(ValueError, match=r"row 1 contains \+inf"):
        entropy_nats(x)


def test_bad_shapes_and_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="shape"):
        entropy_nats(np.zeros((2, 3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="vocab size 0"):
        entropy_nats(np.zeros((2, 0), dtype=np.float32))
    with pytest.raises(TypeError, match="bfloat16"):
        entropy_nats(np.zeros((2, 3), dtype=np.int64))
    assert entropy_nats(np.zeros((0, 7), dtype=np.float32)).shape == (0,)


finite_logits = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(1, 300)),
    elements=st.floats(-50, 50, width=32),
)


@settings(max_examples=150, deadline=None)
@given(finite_logits)
def test_property_bounds_and_reference(x: npt.NDArray[np.float32]) -> None:
    h = entropy_nats(x)
    assert (h >= 0).all() and (h <= math.log(x.shape[1])).all()
    np.testing.assert_allclose(h, brute_entropy(x), atol=ATOL, rtol=0)


@settings(max_examples=150, deadline=None)
@given(finite_logits, st.floats(-100, 100, width=32))
def test_property_shift_invariance(x: npt.NDArray[np.float32], shift: float) -> None:
    shifted = x + np.float32(shift)
    # Adding in float32 rounds each logit by up to ~1 ulp of 150, so allow a little slack.
    np.testing.assert_allclose(entropy_nats(shifted), entropy_nats(x), atol=1e-4, rtol=0)


@settings(max_examples=150, deadline=None)
@given(finite_logits, st.randoms(use_true_random=False))
def test_property_permutation_invariance(x: npt.NDArray[np.float32], rnd: Any) -> None:
    perm = list(range(x.shape[1]))
    rnd.shuffle(perm)
    np.testing.assert_allclose(entropy_nats(x[:, perm]), entropy_nats(x), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- EAT


def eat_config(**kw: Any) -> EntropyConfig:
    base: dict[str, Any] = {"ema_alpha": 0.5, "eat_min_distance": 2, "eat_probe_interval_tokens": 1}
    base.update(kw)
    return EntropyConfig(**base)


def reference_eat(xs: list[float], alpha: float) -> tuple[list[float], list[float]]:
    m: list[float] = []
    v: list[float] = []
    for n, x in enumerate(xs):
        if n == 0:
            m.append(x)
            v.append(0.0)
        else:
            m.append(alpha * x + (1 - alpha) * m[-1])
            v.append(alpha * (x - m[-1]) ** 2 + (1 - alpha) * v[-1])
    return m, v


def test_eat_recursion_hand_computed() -> None:
    # alpha = 0.5, x = 1, 3, 2, 2:
    # M = 1, 2, 2, 2;  V = 0, .5*(3-2)^2 = .5, .5*0 + .5*.5 = .25, .125
    tracker = EatTracker(alpha=0.5, variance_threshold=0.1, min_distance=1, interval_tokens=1)
    expected = [(1.0, 0.0), (2.0, 0.5), (2.0, 0.25), (2.0, 0.125)]
    for x, (m, v) in zip([1.0, 3.0, 2.0, 2.0], expected, strict=True):
        assert not tracker.add_sample(x)
        assert (tracker.ema, tracker.variance) == (m, v)
        tracker.check_integrity()
    # x = 2 again: M = 2, V = .0625 < .1 -> converged at sample index 4
    assert tracker.add_sample(2.0)
    assert tracker.converged_at == 4 and tracker.variance == 0.0625


def test_eat_tracker_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]; got 1.5"):
        EatTracker(alpha=1.5, variance_threshold=1e-3, min_distance=1, interval_tokens=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        EatTracker(alpha=0.5, variance_threshold=1e-3, min_distance=0, interval_tokens=1)
    with pytest.raises(ValueError, match="at least 1 token"):
        RpdiTracker(transition_threshold=2.5, window_tokens=0, rpdi_threshold=3.0)
    with pytest.raises(ValueError, match="finite"):
        EatTracker(
            alpha=0.5, variance_threshold=1e-3, min_distance=1, interval_tokens=1
        ).add_sample(math.nan)


def test_eat_not_before_min_distance() -> None:
    # A constant stream has V = 0 < delta from the first sample; the stop waits for n >= 5.
    tracker = EatTracker(alpha=0.2, variance_threshold=1e-3, min_distance=5, interval_tokens=1)
    fired = [tracker.add_sample(1.7) for _ in range(8)]
    assert fired == [False] * 5 + [True] * 3
    assert tracker.converged_at == 5 and tracker.num_samples == 6


def test_eat_fires_at_the_first_n_with_small_variance() -> None:
    alpha, delta, min_distance = 0.3, 0.01, 3
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 2.6, 2.8, 2.7, 2.72, 2.71] + [2.7] * 20
    _, v = reference_eat(xs, alpha)
    first = next(n for n in range(len(xs)) if n >= min_distance and v[n] < delta)
    assert first > min_distance  # the variance, not the guard, decides here
    tracker = EatTracker(alpha, delta, min_distance, interval_tokens=1)
    for n, x in enumerate(xs):
        assert tracker.add_sample(x) == (n >= first)
    assert tracker.converged_at == first
    assert tracker.variance == pytest.approx(v[first])
    # Latched: later samples change nothing.
    assert tracker.num_samples == first + 1
    tracker.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0, 12), min_size=1, max_size=80),
    st.floats(0.01, 1.0),
    st.integers(1, 10),
)
def test_property_eat_matches_reference(xs: list[float], alpha: float, min_distance: int) -> None:
    delta = 0.05
    m, v = reference_eat(xs, alpha)
    first = next((n for n in range(len(xs)) if n >= min_distance and v[n] < delta), None)
    tracker = EatTracker(alpha, delta, min_distance, interval_tokens=1)
    for x in xs:
        tracker.add_sample(x)
    tracker.check_integrity()
    assert tracker.converged_at == first
    last = len(xs) - 1 if first is None else first
    assert tracker.ema == pytest.approx(m[last]) and tracker.variance == pytest.approx(v[last])


def test_stream_proxy_samples_interval_means() -> None:
    probe = EntropyProbe(eat_config(eat_probe_interval_tokens=4, eat_min_distance=10))
    for h in (1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0):
        probe.observe(h)
    assert probe.num_eat_samples == 1 and probe.eat_ema == 1.0
    probe.observe(3.0)  # completes the second interval: mean 3
    assert probe.num_eat_samples == 2
    assert probe.eat_ema == 2.0 and probe.eat_variance == 0.5
    assert probe.num_tokens == 8
    probe.check_integrity()


def test_default_min_distance_comes_from_alpha() -> None:
    probe = EntropyProbe(EntropyConfig(ema_alpha=0.05, eat_probe_interval_tokens=1))
    for _ in range(40):
        probe.observe(1.0)
    assert not probe.converged  # ceil(2 / 0.05) = 40 -> fires at sample index 40
    probe.observe(1.0)
    assert probe.converged and probe.num_eat_samples == 41


# ---------------------------------------------------------------- RPDI


def brute_rpdi(flags: list[bool], window: int) -> float:
    n = len(flags)
    total = sum(flags)
    if n < 2 * window or total == 0:
        return 0.0
    return (sum(flags[-window:]) / window) / (total / n)


def feed(tracker: RpdiTracker | EntropyProbe, entropies: list[float]) -> None:
    for h in entropies:
        tracker.observe(h)


def test_rpdi_zero_until_two_windows_and_without_transitions() -> None:
    tracker = RpdiTracker(transition_threshold=2.5, window_tokens=10, rpdi_threshold=3.0)
    feed(tracker, [3.0] * 19)
    assert tracker.rpdi == 0.0  # 19 < 2 windows
    tracker.observe(3.0)
    assert tracker.rpdi == 1.0
    quiet = RpdiTracker(transition_threshold=2.5, window_tokens=10, rpdi_threshold=3.0)
    feed(quiet, [2.5] * 100)  # == threshold is not a transition
    assert quiet.rpdi == 0.0 and quiet.num_transitions == 0


def test_rpdi_uniform_rate_is_about_one() -> None:
    tracker = RpdiTracker(transition_threshold=2.5, window_tokens=64, rpdi_threshold=3.0)
    rng = np.random.default_rng(1)
    feed(tracker, [4.0 if rng.random() < 0.2 else 0.5 for _ in range(64 * 40)])
    assert tracker.rpdi == pytest.approx(1.0, abs=0.35)
    periodic = RpdiTracker(transition_threshold=2.5, window_tokens=64, rpdi_threshold=3.0)
    feed(periodic, [4.0 if i % 4 == 0 else 0.5 for i in range(64 * 10)])
    assert periodic.rpdi == pytest.approx(1.0)
    assert not periodic.overthinking


def test_rpdi_late_burst_signals_overthinking() -> None:
    cfg = EntropyConfig(rpdi_window_tokens=32, rpdi_threshold=3.0)
    probe = EntropyProbe(cfg)
    feed(probe, [3.0 if i % 20 == 0 else 0.8 for i in range(32 * 12)])  # rate 5 %
    assert probe.rpdi == pytest.approx(1.0, abs=0.3) and not probe.overthinking
    feed(probe, [3.0 if i % 2 == 0 else 0.8 for i in range(32)])  # burst: rate 50 %
    assert probe.rpdi > 3.0 and probe.overthinking
    probe.check_integrity()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=400), st.integers(1, 40))
def test_property_rpdi_matches_brute_force(flags: list[bool], window: int) -> None:
    tracker = RpdiTracker(transition_threshold=1.0, window_tokens=window, rpdi_threshold=2.0)
    feed(tracker, [2.0 if f else 0.0 for f in flags])
    tracker.check_integrity()
    assert tracker.num_tokens == len(flags) and tracker.num_transitions == sum(flags)
    assert tracker.rpdi == pytest.approx(brute_rpdi(flags, window))
    assert tracker.rpdi <= max(1.0, len(flags) / window) + 1e-9
    assert tracker.overthinking == (tracker.rpdi > 2.0)


# ---------------------------------------------------------------- EntropyProbe


def test_observe_rejects_non_finite() -> None:
    probe = EntropyProbe(EntropyConfig())
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="finite"):
            probe.observe(bad)
    assert probe.num_tokens == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 8), max_size=300), st.integers(1, 8), st.integers(1, 16))
def test_property_probe_integrity(entropies: list[float], interval: int, window: int) -> None:
    probe = EntropyProbe(
        EntropyConfig(ema_alpha=0.3, eat_probe_interval_tokens=interval, rpdi_window_tokens=window)
    )
    for h in entropies:
        probe.observe(h)
        probe.check_integrity()
    assert probe.num_tokens == len(entropies)
    if not probe.converged:
        assert probe.num_eat_samples == len(entropies) // interval
    assert probe.overthinking == (probe.rpdi > probe.rpdi_threshold)
