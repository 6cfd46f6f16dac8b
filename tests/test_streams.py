"""Simulated request streams: tokens, forcing applied up front, accuracy (model), matched caps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import EntropyConfig, MeridianConfig, SchedulerConfig
from meridian.core.budget import BudgetPolicy
from meridian.core.forcing import ThinkForcer
from meridian.core.types import ForceReason
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.streams import (
    ANSWER_TOKEN_ID,
    EOS_ID,
    FORCING_MERIDIAN,
    FORCING_OFF,
    NO_THINK_ID,
    SIM_FORMAT,
    THINK_END_ID,
    THINK_START_ID,
    THINK_TOKEN_ID,
    Forcing,
    ForcingKind,
    build_streams,
    forced_think_length,
    matched_static_cap,
)


def reasoning(rid: str, think: int, entropy: np.ndarray | None = None, settle: int | None = None):  # type: ignore[no-untyped-def]
    return RequestSpec(rid, 0, 12, think, 5, RequestKind.REASONING, entropy, settle)


def chat(rid: str, answer: int = 4) -> RequestSpec:
    return RequestSpec(rid, 0, 9, 0, answer, RequestKind.CHAT)


def test_a_reasoning_stream_thinks_closes_and_answers_then_ends() -> None:
    (stream,) = build_streams([reasoning("r", 3)], FORCING_OFF, MeridianConfig())
    tokens = [stream.token_at(i) for i in range(stream.num_output_tokens)]
    assert tokens == [THINK_TOKEN_ID] * 3 + [THINK_END_ID] + [ANSWER_TOKEN_ID] * 4 + [EOS_ID]
    assert stream.prompt_tail() == (THINK_START_ID,)
    assert SIM_FORMAT.initial_phase(stream.prompt_token_ids(7)).name == "THINK"
    assert stream.correct is True and stream.forced is None


def test_a_chat_stream_only_answers() -> None:
    (stream,) = build_streams([chat("c")], FORCING_MERIDIAN, MeridianConfig())
    tokens = [stream.token_at(i) for i in range(stream.num_output_tokens)]
    assert tokens == [ANSWER_TOKEN_ID] * 3 + [EOS_ID]
    prompt = stream.prompt_token_ids(3)
    assert len(prompt) == 9 and prompt[-1] == NO_THINK_ID
    assert SIM_FORMAT.initial_phase(prompt).name == "OUTPUT"
    assert stream.correct is None


def test_prompts_are_unique_per_salt_and_never_spell_a_boundary() -> None:
    (stream,) = build_streams([reasoning("r", 3)], FORCING_OFF, MeridianConfig())
    a, b = stream.prompt_token_ids(1), stream.prompt_token_ids(2)
    assert a[0] != b[0] and len(a) == 12
    assert not {THINK_START_ID, THINK_END_ID, NO_THINK_ID} & set(a[:-1])


def test_a_static_cap_cuts_the_chain_and_a_cut_before_the_settle_point_is_wrong() -> None:
    specs = [reasoning("early", 100, settle=80), reasoning("late", 100, settle=20)]
    streams = build_streams(specs, Forcing(ForcingKind.STATIC, 50), MeridianConfig())
    assert [(s.num_think, s.forced, s.correct) for s in streams] == [
        (50, ForceReason.HARD_CAP, False),
        (50, ForceReason.HARD_CAP, True),
    ]
    # A chain shorter than the cap ends by itself: not forced, correct.
    cap_50 = Forcing(ForcingKind.STATIC, 50)
    (short,) = build_streams([reasoning("s", 30, settle=29)], cap_50, MeridianConfig())
    assert (short.num_think, short.forced, short.correct) == (30, None, True)


def test_forcing_labels_and_validation() -> None:
    assert FORCING_OFF.label == "off" and FORCING_MERIDIAN.label == "meridian"
    assert Forcing(ForcingKind.STATIC, 64).label == "static:64"
    with pytest.raises(ValueError, match="a static forcing needs a cap"):
        Forcing(ForcingKind.STATIC)
    with pytest.raises(ValueError, match="only a static forcing has one"):
        Forcing(ForcingKind.OFF, 3)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        Forcing(ForcingKind.STATIC, 0)


def test_matched_static_cap_is_the_largest_cap_within_the_target() -> None:
    specs = [reasoning(f"r{i}", n) for i, n in enumerate((100, 300, 500))] + [chat("c")]
    assert matched_static_cap(specs, 900) == 500  # no saving asked: the longest chain
    assert matched_static_cap(specs, 600) == 250  # 100 + 250 + 250
    assert matched_static_cap(specs, 601) == 250
    assert matched_static_cap(specs, 3) == 1
    with pytest.raises(ValueError, match="no reasoning requests"):
        matched_static_cap([chat("c")], 10)


def _forcer_length(spec: RequestSpec, policy: BudgetPolicy) -> tuple[int, ForceReason | None]:
    """What the vLLM logits processor's ThinkForcer does over the same trace, token by token."""
    forcer = ThinkForcer(SIM_FORMAT, policy)
    out: list[int] = []
    forcer.add("k", prompt=[THINK_START_ID], output=out, budget=None)
    assert spec.think_entropy is not None
    for k in range(spec.num_think_tokens):
        forcer.sync("k")
        if forcer.wants_entropy("k"):
            forcer.observe_entropy("k", float(spec.think_entropy[k]))
        if forcer.forced_token("k") == THINK_END_ID:
            return k, forcer.records[-1].reason
        out.append(THINK_TOKEN_ID)
    return spec.num_think_tokens, None


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 700),
    st.integers(0, 10_000),
    st.sampled_from([(0.2, 64), (0.05, 8), (0.5, 300)]),
    st.integers(100, 600),
)
def test_forcing_up_front_equals_the_logits_processors_decisions(
    length: int, seed: int, entropy_shape: tuple[float, int], cap: int
) -> None:
    rng = np.random.default_rng(seed)
    noise, calm_after = entropy_shape
    trace = (1.0 + rng.normal(0, noise, length)).clip(0.01).astype(np.float32)
    trace[calm_after:] = (0.5 + rng.normal(0, 0.002, max(0, length - calm_after))).clip(0.01)
    spec = reasoning("r", length, trace)
    policy = BudgetPolicy(
        SchedulerConfig(max_think_tokens=cap, min_think_tokens=16),
        EntropyConfig(ema_alpha=0.3, eat_probe_interval_tokens=8, rpdi_window_tokens=32),
    )
    assert forced_think_length(spec, policy) == _forcer_length(spec, policy)
