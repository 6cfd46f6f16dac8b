"""The budget policy: every rule, their precedence, the static baseline, per-request overrides."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meridian.config.schema import EntropyConfig, SchedulerConfig
from meridian.core.budget import BudgetPolicy, ForceDecision, RequestBudget, Signals
from meridian.core.signals import EntropyProbe
from meridian.core.types import ForceReason
from meridian.errors import ConfigError

SCHED = SchedulerConfig(min_think_tokens=100, max_think_tokens=1000)
# EAT: interval 1 token, fires at sample index 2 on a flat stream.
# RPDI: window 4 tokens, threshold 1.5.
ENTROPY = EntropyConfig(
    ema_alpha=0.5,
    eat_min_distance=2,
    eat_probe_interval_tokens=1,
    eat_ema_variance_threshold=1e-3,
    rpdi_window_tokens=4,
    rpdi_threshold=1.5,
    transition_entropy_threshold=2.5,
)


def make_probe(
    *, converged: bool, overthinking: bool, config: EntropyConfig = ENTROPY
) -> EntropyProbe:
    """A real probe driven into the requested state by 16 tokens (each one EAT sample).

    A flat start converges EAT at the third sample (it stays latched); an alternating one keeps
    its variance far above the threshold. Four transitions last make rpdi = (4/4) / (4/16) = 4.
    """
    probe = EntropyProbe(config)
    quiet = [0.5] * 16 if converged else [0.5, 1.5] * 8
    tail = [3.0] * 4 if overthinking else quiet[12:]
    for h in quiet[:12] + tail:
        probe.observe(h)
    assert probe.converged == converged and probe.overthinking == overthinking
    return probe


def policy(**entropy_kw: Any) -> BudgetPolicy:
    return BudgetPolicy(SCHED, ENTROPY.model_copy(update=entropy_kw))


def test_forcing_off_never_forces() -> None:
    off = RequestBudget(forcing=False)
    both = make_probe(converged=True, overthinking=True)
    assert policy().decide(10**9, both, off) is None
    assert policy().decide(500, both, RequestBudget(max_think_tokens=5, forcing=False)) is None


def test_hard_cap_at_config_max() -> None:
    p = policy()
    assert p.decide(999, None) is None
    decision = p.decide(1000, None)
    assert decision == ForceDecision(
        ForceReason.HARD_CAP, 1000, "num_think_tokens=1000 >= max_think_tokens=1000 (config)"
    )
    assert p.decide(5000, None) is not None


def test_hard_cap_beats_entropy_signals() -> None:
    probe = make_probe(converged=True, overthinking=True)
    decision = policy().decide(1000, probe)
    assert decision is not None and decision.reason is ForceReason.HARD_CAP


def test_request_override_smaller_than_floor_fires_below_floor() -> None:
    budget = RequestBudget(max_think_tokens=50)
    assert policy().decide(49, None, budget) is None
    decision = policy().decide(50, None, budget)
    assert decision is not None and decision.reason is ForceReason.HARD_CAP
    assert "request override" in decision.detail and "max_think_tokens=50" in decision.detail


def test_request_override_replaces_larger() -> None:
    budget = RequestBudget(max_think_tokens=4000)
    assert policy().decide(1000, None, budget) is None
    decision = policy().decide(4000, None, budget)
    assert decision is not None and decision.reason is ForceReason.HARD_CAP
    # An override without a cap keeps the config's cap.
    decision = policy().decide(1000, None, RequestBudget())
    assert decision is not None and "(config)" in decision.detail


def test_floor_holds_back_entropy_signals() -> None:
    probe = make_probe(converged=True, overthinking=True)
    assert policy().decide(99, probe) is None
    decision = policy().decide(100, probe)
    assert decision is not None and decision.reason is ForceReason.CONVERGED


def test_no_probe_or_entropy_disabled_only_hard_cap() -> None:
    probe = make_probe(converged=True, overthinking=True)
    assert policy().decide(500, None) is None
    disabled = policy(enabled=False)
    assert disabled.decide(500, probe) is None
    assert disabled.decide(999, probe) is None
    decision = disabled.decide(1000, probe)
    assert decision is not None and decision.reason is ForceReason.HARD_CAP
    assert disabled.new_probe() is None
    assert isinstance(policy().new_probe(), EntropyProbe)


def test_converged() -> None:
    probe = make_probe(converged=True, overthinking=False)
    decision = policy().decide(300, probe)
    assert decision is not None
    assert decision.reason is ForceReason.CONVERGED and decision.num_think_tokens == 300
    assert decision.detail == "eat_variance=0 < 0.001 after 3 samples (stream_proxy)"


def test_overthinking() -> None:
    probe = make_probe(converged=False, overthinking=True)
    decision = policy().decide(300, probe)
    assert decision is not None and decision.reason is ForceReason.OVERTHINKING
    assert decision.detail == "rpdi=4 > 1.5 (last 4 of 16 tokens)"


def test_converged_wins_over_overthinking() -> None:
    probe = make_probe(converged=True, overthinking=True)
    decision = policy().decide(300, probe)
    assert decision is not None and decision.reason is ForceReason.CONVERGED


def test_a_request_chooses_which_signals_may_force_it() -> None:
    both = make_probe(converged=True, overthinking=True)
    rpdi_only = make_probe(converged=False, overthinking=True)

    def reason(probe: EntropyProbe, signals: Signals) -> ForceReason | None:
        decision = policy().decide(300, probe, RequestBudget(signals=signals))
        return None if decision is None else decision.reason

    assert reason(both, Signals.ALL) is ForceReason.CONVERGED
    assert reason(both, Signals.EAT) is ForceReason.CONVERGED
    assert reason(both, Signals.RPDI) is ForceReason.OVERTHINKING
    assert reason(both, Signals.NONE) is None
    assert reason(rpdi_only, Signals.EAT) is None
    # The hard cap forces whatever the signals.
    capped = policy().decide(10, None, RequestBudget(max_think_tokens=10, signals=Signals.NONE))
    assert capped is not None and capped.reason is ForceReason.HARD_CAP


def test_neither_signal_keeps_thinking() -> None:
    assert policy().decide(300, make_probe(converged=False, overthinking=False)) is None


def test_stream_proxy_detail_names_its_source() -> None:
    probe = EntropyProbe(ENTROPY)
    for _ in range(3):
        probe.observe(1.2)
    decision = policy().decide(200, probe)
    assert decision is not None and decision.detail.endswith("(stream_proxy)")


def test_static_policy_is_a_hard_cap_only() -> None:
    static = BudgetPolicy.static(100)
    probe = make_probe(converged=True, overthinking=True, config=ENTROPY)
    assert static.decide(0, probe) is None
    assert static.decide(99, probe) is None
    decision = static.decide(100, probe)
    assert decision is not None and decision.reason is ForceReason.HARD_CAP
    assert static.min_think_tokens == 0 and not static.entropy_enabled
    assert static.new_probe() is None
    tighter = static.decide(10, None, RequestBudget(max_think_tokens=10))
    assert tighter is not None and tighter.reason is ForceReason.HARD_CAP


def test_invalid_inputs_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="positive integer; got 0"):
        BudgetPolicy.static(0)
    with pytest.raises(ValueError, match="positive integer or None; got 0"):
        RequestBudget(max_think_tokens=0)
    with pytest.raises(ValueError, match=">= 0; got -1"):
        policy().decide(-1, None)


@settings(max_examples=300, deadline=None)
@given(
    min_tokens=st.integers(0, 400),
    span=st.integers(1, 400),
    num=st.integers(0, 1200),
    override=st.one_of(st.none(), st.integers(1, 1200)),
    forcing=st.booleans(),
    converged=st.booleans(),
    overthinking=st.booleans(),
    enabled=st.booleans(),
    with_probe=st.booleans(),
)
def test_property_floor_and_cap(
    min_tokens: int,
    span: int,
    num: int,
    override: int | None,
    forcing: bool,
    converged: bool,
    overthinking: bool,
    enabled: bool,
    with_probe: bool,
) -> None:
    max_tokens = min_tokens + span
    p = BudgetPolicy(
        SchedulerConfig(min_think_tokens=min_tokens, max_think_tokens=max_tokens),
        ENTROPY.model_copy(update={"enabled": enabled}),
    )
    probe = make_probe(converged=converged, overthinking=overthinking) if with_probe else None
    budget = RequestBudget(max_think_tokens=override, forcing=forcing)
    decision = p.decide(num, probe, budget)
    cap = max_tokens if override is None else override
    if not forcing:
        assert decision is None
        return
    if num >= cap:
        # Always forces at the cap, and says so.
        assert decision is not None and decision.reason is ForceReason.HARD_CAP
        return
    assert decision is None or decision.reason is not ForceReason.HARD_CAP
    if num < min_tokens:
        # Below the floor only an explicit smaller cap may force (handled above).
        assert decision is None
    signalled = enabled and with_probe and (converged or overthinking)
    assert (decision is not None) == (num >= min_tokens and signalled)
    if decision is not None:
        expected = ForceReason.CONVERGED if converged else ForceReason.OVERTHINKING
        assert decision.reason is expected and decision.num_think_tokens == num
        assert decision.detail


def test_a_request_with_no_signals_costs_no_entropy_work() -> None:
    from meridian.core.forcing import ThinkForcer
    from meridian.core.format import ReasoningFormat

    forcer = ThinkForcer(ReasoningFormat(think_start=(3,), think_end=(4,)), policy())
    for key, signals in (("all", Signals.ALL), ("none", Signals.NONE)):
        forcer.add(key, prompt=[9, 3], output=[], budget=RequestBudget(signals=signals))
    assert forcer.wants_entropy("all") and not forcer.wants_entropy("none")


def test_a_request_back_with_its_output_view_resumes_its_probe() -> None:
    """``ThinkForcer.resume``: the same live output view, holding every token seen, takes the
    kept state back (tokens generated meanwhile are fed); another view, or one that lost
    tokens, is refused and changes nothing."""
    from meridian.core.forcing import ThinkForcer
    from meridian.core.format import ReasoningFormat

    forcer = ThinkForcer(ReasoningFormat(think_start=(3,), think_end=(4,)), policy())
    out = [7, 7]
    forcer.add("r", prompt=[9, 3], output=out, budget=None)
    for h in (0.5, 0.5):
        forcer.observe_entropy("r", h)
    probe = forcer._rows["r"].probe
    assert probe is not None and probe.num_tokens == 2
    assert not forcer.resume("r", [7, 7])  # equal tokens, another view
    assert not forcer.resume("gone", out)
    out.append(7)
    assert forcer.resume("r", out)
    assert forcer._rows["r"].probe is probe and probe.num_tokens == 2
    assert forcer.state("r").num_think_tokens == 3
    del out[:]
    assert not forcer.resume("r", out)  # tokens taken back: start afresh
    forcer.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    caps=st.lists(st.sampled_from([None, 1, 3, 6, 12, 0]), min_size=1, max_size=4),
    steps=st.lists(
        st.lists(
            # Entropies at 0, on a flat 1 nat (EAT converges), or above the transition
            # threshold (bursts of them: RPDI's overthinking).
            st.tuples(st.sampled_from([5, 5, 5, 6, 6, 6, 3, 4]), st.sampled_from([0.0, 1.0, 2.9])),
            min_size=4,
            max_size=4,
        ),
        min_size=1,
        max_size=20,
    ),
    eat_min_distance=st.sampled_from([2, 50]),  # 50: EAT never fires, RPDI may
)
# RPDI fires: 8 quiet think tokens, then a burst of transitions.
@example(caps=[None], steps=[[(5, 0.0)] * 4] * 8 + [[(5, 2.9)] * 4] * 3, eat_min_distance=50)
def test_the_batched_step_decides_as_the_per_key_one(
    caps: list[int | None], steps: list[list[tuple[int, float]]], eat_min_distance: int
) -> None:
    """``prepare`` and ``forced_tokens`` (what the logits processor calls once per step) sync,
    ask for entropy and force exactly as ``sync``, ``wants_entropy`` and ``forced_token`` per key
    do, whatever the tokens (think_start 3 and think_end 4 included), entropies and caps (0:
    forcing off)."""
    from meridian.core.forcing import ThinkForcer
    from meridian.core.format import ReasoningFormat

    model = ReasoningFormat(think_start=(3,), think_end=(4,))
    entropy = ENTROPY.model_copy(update={"eat_min_distance": eat_min_distance})
    floor = BudgetPolicy(SchedulerConfig(min_think_tokens=2, max_think_tokens=1000), entropy)
    forcers = [ThinkForcer(model, floor) for _ in range(2)]
    outputs: list[list[list[int]]] = [[[] for _ in caps] for _ in forcers]
    keys = [f"r{i}" for i in range(len(caps))]
    for forcer, outs in zip(forcers, outputs, strict=True):
        for key, cap, out in zip(keys, caps, outs, strict=True):
            budget = (
                RequestBudget(forcing=False) if cap == 0 else RequestBudget(max_think_tokens=cap)
            )
            forcer.add(key, prompt=[9, 3], output=out, budget=budget)
    per_key, batched = forcers
    for step in steps:
        wanted = []
        for i, key in enumerate(keys):
            per_key.sync(key)
            if per_key.wants_entropy(key):
                wanted.append(i)
        assert batched.prepare(keys) == wanted
        for i in wanted:
            for forcer in forcers:
                forcer.observe_entropy(keys[i], step[i][1])
        expected = [
            (i, t) for i, key in enumerate(keys) if (t := per_key.forced_token(key)) is not None
        ]
        assert batched.forced_tokens(keys) == expected
        forced = dict(expected)
        for outs in outputs:
            for i, out in enumerate(outs):
                out.append(forced.get(i, step[i][0]))
    assert per_key.num_forced == batched.num_forced
    for forcer in forcers:
        forcer.check_integrity()
