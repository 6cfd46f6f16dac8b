"""The one Meridian policy (``meridian.core.policy``), engine-neutral: plans, victims, holds,
deferral, the re-admission guard, the measured output budget, and the counters.

The same object runs inside vLLM's scheduler (tests/vllm_e2e) and the fast engine
(tests/test_sim_engine.py); here it is driven directly, as an engine adapter would."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import MeridianConfig, SchedulerConfig
from meridian.core import admission as admission_module
from meridian.core import headroom
from meridian.core.budget import RequestBudget
from meridian.core.format import ReasoningFormat
from meridian.core.headroom import MIN_SAMPLES
from meridian.core.interface import output_budget_setting
from meridian.core.output_budget import BUDGET_REFIT_STEPS
from meridian.core.planner import READMIT_GUARD_STEPS
from meridian.core.policy import MeridianPolicy
from meridian.core.state import RequestState
from meridian.core.tracking import UntrackedRequestsError
from meridian.core.types import EnterThink, ExitThink, ForceBudget, ForceReason, Phase, PhaseEvent

START, END = 3, 4
MODEL = ReasoningFormat(think_start=(START,), think_end=(END,))
THINK_PROMPT = [10, 11, START]
PLAIN_PROMPT = [10, 11, 12]
CHAT_PROMPT = [10, START, END]  # thinking disabled in the prompt: OUTPUT from the start


@dataclass
class FakeRequest:
    """What the policy reads of an engine's request (vLLM's names)."""

    request_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    max_tokens: int = 1 << 20  # a client that sets no useful limit

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    def emit(self, policy: MeridianPolicy, token: int, step: int) -> None:
        """One decode step of this request alone (:func:`emit_step`)."""
        emit_step(policy, step, [(self, token)])


def state_of(policy: MeridianPolicy, request_id: str) -> RequestState:
    """A tracked request's state, its counts brought up to date (as admission reads them)."""
    policy.tracker.settle()
    return policy.tracker.states[request_id]


def emit_step(policy: MeridianPolicy, step: int, tokens: list[tuple[FakeRequest, int]]) -> None:
    """One engine step: each request's token (computed next step, as in vLLM), observed in one
    call."""
    for r, token in tokens:
        r.num_computed_tokens = r.num_tokens
        r.output.append(token)
    policy.observe([r.request_id for r, _ in tokens], [[token] for _, token in tokens], step)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_policy(**kw: Any) -> MeridianPolicy:
    return MeridianPolicy(MODEL, SchedulerConfig(), block_size=4, capacity=64, **kw)


def admitted(policy: MeridianPolicy, rid: str, prompt: list[int], **kw: Any) -> FakeRequest:
    r = FakeRequest(rid, prompt, num_computed_tokens=len(prompt))
    policy.track(rid, prompt, **kw)
    return r


def ids(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


def test_answers_first_and_newest_think_last() -> None:
    policy = make_policy()
    t1 = admitted(policy, "t1", THINK_PROMPT)
    o1 = admitted(policy, "o1", THINK_PROMPT)
    t2 = admitted(policy, "t2", THINK_PROMPT)
    o2 = admitted(policy, "o2", PLAIN_PROMPT)
    emit_step(policy, 1, [(o1, END), (o2, 9)])  # o1 leaves its think phase; o2 never thinks
    assert policy.phase("o2") is Phase.OUTPUT
    plan = policy.plan([t1, o1, t2, o2], step=2, num_free_blocks=10)
    assert ids(plan.order) == ["o1", "o2", "t1", "t2"]
    assert ids(plan.victims) == ["t2"]  # 25 % of 4 running: one ranked victim, last in order
    assert not plan.skip
    policy.check_integrity()


def test_the_think_requests_with_the_least_work_are_the_first_victims() -> None:
    # vLLM recomputes a victim's KV: the cheapest thinking requests go last (first victims),
    # whatever their age; answer streams stay in front. 8 running: 2 ranked victims (25 %).
    policy = make_policy()
    names = ("t1", "t2", "t3", "t4", "t5", "t6", "o1", "o2")
    reqs = [admitted(policy, rid, THINK_PROMPT) for rid in names]
    emit_step(policy, 1, [(r, END) for r in reqs[6:]])
    for r, computed in zip(reqs, (40, 7, 90, 60, 12, 80, 5, 3), strict=True):
        r.num_computed_tokens = computed
    plan = policy.plan(reqs, step=2, num_free_blocks=10)
    order = ids(plan.order)
    assert order[:2] == ["o1", "o2"]
    assert order[-2:] == ["t5", "t2"]  # 12 then 7 computed tokens: t2 is the first victim
    assert order[2:6] == ["t1", "t3", "t4", "t6"]  # the others keep plan order
    assert ids(plan.victims) == ["t2", "t5"]


def test_requests_without_kv_go_first() -> None:
    policy = make_policy()
    t1 = admitted(policy, "t1", THINK_PROMPT)
    fresh = FakeRequest("new", THINK_PROMPT)  # not computed yet: holds no KV
    policy.track("new", THINK_PROMPT)
    assert ids(policy.plan([t1, fresh], step=1, num_free_blocks=10).order) == ["new", "t1"]


def test_a_readmitted_think_request_is_guarded_for_one_plan() -> None:
    policy = make_policy()
    t1, t2, t3 = (admitted(policy, f"t{i}", THINK_PROMPT) for i in (1, 2, 3))
    assert ids(policy.plan([t1, t2, t3], step=1, num_free_blocks=10).order)[-1] == "t3"
    assert policy.on_preempt("t3", num_blocks=1) is Phase.THINK
    assert policy.stats.num_preemptions[Phase.THINK] == 1
    # t3 re-entered the running set during step 5; the plan of step 6 sees it.
    assert ids(policy.plan([t1, t2, t3], step=6, num_free_blocks=10).order)[-1] == "t2"
    assert state_of(policy, "t3").readmitted_step == 5
    later = policy.plan([t1, t2, t3], step=5 + READMIT_GUARD_STEPS, num_free_blocks=10)
    assert ids(later.order)[-1] == "t3", "the guard expired"


def test_surplus_think_requests_are_skipped_one_step() -> None:
    policy = make_policy(output_budget=1)  # think limit floor(2.5 * 1) = 2
    o1 = admitted(policy, "o1", PLAIN_PROMPT)
    o1.emit(policy, 9, 1)
    thinks = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(4)]
    plan = policy.plan([o1, *thinks], step=2, num_free_blocks=10)
    assert ids(plan.skip) == ["t2", "t3"]
    assert policy.stats.num_deferred == 2


