"""The one observe path (``meridian.core.tracking``, driven through the policy's ``observe``)
against a plain reference model.

Random engine steps, shaped as a live engine sends them: the same requests step after step, one
token each (the steady and bulk-counted steps of a busy batch), several tokens at once, requests
that stall for a few steps, quiet steps, multi-token boundary markers, requests untracked and
tracked again under the same id, preemptions, and tokens for a request the policy does not
track. The reference advances an independent :class:`~meridian.core.state.RequestState` per
request over every token and writes down, by the rules the tracker documents, what each step
must report: phases and counts, think exits and inferred hard-cap forces, first answers, the
gaps between each answer stream's tokens, and every listener call, at its step.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import SchedulerConfig
from meridian.core.budget import RequestBudget
from meridian.core.format import ReasoningFormat
from meridian.core.memo import ENV_PLAIN_PATHS
from meridian.core.policy import MeridianPolicy
from meridian.core.state import RequestState, advance, start
from meridian.core.tracking import UntrackedRequestsError
from meridian.core.types import EnterThink, ExitThink, Phase, PhaseEvent

START, END = 3, 4
PLAIN = [10, 11, 12]
NUM_REQUESTS = 6


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Listener:
    """Writes down every call, with the step the test is at (``self.step``)."""

    phase_events = True

    def __init__(self) -> None:
        self.step = 0
        self.log: dict[str, list[tuple[int, object]]] = collections.defaultdict(list)
        self.gaps: collections.Counter[int] = collections.Counter()
        self.preemptions: list[Phase] = []

    def _add(self, request_id: str, what: object) -> None:
        self.log[request_id].append((self.step, what))

    def request_started(self, request_id: str) -> None:
        self._add(request_id, "start")

    def requests_finished(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._add(request_id, "finish")

    def phase_event(self, request_id: str, event: PhaseEvent) -> None:
        self._add(request_id, type(event).__name__)

    def preempted(self, phase: Phase, num_blocks: int) -> None:
        self.preemptions.append(phase)

    def think_ended(self, request_id: str, num_think_tokens: int, hard_cap: bool) -> None:
        self._add(request_id, ("think_ended", num_think_tokens, hard_cap))

    def force_cut_short(self, request_id: str) -> None:
        self._add(request_id, "force cut short")

    def reasoning_started(self, request_id: str) -> None:
        self._add(request_id, "reasoning")

    def first_answer(self, request_id: str) -> None:
        self._add(request_id, "first answer")

    def answer_gaps(self, seconds: float, count: int) -> None:
        self.gaps[round(seconds)] += count  # the clock reads the step number


@dataclass
class Script:
    """What one request generates: its prompt, the tokens until its answer, then its answer
    (repeated), and its think cap (``None``: forcing off)."""

    prompt: list[int]
    head: list[int]
    answer: list[int]
    cap: int | None
    budget: RequestBudget | None

    def token(self, j: int) -> int:
        if j < len(self.head):
            return self.head[j]
        return self.answer[(j - len(self.head)) % len(self.answer)]


def state_of(policy: MeridianPolicy, request_id: str) -> RequestState:
    """A tracked request's state, its counts brought up to date (as admission reads them)."""
    policy.tracker.settle()
    return policy.tracker.states[request_id]


@st.composite
def scripts(draw: st.DrawFn, fmt: ReasoningFormat) -> Script:
    """A chat request, or one that thinks from its prompt (its reasoning perhaps started there),
    or that generates ``think_start`` first; its reasoning holds tokens that spell part of a
    marker, and its answer may hold whole markers (plain output there)."""
    begin, end = list(fmt.think_start), list(fmt.think_end)
    kind = draw(st.sampled_from(["chat", "prompt", "reasoning prompt", "generated"]))
    # Inside reasoning: the start marker's tokens, and the end marker's first token when the end
    # marker is longer (a partial match that fails); never a whole think_end.
    content = [7, 9, *begin, *(end[:1] if len(end) > 1 else [])]
    body = draw(st.lists(st.sampled_from(content), max_size=9))
    answer = draw(st.lists(st.sampled_from([9, 9, START, END]), min_size=1, max_size=4))
    if kind == "chat":
        prompt, head = PLAIN, []
        answer = [9, *answer]  # its first token decides: not think_start
    elif kind == "generated":
        prompt, head = PLAIN, [*begin, *body, *end]
    else:
        prompt = [10, *begin, *([7, 7] if kind == "reasoning prompt" else [])]
        repeat = draw(st.booleans())  # the model repeats the prompt's think_start first
        head = [*(begin if repeat else []), *body, *end]
    choice = draw(st.sampled_from(["default", "cap", "off"]))
    default = SchedulerConfig().max_think_tokens
    if choice == "default":
        return Script(prompt, head, answer, default, None)
    if choice == "off":
        return Script(prompt, head, answer, None, RequestBudget(forcing=False))
    cap = draw(st.integers(1, 6))
    return Script(prompt, head, answer, cap, RequestBudget(max_think_tokens=cap))


