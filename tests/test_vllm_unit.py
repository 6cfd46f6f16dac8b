"""The vLLM integration's pure parts, without vLLM: knobs, model resolution, forcing, ordering."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import EntropyConfig, MeridianConfig, SchedulerConfig
from meridian.core.budget import BudgetPolicy, RequestBudget
from meridian.core.router import ReasoningModel
from meridian.core.types import ForceReason, Phase
from meridian.errors import BoundaryError, ConfigError
from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
)
from meridian.vllm.forcing import ThinkForcer
from meridian.vllm.policy import READMIT_GUARD_STEPS, RunningOrder
from meridian.vllm.runtime import (
    GENERIC_NAME,
    RequestArgsError,
    parse_request_budget,
    resolve_runtime,
)
from meridian.vllm.serve import build_serve_argv
from meridian.vllm.steptime import DecodeStepTime

START, END = 3, 4
MODEL = ReasoningModel(think_start=(START,), think_end=(END,))
THINK_PROMPT = [10, 11, START]
PLAIN_PROMPT = [10, 11, 12]


# -- import weight -------------------------------------------------------------------------


def test_package_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, meridian.vllm, meridian.vllm.runtime, meridian.vllm.forcing, "
        "meridian.vllm.policy, meridian.vllm.serve; "
        "bad = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- per-request knobs ---------------------------------------------------------------------


def test_knobs_parse() -> None:
    assert parse_request_budget(None) is None
    assert parse_request_budget({}) is None
    assert parse_request_budget({"other_plugin": 1}) is None
    assert parse_request_budget({"meridian_max_think_tokens": 64}) == RequestBudget(64, True)
    assert parse_request_budget({"meridian_forcing": "off"}) == RequestBudget(None, False)
    assert parse_request_budget({"meridian_forcing": "ON"}) == RequestBudget(None, True)
    assert parse_request_budget({"meridian_forcing": False}) == RequestBudget(None, False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"meridian_max_think_tokens": 0}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": True}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": "64"}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": 2.5}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_forcing": "maybe"}, 'meridian_forcing must be "on" or "off"'),
        ({"meridian_forcing": [1]}, 'meridian_forcing must be "on" or "off"'),
        ({"meridian_max_think": 5}, "unknown Meridian key 'meridian_max_think'"),
    ],
)
def test_bad_knobs_are_clear_value_errors(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestArgsError, match=message) as info:
        parse_request_budget(extra)
    # vLLM turns a ValueError from validate_params into an HTTP 400 for that request.
    assert isinstance(info.value, ValueError)


# -- model family resolution ---------------------------------------------------------------


def test_generic_think_tags_from_vocab() -> None:
    rt = resolve_runtime({"<think>": 7, "</think>": 8, "Ċ": 9, "a": 1})
    assert rt.model_name == GENERIC_NAME
    assert rt.model.think_start == (7,) and rt.think_end_ids == (8,)
    assert rt.boundaries is not None and rt.boundaries.newline_ids == frozenset({9})


def test_reasoning_parser_picks_the_bundled_family() -> None:
    rt = resolve_runtime({"<think>": 151667, "</think>": 151668}, reasoning_parser="qwen3")
    assert rt.model_name == "qwen3"
    # Bundled qwen3 ids disagree with this vocab: skipped, the generic pair wins.
    rt = resolve_runtime({"<think>": 3, "</think>": 4}, reasoning_parser="qwen3")
    assert rt.model_name == GENERIC_NAME and rt.think_end_ids == (4,)


def test_no_boundaries_falls_back_to_single_phase(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        rt = resolve_runtime({"a": 1, "b": 2})
    assert not rt.model.has_boundaries and rt.boundaries is None
    assert "no think boundaries" in caplog.text and "MERIDIAN_MODEL" in caplog.text


def test_named_family_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        resolve_runtime({"<think>": 1, "</think>": 2}, model_name="nope")
    with pytest.raises(BoundaryError, match=r"think_start_token_ids is \[151667\]"):
        resolve_runtime({"<think>": 1, "</think>": 2}, model_name="qwen3")
    # No tokenizer (vLLM's skip_tokenizer_init): configured ids are used.
    rt = resolve_runtime(None, model_name="qwen3")
    assert rt.think_end_ids == (151668,)


# -- the forcer ----------------------------------------------------------------------------


def _run(forcer: ThinkForcer, key: str, out: list[int], steps: int, free: int = 7) -> list[int]:
    """Drive one request for ``steps`` tokens: forced token when asked, else ``free``."""
    for _ in range(steps):
        forcer.sync(key)
        if forcer.wants_entropy(key):
            forcer.observe_entropy(key, 1.0)
        token = forcer.forced_token(key)
        out.append(free if token is None else token)
        forcer.check_integrity()
    forcer.sync(key)
    return out


def test_hard_cap_forces_at_the_exact_index() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(100))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=RequestBudget(max_think_tokens=5))
    _run(forcer, "r", out, 9)
    assert out.index(END) == 5 and out.count(END) == 1
    assert forcer.phase("r") is Phase.OUTPUT
    assert forcer.num_forced[ForceReason.HARD_CAP] == 1
    assert forcer.records[0].num_think_tokens == 5


def test_forcing_off_never_forces() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(3))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=RequestBudget(forcing=False))
    _run(forcer, "r", out, 20)
    assert END not in out and sum(forcer.num_forced.values()) == 0


def test_natural_end_is_not_forced() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(10))
    out = [7, 7, END]
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 20)
    assert out.count(END) == 1 and forcer.router.state("r").forced is None


def test_multi_token_marker_is_forced_whole() -> None:
    model = ReasoningModel(think_start=(3,), think_end=(4, 5))
    forcer = ThinkForcer(model, BudgetPolicy.static(4))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)
    assert out[4:6] == [4, 5] and forcer.phase("r") is Phase.OUTPUT
    assert forcer.router.state("r").num_think_tokens == 4


def test_transition_phrase_precedes_the_marker() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(3), transition=(20, 21))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)
    assert out[:7] == [7, 7, 7, 20, 21, END, 7]
    # The phrase is part of the reasoning: think tokens = cap + phrase.
    assert forcer.router.state("r").num_think_tokens == 5
    assert forcer.num_forced[ForceReason.HARD_CAP] == 1


def test_transition_phrase_does_not_split_a_started_marker() -> None:
    model = ReasoningModel(think_start=(3,), think_end=(4, 5))
    forcer = ThinkForcer(model, BudgetPolicy.static(3), transition=(20,))
    out = [7, 7, 4]  # the model began the two-token marker on its own at the cap
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 2)
    assert out == [7, 7, 4, 5, 7] and forcer.phase("r") is Phase.OUTPUT


class _Encoder:
    """A tokenizer stand-in: a vocab and a word-per-token encode()."""

    vocab: ClassVar[dict[str, int]] = {"<think>": 3, "</think>": 4, "wrap": 20, "up": 21}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [self.vocab[w] for w in text.split()]


def _phrase_config(phrase: str) -> MeridianConfig:
    return MeridianConfig.model_validate({"scheduler": {"force_transition_phrase": phrase}})


def test_transition_phrase_resolves_to_token_ids() -> None:
    rt = resolve_runtime(_Encoder(), config=_phrase_config("wrap up"))
    assert rt.transition_ids == (20, 21) and rt.think_end_ids == (4,)
    assert resolve_runtime(_Encoder()).transition_ids == ()
    # A model without reasoning never forces: the phrase is not needed.
    assert resolve_runtime({"a": 1}, config=_phrase_config("wrap up")).transition_ids == ()


@pytest.mark.parametrize(
    ("tokenizer", "model_name", "phrase", "message"),
    [
        # vLLM's skip_tokenizer_init: the family's configured ids, but nothing to encode with.
        (None, "qwen3", "wrap up", "needs the model's tokenizer"),
        (_Encoder(), None, "wrap </think>", "contains the think-end marker"),
        (_Encoder(), None, "   ", "encodes to no tokens"),
    ],
)
def test_unusable_transition_phrases_are_clear_config_errors(
    tokenizer: Any, model_name: str | None, phrase: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"scheduler.force_transition_phrase.*{message}"):
        resolve_runtime(tokenizer, config=_phrase_config(phrase), model_name=model_name)


def test_resumed_request_replays_its_output() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(6))
    out = [7, 7, 7, 7]  # four think tokens generated before a preemption
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    assert forcer.router.state("r").num_think_tokens == 4
    _run(forcer, "r", out, 4)
    assert out.index(END) == 6


def test_entropy_convergence_forces_after_the_floor() -> None:
    policy = BudgetPolicy(
        SchedulerConfig(min_think_tokens=4, max_think_tokens=1000),
        EntropyConfig(ema_alpha=0.5, eat_min_distance=2, eat_probe_interval_tokens=1),
    )
    forcer = ThinkForcer(MODEL, policy)
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)  # flat entropy: EAT converges at once, the floor holds it to 4
    assert out.index(END) == 4
    assert forcer.num_forced[ForceReason.CONVERGED] == 1


def test_remove_untracks() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(5))
    forcer.add("a", prompt=THINK_PROMPT, output=[], budget=None)
    forcer.add("b", prompt=PLAIN_PROMPT, output=[], budget=None)
    forcer.remove("a")
    forcer.remove("missing")
    assert len(forcer) == 1 and forcer.router.tracked_requests == 1
    forcer.check_integrity()


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(1, 40),
    forcing=st.booleans(),
    stream=st.lists(st.sampled_from([7, 8, 9, END]), min_size=1, max_size=60),
)
def test_forcer_property(cap: int, forcing: bool, stream: list[int]) -> None:
    """Forced exactly at the cap unless the model ended earlier; never twice; never when off."""
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(1000))
    out: list[int] = []
    budget = RequestBudget(max_think_tokens=cap, forcing=forcing)
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=budget)
    for free in stream:
        forcer.sync("r")
        token = forcer.forced_token("r")
        out.append(free if token is None else token)
        forcer.check_integrity()
    natural = out.index(END) if END in out else None
    num_forced = sum(forcer.num_forced.values())
    ended_first = natural is not None and natural < cap
    if not forcing or ended_first:
        assert num_forced == 0
    elif len(out) > cap:
        assert out[cap] == END and num_forced == 1
    else:
        assert num_forced == 0
    assert num_forced <= 1


# -- the running order ---------------------------------------------------------------------


@dataclass
class FakeRequest:
    """The attributes of vLLM's Request that RunningOrder reads and writes."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    sampling_params: Any = None
    num_computed_tokens: int = 0
    next_decode_eligible_step: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def emit(self, order: RunningOrder, token: int, step: int) -> None:
        """One decode step: the token is computed next step, as in vLLM."""
        self.num_computed_tokens = self.num_tokens
        self.output_token_ids.append(token)
        order.observe(self, [token], step)