def test_the_order_is_planned_again_only_while_the_plan_defers() -> None:
    policy = make_policy(output_budget=1)  # think limit floor(2.5 * 1) = 2
    thinks = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(3)]
    starvation_steps = SchedulerConfig().think_starvation_steps
    # t2 is deferred, and every plan that defers is made again: its deferrals add up until the
    # starvation guard serves it (and defers t1, the newest of the others, instead).
    for step in range(1, starvation_steps + 1):
        plan = policy.plan(thinks, step=step, num_free_blocks=10)
        assert ids(plan.skip) == ["t2"] and plan.order is not thinks
    plan = policy.plan(thinks, step=starvation_steps + 1, num_free_blocks=10)
    assert ids(plan.skip) == ["t1"]
    assert policy.stats.num_deferred == starvation_steps + 1
    policy.untrack("t2")
    running = [thinks[0], thinks[1]]
    plan = policy.plan(running, step=20, num_free_blocks=10)  # both fit: nobody deferred
    assert not plan.skip and plan.order is not running and ids(plan.victims) == ["t1"]
    # Nothing changed: the order set last time holds, and the running list is the plan.
    plan = policy.plan(running, step=21, num_free_blocks=10)
    assert plan.order is running and not plan.skip and ids(plan.victims) == ["t1"]
    assert policy.stats.num_deferred == starvation_steps + 1


def test_an_order_that_cannot_change_the_step_is_not_planned() -> None:
    # Block size 4; every request decodes at a block boundary (4 computed of 5): 1 block each.
    policy = make_policy(max_step_tokens=16)
    t1, o1, t2 = (admitted(policy, rid, THINK_PROMPT) for rid in ("t1", "o1", "t2"))
    for r in (t1, o1, t2):
        r.output += [7, END if r is o1 else 7]
        r.num_computed_tokens = 4
    running = [t1, o1, t2]
    policy.observe(ids(running), [r.output for r in running], 1)  # o1 answers now
    # The engine's order is kept (no victims ranked), and the dual queue counts a step that
    # served everyone: the answer stream and the two thinking requests.
    plan = policy.plan(running, step=2, num_free_blocks=3)
    assert plan.order is running and not plan.skip and plan.victims == []
    assert policy.queue_gauges() == (1, 2, 1, 2)
    policy.check_integrity()
    # Two free blocks for three that need one: a preemption is possible, so the order is
    # planned: the answer first, the thinking request with the least KV last (the victim).
    t2.num_computed_tokens = 3
    t2.output.append(7)  # 3 computed of 6: 3 new tokens, still 1 block
    plan = policy.plan(running, step=3, num_free_blocks=2)
    assert ids(plan.order) == ["o1", "t1", "t2"] and ids(plan.victims) == ["t2"]
    # The tokens count too: with ample blocks, a 20-token prefill beyond the budget of 16.
    long = FakeRequest("p", list(range(20, 40)))
    policy.track("p", long.prompt)
    plan = policy.plan([*running, long], step=4, num_free_blocks=100)
    assert ids(plan.order)[0] == "o1" and plan.victims
    policy.untrack("p")
    assert policy.plan(running, step=5, num_free_blocks=100).order is running
    # Without a token budget (the default), every change is planned: victims are ranked.
    unbounded = make_policy()
    a, b = (admitted(unbounded, rid, THINK_PROMPT) for rid in ("a", "b"))
    plan = unbounded.plan([a, b], step=1, num_free_blocks=100)
    assert ids(plan.order) == ["a", "b"] and ids(plan.victims) == ["b"]


def test_an_answer_more_keeps_a_moot_order_and_moves_the_batch_sizes() -> None:
    # One more answer stream cannot make a kept order matter (the think queue only shrinks):
    # the step after a think exit keeps the engine's order without planning it; the batch
    # sizes by phase still move, and an order planned later puts the new answer first.
    policy = make_policy(max_step_tokens=16)
    running = [admitted(policy, rid, THINK_PROMPT) for rid in ("t1", "t2", "t3")]
    emit_step(policy, 1, [(r, 7) for r in running])
    assert policy.plan(running, step=2, num_free_blocks=10).order is running
    assert policy.queue_gauges() == (0, 3, 0, 3)
    reordered, kept = policy.stats.num_reordered_steps, policy.stats.num_engine_order_steps
    emit_step(policy, 2, [(running[0], END), (running[1], 7), (running[2], 7)])
    plan = policy.plan(running, step=3, num_free_blocks=10)
    assert plan.order is running and not plan.skip
    assert policy.stats.num_reordered_steps == reordered
    assert policy.stats.num_engine_order_steps == kept + 1
    assert policy.queue_gauges() == (1, 2, 1, 2)
    policy.check_integrity()
    # Each decode now opens a block, two are free: the order is planned, the answer first.
    plan = policy.plan(running, step=4, num_free_blocks=2)
    assert ids(plan.order)[0] == "t1" and ids(plan.victims) == ["t3"]


def test_the_engine_order_is_kept_only_while_nobody_can_be_deferred() -> None:
    policy = make_policy(output_budget=1, max_step_tokens=64)  # think limit floor(2.5) = 2
    thinks = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(2)]
    assert policy.plan(thinks, step=1, num_free_blocks=100).order is thinks
    thinks.append(admitted(policy, "t2", THINK_PROMPT))  # a third thinker: one is deferred
    plan = policy.plan(thinks, step=2, num_free_blocks=100)
    assert ids(plan.skip) == ["t2"] and plan.order is not thinks


def test_answer_streams_hold_rather_than_preempt_each_other() -> None:
    policy = make_policy()
    answers = [admitted(policy, f"o{i}", PLAIN_PROMPT) for i in range(4)]
    emit_step(policy, 1, [(r, 9) for r in answers])
    # Computed 4 tokens, 5 in total: a decode at a block boundary.
    emit_step(policy, 2, [(r, 9) for r in answers])
    answers[0].num_computed_tokens = 3  # this one still has room in its block
    answers[0].output.pop()
    plan = policy.plan(answers, step=3, num_free_blocks=1)
    assert ids(plan.skip) == ["o2", "o3"] and policy.stats.num_answer_holds == 2
    # With a thinking request holding KV, it is preempted instead: nothing is held.
    t = admitted(policy, "t", THINK_PROMPT)
    assert not policy.plan([*answers, t], step=4, num_free_blocks=0).skip


def test_without_reasoning_the_engine_order_and_admission_stand() -> None:
    # A model without reasoning: every request is an answer stream and Meridian's rules, which
    # arbitrate between the phases, have nothing to decide. The scenes where a policy with
    # reasoning holds an answer stream (the test above), admits by bounds and reorders the
    # waiting queue: the engine's order and admission stand, and tracking goes on.
    def scene(policy: MeridianPolicy) -> tuple[Any, int | None, Any]:
        answers = [admitted(policy, f"o{i}", PLAIN_PROMPT) for i in range(4)]
        for r in answers:
            r.max_tokens = 13
        emit_step(policy, 1, [(r, 9) for r in answers])
        emit_step(policy, 2, [(r, 9) for r in answers])
        plan = policy.plan(answers, step=3, num_free_blocks=1)
        waiting = [FakeRequest(f"w{i}", PLAIN_PROMPT, max_tokens=13) for i in range(40)]
        allowed = policy.admissions(answers, waiting, 64)
        for r in waiting[:3]:
            policy.track(r.request_id, r.prompt)
        policy.on_preempt("o3")
        return plan, allowed, policy.waiting_order([*waiting[:3], answers[3]])

    plan, allowed, order = scene(make_policy())  # the same scene, a model with reasoning
    assert plan.skip and allowed is not None and order is not None
    policy = MeridianPolicy(
        ReasoningFormat.without_reasoning(), SchedulerConfig(), block_size=4, capacity=64
    )
    assert policy.stands_aside and not make_policy().stands_aside
    plan, allowed, order = scene(policy)
    assert not plan.skip and not plan.victims and ids(plan.order) == ["o0", "o1", "o2", "o3"]
    assert allowed is None and order is None
    assert policy.stats.num_answer_holds == 0 and policy.num_tracked == 7


