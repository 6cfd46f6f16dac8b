"""Workload generation: determinism, Poisson arrivals, length targets, mix, and the data file."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.entropy_model import EntropyModelParams, load_data_file
from meridian.bench.workload_table import (
    DistKind,
    LengthDist,
    clipped_lognormal_mean,
    parse_workload_table,
)
from meridian.bench.workloads import (
    MAX_EXPECTED_REQUESTS,
    TABLE_WORKLOADS,
    WORKLOADS,
    WorkloadError,
    WorkloadParams,
    generate_workload,
    poisson_arrivals_ns,
    workload_definition,
)
from meridian.errors import MeridianError
from meridian.sim.request import RequestKind, RequestSpec


def fields_of(spec: RequestSpec) -> tuple[Any, ...]:
    """A comparable view of a spec (RequestSpec has eq=False because of the numpy array)."""
    entropy = None if spec.think_entropy is None else spec.think_entropy.tobytes()
    return (
        spec.request_id,
        spec.arrival_ns,
        spec.num_prompt_tokens,
        spec.num_think_tokens,
        spec.num_answer_tokens,
        spec.kind,
        entropy,
        spec.settle_token,
    )


def params(rate: float = 10.0, duration: float = 30.0, seed: int = 0, **kw: Any) -> WorkloadParams:
    return WorkloadParams(arrival_rate=rate, duration_s=duration, seed=seed, **kw)


def lengths(specs: list[RequestSpec], attr: str) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array([getattr(s, attr) for s in specs], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Determinism and structure


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_identical_different_seed_differs(name: str) -> None:
    a = generate_workload(name, params(rate=4.0, duration=20.0, seed=42))
    b = generate_workload(name, params(rate=4.0, duration=20.0, seed=42))
    c = generate_workload(name, params(rate=4.0, duration=20.0, seed=43))
    assert [fields_of(s) for s in a] == [fields_of(s) for s in b]
    assert [fields_of(s) for s in a] != [fields_of(s) for s in c]


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(TABLE_WORKLOADS),
    rate=st.floats(min_value=0.05, max_value=20.0),
    duration=st.floats(min_value=0.01, max_value=20.0),
    seed=st.integers(min_value=0, max_value=2**63),
)
def test_generated_requests_are_well_formed(
    name: str, rate: float, duration: float, seed: int
) -> None:
    specs = generate_workload(name, params(rate, duration, seed))
    definition = workload_definition(name)
    duration_ns = duration * 1e9
    for index, spec in enumerate(specs):
        assert spec.request_id == f"r{index:06d}"
        assert 0 <= spec.arrival_ns < duration_ns
        if index:
            assert specs[index - 1].arrival_ns <= spec.arrival_ns
        if spec.is_reasoning:
            assert spec.think_entropy is not None
            assert spec.think_entropy.dtype == np.float32
            assert spec.think_entropy.shape == (spec.num_think_tokens,)
            assert spec.settle_token is not None
            assert 0 <= spec.settle_token < spec.num_think_tokens
            assert definition.think is not None
            assert (
                definition.think.min_tokens <= spec.num_think_tokens <= definition.think.max_tokens
            )
            if definition.total_tokens_cap is not None:
                assert spec.num_think_tokens + spec.num_answer_tokens <= definition.total_tokens_cap
        else:
            assert spec.kind is RequestKind.CHAT
            assert spec.num_think_tokens == 0
            assert spec.think_entropy is None and spec.settle_token is None


def test_ids_are_unique_and_start_at_zero() -> None:
    specs = generate_workload("synthetic", params(rate=50.0, duration=1.0, seed=1))
    assert specs[0].request_id == "r000000"
    assert len({s.request_id for s in specs}) == len(specs)


# ---------------------------------------------------------------------------------------------
# Arrivals


def test_arrival_rate_over_a_long_run() -> None:
    specs = generate_workload("sharegpt", params(rate=40.0, duration=500.0, seed=3))
    expected = 40.0 * 500.0
    # Poisson count: std sqrt(20,000) = 141, so 3 % is about 4 standard deviations.
    assert abs(len(specs) - expected) < 0.03 * expected
    gaps = np.diff(lengths(specs, "arrival_ns")) / 1e9
    assert abs(gaps.mean() - 1 / 40.0) < 0.03 / 40.0
    # Exponential gaps: coefficient of variation 1, and P(gap > mean) = e^-1.
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05
    assert abs(float(np.mean(gaps > 1 / 40.0)) - math.exp(-1)) < 0.02


def test_poisson_arrivals_cover_the_window_across_chunks() -> None:
    rng = np.random.default_rng(0)
    # A tiny expected count forces several chunk draws when the draw runs long.
    arrivals = poisson_arrivals_ns(1000.0, 0.002, rng)
    assert arrivals.dtype == np.int64
    assert (arrivals < 2_000_000).all() and (np.diff(arrivals) >= 0).all()
    many = poisson_arrivals_ns(5.0, 2000.0, np.random.default_rng(1))
    assert abs(many.size - 10_000) < 500
    assert many[-1] > 1990 * 1e9


def test_arrivals_scale_with_rate() -> None:
    slow = generate_workload("sharegpt", params(rate=2.0, duration=200.0, seed=9))
    fast = generate_workload("sharegpt", params(rate=20.0, duration=200.0, seed=9))
    assert 7.0 < len(fast) / len(slow) < 13.0


# ---------------------------------------------------------------------------------------------
# Length distributions and mixes against the data file


@pytest.fixture(scope="module")
def math500() -> list[RequestSpec]:
    return generate_workload("math500", params(rate=20.0, duration=100.0, seed=5))


@pytest.fixture(scope="module")
def aime() -> list[RequestSpec]:
    return generate_workload("aime", params(rate=10.0, duration=100.0, seed=6))


def assert_mean_near(values: np.ndarray[Any, Any], target: float, rel: float) -> None:
    mean = float(values.mean())
    assert abs(mean - target) <= rel * target, f"mean {mean:.1f} vs target {target:.1f}"


def test_math500_lengths(math500: list[RequestSpec]) -> None:
    d = workload_definition("math500")
    assert d.think and d.answer and d.reasoning_prompt and d.published_total_range
    assert all(s.is_reasoning for s in math500)
    think = lengths(math500, "num_think_tokens")
    answer = lengths(math500, "num_answer_tokens")
    prompt = lengths(math500, "num_prompt_tokens")
    assert_mean_near(think, d.think.mean, 0.06)
    assert_mean_near(answer, d.answer.mean, 0.04)
    assert_mean_near(prompt, d.reasoning_prompt.mean, 0.04)
    lo, hi = d.published_total_range
    assert lo <= float((think + answer).mean()) <= hi
    assert 100 <= float(prompt.mean()) <= 200  # "short prompts"
    assert 100 <= float(np.median(answer)) <= 600  # "a few hundred tokens"
    assert think.min() >= d.think.min_tokens and think.max() <= d.think.max_tokens


def test_aime_lengths_and_cap(aime: list[RequestSpec]) -> None:
    d = workload_definition("aime")
    assert d.think and d.answer and d.published_total_range and d.total_tokens_cap == 16384
    think = lengths(aime, "num_think_tokens")
    answer = lengths(aime, "num_answer_tokens")
    total = think + answer
    assert_mean_near(think, d.think.mean, 0.03)
    assert_mean_near(answer, d.answer.mean, 0.04)
    lo, hi = d.published_total_range
    assert lo <= float(total.mean()) <= hi
    assert total.max() <= 16384
    # Many chains run into the cap.
    assert 0.15 < float(np.mean(think == d.think.max_tokens)) < 0.4


def test_sharegpt_means() -> None:
    specs = generate_workload("sharegpt", params(rate=50.0, duration=200.0, seed=7))
    assert all(s.kind is RequestKind.CHAT for s in specs)
    # The published ShareGPT means (vLLM paper): input 161, output 338.
    assert_mean_near(lengths(specs, "num_prompt_tokens"), 161.0, 0.04)
    assert_mean_near(lengths(specs, "num_answer_tokens"), 338.0, 0.03)
    prompt = lengths(specs, "num_prompt_tokens")
    assert prompt.min() >= 4 and prompt.max() <= 2048
    assert float(np.median(prompt)) < 161.0  # log-normal: right-skewed


def test_synthetic_mix_and_ranges() -> None:
    specs = generate_workload("synthetic", params(rate=20.0, duration=150.0, seed=8))
    reasoning = [s for s in specs if s.is_reasoning]
    chat = [s for s in specs if not s.is_reasoning]
    ratio = len(reasoning) / len(specs)
    se = math.sqrt(0.4 * 0.6 / len(specs))
    assert abs(ratio - 0.4) < 4 * se
    out = lengths(chat, "num_answer_tokens")
    assert out.min() >= 40 and out.max() <= 240
    assert_mean_near(out, 140.0, 0.03)
    think = lengths(reasoning, "num_think_tokens")
    assert think.min() >= 600 and think.max() <= 6000
    assert_mean_near(think, 3300.0, 0.05)
    answer = lengths(reasoning, "num_answer_tokens")
    assert answer.min() >= 60 and answer.max() <= 400
    assert_mean_near(lengths(chat, "num_prompt_tokens"), 161.0, 0.08)


def test_reasoning_ratio_override() -> None:
    all_reasoning = generate_workload("synthetic", params(seed=1, reasoning_ratio=1.0))
    assert all_reasoning and all(s.is_reasoning for s in all_reasoning)
    no_reasoning = generate_workload("synthetic", params(seed=1, reasoning_ratio=0.0))
    assert no_reasoning and not any(s.is_reasoning for s in no_reasoning)
    mixed = generate_workload(
        "synthetic", params(rate=50, duration=60, seed=1, reasoning_ratio=0.8)
    )
    assert 0.75 < sum(s.is_reasoning for s in mixed) / len(mixed) < 0.85


def test_ratio_a_workload_cannot_serve_is_refused() -> None:
    with pytest.raises(WorkloadError, match="'sharegpt' is chat-only"):
        generate_workload("sharegpt", params(reasoning_ratio=0.5))
    with pytest.raises(WorkloadError, match="'math500' is reasoning-only"):
        generate_workload("math500", params(reasoning_ratio=0.5))


def test_entropy_params_override_reaches_the_traces() -> None:
    base = EntropyModelParams.default()
    from dataclasses import replace

    calm = replace(base, overthinking_fraction=0.0, transition_rate_post=0.0)
    specs = generate_workload("aime", params(rate=2.0, duration=30.0, seed=4, entropy_params=calm))
    for spec in specs:
        assert spec.think_entropy is not None and spec.settle_token is not None
        after = spec.think_entropy[spec.settle_token + 1 :]
        assert not (after > 2.5).any()


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError) as info:
        generate_workload("gsm8k", params())
    message = str(info.value)
    assert "unknown workload 'gsm8k'" in message
    for name in WORKLOADS:
        assert name in message
    assert isinstance(info.value, MeridianError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arrival_rate": 0.0}, "arrival_rate must be a finite number > 0; got 0.0"),
        ({"arrival_rate": -1.0}, "arrival_rate must be a finite number > 0"),
        ({"arrival_rate": float("nan")}, "arrival_rate must be a finite number > 0"),
        ({"duration_s": float("inf")}, "duration_s must be a finite number > 0"),
        ({"duration_s": "10"}, "duration_s must be a number"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"seed": True}, "seed must be an integer >= 0"),
        ({"seed": 1.5}, "seed must be an integer >= 0"),
        ({"reasoning_ratio": 1.5}, "reasoning_ratio must be in"),
        ({"reasoning_ratio": -0.1}, "reasoning_ratio must be in"),
        ({"entropy_params": {"a": 1}}, "entropy_params must be EntropyModelParams"),
        (
            {"arrival_rate": 1e6, "duration_s": 10.0},
            "at most 1,000,000 are supported",
        ),
    ],
)
def test_bad_params(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"arrival_rate": 1.0, "duration_s": 1.0, "seed": 0}
    with pytest.raises(WorkloadError, match=message):
        WorkloadParams(**{**base, **kwargs})


def test_max_expected_requests_is_reachable() -> None:
    WorkloadParams(arrival_rate=MAX_EXPECTED_REQUESTS / 10, duration_s=10.0, seed=0)


# ---------------------------------------------------------------------------------------------
# The data file


def test_every_distribution_names_its_source() -> None:
    for name in TABLE_WORKLOADS:
        d = workload_definition(name)
        dists = [d.chat_prompt, d.chat_output, d.reasoning_prompt, d.think, d.answer]
        present = [x for x in dists if x is not None]
        assert present
        for dist in present:
            assert dist.source.strip()
    for key, text in load_data_file()["sources"].items():
        assert isinstance(text, str) and len(text) > 20, key


def test_lognormal_mu_is_solved_for_the_clipped_mean() -> None:
    for name in TABLE_WORKLOADS:
        d = workload_definition(name)
        for dist in (d.chat_prompt, d.chat_output, d.reasoning_prompt, d.think, d.answer):
            if dist is None or dist.kind is not DistKind.LOGNORMAL:
                continue
            got = clipped_lognormal_mean(dist.mu, dist.sigma, dist.min_tokens, dist.max_tokens)
            assert got == pytest.approx(dist.mean, rel=1e-9)


def test_clipped_lognormal_mean_matches_sampling() -> None:
    rng = np.random.default_rng(0)
    x = np.clip(rng.lognormal(5.0, 1.0, size=400_000), 20.0, 600.0)
    assert clipped_lognormal_mean(5.0, 1.0, 20.0, 600.0) == pytest.approx(x.mean(), rel=0.005)


def test_uniform_dist_samples_inclusive_range() -> None:
    dist = LengthDist(DistKind.UNIFORM, 3, 5, mean=4.0, sigma=0.0, source="t")
    values = dist.sample(np.random.default_rng(0), 3000)
    assert set(values.tolist()) == {3, 4, 5}


def bundled() -> dict[str, Any]:
    return copy.deepcopy(load_data_file())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["workloads"].pop("aime"), "workloads aime are not defined"),
        (
            lambda d: d["workloads"]["aime"]["reasoning"]["think_tokens"].update(sigma=-1.0),
            r"workloads.aime.reasoning.think_tokens.sigma must be > 0; got -1.0",
        ),
        (
            lambda d: d["workloads"]["sharegpt"]["chat"]["prompt_tokens"].update(dist="gamma"),
            "workloads.sharegpt.chat.prompt_tokens.dist must be one of lognormal, uniform",
        ),
        (
            lambda d: d["workloads"]["sharegpt"]["chat"]["prompt_tokens"].pop("source"),
            "prompt_tokens.source must be a non-empty string naming the source",
        ),
        (
            lambda d: d["workloads"]["math500"]["reasoning"]["think_tokens"].update(mean=5.0),
            "think_tokens.mean must be strictly between min",
        ),
        (
            lambda d: d["workloads"]["aime"]["reasoning"].update(total_tokens_cap=12000),
            "must be <= total_tokens_cap",
        ),
        (
            lambda d: d["workloads"]["synthetic"].update(reasoning_ratio=2),
            "workloads.synthetic.reasoning_ratio must be in",
        ),
        (
            lambda d: d["workloads"]["synthetic"].pop("chat"),
            "workloads.synthetic.chat must be defined when reasoning_ratio < 1",
        ),
        (
            lambda d: d["workloads"]["synthetic"]["chat"]["output_tokens"].update(max=10),
            "output_tokens.max must be >= min",
        ),
    ],
)
def test_data_file_validation(edit: Any, message: str) -> None:
    data = bundled()
    edit(data)
    with pytest.raises(WorkloadError, match=message):
        parse_workload_table(data, source="test.toml")


def test_bundled_data_parses() -> None:
    definitions = parse_workload_table(bundled(), source="workloads.toml")
    assert set(TABLE_WORKLOADS) <= set(definitions)
    assert definitions["synthetic"].reasoning_ratio == 0.4
    assert definitions["sharegpt"].reasoning_ratio == 0.0