def make_order(**kw: Any) -> RunningOrder:
    return RunningOrder(MODEL, SchedulerConfig(), block_size=4, capacity=64, **kw)


def admitted(order: RunningOrder, rid: str, prompt: list[int]) -> FakeRequest:
    r = FakeRequest(rid, prompt, num_computed_tokens=len(prompt))
    order.track(r)
    return r


def ids(requests: list[Any]) -> list[str]:
    return [r.request_id for r in requests]


def test_answers_first_and_newest_think_last() -> None:
    order = make_order()
    t1 = admitted(order, "t1", THINK_PROMPT)
    o1 = admitted(order, "o1", THINK_PROMPT)
    t2 = admitted(order, "t2", THINK_PROMPT)
    o2 = admitted(order, "o2", PLAIN_PROMPT)
    o1.emit(order, END, 1)  # o1 leaves its think phase
    o2.emit(order, 9, 1)  # o2 never thinks: a plain answer
    assert order.phase("o2") is Phase.OUTPUT
    result = order.order([t1, o1, t2, o2], step=1, num_free_blocks=10)
    assert ids(result) == ["o1", "o2", "t1", "t2"]
    order.check_integrity()


def test_the_think_requests_with_the_least_work_are_the_first_victims() -> None:
    # vLLM recomputes a victim's KV: the cheapest thinking requests go last (first victims),
    # whatever their age; answer streams stay in front. 8 running: 2 ranked victims (25 %).
    order = make_order()
    names = ("t1", "t2", "t3", "t4", "t5", "t6", "o1", "o2")
    reqs = [admitted(order, rid, THINK_PROMPT) for rid in names]
    for r in reqs[6:]:
        r.emit(order, END, 1)
    for r, computed in zip(reqs, (40, 7, 90, 60, 12, 80, 5, 3), strict=True):
        r.num_computed_tokens = computed
    result = ids(order.order(reqs, step=1, num_free_blocks=10))
    assert result[:2] == ["o1", "o2"]
    assert result[-2:] == ["t5", "t2"]  # 12 then 7 computed tokens: t2 is the first victim
    assert result[2:6] == ["t1", "t3", "t4", "t6"]  # the others keep plan order
    order.check_integrity()


