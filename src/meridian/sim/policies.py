"""Scheduling policies the simulator compares, all on the same engine.

=================  ==========================================================================
``meridian``       the core objects: dual-queue order (output first, think fills up to
                   ``think_batch_multiplier`` x the output budget), phase-aware preemption victims
                   and tiered KV (think cap), entropy-driven budget forcing (EAT + RPDI).
``vllm-fcfs``      stock vLLM: the running list in admission order; under KV pressure the last
                   running request (``running[-1]``, the newest) is preempted.
``vllm-priority``  vLLM's priority policy with the priorities a user would set: chat requests 0,
                   reasoning requests 1 (lower runs first); the victim is the lowest-priority,
                   latest-arrived candidate.
``static-budget``  FCFS plus vLLM's ``thinking_token_budget``: ``</think>`` forced at a fixed
                   think length, no entropy.
``think-first``    Pascal-like (HPCA 2026): reasoning at high priority; answer tokens paced to the
                   output ITL SLO (an answer row is scheduled only when its next token is due);
                   victims from the low-priority (answer) end.
=================  ==========================================================================
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from meridian.config.schema import MeridianConfig
from meridian.core.budget import BudgetPolicy
from meridian.core.dual_queue import DualQueueScheduler
from meridian.core.preemption import RunningRequest, select_preemption_victims
from meridian.core.types import Phase, PhaseEvent, Tier, floor_fraction
from meridian.errors import MeridianError
from meridian.sim.engine import Engine, SimPolicy
from meridian.sim.state import SimRequest
from meridian.sim.steptime import rows_within_budget

DEFAULT_STATIC_THINK_BUDGET = 4096


class _Forcing:
    """Runs a core BudgetPolicy on each think token (full checks every probe interval)."""

    def __init__(self, budget: BudgetPolicy, interval: int, use_entropy: bool) -> None:
        self.budget = budget
        self.interval = interval
        self.use_entropy = use_entropy
        self.engine: Engine | None = None

    def on_admit(self, req: SimRequest) -> None:
        if self.use_entropy and req.probe is None and req.spec.is_reasoning:
            req.probe = self.budget.new_probe()

    def after_think_token(self, req: SimRequest) -> None:
        probe = req.probe
        if probe is not None:
            h = req.current_entropy()
            if h is not None:
                probe.observe(h)
        n = req.num_think
        # The hard cap is checked every token; entropy signals only change meaningfully at probe
        # intervals, so the full decision runs there (the vLLM logits processor does the same).
        if n < self.budget.max_think_tokens and n % self.interval:
            return
        decision = self.budget.decide(n, probe)
        if decision is not None and self.engine is not None:
            self.engine.force(req, decision)


class FcfsPolicy(SimPolicy):
    """Stock vLLM FCFS."""

    name = "vllm-fcfs"


class StaticBudgetPolicy(SimPolicy):
    """FCFS plus a static ``thinking_token_budget``."""

    name = "static-budget"

    def __init__(self, think_budget: int = DEFAULT_STATIC_THINK_BUDGET) -> None:
        self._forcing = _Forcing(BudgetPolicy.static(think_budget), 1, use_entropy=False)

    def setup(self, engine: Engine) -> None:
        self._forcing.engine = engine

    def after_think_token(self, req: SimRequest) -> None:
        self._forcing.after_think_token(req)


class PriorityPolicy(SimPolicy):
    """vLLM's priority scheduling: chat 0, reasoning 1; ties by arrival."""

    name = "vllm-priority"

    @staticmethod
    def _key(req: SimRequest) -> tuple[int, int, str]:
        return (1 if req.spec.is_reasoning else 0, req.spec.arrival_ns, req.rid)

    def order(
        self, running: list[SimRequest], step: int, now_ns: int
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        return sorted(running, key=self._key), []

    def pick_victim(
        self, candidates: list[SimRequest], needed_blocks: int, step: int
    ) -> SimRequest | None:
        return max(candidates, key=self._key)

    def next_waiting(self, waiting: deque[SimRequest]) -> SimRequest | None:
        return min(waiting, key=self._key)


class ThinkFirstPolicy(SimPolicy):
    """Pascal-like: think phase first; answers paced to the output ITL SLO."""

    name = "think-first"

    def __init__(self, output_itl_ns: int) -> None:
        self._pace_ns = output_itl_ns

    def order(
        self, running: list[SimRequest], step: int, now_ns: int
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        think = [r for r in running if r.phase is not Phase.OUTPUT or not r.record.answer_token_ns]
        answer = [r for r in running if r.phase is Phase.OUTPUT and r.record.answer_token_ns]
        due: list[SimRequest] = []
        paced: list[SimRequest] = []
        # An answer row not due within half a pace interval waits: pacing keeps it at the SLO
        # while the freed batch slots go to reasoning.
        horizon = now_ns + self._pace_ns // 2
        for r in answer:
            (due if r.record.answer_token_ns[-1] + self._pace_ns <= horizon else paced).append(r)
        if not think and not due:
            return paced, []  # nothing else to run: pacing would only idle the engine
        return think + due, paced

    def pick_victim(
        self, candidates: list[SimRequest], needed_blocks: int, step: int
    ) -> SimRequest | None:
        answers = [c for c in candidates if c.phase is Phase.OUTPUT]
        return answers[-1] if answers else candidates[-1]


class MeridianPolicy(SimPolicy):
    """The policy that ships: the same core objects the vLLM integration drives."""

    name = "meridian"

    def __init__(self, config: MeridianConfig) -> None:
        self.config = config
        self.dual_queue = DualQueueScheduler(config.scheduler)
        self._forcing = _Forcing(
            BudgetPolicy(config.scheduler, config.entropy),
            config.entropy.eat_probe_interval_tokens,
            use_entropy=config.entropy.enabled,
        )
        self._engine: Engine | None = None
        self._by_id: dict[str, SimRequest] = {}
        self._victims_this_step = 0
        self._step = -1
        self._output_budget_cache: dict[int, int] = {}

    def setup(self, engine: Engine) -> None:
        self._engine = engine
        self._forcing.engine = engine

    def next_waiting(self, waiting: deque[SimRequest]) -> SimRequest | None:
        """FCFS, except that new reasoning requests wait while think tiers hold more than
        ``think_phase_memory_fraction`` of the cache (requests behind them may go first)."""
        engine = self._engine
        assert engine is not None
        kv = engine.kv
        think = kv.num_blocks_in_tier(Tier.THINK_ACTIVE) + kv.num_blocks_in_tier(
            Tier.THINK_COMPLETE
        )
        if think < self.config.kv_memory.think_phase_memory_fraction * kv.num_blocks:
            return waiting[0]
        for req in waiting:
            if req.phase is not Phase.THINK or req.record.preemptions_by_phase:
                return req
        return None

    def _output_budget(self, engine: Engine, running: Sequence[SimRequest]) -> int:
        """Rows that fit in one step within the output TPOT budget at today's mean context."""
        if not running:
            return engine.config.max_num_seqs
        mean_context = sum(r.num_tokens for r in running) // len(running)
        bucket = max(1, mean_context // 256)  # cache by 256-token buckets: it changes slowly
        cached = self._output_budget_cache.get(bucket)
        if cached is None:
            budget_ns = int(self.config.scheduler.output_tpot_budget_ms * 1e6)
            cached = rows_within_budget(
                engine.step_model, budget_ns, bucket * 256, engine.config.max_num_seqs
            )
            self._output_budget_cache[bucket] = cached
        return cached

    def order(
        self, running: list[SimRequest], step: int, now_ns: int
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        engine = self._engine
        assert engine is not None
        plan = self.dual_queue.schedule(
            engine.config.max_num_seqs, self._output_budget(engine, running)
        )
        by_id = self._by_id
        return [by_id[r] for r in plan.served], [by_id[r] for r in plan.deferred]

    def pick_victim(
        self, candidates: list[SimRequest], needed_blocks: int, step: int
    ) -> SimRequest | None:
        engine = self._engine
        assert engine is not None
        if step != self._step:
            self._step, self._victims_this_step = step, 0
        limit = max(
            1, floor_fraction(self.config.scheduler.preempt_max_fraction, len(engine.running))
        )
        if self._victims_this_step >= limit:
            return None  # NOTE: the requester waits a step rather than exceed the per-step cap.
        running = [
            RunningRequest(
                request_id=c.rid,
                phase=c.phase,
                num_blocks=c.num_blocks,
                last_touched=c.last_scheduled_step,
                readmitted_step=c.readmitted_step,
            )
            for c in candidates
        ]
        victims = select_preemption_victims(
            needed_blocks, running, step=step, max_fraction=1.0, readmit_guard_steps=1
        )
        self._victims_this_step += 1
        if not victims:
            return candidates[0]  # nobody else holds blocks: the requester gives way
        return self._by_id[victims[0].request_id]

    def on_admit(self, req: SimRequest, step: int) -> None:
        self._by_id[req.rid] = req
        self.dual_queue.add(req.rid, req.phase)
        self._forcing.on_admit(req)

    def on_leave(self, req: SimRequest) -> None:
        self.dual_queue.remove(req.rid)
        self._by_id.pop(req.rid, None)

    def on_events(self, req: SimRequest, events: Sequence[PhaseEvent]) -> None:
        if req.rid in self.dual_queue and req.phase is not Phase.COMPLETE:
            self.dual_queue.set_phase(req.rid, req.phase)

    def after_think_token(self, req: SimRequest) -> None:
        self._forcing.after_think_token(req)


class MeridianDisaggPolicy(MeridianPolicy):
    """Meridian plus offload of ThinkComplete KV to a KV pool at ExitThink (``--disagg``).

    NOTE: this models the design's premise that a request's think-phase KV is cold once its
    answer starts (the answer is generated from the local, recent KV); the engine frees those
    slots when the pool acknowledges the transfer and pulls them back instead of recomputing
    when the request resumes after a preemption.
    """

    name = "meridian-disagg"

    def offloads_think_kv(self) -> bool:
        return True


PolicyFactory = Callable[[MeridianConfig, int], SimPolicy]

POLICIES: dict[str, PolicyFactory] = {
    "meridian": lambda config, itl_ns: MeridianPolicy(config),
    "meridian-disagg": lambda config, itl_ns: MeridianDisaggPolicy(config),
    "vllm-fcfs": lambda config, itl_ns: FcfsPolicy(),
    "vllm-priority": lambda config, itl_ns: PriorityPolicy(),
    "static-budget": lambda config, itl_ns: StaticBudgetPolicy(),
    "think-first": lambda config, itl_ns: ThinkFirstPolicy(itl_ns),
}


def make_policy(name: str, config: MeridianConfig, output_itl_ns: int) -> SimPolicy:
    """A fresh policy by registry name; a clear error for unknown names."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise MeridianError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(config, output_itl_ns)
