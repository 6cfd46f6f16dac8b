"""The policies the simulator compares, and their adapters to the fast engine.

A policy is a scheduler and a forcing (:mod:`meridian.sim.streams`): forcing is reported apart
from scheduling, so every scheduler runs with forcing off and with Meridian's forcing on.

========================  ==================================================================
``vllm-fcfs``             stock vLLM: running list in admission order; under KV pressure the
                          newest running request (``running[-1]``) is preempted by recompute.
``vllm-priority``         vLLM's priority policy with the priorities a user would set: chat 0,
                          reasoning 1 (lower runs first; the victim is the lowest-priority,
                          latest arrival).
``pascal``                a single-instance rendering of Pascal (arXiv:2602.11530,
                          :class:`PascalPolicy`).
``meridian-sched``        Meridian's scheduling (:class:`~meridian.core.policy.MeridianPolicy`,
                          the shipped object), forcing off.
``meridian``              Meridian's scheduling and Meridian's forcing: what ships.
``NAME+forcing``          scheduler ``NAME`` with Meridian's forcing (the same streams).
``static-budget``         FCFS plus vLLM's ``thinking_token_budget`` at the cap whose think-token
                          saving matches Meridian's forcing on this workload;
                          ``static-budget:CAP`` at a given cap.
========================  ==================================================================

Baselines run at vLLM's defaults for the hardware (``meridian.sim.presets``). Both engines run
the same policy objects: the fast engine through :func:`make_sim_policy`, vLLM's scheduler
through :mod:`meridian.sim.vllm_engine`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from meridian.config.schema import MeridianConfig
from meridian.core.interface import Plan, R
from meridian.core.policy import MeridianPolicy, TrackingPolicy
from meridian.core.types import Phase
from meridian.errors import MeridianError
from meridian.sim.engine import Engine, SimPolicy
from meridian.sim.state import SimRequest
from meridian.sim.streams import FORCING_MERIDIAN, FORCING_OFF, SIM_FORMAT, Forcing, ForcingKind

FORCING_SUFFIX = "+forcing"
STATIC_BUDGET = "static-budget"
# Pascal, Sec. IV-C (as summarised in docs/benchmarks.md): a reasoning request longer than this
# is demoted to the answering (low-priority) queue.
PASCAL_DEMOTION_TOKENS = 5000


class SchedulerKind(enum.Enum):
    """Which scheduler a policy runs."""

    FCFS = "vllm-fcfs"
    PRIORITY = "vllm-priority"
    PASCAL = "pascal"
    MERIDIAN = "meridian-sched"


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A named policy: its scheduler and its forcing. ``static-budget`` without a cap gets the
    matched cap once the workload is known (``cap is None`` until then)."""

    name: str
    scheduler: SchedulerKind
    forcing: Forcing | None


DEFAULT_POLICIES = (
    "meridian",
    "meridian-sched",
    "vllm-fcfs",
    "vllm-fcfs+forcing",
    "vllm-priority",
    "vllm-priority+forcing",
    "pascal",
    "pascal+forcing",
    STATIC_BUDGET,
)


def parse_policy(name: str) -> PolicySpec:
    """The policy a name stands for (module docstring); a clear error for anything else."""
    text = name.strip()
    if text == "meridian":
        return PolicySpec(text, SchedulerKind.MERIDIAN, FORCING_MERIDIAN)
    if text == STATIC_BUDGET:
        return PolicySpec(text, SchedulerKind.FCFS, None)
    if text.startswith(STATIC_BUDGET + ":"):
        raw = text.split(":", 1)[1]
        if not raw.isdigit() or int(raw) < 1:
            raise MeridianError(f"policy {name!r}: the cap must be a positive integer; got {raw!r}")
        return PolicySpec(text, SchedulerKind.FCFS, Forcing(ForcingKind.STATIC, int(raw)))
    base, plus, rest = text.partition("+")
    kinds = {k.value: k for k in SchedulerKind}
    if base not in kinds or (plus and rest != FORCING_SUFFIX[1:]):
        known = ", ".join([*DEFAULT_POLICIES[:-1], "static-budget[:CAP]"])
        raise MeridianError(f"unknown policy {name!r}; known: {known}")
    if base == SchedulerKind.MERIDIAN.value and plus:
        raise MeridianError(f"policy {name!r}: Meridian with its forcing is called 'meridian'")
    forcing = FORCING_MERIDIAN if plus else FORCING_OFF
    return PolicySpec(text, kinds[base], forcing)


def parse_policies(text: str) -> list[PolicySpec]:
    """``all`` or a comma list of policy names, in order, without repeats."""
    names = list(DEFAULT_POLICIES) if text.strip() == "all" else text.split(",")
    specs: list[PolicySpec] = []
    for name in names:
        if name.strip() and all(s.name != name.strip() for s in specs):
            specs.append(parse_policy(name))
    if not specs:
        raise MeridianError("--policies: no policy named; use 'all' or a comma list")
    return specs