def test_requests_without_kv_go_first() -> None:
    order = make_order()
    t1 = admitted(order, "t1", THINK_PROMPT)
    fresh = FakeRequest("new", THINK_PROMPT)  # not computed yet: holds no KV
    order.track(fresh)
    assert ids(order.order([t1, fresh], step=0, num_free_blocks=10)) == ["new", "t1"]


def test_readmitted_think_request_is_guarded() -> None:
    order = make_order()
    t1, t2, t3 = (admitted(order, f"t{i}", THINK_PROMPT) for i in (1, 2, 3))
    assert ids(order.order([t1, t2, t3], step=0, num_free_blocks=10))[-1] == "t3"
    order.on_preempt("t3")
    assert order.stats.num_preemptions[Phase.THINK] == 1
    # t3 re-enters running during schedule() of step 5; the next order sees it.
    result = order.order([t1, t2, t3], step=5, num_free_blocks=10)
    assert ids(result)[-1] == "t2", "a just re-admitted request is not the first victim"
    later = order.order([t1, t2, t3], step=5 + READMIT_GUARD_STEPS, num_free_blocks=10)
    assert ids(later)[-1] == "t3", "the guard expires"


def test_surplus_think_requests_are_deferred_one_step() -> None:
    order = make_order(output_budget=1)  # think limit floor(2.5 * 1) = 2
    o1 = admitted(order, "o1", PLAIN_PROMPT)
    o1.emit(order, 9, 1)
    thinks = [admitted(order, f"t{i}", THINK_PROMPT) for i in range(4)]
    order.order([o1, *thinks], step=7, num_free_blocks=10)
    skipped = [r.request_id for r in thinks if r.next_decode_eligible_step == 9]
    assert skipped == ["t2", "t3"] and o1.next_decode_eligible_step == 0
    assert order.stats.num_deferred == 2