@dataclass
class Request:
    """The reference's record of one tracked request."""

    script: Script
    state: RequestState
    num_emitted: int = 0
    last_answer_step: int | None = None


@dataclass
class Reference:
    """The accounting written plainly: one state per request, advanced over every token."""

    fmt: ReasoningFormat
    transition_len: int
    requests: dict[str, Request] = field(default_factory=dict)
    log: dict[str, list[tuple[int, object]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    gaps: list[int] = field(default_factory=list)
    num_think_exits: int = 0
    think_tokens_total: int = 0
    num_hard_cap: int = 0
    preemptions: list[Phase] = field(default_factory=list)

    def track(self, rid: str, script: Script, step: int) -> None:
        st_ = start(rid, self.fmt, script.prompt)
        self.requests[rid] = Request(script, st_)
        self.log[rid].append((step, "start"))
        if st_.phase is Phase.THINK:
            self.log[rid].append((step, "EnterThink"))

    def untrack(self, rid: str, step: int) -> None:
        r = self.requests.pop(rid)
        st_, cap = r.state, r.script.cap
        if st_.phase is Phase.THINK and cap is not None:
            # Finished inside its hard-cap force (the phrase, or a begun think_end, not all out):
            # no think exit will count that force, so the finish does.
            base = max(cap, st_.num_prompt_think_tokens)
            thought = st_.num_reasoning_tokens - st_.marker_progress
            if base < thought <= base + self.transition_len or (
                thought == base and st_.marker_progress
            ):
                self.num_hard_cap += 1
                self.log[rid] += [(step, "ForceBudget"), (step, "force cut short")]
        self.log[rid].append((step, "finish"))

    def next_tokens(self, rid: str, n: int) -> list[int]:
        r = self.requests[rid]
        return [r.script.token(r.num_emitted + i) for i in range(n)]

    def observe(self, step: int, rids: list[str], deltas: list[list[int]]) -> None:
        for rid, toks in zip(rids, deltas, strict=True):
            r = self.requests[rid]
            r.num_emitted += len(toks)
            st_, log = r.state, self.log[rid]
            if r.last_answer_step is not None:  # an answer stream: a gap since its last token
                self.gaps.append(step - r.last_answer_step)
                r.last_answer_step = step
                advance(st_, toks)
                continue
            if st_.phase is Phase.THINK and not st_.num_generated_tokens:
                log.append((step, "reasoning"))  # its first tokens, all reasoning
            for event in advance(st_, toks):
                if isinstance(event, EnterThink):
                    log += [(step, "reasoning"), (step, "EnterThink")]
                elif isinstance(event, ExitThink):
                    cap = r.script.cap
                    forced = cap is not None and st_.num_reasoning_tokens == (
                        max(cap, st_.num_prompt_think_tokens) + self.transition_len
                    )
                    self.num_think_exits += 1
                    self.think_tokens_total += event.think_tokens
                    self.num_hard_cap += forced
                    if forced:
                        log.append((step, "ForceBudget"))
                    log += [
                        (step, ("think_ended", event.think_tokens, forced)),
                        (step, "ExitThink"),
                    ]
            if st_.num_output_tokens:  # its first answer tokens
                r.last_answer_step = step
                log.append((step, "first answer"))  # every request's: its TTFVT


def check(policy: MeridianPolicy, ref: Reference, listener: Listener) -> None:
    """Everything the policy says agrees with the reference."""
    assert sorted(policy.tracker.states) == sorted(ref.requests)
    for rid, r in ref.requests.items():
        want = r.state
        assert policy.phase(rid) is want.phase, rid
        assert policy.tokens_by_phase(rid, r.num_emitted) == (
            want.num_think_tokens,
            want.num_output_tokens,
        ), rid
        got = state_of(policy, rid)
        assert (
            got.phase,
            got.num_think_tokens,
            got.num_marker_tokens,
            got.num_prompt_think_tokens,
            got.num_reasoning_tokens,
        ) == (
            want.phase,
            want.num_think_tokens,
            want.num_marker_tokens,
            want.num_prompt_think_tokens,
            want.num_reasoning_tokens,
        ), rid
    stats = policy.stats
    assert (
        stats.num_think_exits,
        stats.think_tokens_total,
        stats.num_forced_inferred,
        stats.max_answer_gap_steps,
        stats.num_answer_gaps_over_2,
    ) == (
        ref.num_think_exits,
        ref.think_tokens_total,
        ref.num_hard_cap,
        max(ref.gaps, default=0),
        sum(gap > 2 for gap in ref.gaps),
    )
    assert {p: n for p, n in stats.num_preemptions.items() if n} == dict(
        collections.Counter(ref.preemptions)
    )
    assert listener.preemptions == ref.preemptions
    assert listener.gaps == collections.Counter(ref.gaps)
    assert dict(listener.log) == dict(ref.log)
    policy.check_integrity()


@dataclass
class Run:
    """Steps of the same requests: ``who`` (indices of live requests) get tokens for ``length``
    steps, one each, or ``sizes`` tokens each on the first step; then ``quiet`` steps with no
    tokens, a ``read`` of every count, and ``churn``: (index, untrack with the engine's count,
    track again, preempt first)."""

    who: set[int]
    length: int
    sizes: tuple[int, ...]
    ghost: int | None
    quiet: int
    read: bool
    churn: tuple[int, bool, bool, bool] | None


runs = st.builds(
    Run,
    who=st.sets(st.integers(0, NUM_REQUESTS - 1)),
    length=st.integers(1, 6),
    sizes=st.one_of(st.just(()), st.lists(st.integers(1, 3), max_size=NUM_REQUESTS).map(tuple)),
    ghost=st.one_of(st.none(), st.integers(0, NUM_REQUESTS)),
    quiet=st.sampled_from([0, 0, 0, 1, 3]),
    read=st.booleans(),
    churn=st.one_of(
        st.none(),
        st.tuples(st.integers(0, NUM_REQUESTS - 1), st.booleans(), st.booleans(), st.booleans()),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    think_start=st.sampled_from([(START,), (START, 5, 6)]),
    think_end=st.sampled_from([(END,), (END, 8)]),
    transition_len=st.integers(0, 2),
    plan=st.lists(runs, min_size=1, max_size=12),
    plain=st.booleans(),
    data=st.data(),
)
def test_observe_accounts_every_step_as_the_reference_does(
    think_start: tuple[int, ...],
    think_end: tuple[int, ...],
    transition_len: int,
    plan: list[Run],
    plain: bool,
    data: st.DataObject,
) -> None:
    """The fast ways (steady, bulk) and the plain one ($MERIDIAN_PLAIN_PATHS=1, every step the
    general way) both agree with the reference, step by step."""
    fmt = ReasoningFormat(think_start=think_start, think_end=think_end)
    listener, clock = Listener(), Clock()
    with mock.patch.dict(os.environ, {ENV_PLAIN_PATHS: "1" if plain else ""}):
        policy = MeridianPolicy(
            fmt,
            SchedulerConfig(),
            block_size=4,
            capacity=64,
            listener=listener,
            clock=clock,
            transition_len=transition_len,
        )
    assert policy.tracker.plain is plain
    ref = Reference(fmt, transition_len)
    rids = [f"r{i}" for i in range(NUM_REQUESTS)]

    def track(rid: str) -> None:
        script = data.draw(scripts(fmt))
        policy.track(rid, script.prompt, request_budget=script.budget)
        ref.track(rid, script, listener.step)

    for rid in rids:
        track(rid)
    step = 0
    for run in plan:
        present = [rid for i, rid in enumerate(rids) if i in run.who and rid in ref.requests]
        for k in range(run.length):
            step += 1
            if not present:
                continue
            sizes = run.sizes if k == 0 else ()
            deltas = [
                ref.next_tokens(rid, sizes[i] if i < len(sizes) else 1)
                for i, rid in enumerate(present)
            ]
            ids, tokens = list(present), [list(d) for d in deltas]
            if run.ghost is not None and k == 0:
                at = min(run.ghost, len(ids))
                ids.insert(at, "ghost")
                tokens.insert(at, [9])
            listener.step = step
            clock.now = float(step)
            ref.observe(step, present, deltas)
            try:
                policy.observe(ids, tokens, step)
            except UntrackedRequestsError as exc:
                assert exc.request_ids == ["ghost"]
            else:
                assert "ghost" not in ids
        step += run.quiet
        if run.read:
            check(policy, ref, listener)
        if run.churn is not None:
            i, with_count, again, preempt = run.churn
            rid = rids[i]
            if rid in ref.requests:
                if preempt:
                    phase = ref.requests[rid].state.phase
                    assert policy.on_preempt(rid) is phase
                    ref.preemptions.append(phase)
                count = ref.requests[rid].num_emitted if with_count else None
                policy.untrack(rid, count)
                ref.untrack(rid, listener.step)
            if again:
                track(rid)
    check(policy, ref, listener)
    finished = [(rid, r.num_emitted) for rid, r in ref.requests.items()]
    policy.untrack_many(finished)
    for rid, _ in finished:
        ref.untrack(rid, listener.step)
    assert policy.num_tracked == 0
    check(policy, ref, listener)