def test_answer_gaps_and_inferred_caps() -> None:
    policy = make_policy()
    r = admitted(policy, "r", THINK_PROMPT, request_budget=RequestBudget(max_think_tokens=2))
    for step, token in [(1, 7), (2, 7), (3, END), (4, 9), (5, 9), (9, 9)]:
        r.emit(policy, token, step)
    stats = policy.stats
    assert stats.max_answer_gap_steps == 4 and stats.num_answer_gaps_over_2 == 1
    assert stats.num_forced_inferred == 1
    assert stats.think_tokens_total == 2 and stats.num_think_exits == 1
    policy.untrack("r")
    assert policy.num_tracked == 0
    policy.check_integrity()


def test_inferred_caps_count_the_transition_phrase_and_forcing_off_never_counts() -> None:
    policy = make_policy(transition_len=2)
    r = admitted(policy, "r", THINK_PROMPT, request_budget=RequestBudget(max_think_tokens=2))
    for step, token in enumerate([7, 7, 20, 21, END, 9], start=1):
        r.emit(policy, token, step)
    assert policy.stats.num_forced_inferred == 1
    assert policy.stats.think_tokens_total == 4
    off = admitted(policy, "off", THINK_PROMPT, request_budget=RequestBudget(forcing=False))
    for step, token in enumerate([7, 7, 20, 21, END], start=10):
        off.emit(policy, token, step)
    assert policy.stats.num_forced_inferred == 1


@settings(max_examples=80, deadline=None)
@given(prompt_think=st.integers(0, 6), cap=st.integers(1, 6), transition_len=st.integers(0, 2))
def test_the_forcer_and_the_policy_agree_on_a_prompt_whose_reasoning_started(
    prompt_think: int, cap: int, transition_len: int
) -> None:
    """A prompt that opened the think block and holds ``prompt_think`` reasoning tokens (router
    rule 5): they count toward the cap in the logits processor's forcer, which forces once the
    reasoning reaches it (at once if the prompt's alone did), and the scheduler's policy, fed
    the tokens the forcer let through, counts that same hard-cap force."""
    from meridian.core.budget import BudgetPolicy
    from meridian.core.forcing import ThinkForcer

    prompt = [10, START, *([7] * prompt_think)]
    budget = RequestBudget(max_think_tokens=cap)
    transition = [20 + i for i in range(transition_len)]
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(100), transition=transition)
    output: list[int] = []
    forcer.add("r", prompt=prompt, output=output, budget=budget)
    policy = make_policy(transition_len=transition_len)
    r = admitted(policy, "r", prompt, request_budget=budget)
    assert state_of(policy, "r").num_prompt_think_tokens == prompt_think
    for step in range(1, 20):
        forcer.sync("r")
        token = forcer.forced_token("r")
        token = 7 if token is None else token
        output.append(token)
        r.emit(policy, token, step)
        if token == END:
            break
    assert output.index(END) == max(0, cap - prompt_think) + transition_len
    assert forcer.num_forced[ForceReason.HARD_CAP] == 1
    assert policy.stats.num_forced_inferred == 1
    # The generated think tokens, not the prompt's, are the think phase's length.
    assert policy.stats.think_tokens_total == output.index(END)


def test_tokens_of_an_untracked_request_are_named_after_the_batch() -> None:
    policy = make_policy()
    admitted(policy, "r", PLAIN_PROMPT)
    with pytest.raises(UntrackedRequestsError, match="ghost") as info:
        policy.observe(["ghost", "r", "spook"], [[9], [9], [9]], 1)
    assert isinstance(info.value, KeyError) and info.value.request_ids == ["ghost", "spook"]
    assert state_of(policy, "r").num_output_tokens == 1  # the step was accounted all the same
    assert policy.tokens_by_phase("r", 1) == (0, 1)


def test_the_table_of_tracked_requests() -> None:
    """What was the router's table: a tracked id cannot be tracked again until untracked;
    unknown ids are ignored by untrack and raise KeyError when read; an id can be reused."""
    policy = make_policy()
    admitted(policy, "r", THINK_PROMPT)
    with pytest.raises(ValueError, match="'r' is already tracked; untrack it first"):
        policy.track("r", PLAIN_PROMPT)
    assert policy.phase("r") is Phase.THINK, "the failed track changed nothing"
    assert policy.num_tracked == 1 and list(policy.tracker.states) == ["r"]
    policy.untrack("never")
    policy.untrack_many([("never", None), ("nor", 5)])
    assert policy.num_tracked == 1
    for read in (policy.phase, policy.on_preempt):
        with pytest.raises(KeyError, match="x"):
            read("x")
    assert policy.tokens_by_phase("x", 3) is None
    policy.untrack("r")
    policy.untrack("r")
    assert policy.num_tracked == 0
    with pytest.raises(KeyError):
        policy.phase("r")
    policy.track("r", PLAIN_PROMPT)  # the id can be reused after untrack: a new request
    assert policy.phase("r") is Phase.PREFILL
    assert state_of(policy, "r").num_generated_tokens == 0
    policy.check_integrity()


def test_check_integrity_names_the_request_whose_state_is_broken() -> None:
    policy = make_policy()
    r = admitted(policy, "r", THINK_PROMPT)
    r.emit(policy, 7, 1)
    policy.check_integrity()
    state_of(policy, "r").num_think_tokens += 1
    with pytest.raises(AssertionError, match="request 'r': think \\+ output"):
        policy.check_integrity()


class Recording:
    """A listener that writes down what the policy reports."""

    phase_events = True

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.preemptions: list[tuple[Phase, int]] = []
        self.think_ends: list[tuple[int, bool]] = []
        self.gaps: list[tuple[float, int]] = []

    def request_started(self, request_id: str) -> None:
        self.log.append(("start", request_id))

    def requests_finished(self, request_ids: list[str]) -> None:
        self.log.extend(("finish", request_id) for request_id in request_ids)

    def phase_event(self, request_id: str, event: PhaseEvent) -> None:
        self.log.append((type(event).__name__, request_id))

    def preempted(self, phase: Phase, num_blocks: int) -> None:
        self.preemptions.append((phase, num_blocks))

    def think_ended(self, request_id: str, num_think_tokens: int, hard_cap: bool) -> None:
        self.think_ends.append((num_think_tokens, hard_cap))

    def force_cut_short(self, request_id: str) -> None:
        self.log.append(("force cut short", request_id))

    def reasoning_started(self, request_id: str) -> None:
        self.log.append(("reasoning", request_id))

    def first_answer(self, request_id: str) -> None:
        self.log.append(("first answer", request_id))

    def answer_gaps(self, seconds: float, count: int) -> None:
        self.gaps.append((seconds, count))