def test_order_is_planned_again_only_while_the_plan_defers() -> None:
    order = make_order(output_budget=1)  # think limit floor(2.5 * 1) = 2
    thinks = [admitted(order, f"t{i}", THINK_PROMPT) for i in range(3)]
    order.order(thinks, step=1, num_free_blocks=10)
    assert order.stats.num_reordered_steps == 1 and order.stats.num_deferred == 1
    order.order(thinks, step=2, num_free_blocks=10)  # t2 is deferred again: a new plan
    assert order.stats.num_reordered_steps == 2 and order.stats.num_deferred == 2
    order.untrack("t2")
    order.order(thinks[:2], step=3, num_free_blocks=10)  # both fit: nobody deferred
    assert order.stats.num_reordered_steps == 3 and order.stats.num_deferred == 2
    assert ids(order.order(thinks[:2], step=4, num_free_blocks=10)) == ["t0", "t1"]
    assert order.stats.num_reordered_steps == 3, "nothing changed: the fast path"


def test_answer_streams_hold_rather_than_preempt_each_other() -> None:
    order = make_order()
    answers = [admitted(order, f"o{i}", PLAIN_PROMPT) for i in range(4)]
    for r in answers:
        r.emit(order, 9, 1)  # computed 3 tokens, 4 in total: a decode at a block boundary
        r.num_computed_tokens = 4
        r.output_token_ids.append(9)
        order.observe(r, [9], 2)
    answers[0].num_computed_tokens = 3  # this one still has room in its block
    answers[0].output_token_ids.pop()
    result = order.order(answers, step=2, num_free_blocks=1)
    held = [r.request_id for r in result if r.next_decode_eligible_step == 4]
    assert held == ["o2", "o3"] and order.stats.num_answer_holds == 2
    # With a thinking request holding KV, vLLM preempts that one instead: nothing is held.
    t = admitted(order, "t", THINK_PROMPT)
    assert order.hold_answers([*answers, t], step=2, num_free_blocks=0) == 0


