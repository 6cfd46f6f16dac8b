"""The planner's caches against its plain path ($MERIDIAN_PLAIN_PATHS=1, every step's order
computed in full, no plan kept): two engines driven by the same random steps (arrivals, phase
changes, finishes, preemptions, free blocks that vary) make the same decisions step by step."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from meridian.config import SchedulerConfig
from meridian.core.format import ReasoningFormat
from meridian.core.memo import ENV_PLAIN_PATHS
from meridian.core.policy import MeridianPolicy

START, END, THINKING, ANSWER = 3, 4, 7, 9
MODEL = ReasoningFormat(think_start=(START,), think_end=(END,))
BLOCK_SIZE = 4


@dataclass(frozen=True)
class Script:
    """A request: its prompt (ending in ``think_start`` if it reasons) and the tokens it will
    generate."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass
class Request:
    """What the policy reads of an engine's request (vLLM's names)."""

    request_id: str
    script: Script
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_blocks: int = 0
    max_tokens: int = 1 << 20

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.script.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.script.prompt) + len(self.output)


@dataclass(frozen=True)
class Decision:
    """What a step did: who sat it out, who ran and with how many tokens, who was preempted;
    the plan's order (``None`` where the engine's was kept as moot: any order runs the same)."""

    skipped: frozenset[str]
    scheduled: frozenset[tuple[str, int]]
    preempted: tuple[str, ...]
    order: tuple[str, ...] | None = field(compare=False)


class Engine:
    """A small engine in vLLM's manner: serves its running list from the front with a token
    budget, preempts from the back when the KV blocks run out, admits waiting requests in order
    and appends them; a computed request samples its next token."""

    def __init__(self, policy: MeridianPolicy, num_blocks: int, max_step_tokens: int) -> None:
        self.policy = policy
        self.num_free_blocks = num_blocks
        self.max_step_tokens = max_step_tokens
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()

    def add(self, request_id: str, script: Script) -> None:
        self.policy.track(request_id, list(script.prompt))
        self.waiting.append(Request(request_id, script))

    def _allocate(self, r: Request, new: int, free: int) -> int | None:
        """Blocks ``r`` needs to compute ``new`` tokens more, if ``free`` covers them."""
        need = -(-(r.num_computed_tokens + new) // BLOCK_SIZE) - r.num_blocks
        return need if need <= free else None

    def step(self, step: int, reserved: int) -> Decision:
        policy = self.policy
        free = max(0, self.num_free_blocks - reserved)  # others hold the reserved blocks
        kept = policy.stats.num_engine_order_steps
        plan = policy.plan(self.running, step, free)
        moot = policy.stats.num_engine_order_steps > kept
        assert sorted(r.request_id for r in plan.order) == sorted(
            r.request_id for r in self.running
        )
        self.running = list(plan.order)
        skipped = frozenset(r.request_id for r in plan.skip)
        budget = self.max_step_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r.request_id in skipped:
                i += 1
                continue
            new = min(r.num_tokens - r.num_computed_tokens, budget)
            need = self._allocate(r, new, free)
            while need is None:
                victim = self.running.pop()
                policy.on_preempt(victim.request_id, victim.num_blocks)
                free += victim.num_blocks
                self.num_free_blocks += victim.num_blocks
                victim.num_blocks = victim.num_computed_tokens = 0
                self.waiting.appendleft(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break
                need = self._allocate(r, new, free)
            if need is None:
                break
            free -= need
            self.num_free_blocks -= need
            r.num_blocks += need
            scheduled.append((r, new))
            budget -= new
            i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < 8:
            r = self.waiting[0]
            new = min(r.num_tokens - r.num_computed_tokens, budget)
            need = self._allocate(r, new, free)
            if need is None:
                break
            self.waiting.popleft()
            self.running.append(r)
            free -= need
            self.num_free_blocks -= need
            r.num_blocks += need
            scheduled.append((r, new))
            budget -= new
        policy.on_step(len(scheduled), sum(new for _, new in scheduled))
        ids: list[str] = []
        tokens: list[list[int]] = []
        for r, new in scheduled:
            r.num_computed_tokens += new
            if r.num_computed_tokens == r.num_tokens:  # computed: it samples its next token
                token = r.script.output[len(r.output)]
                r.output.append(token)
                ids.append(r.request_id)
                tokens.append([token])
        if ids:
            policy.observe(ids, tokens, step)
        done = [r for r in self.running if len(r.output) == len(r.script.output)]
        if done:
            self.running = [r for r in self.running if r not in done]
            for r in done:
                self.num_free_blocks += r.num_blocks
            policy.untrack_many((r.request_id, len(r.output)) for r in done)
        if not self.running and not self.waiting:
            policy.on_idle()
        policy.check_integrity()
        return Decision(
            skipped,
            frozenset((r.request_id, new) for r, new in scheduled),
            tuple(preempted),
            None if moot else tuple(r.request_id for r in plan.order),
        )


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    prompt = (10,) * draw(st.integers(1, 9))
    answer = (ANSWER,) * draw(st.integers(1, 10))
    if draw(st.booleans()):  # it reasons: thinks, ends its think phase, answers
        thought = (THINKING,) * draw(st.integers(0, 12))
        return Script((*prompt, START), (*thought, END, *answer))
    return Script(prompt, answer)


steps = st.tuples(st.lists(scripts(), max_size=3), st.integers(0, 12))


@settings(max_examples=200, deadline=None)
@given(
    plan=st.lists(steps, min_size=1, max_size=40),
    num_blocks=st.integers(8, 40),
    max_step_tokens=st.integers(4, 48),
    quiet=st.integers(0, 60),
)
def test_the_planners_caches_decide_as_its_plain_path(
    plan: list[tuple[list[Script], int]], num_blocks: int, max_step_tokens: int, quiet: int
) -> None:
    engines = []
    for plain in (False, True):
        with mock.patch.dict(os.environ, {ENV_PLAIN_PATHS: "1" if plain else ""}):
            policy = MeridianPolicy(
                MODEL,
                SchedulerConfig(),
                block_size=BLOCK_SIZE,
                capacity=8,
                max_step_tokens=max_step_tokens,
            )
        assert policy.planner.plain is plain
        engines.append(Engine(policy, num_blocks, max_step_tokens))
    cached, reference = engines
    n = 0
    # The steps drawn, then quiet ones (no arrivals, all blocks free) for the batch to drain.
    for step, (arrivals, reserved) in enumerate([*plan, *[([], 0)] * quiet], start=1):
        for engine in engines:
            for i, script in enumerate(arrivals):
                engine.add(f"r{n + i}", script)
        n += len(arrivals)
        decided, planned = cached.step(step, reserved), reference.step(step, reserved)
        assert decided == planned, f"step {step}"
        assert decided.order is None or decided.order == planned.order, f"step {step}"
    stats = cached.policy.stats
    lazy = stats.num_plans - stats.num_reordered_steps - stats.num_engine_order_steps
    event(f"engine order kept: {stats.num_engine_order_steps > 0}, lazy order: {lazy > 0}")
    event(
        f"preempted: {sum(stats.num_preemptions.values()) > 0}, held: {stats.num_answer_holds > 0}"
    )