def test_the_listener_hears_lifetimes_phases_preemptions_and_think_ends() -> None:
    listener = Recording()
    policy = make_policy(listener=listener)
    r = admitted(policy, "r", THINK_PROMPT)
    for step, token in [(1, 7), (2, END), (3, 9)]:
        r.emit(policy, token, step)
    policy.on_preempt("r", num_blocks=3)
    policy.untrack("r")
    policy.untrack("r")  # idempotent: one finish only
    assert listener.log == [
        ("start", "r"),
        (EnterThink.__name__, "r"),
        ("reasoning", "r"),  # its first token, not its admission (EnterThink came from the prompt)
        (ExitThink.__name__, "r"),
        ("first answer", "r"),
        ("finish", "r"),
    ]
    assert listener.preemptions == [(Phase.OUTPUT, 3)]
    assert listener.think_ends == [(1, False)]
    capped = admitted(policy, "c", THINK_PROMPT, request_budget=RequestBudget(max_think_tokens=2))
    for step, token in [(4, 7), (5, 7), (6, END)]:
        capped.emit(policy, token, step)
    assert [name for name, rid in listener.log if rid == "c"][-2:] == [
        ForceBudget.__name__,
        ExitThink.__name__,
    ]
    assert listener.think_ends[-1] == (2, True)


def test_a_request_that_finishes_inside_its_forced_phrase_counts_as_forced() -> None:
    """Its max_tokens ran out while the transition phrase was forced (issue 41: a long phrase
    took every token left and the force was counted nowhere): the finish counts the force,
    once; a request that stops at its cap, before any forced token, or inside its reasoning,
    is no force."""
    listener = Recording()
    policy = make_policy(listener=listener, transition_len=3)
    budget = RequestBudget(max_think_tokens=2)
    # "cut": 2 think tokens (the cap), then 2 of the 3 forced phrase tokens, then max_tokens.
    # "at cap": stops at the cap. "early": stops before it. "none": no cap (forcing off).
    for rid, tokens, kw in [
        ("cut", [7, 7, 7, 7], {"request_budget": budget}),
        ("at cap", [7, 7], {"request_budget": budget}),
        ("early", [7], {"request_budget": budget}),
        ("none", [7, 7, 7, 7], {"request_budget": RequestBudget(forcing=False)}),
    ]:
        r = admitted(policy, rid, THINK_PROMPT, **kw)
        for step, token in enumerate(tokens, start=1):
            r.emit(policy, token, step)
    policy.untrack_many([(rid, None) for rid in ("cut", "at cap", "early", "none")])
    assert policy.stats.num_forced_inferred == 1
    forces = ("force cut short", ForceBudget.__name__)
    heard = [(name, rid) for name, rid in listener.log if name in forces]
    assert heard == [(ForceBudget.__name__, "cut"), ("force cut short", "cut")]
    assert listener.think_ends == []  # no think phase ended


def test_a_listener_without_phase_events_hears_the_rest() -> None:
    # phase_events False (vLLM's adapter without traces): no request_started, phase_event or
    # forced-budget event, and the same reasoning start, think ends, first answers, finishes.
    listener = Recording()
    listener.phase_events = False
    policy = make_policy(listener=listener)
    r = admitted(policy, "r", THINK_PROMPT, request_budget=RequestBudget(max_think_tokens=2))
    for step, token in [(1, 7), (2, 7), (3, END), (4, 9)]:
        r.emit(policy, token, step)
    policy.untrack("r")
    assert listener.log == [("reasoning", "r"), ("first answer", "r"), ("finish", "r")]
    assert listener.think_ends == [(2, True)]
    assert policy.stats.num_forced_inferred == 1


def test_requests_finishing_together_leave_in_one_batch_even_if_a_length_fails() -> None:
    """A batch of finished requests leaves the table, the queues and the listener at once; an
    error while the policy learns their lengths is raised, and still every one of them is
    untracked and the listener hears their end."""
    listener = Recording()
    policy = make_policy(listener=listener)
    running = [admitted(policy, f"r{i}", THINK_PROMPT) for i in range(3)]
    policy.plan(running, 1, 100)
    assert policy.planner.queues.num_think_queued == 3

    def failing(st: Any, num_output_tokens: int) -> None:
        raise RuntimeError("length model failed")

    policy.admission.finished = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="length model failed"):
        policy.untrack_many([("r0", 5), ("r1", 5), ("never", 5), ("r2", None)])
    assert policy.num_tracked == 0
    assert policy.planner.queues.num_think_queued == policy.planner.queues.num_output_queued == 0
    assert [entry for entry in listener.log if entry[0] == "finish"] == [
        ("finish", "r0"),
        ("finish", "r1"),
        ("finish", "r2"),
    ]
    policy.check_integrity()


def test_reasoning_starts_at_a_generated_think_start_and_tokens_split_by_phase() -> None:
    listener = Recording()
    policy = make_policy(listener=listener)
    r = admitted(policy, "p", PLAIN_PROMPT)  # PREFILL: the first tokens decide
    assert policy.tokens_by_phase("p", 0) == (0, 0)
    r.emit(policy, START, 1)
    assert listener.log[-2:] == [("reasoning", "p"), (EnterThink.__name__, "p")]
    for step, token in enumerate([7, 7, 7, END, 9, 9], start=2):
        r.emit(policy, token, step)
    # 7 generated: <think>, 3 think tokens, </think>, 2 answer tokens (not fed to the router).
    assert policy.tokens_by_phase("p", len(r.output)) == (3, 2)
    assert [e for e in listener.log if e[0] == "reasoning"] == [("reasoning", "p")]
    policy.untrack("p")
    assert policy.tokens_by_phase("p", 7) is None


# -- the measured output budget through the injected clock --------------------------------