def test_answer_gaps_and_inferred_caps() -> None:
    order = make_order()
    params = type("P", (), {"extra_args": {"meridian_max_think_tokens": 2}})()
    r = FakeRequest("r", THINK_PROMPT, sampling_params=params, num_computed_tokens=3)
    order.track(r)
    for step, token in [(1, 7), (2, 7), (3, END), (4, 9), (5, 9), (9, 9)]:
        r.emit(order, token, step)
    stats = order.stats
    assert stats.max_answer_gap_steps == 4 and stats.num_answer_gaps_over_2 == 1
    assert stats.num_forced_inferred[ForceReason.HARD_CAP] == 1
    assert stats.think_tokens_total == 2 and stats.num_think_exits == 1
    order.untrack("r")
    assert order.num_tracked == 0
    order.check_integrity()


def test_inferred_caps_count_the_transition_phrase() -> None:
    order = make_order(transition_len=2)
    params = type("P", (), {"extra_args": {"meridian_max_think_tokens": 2}})()
    r = FakeRequest("r", THINK_PROMPT, sampling_params=params, num_computed_tokens=3)
    order.track(r)
    for step, token in enumerate([7, 7, 20, 21, END, 9], start=1):
        r.emit(order, token, step)
    assert order.stats.num_forced_inferred[ForceReason.HARD_CAP] == 1
    assert order.stats.think_tokens_total == 4


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), min_size=1, max_size=80),
    st.one_of(st.none(), st.integers(1, 4)),
)
def test_order_property(ops: list[tuple[int, int]], output_budget: int | None) -> None:
    """Random add/decode/preempt/readmit/finish, with and without deferral: the order is a
    permutation, every answer stream holding KV comes before every thinking request holding KV,
    vLLM's victim (the last one holding KV) is not an answer stream while anything else is, and
    tracking drains to 0."""
    order = make_order(output_budget=output_budget)
    running: list[FakeRequest] = []
    waiting: list[FakeRequest] = []
    for step, (op, arg) in enumerate(ops):
        n = step
        if op == 0 or not running:
            r = admitted(order, f"r{n}", THINK_PROMPT if arg % 3 else PLAIN_PROMPT)
            running.append(r)
        elif op in (1, 2):
            r = running[arg % len(running)]
            r.emit(order, END if arg % 4 == 0 else 7, step)
        elif op == 3:
            victim = running.pop()
            order.on_preempt(victim.request_id)
            victim.num_computed_tokens = 0
            waiting.append(victim)
        elif op == 4 and waiting:
            back = waiting.pop(0)
            back.num_computed_tokens = back.num_tokens
            running.append(back)
        else:
            r = running.pop(arg % len(running))
            order.untrack(r.request_id)
        result = order.order(running, step=step, num_free_blocks=arg % 3)
        assert sorted(ids(result)) == sorted(ids(running))
        kv_phases = [order.phase(r.request_id) for r in result if r.num_computed_tokens > 0]
        first_think = next((i for i, p in enumerate(kv_phases) if p is Phase.THINK), None)
        if first_think is not None:
            assert Phase.OUTPUT not in kv_phases[first_think:]
            assert kv_phases[-1] is not Phase.OUTPUT, "a thinking request is the first victim"
        running[:] = result
        order.check_integrity()
    for r in running + waiting:
        order.untrack(r.request_id)
    assert order.num_tracked == 0 and len(order.queues) == 0


def test_config_defaults_are_usable() -> None:
    cfg = MeridianConfig()
    order = RunningOrder(MODEL, cfg.scheduler, block_size=16, capacity=8)
    assert order.output_budget is None
    with pytest.raises(ValueError, match="block_size and capacity"):
        RunningOrder(MODEL, cfg.scheduler, block_size=0, capacity=8)


# -- meridian serve ------------------------------------------------------------------------