class PascalPolicy(TrackingPolicy):
    """A faithful-where-possible single-instance rendering of Pascal's intra-instance scheduler
    (Cho et al., "PASCAL: A Phase-Aware Scheduling Algorithm for Serving Reasoning-based LLMs",
    HPCA 2026, arXiv:2602.11530; the choices and their sources are in docs/benchmarks.md).

    - Reasoning, prefill included, is the high-priority class; answering the low one (the
      reasoning phase "includes the prefill stage"). The order serves the high class first.
    - Under memory pressure answering requests are preempted first ("reasoning requests always
      preempt answering requests for GPU memory", Sec. IV-C): they are last in the order, where
      vLLM takes its victim (the newest first).
    - A reasoning request past 5,000 think tokens is demoted to the low class (Sec. IV-C).
    - Answer tokens reach the user through a token pacer at the output SLO (the engine applies
      ``delivery_pace_ns``), hiding stalls shorter than the tokens buffered ahead.

    Not rendered: round robin with a 500-token quantum inside each class (vLLM preempts by
    recompute, so time-slicing by preemption would recompute where Pascal swaps; FCFS is kept
    within each class) and Pascal's multi-instance placement and migration. Admission is
    vLLM's own, in vLLM's order (Pascal does not gate it): the tracking policy's.

    A plan of its own over Meridian's tracking (phases and think counts), nothing of Meridian's
    plan or admission.
    """

    def plan(self, running: Sequence[R], step: int, num_free_blocks: int) -> Plan[R]:
        self.stats.num_plans += 1
        self.tracker.settle()
        high: list[R] = []
        low: list[R] = []
        states = self.tracker.states
        for request in running:
            st = states[request.request_id]
            answering = st.phase is Phase.OUTPUT
            (low if answering or st.num_think_tokens > PASCAL_DEMOTION_TOKENS else high).append(
                request
            )
        order: Sequence[R] = running
        if any(a is not b for a, b in zip(high + low, running, strict=True)):
            order = high + low
            self.stats.num_reordered_steps += 1
        return Plan(order, [], len(low))


class _CorePolicy(SimPolicy):
    """The fast engine's adapter over a core policy object (Meridian's, or Pascal's)."""

    def __init__(
        self, name: str, config: MeridianConfig, policy_class: type[TrackingPolicy]
    ) -> None:
        self.name = name
        self.config = config
        self.policy_class = policy_class
        self._core: TrackingPolicy | None = None

    @property
    def core(self) -> TrackingPolicy:
        assert self._core is not None, "setup() first"
        return self._core

    def setup(self, engine: Engine) -> None:
        cfg = engine.config
        self._core = self.policy_class.from_config(
            SIM_FORMAT,
            self.config.scheduler,
            block_size=cfg.block_size_tokens,
            capacity=cfg.max_num_seqs,
            clock=lambda: engine.now_ns / 1e9,
            max_step_tokens=cfg.max_num_batched_tokens,
        )

    def on_arrival(self, req: SimRequest) -> None:
        # The whole prompt, as vLLM's scheduler hands it over: its length is the request's
        # prompt KV to the policy (admission's sizes and progress), its tail the initial phase.
        self.core.track(req.request_id, req.stream.prompt_token_ids(0))

    def plan(self, running: list[SimRequest], step: int, num_free_blocks: int) -> Plan[SimRequest]:
        return self.core.plan(running, step, num_free_blocks)

    def waiting_order(self, head: list[SimRequest]) -> list[SimRequest] | None:
        return self.core.waiting_order(head)

    def admissions(
        self, running: list[SimRequest], waiting: list[SimRequest], num_blocks: int
    ) -> int | None:
        return self.core.admissions(running, waiting, num_blocks)

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        self.core.on_step(num_rows, num_tokens)

    def on_idle(self) -> None:
        self.core.on_idle()

    def on_tokens(self, request_ids: list[str], tokens: list[list[int]], step: int) -> None:
        self.core.observe(request_ids, tokens, step)

    def on_preempt(self, req: SimRequest) -> None:
        self.core.on_preempt(req.request_id)

    def on_finish(self, req: SimRequest) -> None:
        self.core.untrack(req.request_id, req.num_output_tokens)


class _Priority(SimPolicy):
    uses_priority = True


def make_sim_policy(spec: PolicySpec, config: MeridianConfig, output_itl_ns: int) -> SimPolicy:
    """A fresh fast-engine policy for ``spec`` (its forcing is in the streams, not here)."""
    kind = spec.scheduler
    policy: SimPolicy
    if kind is SchedulerKind.MERIDIAN:
        policy = _CorePolicy(spec.name, config, MeridianPolicy)
    elif kind is SchedulerKind.PASCAL:
        policy = _CorePolicy(spec.name, config, PascalPolicy)
        policy.delivery_pace_ns = output_itl_ns
    elif kind is SchedulerKind.PRIORITY:
        policy = _Priority()
    else:
        policy = SimPolicy()
    policy.name = spec.name
    return policy