def test_the_listener_hears_first_answers_and_answer_gaps_on_the_clock() -> None:
    listener, clock = Recording(), Clock()
    policy = make_policy(listener=listener, clock=clock)
    thinker = admitted(policy, "t", THINK_PROMPT)
    chat = admitted(policy, "c", PLAIN_PROMPT)
    # step: (time, tokens of t, tokens of c); t thinks 1 token then answers; c answers at once.
    steps = {1: (0.0, [7], [9]), 2: (0.5, [END, 9], [9]), 3: (0.75, [9], [9]), 6: (2.0, [9], [])}
    for step, (now, t_toks, c_toks) in steps.items():
        clock.now = now
        batch = {"t": t_toks, "c": c_toks} if c_toks else {"t": t_toks}
        policy.observe(list(batch), list(batch.values()), step)
    # A first answer is reported for every request (a chat's TTFVT is its TTFT), at its step;
    # the start of reasoning for the request that reasoned only (once, at its first token).
    assert [e for e in listener.log if e[0] == "first answer"] == [
        ("first answer", "c"),
        ("first answer", "t"),
    ]
    assert [e for e in listener.log if e[0] == "reasoning"] == [("reasoning", "t")]
    assert thinker.request_id == "t" and chat.request_id == "c"
    # c: 1 -> 2 (0.5 s); t and c: 2 -> 3 (0.25 s each); t: 3 -> 6 (a stall of 1.25 s).
    assert listener.gaps == [(0.5, 1), (0.25, 2), (1.25, 1)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sets(st.integers(0, 5)), min_size=1, max_size=30),
    st.sets(st.integers(0, 29)),
)
def test_answer_gaps_match_each_streams_own_token_steps(
    served: list[set[int]], quiet: set[int]
) -> None:
    # Six answer streams; at step s + 1 the streams in served[s] get a token, except on quiet
    # steps, where the engine delivers none (no observe call at all). Whatever the pattern, the
    # gaps reported are each stream's own steps between two answer tokens.
    listener, clock = Recording(), Clock()
    policy = make_policy(listener=listener, clock=clock)
    steps: dict[str, list[int]] = {f"c{i}": [] for i in range(6)}
    for rid in steps:
        policy.track(rid, PLAIN_PROMPT)
    last = 0
    for s, who in enumerate(served):
        step = s + 1
        if s in quiet or not who:
            continue
        clock.now = float(step)
        ids = [f"c{i}" for i in sorted(who)]
        policy.observe(ids, [[9]] * len(ids), step)
        last = step
        for i in who:
            steps[f"c{i}"].append(step)
    gaps = [b - a for stamps in steps.values() for a, b in itertools.pairwise(stamps)]
    stats = policy.stats
    assert stats.max_answer_gap_steps == max(gaps, default=0)
    assert stats.num_answer_gaps_over_2 == sum(g > 2 for g in gaps)
    heard = collections.Counter()
    for seconds, count in listener.gaps:
        heard[round(seconds)] += count
    assert heard == collections.Counter(gaps)
    for rid in steps:
        policy.untrack(rid)
    policy.check_integrity()
    # Untracked streams are forgotten: the same ids tracked again are new streams, whose first
    # tokens (the next step, or much later) continue no gap of their former selves.
    heard_before, max_gap = list(listener.gaps), stats.max_answer_gap_steps
    for rid in steps:
        policy.track(rid, PLAIN_PROMPT)
    for step, who in ((last + 1, ["c0", "c1", "c2"]), (last + 50, ["c3", "c4", "c5"])):
        clock.now = float(step)
        policy.observe(who, [[9]] * len(who), step)
    assert listener.gaps == heard_before and stats.max_answer_gap_steps == max_gap


def test_a_request_tracked_again_is_not_counted_as_its_former_self() -> None:
    # A request untracked (aborted) while its batch counts in bulk, and tracked again under
    # the same id at the same place: its new state counts its tokens, the old one is gone.
    policy = make_policy()
    rids = ["t0", "t1"]
    for rid in rids:
        policy.track(rid, THINK_PROMPT)
    for step in range(1, 6):
        policy.observe(list(rids), [[9], [9]], step)
    policy.untrack("t1")
    policy.track("t1", THINK_PROMPT)
    for step in range(6, 10):
        policy.observe(list(rids), [[9], [9]], step)
    assert policy.tokens_by_phase("t0", 9) == (9, 0)
    assert policy.tokens_by_phase("t1", 4) == (4, 0)
    policy.check_integrity()


def test_a_steady_batch_counts_its_thinking_rows_in_bulk() -> None:
    # Four thinking requests and an answering one get a token every step: from the third step
    # on (the same requests twice) their thinking tokens are counted in bulk, and the count a
    # reader sees, the think phase a capped one ends and the first answer are exact.
    listener = Recording()
    policy = make_policy(listener=listener)
    rids = [f"t{i}" for i in range(4)] + ["c"]
    for rid in rids:
        policy.track(rid, THINK_PROMPT if rid != "c" else PLAIN_PROMPT)
    for step in range(1, 41):
        tokens = [[END] if rid == "t0" and step == 30 else [9] for rid in rids]
        policy.observe(list(rids), tokens, step)
        if step == 20:
            assert policy.tokens_by_phase("t1", 20) == (20, 0)
            assert state_of(policy, "t2").num_think_tokens == 20
    assert policy.tokens_by_phase("t0", 40) == (29, 10)
    assert policy.tokens_by_phase("t3", 40) == (40, 0)
    assert listener.think_ends == [(29, False)]
    assert ("first answer", "t0") in listener.log
    policy.check_integrity()


def test_the_output_budget_is_measured_on_the_injected_clock() -> None:
    clock = Clock()
    policy = make_policy(output_budget="auto", clock=clock)
    assert policy.output_budget.rows is None and policy.output_budget.step_time is not None
    thinks = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(8)]
    step = 0
    # Decode-only steps of 8 rows that take 40 ms against a 20 ms budget (time proportional
    # to rows at one batch size): after enough samples the budget is 4 rows.
    for _ in range(32 + BUDGET_REFIT_STEPS):
        step += 1
        policy.plan(thinks, step, num_free_blocks=100)
        policy.on_step(num_rows=8, num_tokens=8)
        clock.now += 0.040
    policy.plan(thinks, step + 1, num_free_blocks=100)
    assert policy.output_budget.rows == 4
    # A prefill step is not a sample, nor is the time spent idle: were either folded in (5 s,
    # 60 s for 8 rows), the proportional fit would cap the budget at 1 row.
    step += 1
    policy.plan(thinks, step, num_free_blocks=100)
    policy.on_step(num_rows=8, num_tokens=500)
    clock.now += 5.0
    step += 1
    policy.plan(thinks, step, num_free_blocks=100)
    policy.on_step(num_rows=8, num_tokens=8)
    policy.on_idle()
    clock.now += 60.0
    for _ in range(BUDGET_REFIT_STEPS + 1):
        step += 1
        policy.plan(thinks, step, num_free_blocks=100)
        policy.on_step(num_rows=8, num_tokens=8)
        clock.now += 0.040
    policy.plan(thinks, step + 1, num_free_blocks=100)
    assert policy.output_budget.rows == 4


def test_a_budget_no_batch_can_meet_defers_nothing() -> None:
    """A large model on a slow device: 25 ms per step before the first row, against a 20 ms
    budget. No row count meets it, so the policy must not hold thinking requests back (that
    would only slow reasoning; a fixed cap of 1 row once collapsed throughput this way)."""
    clock = Clock()
    policy = make_policy(output_budget="auto", clock=clock)
    thinks = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(8)]
    for step in range(1, 3 * BUDGET_REFIT_STEPS + 40):
        rows = 2 + step % 7
        plan = policy.plan(thinks, step, num_free_blocks=100)
        assert not plan.skip
        policy.on_step(num_rows=rows, num_tokens=rows)
        clock.now += 0.025 + 0.0001 * rows
    assert (
        policy.output_budget.step_time is not None
        and policy.output_budget.step_time.num_samples >= 32
    )
    assert policy.output_budget.rows is None and policy.stats.num_deferred == 0