def test_serve_argv_wires_meridian_in(tmp_path: Any) -> None:
    cmd = build_serve_argv(
        "Qwen/Qwen3-8B",
        ["--port", "8123", "--max-model-len", "4096", "--no-async-scheduling"],
        config_path=tmp_path / "meridian.toml",
        python="py",
        metrics_dir=tmp_path / "prom",
    )
    argv = cmd.argv
    assert argv[:5] == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "Qwen/Qwen3-8B",
    ]
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert argv[argv.index("--logits-processors") + 1] == LOGITS_PROCESSOR
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[-5:] == ["--port", "8123", "--max-model-len", "4096", "--no-async-scheduling"]
    assert cmd.env["MERIDIAN_MODEL"] == "qwen3"
    assert cmd.env["MERIDIAN_CONFIG"].endswith("meridian.toml")
    assert cmd.env["PROMETHEUS_MULTIPROC_DIR"].endswith("prom")
    assert cmd.metrics_url == "http://127.0.0.1:8123/metrics"


def test_serve_argv_async_v2_and_user_parser() -> None:
    cmd = build_serve_argv(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        ["--async-scheduling", "--reasoning-parser", "mine"],
        environ={"VLLM_USE_V2_MODEL_RUNNER": "1"},
    )
    assert cmd.model_family == "r1_distill_qwen"
    assert cmd.argv[cmd.argv.index("--scheduler-cls") + 1] == ASYNC_SCHEDULER_CLS
    assert cmd.argv[cmd.argv.index("--logits-processors") + 1] == LOGITS_PROCESSOR_V2
    assert cmd.argv.count("--reasoning-parser") == 1


def test_serve_local_dir_uses_generic_tags(tmp_path: Any) -> None:
    cmd = build_serve_argv(str(tmp_path), ["--no-async-scheduling"])
    assert cmd.model_family == GENERIC_NAME and "MERIDIAN_MODEL" not in cmd.env
    assert cmd.argv[cmd.argv.index("--reasoning-parser") + 1] == "deepseek_r1"


@pytest.mark.parametrize(
    ("model", "args", "message"),
    [
        ("some/unknown-model", [], r"(?s)cannot tell the reasoning-model family.*\[model\.NAME\]"),
        ("Qwen/Qwen3-8B", ["--scheduler-cls", "x.Y"], "sets --scheduler-cls itself"),
        ("Qwen/Qwen3-8B", ["--scheduling-policy=priority"], "needs --scheduling-policy fcfs"),
    ],
)
def test_serve_refuses_clearly(model: str, args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_serve_argv(model, args)
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        build_serve_argv("Qwen/Qwen3-8B", model_family="nope")


def test_order_feeds_the_metric_catalogue() -> None:
    from prometheus_client import CollectorRegistry

    from meridian.telemetry.metrics import MeridianMetrics

    metrics = MeridianMetrics(CollectorRegistry())
    order = RunningOrder(MODEL, SchedulerConfig(), block_size=4, capacity=8, metrics=metrics)
    params = type("P", (), {"extra_args": {"meridian_max_think_tokens": 2}})()
    r = FakeRequest("r", THINK_PROMPT, sampling_params=params, num_computed_tokens=3)
    order.track(r)
    for step, token in [(1, 7), (2, 7), (3, END), (4, 9)]:
        r.emit(order, token, step)
    order.on_preempt("r", num_blocks=3)
    sample = metrics.registry.get_sample_value
    assert sample("meridian_request_think_tokens_count") == 1
    assert sample("meridian_request_think_tokens_sum") == 2
    assert sample("meridian_budget_forces_total", {"reason": "hard_cap"}) == 1
    assert sample("meridian_preemptions_total", {"phase": "output"}) == 1
    assert sample("meridian_output_critical_evictions_total") == 3


def test_phase_events_and_request_lifetimes_reach_the_tracer() -> None:
    from meridian.core.types import EnterThink, ExitThink, PhaseEvent
    from meridian.telemetry.otel import Tracer

    class Recording(Tracer):
        enabled = True

        def __init__(self) -> None:
            self.log: list[tuple[str, str]] = []

        def request_started(self, request_id: str) -> None:
            self.log.append(("start", request_id))

        def phase_event(self, request_id: str, event: PhaseEvent) -> None:
            self.log.append((type(event).__name__, request_id))

        def request_finished(self, request_id: str) -> None:
            self.log.append(("finish", request_id))

    order = make_order()
    tracer = Recording()
    order.tracer = tracer
    r = admitted(order, "r", THINK_PROMPT)
    for step, token in [(1, 7), (2, END), (3, 9)]:
        r.emit(order, token, step)
    order.untrack("r")
    order.untrack("r")  # idempotent: one finish only
    assert tracer.log == [
        ("start", "r"),
        (EnterThink.__name__, "r"),
        (ExitThink.__name__, "r"),
        ("finish", "r"),
    ]
    # A think phase that ends exactly at the request's cap was forced: ForceBudget comes first.
    params = type("P", (), {"extra_args": {"meridian_max_think_tokens": 2}})()
    capped = FakeRequest("c", THINK_PROMPT, sampling_params=params, num_computed_tokens=3)
    order.track(capped)
    for step, token in [(4, 7), (5, 7), (6, END)]:
        capped.emit(order, token, step)
    assert [name for name, rid in tracer.log if rid == "c"][-2:] == ["ForceBudget", "ExitThink"]


def test_output_budget_rows_come_from_config_and_the_environment_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm.sampling_params")
    from meridian.vllm.scheduler import ENV_OUTPUT_BUDGET_ROWS, _output_budget

    monkeypatch.delenv(ENV_OUTPUT_BUDGET_ROWS, raising=False)
    assert _output_budget(0) is None  # 0: the whole batch, no deferral
    assert _output_budget(48) == 48
    assert _output_budget("auto") == "auto"
    assert SchedulerConfig().output_budget_rows == "auto"
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "16")
    assert _output_budget(48) == 16
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "0")
    assert _output_budget("auto") is None
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "auto")
    assert _output_budget(48) == "auto"
    for bad in ("lots", "-3"):
        monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, bad)
        with pytest.raises(ConfigError, match='MERIDIAN_OUTPUT_BUDGET_ROWS must be "auto" or'):
            _output_budget(48)