def test_a_new_output_budget_replans_the_next_step() -> None:
    """The plan is reused while nothing changes; the step after the measured budget changes is
    planned anew, and thinking requests beyond the new limit sit it out."""
    clock = Clock()
    policy = make_policy(output_budget="auto", clock=clock)
    reqs = [admitted(policy, f"t{i}", THINK_PROMPT) for i in range(6)]
    step, plan = 0, None
    while policy.output_budget.rows is None:
        assert step < 32 + 2 * BUDGET_REFIT_STEPS, "the budget never changed"
        step += 1
        plan = policy.plan(reqs, step, 100)
        if policy.output_budget.rows is None:
            assert not plan.skip and (step == 1 or plan.order is reqs)  # reused
        # Decode-only steps of 6 rows taking 60 ms against a 20 ms budget.
        policy.on_step(num_rows=6, num_tokens=6)
        clock.now += 0.060
    assert plan is not None and plan.order is not reqs and plan.skip
    assert policy.stats.num_deferred == len(plan.skip)


def test_a_plan_never_keeps_the_engines_running_list_alive() -> None:
    """An engine may replace its running list (vLLM does when several requests finish in a
    step): once the step is scheduled, the policy holds nothing of the old list, so the list and
    the finished requests in it are freed when the engine drops them."""
    import gc
    import weakref

    class Running(list[Any]):
        """A list a weak reference can follow."""

    policy = make_policy()
    reqs = Running(admitted(policy, f"t{i}", THINK_PROMPT) for i in range(3))
    policy.plan(reqs, 1, 100)
    plan = policy.plan(reqs, 2, 100)
    assert plan.order is reqs and not plan.skip  # the kept order: the list itself
    policy.on_step(num_rows=3, num_tokens=3)
    gone = weakref.ref(reqs)
    del reqs, plan
    gc.collect()
    assert gone() is None
    replacement = [admitted(policy, f"u{i}", THINK_PROMPT) for i in range(2)]
    assert sorted(ids(policy.plan(replacement, 3, 100).order)) == ["u0", "u1"]


def test_output_budget_setting() -> None:
    assert output_budget_setting(0) is None  # 0: the whole batch, no deferral
    assert output_budget_setting(48) == 48
    assert output_budget_setting("auto") == "auto"
    assert SchedulerConfig().output_budget_rows == 0  # no deferral unless asked for


def test_config_defaults_are_usable() -> None:
    cfg = MeridianConfig()
    policy = MeridianPolicy(MODEL, cfg.scheduler, block_size=16, capacity=8)
    assert policy.output_budget.rows is None and policy.output_budget.step_time is None
    with pytest.raises(ValueError, match="block_size and capacity"):
        MeridianPolicy(MODEL, cfg.scheduler, block_size=0, capacity=8)


# -- properties ---------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30)), min_size=1, max_size=80),
    st.one_of(st.none(), st.integers(1, 4)),
)
def test_plan_properties(ops: list[tuple[int, int]], output_budget: int | None) -> None:
    """Random add/decode/preempt/readmit/finish, with and without deferral: the order is a
    permutation, every answer stream holding KV comes before every thinking request holding KV,
    the engine's victim (the last one holding KV) is not an answer stream while anything else
    is, skips are running requests and never all of them, and tracking drains to 0."""
    policy = make_policy(output_budget=output_budget)
    running: list[FakeRequest] = []
    waiting: list[FakeRequest] = []
    for step, (op, arg) in enumerate(ops, start=1):
        if op == 0 or not running:
            r = admitted(policy, f"r{step}", THINK_PROMPT if arg % 3 else PLAIN_PROMPT)
            running.append(r)
        elif op in (1, 2):
            r = running[arg % len(running)]
            r.emit(policy, END if arg % 4 == 0 else 7, step)
        elif op == 3:
            victim = running.pop()
            policy.on_preempt(victim.request_id)
            victim.num_computed_tokens = 0
            waiting.append(victim)
        elif op == 4 and waiting:
            back = waiting.pop(0)
            back.num_computed_tokens = back.num_tokens
            running.append(back)
        else:
            r = running.pop(arg % len(running))
            policy.untrack(r.request_id)
        plan = policy.plan(running, step=step, num_free_blocks=arg % 3)
        assert sorted(ids(plan.order)) == sorted(ids(running))
        kv_phases = [policy.phase(r.request_id) for r in plan.order if r.num_computed_tokens > 0]
        first_think = next((i for i, p in enumerate(kv_phases) if p is Phase.THINK), None)
        if first_think is not None:
            assert Phase.OUTPUT not in kv_phases[first_think:]
            assert kv_phases[-1] is not Phase.OUTPUT, "a thinking request is the first victim"
        assert set(ids(plan.skip)) <= set(ids(running))
        assert len(plan.skip) < max(len(running), 1) or not running
        running[:] = plan.order
        policy.check_integrity()
    for r in running + waiting:
        policy.untrack(r.request_id)
    assert policy.num_tracked == 0 and len(policy.planner.queues) == 0


def _teach(policy: MeridianPolicy, n: int, num_output_tokens: int | None) -> None:
    """``n`` chat requests that finished (or, with ``None``, were aborted)."""
    for i in range(n):
        policy.track(f"done{i}", PLAIN_PROMPT)
        policy.untrack(f"done{i}", num_output_tokens)


def test_waiting_order_puts_preempted_requests_first_then_the_preferred_kind() -> None:
    def policy_for(order: str) -> MeridianPolicy:
        config = SchedulerConfig(admission_order=order)
        return MeridianPolicy(MODEL, config, block_size=4, capacity=64)

    def queue(policy: MeridianPolicy) -> list[FakeRequest]:
        # Arrival order: chat, reasoning, chat, a preempted reasoning request, reasoning.
        # (A plain prompt starts in PREFILL, reasoning: test_kind.py; chat closes the block.)
        prompts = [CHAT_PROMPT, THINK_PROMPT, CHAT_PROMPT, THINK_PROMPT, THINK_PROMPT]
        waiting = [FakeRequest(f"{i}", p) for i, p in enumerate(prompts)]
        for r in waiting:
            policy.track(r.request_id, r.prompt)
        waiting[3].emit(policy, 9, 1)
        policy.on_preempt("3")
        return waiting

    policy = policy_for("arrival")
    assert policy.waiting_order(queue(policy)) is None
    policy = policy_for("reasoning-first")
    assert ids(policy.waiting_order(queue(policy))) == ["3", "1", "4", "0", "2"]
    policy = policy_for("chat-first")
    waiting = queue(policy)
    ordered = policy.waiting_order(waiting)
    assert ids(ordered) == ["3", "0", "2", "1", "4"]
    assert policy.waiting_order(ordered) is None  # already in order: the queue is left alone
    assert policy.waiting_order(waiting[:1]) is None
    # Unknown requests (not tracked, as an engine may hold) keep their place at the head.
    assert ids(policy.waiting_order([waiting[1], FakeRequest("x", PLAIN_PROMPT)])) == ["x", "1"]
    # The starvation bound: a request that has waited admission_order_max_wait_s is passed over
    # no more; it starts in arrival order, ahead of newer requests of the preferred kind.
    clock = Clock()
    config = SchedulerConfig(admission_order="chat-first", admission_order_max_wait_s=30.0)
    policy = MeridianPolicy(MODEL, config, block_size=4, capacity=64, clock=clock)
    old = [FakeRequest("old-r", THINK_PROMPT), FakeRequest("old-c", CHAT_PROMPT)]
    for r in old:
        policy.track(r.request_id, r.prompt)
    clock.now = 29.0
    new = [FakeRequest("new-c", CHAT_PROMPT)]
    policy.track("new-c", CHAT_PROMPT)
    assert ids(policy.waiting_order([*old, *new])) == ["old-c", "new-c", "old-r"]
    clock.now = 30.0
    assert ids(policy.waiting_order([*new, *old])) == ["old-r", "old-c", "new-c"]