def test_output_budget_rows_config_values() -> None:
    assert SchedulerConfig.model_validate({"output_budget_rows": 0}).output_budget_rows == 0
    for bad in (-1, "many", True, 2.5):
        with pytest.raises(ValueError, match=r"must be \"auto\" or a number of rows"):
            SchedulerConfig.model_validate({"output_budget_rows": bad})


# -- the measured output budget -------------------------------------------------------------


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
    # Never below 1 row; no cap when the largest possible batch (max_rows) fits.
    assert model.rows_within(0.0001, 256) == 1
    assert model.rows_within(0.006, 30) is None


def test_step_time_needs_samples_and_uses_proportion_for_one_batch_size() -> None:
    assert _fed([(64, 0.04)] * 31).rows_within(0.02, 256) is None  # too few samples yet
    model = _fed([(64, 0.04)] * 32)
    assert model.fit() == pytest.approx((0.0, 0.04 / 64))
    assert model.rows_within(0.02, 256) == 32  # half the time: half the rows
    assert _fed([(64, 0.01)] * 32).rows_within(0.02, 256) is None  # it fits already


def test_step_time_without_a_positive_slope_is_read_as_proportional() -> None:
    # Fixed cost dominating, noise makes small batches look slower: no evidence that rows cost
    # time, so the conservative reading (time proportional to rows) decides, and an
    # unmeetable budget caps at 1 row instead of flipping to "no cap" on a noisy slope.
    model = _fed([(8, 0.0030), (3, 0.0031)] * 20)
    assert model.fit() == pytest.approx((0.0, 0.00305 * 2 / 11), rel=0.05)
    assert model.rows_within(1e-6, 256) == 1
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


def test_a_new_output_budget_replans_the_next_step() -> None:
    order = make_order(output_budget=None)
    reqs = [admitted(order, f"t{i}", THINK_PROMPT) for i in range(6)]
    order.order(reqs, 0, 100)
    assert order.stats.num_deferred == 0
    before = order.stats.num_reordered_steps
    order.order(reqs, 1, 100)
    assert order.stats.num_reordered_steps == before  # nothing changed: the order is reused
    order.set_output_budget(1)  # think limit: floor(2.5 * 1) = 2 of 6 thinking requests
    order.order(reqs, 2, 100)
    assert order.stats.num_reordered_steps == before + 1 and order.stats.num_deferred == 4