def test_headroom_admission_starts_what_the_projected_peak_leaves_room_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tiny cache: 40 blocks hold under 4 requests of 43 tokens, where headroom stands aside.
    assert headroom.MIN_REQUESTS_IN_CACHE > 4
    policy = make_policy(admission="headroom")  # block size 4
    _teach(policy, MIN_SAMPLES, 40)
    assert policy.admissions([], [FakeRequest("w", PLAIN_PROMPT)], 40) is None
    monkeypatch.setattr(admission_module, "MIN_REQUESTS_IN_CACHE", 1)
    # (The figures below are worked for a 5 % reserve.)
    config = SchedulerConfig(admission_reserve=0.05)
    policy = MeridianPolicy(MODEL, config, block_size=4, capacity=64, admission="headroom")
    waiting = [FakeRequest(f"w{i}", PLAIN_PROMPT) for i in range(5)]
    _teach(policy, MIN_SAMPLES, None)  # aborted requests teach nothing
    assert policy.admissions([], waiting, 40) is None
    _teach(policy, MIN_SAMPLES, 40)
    # Each newcomer is expected to grow from 3 to 43 tokens: about 11 blocks at its peak, and
    # 40 blocks less the 5 % reserve hold 3 of them.
    assert policy.admissions([], waiting, 40) == 3
    assert policy.stats.num_admissions_held == 1
    # Running requests take their share: one that has generated 20 of its 40 tokens holds 23
    # and is projected from its bucket's lower edge (here 0: every sample is 40 long), up to
    # 62 tokens, 16 blocks; 50 blocks less the 5 % reserve (47.5) hold it and 2 newcomers (38;
    # a third would need 49).
    r = admitted(policy, "r", PLAIN_PROMPT)
    for step in range(20):
        r.emit(policy, 9, step + 1)
    assert policy.admissions([r], waiting, 50) == 2
    assert policy.admissions([r], waiting, 400) == 5
    assert policy.stats.num_admissions_held == 2
    assert make_policy(admission="vllm").admissions([], waiting, 40) is None


def test_the_projection_once_in_use_stands_aside_only_at_half_its_threshold() -> None:
    # Finished requests of 43 tokens (3 of prompt, 40 generated): MIN_REQUESTS_IN_CACHE of them
    # need 128 x 43 / 4 = 1,376 blocks of 4. Newcomers with no useful max_tokens (loose bounds:
    # the bounds' rule stands aside too), so a count means the projection decided.
    assert headroom.MIN_REQUESTS_IN_CACHE == 128
    waiting = [FakeRequest(f"w{i}", PLAIN_PROMPT) for i in range(5)]
    fresh = make_policy(admission="headroom")
    _teach(fresh, MIN_SAMPLES, 40)
    assert fresh.admissions([], waiting, 1000) is None  # 93 of them: under the threshold
    policy = make_policy(admission="headroom")
    _teach(policy, MIN_SAMPLES, 40)
    assert policy.admissions([], waiting, 1400) == 5  # 130 of them: the projection decides
    # In use, it goes on while the cache holds half the threshold (a drifting mean near it
    # would otherwise switch vLLM's admission on and off) ...
    assert policy.admissions([], waiting, 1000) == 5
    assert policy.admissions([], waiting, 690) == 5  # 64.2 of them
    # ... and below that it stands aside, until the cache holds the full threshold again.
    assert policy.admissions([], waiting, 680) is None  # 63.3 of them
    assert policy.admissions([], waiting, 1000) is None
    assert policy.admissions([], waiting, 1400) == 5


def test_requests_that_fit_at_their_bounds_start_whatever_the_projection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Finished requests were 40 tokens long: the projection holds 5 newcomers to 3 in 40 blocks
    # (the test above). Newcomers that may generate at most 4 tokens hold at most 2 blocks of 4
    # each: 5 of them and a running one fit 40 blocks at their bounds, so all start.
    monkeypatch.setattr(admission_module, "MIN_REQUESTS_IN_CACHE", 1)
    policy = make_policy(admission="headroom")  # block size 4
    _teach(policy, MIN_SAMPLES, 40)
    short = [FakeRequest(f"s{i}", PLAIN_PROMPT, max_tokens=4) for i in range(5)]
    running = [FakeRequest("r", PLAIN_PROMPT, max_tokens=4)]
    assert policy.admissions(running, short, 40) == 5
    assert policy.stats.num_admissions_held == 0
    # One block fewer than their bounds need together (6 x 2 = 12): the projection decides.
    assert policy.admissions(running, short, 11) == 0
    loose = [FakeRequest(f"l{i}", PLAIN_PROMPT, max_tokens=40) for i in range(5)]
    assert policy.admissions([], loose, 40) == 3
    assert policy.stats.num_admissions_held == 2


def test_bounds_admit_before_the_length_model_and_never_overcommit() -> None:
    # Nothing has finished. Each request may reach 3 + 13 = 16 tokens: run to their bounds
    # together, n of them peak at (16 n) / 4 + n partly filled blocks = 5 n, and 64 blocks hold
    # 12. The rest wait, and the running set can never outgrow the cache.
    policy = make_policy(admission="headroom")  # block size 4
    waiting = [FakeRequest(f"w{i}", PLAIN_PROMPT, max_tokens=13) for i in range(40)]
    assert policy.admissions([], waiting, 64) == 12
    assert policy.stats.num_bounded_holds == policy.stats.num_admissions_held == 1
    assert policy.admissions(waiting[:10], waiting[10:], 64) == 2
    assert policy.admissions(waiting[:12], waiting[12:], 64) == 0
    # Requests further along end sooner: 8 that have generated 12 of their 13 tokens peak at
    # the next step, 8 x 5 blocks, and then free them; 12 newcomers still fit beside them
    # (40 + 12 x 2 blocks at that step, 12 x 5 at their own end), a 13th does not; three steps
    # from their end they leave room for 9 (40 + 9 x 2.5 blocks).
    ahead = [FakeRequest(f"a{i}", PLAIN_PROMPT, [9] * 12, max_tokens=13) for i in range(8)]
    assert policy.admissions(ahead, waiting, 64) == 12
    ahead = [FakeRequest(f"a{i}", PLAIN_PROMPT, [9] * 10, max_tokens=13) for i in range(8)]
    assert policy.admissions(ahead, waiting, 64) == 9
    # Once in use, bounds stay in use down to a cache of half the count (no switching back and
    # forth near the threshold) ...
    assert policy.admissions([], waiting, 32) == 6
    assert policy.admissions([], waiting, 31) is None
    # ... and a cache that holds fewer than MIN_BOUNDED_IN_CACHE of them does not start it.
    assert policy.admissions([], waiting, 63) is None
    loose = [FakeRequest(f"l{i}", PLAIN_PROMPT) for i in range(40)]  # no useful max_tokens
    assert make_policy(admission="headroom").admissions([], loose, 64) is None
    assert make_policy(admission="vllm").admissions([], waiting, 64) is None
    # Finished requests 4x smaller than the bounds: too loose once lengths are known ...
    policy = make_policy(admission="headroom")
    _teach(policy, 4, 1)
    assert policy.admissions([], waiting, 64) is None
    # ... and as long as the bounds: they still decide in a cache too small for the projection.
    policy = make_policy(admission="headroom")
    _teach(policy, MIN_SAMPLES, 13)
    assert policy.admission.lengths.ready and policy.admissions([], waiting, 64) == 12


def test_paced_answer_streams_skip_steps_but_keep_their_pace() -> None:
    clock = Clock()
    config = SchedulerConfig(answer_pace_ms=40.0)
    policy = MeridianPolicy(MODEL, config, block_size=4, capacity=64, clock=clock)
    answers = [admitted(policy, f"o{i}", PLAIN_PROMPT) for i in range(2)]
    think = admitted(policy, "t", THINK_PROMPT)
    times: dict[str, list[float]] = {r.request_id: [] for r in answers}
    served_think = 0
    for step in range(1, 200):
        clock.now += 0.010  # 10 ms steps
        plan = policy.plan([*answers, think], step, num_free_blocks=100)
        skipped = {r.request_id for r in plan.skip}
        assert "t" not in skipped and len(skipped) < 3
        tokens = [(r, 9) for r in answers if r.request_id not in skipped]
        for r, _ in tokens:
            times[r.request_id].append(clock.now)
        served_think += 1
        emit_step(policy, step, [*tokens, (think, 7)])
    assert policy.stats.num_paced > 0
    for stamps in times.values():
        gaps = np.diff(stamps[5:])  # once the mean step time has settled
        assert gaps.max() <= 0.040 + 1e-9, "a paced stream fell behind its pace"
        assert gaps.mean() > 0.015, "pacing skipped nothing"
    assert served_think == 199


def test_blocks_by_phase_splits_the_running_kv() -> None:
    policy = make_policy()
    t = admitted(policy, "t", THINK_PROMPT)  # 3 computed: 1 block of 4
    o = admitted(policy, "o", PLAIN_PROMPT)
    o.emit(policy, 9, 1)
    o.num_computed_tokens = 9  # 3 blocks
    stranger = FakeRequest("x", PLAIN_PROMPT, num_computed_tokens=4)  # untracked: not answering
    assert policy.blocks_by_phase([t, o, stranger]) == (2, 3)


def test_a_held_request_starts_once_its_weighted_wait_outweighs_the_preemptions_it_risks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The projection holds 5 newcomers to 3 in 40 blocks (the tests above). With a wait weight,
    # the 4th starts once its wait times the weight reaches the expected cost of the preemptions
    # it risks: its overflow recomputed at the prefill rate, plus the victim's re-queue delay.
    monkeypatch.setattr(admission_module, "MIN_REQUESTS_IN_CACHE", 1)
    clock, weight = Clock(), 2.0
    # The reserve is pinned at 5 %: the figures below are worked out by hand for it.
    config = SchedulerConfig(admission_wait_weight=weight, admission_reserve=0.05)
    policy = MeridianPolicy(MODEL, config, block_size=4, capacity=64, clock=clock)
    _teach(policy, MIN_SAMPLES, 40)

    def newcomers(tag: str) -> list[FakeRequest]:
        waiting = [FakeRequest(f"{tag}{i}", PLAIN_PROMPT) for i in range(5)]
        for r in waiting:
            policy.track(r.request_id, r.prompt)
        return waiting

    def cost_of_the_fourth(waiting: list[FakeRequest]) -> float:
        adm = policy.admission
        blocks = adm.lengths.expected_blocks(*adm.progress(waiting), 4)
        limit, grid = adm.peak_limit(40), adm.lengths.grid
        excess, steps = headroom.overflows(blocks[:3].sum(axis=0)[None], blocks[3:], limit, grid)
        return float(excess[0] * 4 / adm.rates.prefill_tokens_per_s + steps[0] * adm.rates.step_s)

    waiting = newcomers("a")
    assert policy.admissions([], waiting, 40) == 3  # no wait yet
    # By hand, on the priors (1,000 tokens/s, 0.1 s a step): 4 newcomers growing from 3 to 43
    # tokens peak at 44.1 blocks, 6.1 (24.6 tokens) over the 38 of 40 less the reserve, and stay
    # over from step 33.2 to the grid's end (40): 0.025 + 0.68 s.
    cost = cost_of_the_fourth(waiting)
    assert cost == pytest.approx(0.025 + 0.68, abs=0.01)
    clock.now = cost / weight * 0.99
    assert policy.admissions([], waiting, 40) == 3
    clock.now = cost / weight * 1.01
    assert policy.admissions([], waiting, 40) == 4  # the 5th risks more: it waits on
    clock.now = 1000.0
    assert policy.admissions([], waiting, 40) == 5
    # A preempted request restarts only when the projection says so (its wait since arrival
    # would start it again at once: churn), and nobody behind it starts past it on cost.
    policy.on_preempt(waiting[3].request_id)
    assert policy.admissions([], waiting, 40) == 3
    # Without a weight (the default) the projection alone decides, however long the wait.
    plain = make_policy(admission="headroom")
    _teach(plain, MIN_SAMPLES, 40)
    for r in waiting:
        plain.track(r.request_id, r.prompt, tracked_at=-1e6)
    assert plain.admissions([], waiting, 40) == 3

    # The engine's own steps teach the rates: steps of 10 ms that prefill 2,000 tokens make
    # preemptions cheaper, and a held request starts after a shorter wait (each step planned
    # first, as both drivers do: the plan starts the step's clock).
    for step in range(300):
        policy.plan([], step, 40)
        policy.on_step(8, 2000)
        clock.now += 0.01
    waiting = newcomers("b")
    tracked_at = clock.now
    faster = cost_of_the_fourth(waiting)
    assert faster < cost / 5
    clock.now = tracked_at + faster / weight * 0.99
    policy.plan([], 300, 40)
    assert policy.admissions([], waiting, 40) == 3
    clock.now = tracked_at + faster / weight * 1.01
    policy.plan([], 301, 40)
    assert policy.admissions([], waiting, 40) == 4
