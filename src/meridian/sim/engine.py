"""A discrete-event model of a vLLM-V1-like engine: continuous batching over one KV cache.

Time is integer nanoseconds of simulated time; the loop is a ``heapq`` of ``(time, priority,
seq)`` events (arrivals, step ends), so ties break deterministically. Nothing here reads a wall
clock or sleeps; the cost of a step comes from a :class:`~meridian.sim.steptime.StepTimeModel`.

One step, as vLLM's ``Scheduler.schedule()`` does it:

1. The policy orders the running requests (and may defer some for a step).
2. Each running request in that order gets its next tokens: the rest of its prompt (or of its
   recompute after a preemption) in chunks up to the step's token budget, else one decode token.
   Its KV blocks are allocated first; when the cache is full the policy picks a victim, which is
   preempted by recompute (its KV is freed; it goes back to the front of the waiting queue and
   prefills prompt + generated tokens again when it resumes).
3. Waiting requests are admitted while sequences, tokens and free blocks allow (not in a step
   that preempted, as in vLLM).
4. At the step's end every row whose context is fully computed samples one token. The token
   stream (``<think>`` ... ``</think>`` answer) goes through the core
   :class:`~meridian.core.router.PhaseRouter`; think tokens feed the policy's entropy probe and
   budget policy, which may force ``</think>`` early.

The engine is policy-agnostic: the same loop, KV cache (the core
:class:`~meridian.core.blocks.TieredBlockManager`) and step-time model serve every policy.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meridian.config.schema import KvMemoryConfig
from meridian.core.blocks import TieredBlockManager
from meridian.core.budget import ForceDecision
from meridian.core.router import PhaseRouter, ReasoningModel
from meridian.core.types import ExitThink, Phase, PhaseEvent, Tier, tier_for_phase
from meridian.errors import MeridianError
from meridian.sim.fabric import FabricModel
from meridian.sim.records import RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestSpec
from meridian.sim.state import (
    NO_THINK_ID,
    THINK_END_ID,
    THINK_START_ID,
    THINK_TOKEN_ID,
    RequestStatus,
    SimRequest,
)
from meridian.sim.steptime import BatchShape, StepTimeModel

SIM_MODEL = ReasoningModel(
    think_start=(THINK_START_ID,), think_end=(THINK_END_ID,), no_think=(NO_THINK_ID,)
)
# Reasoning prompts end with the template's <think>; chat prompts carry /no_think.
_REASONING_PROMPT_TAIL = (THINK_START_ID,)
_CHAT_PROMPT_TAIL = (NO_THINK_ID,)

# Event priorities at the same instant: arrivals, finished offloads, then the step's end.
_ARRIVAL, _OFFLOADED, _STEP_END = 0, 1, 2


class SimulationError(MeridianError):
    """The simulated engine cannot make progress (e.g. a request larger than the whole cache)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's shape (vLLM's ``max_num_batched_tokens``, ``max_num_seqs``, KV cache)."""

    num_kv_blocks: int
    block_size_tokens: int = 16
    kv_bytes_per_token: int = 2
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    fabric: FabricModel | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_kv_blocks",
            "block_size_tokens",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1; got {getattr(self, name)}")


class SimPolicy:
    """What a scheduling policy decides; the engine does everything else.

    Subclasses override the hooks they need; the defaults are vLLM's FCFS behaviour.
    """

    name = "base"

    def setup(self, engine: Engine) -> None:
        """Called once before the run."""

    def think_block_fraction(self) -> float | None:
        """Cap on the share of KV blocks think tiers may hold (``None``: no cap)."""
        return None

    def order(
        self, running: list[SimRequest], step: int, now_ns: int
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        """Requests to schedule this step in order, and those deferred (kept, not scheduled)."""
        return running, []

    def pick_victim(
        self, candidates: list[SimRequest], needed_blocks: int, step: int
    ) -> SimRequest | None:
        """The request to preempt; ``candidates`` are in running-list order, the requester first.

        ``None`` means: do not preempt, leave the requester unscheduled this step.
        """
        return candidates[-1]

    def next_waiting(self, waiting: deque[SimRequest]) -> SimRequest | None:
        """The waiting request to admit next (FCFS: the head); ``None``: admit nothing now."""
        return waiting[0]

    def on_admit(self, req: SimRequest, step: int) -> None:
        """``req`` joined the running set."""

    def on_leave(self, req: SimRequest) -> None:
        """``req`` left the running set (finished or preempted)."""

    def on_events(self, req: SimRequest, events: Sequence[PhaseEvent]) -> None:
        """Phase events of ``req`` from its latest token."""

    def after_think_token(self, req: SimRequest) -> None:
        """``req`` generated a think token; a budget policy may call ``engine.force``."""

    def offloads_think_kv(self) -> bool:
        """Offload ThinkComplete blocks to the KV pool at ExitThink (needs a fabric)."""
        return False


class Engine:
    """Runs one policy over one workload; :meth:`run` returns a :class:`SimResult`."""

    def __init__(
        self,
        config: EngineConfig,
        step_model: StepTimeModel,
        policy: SimPolicy,
        kv_config: KvMemoryConfig | None = None,
        *,
        sample_every_steps: int = 1,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.step_model = step_model
        self.policy = policy
        self.router = PhaseRouter(clock=lambda: 0.0)
        kv = kv_config or KvMemoryConfig()
        fraction = policy.think_block_fraction()
        block_bytes = config.block_size_tokens * config.kv_bytes_per_token
        # Baselines know no tiers: a cap of 1.0 (not a valid user setting) means "no cap".
        kv = KvMemoryConfig.model_construct(
            **{
                **kv.model_dump(),
                "block_size_bytes": block_bytes,
                "block_size_tokens": config.block_size_tokens,
                "think_phase_memory_fraction": 1.0 if fraction is None else fraction,
            }
        )
        self.kv = TieredBlockManager(kv, capacity_bytes=config.num_kv_blocks * block_bytes)
        self.counters = RunCounters()
        self.step = 0
        self.now_ns = 0
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.samples: list[TimeSample] = []
        self._sample_every = max(1, sample_every_steps)
        self._on_progress = on_progress
        self._num_finished = 0
        self._last_batch = (0, 0)
        self._heap: list[tuple[int, int, int, SimRequest | None]] = []
        # The rows of the step in flight, with their token counts (set by _start_step).
        self._scheduled: list[tuple[SimRequest, int]] = []
        self._seq = itertools.count()
        self._ingest_ns = 0

    # -- public helpers for policies -------------------------------------------------------------

    def force(self, req: SimRequest, decision: ForceDecision) -> None:
        """End ``req``'s think phase now: its next token is ``</think>``."""
        if req.think_target <= req.num_think or req.record.forced_reason is not None:
            return
        self.router.mark_forced(req.rid, decision.reason)
        req.think_target = req.num_think
        req.record.forced_reason = decision.reason

    # -- the run ------------------------------------------------------------------------------

    def run(self, specs: Sequence[RequestSpec]) -> SimResult:
        """Serve every request of ``specs`` to completion."""
        self.policy.setup(self)
        if self.policy.offloads_think_kv():
            if self.config.fabric is None:
                raise SimulationError(f"policy {self.policy.name} offloads KV but has no fabric")
            self.kv.attach_fabric(self.config.fabric)
        heap = self._heap
        seq = self._seq
        requests: list[SimRequest] = []
        max_tokens = self.config.num_kv_blocks * self.config.block_size_tokens
        for spec in specs:
            need = spec.num_prompt_tokens + spec.num_think_tokens + spec.num_answer_tokens + 1
            if need > max_tokens:
                raise SimulationError(
                    f"request {spec.request_id} needs {need} tokens of KV but the whole cache "
                    f"holds {max_tokens}; use a larger cache or shorter requests"
                )
            req = SimRequest.from_spec(spec)
            requests.append(req)
            heapq.heappush(heap, (spec.arrival_ns, _ARRIVAL, next(seq), req))
        busy = False
        while heap:
            time_ns, kind, _, payload = heapq.heappop(heap)
            self.now_ns = time_ns
            if kind == _ARRIVAL:
                assert payload is not None
                self._arrive(payload)
            elif kind == _OFFLOADED:
                assert payload is not None
                self._offloaded(payload)
            else:
                self._finish_step()
                busy = False
            if not busy and (self.running or self.waiting):
                # Arrivals at this same instant are queued before the step starts (priority 0).
                if heap and heap[0][0] == time_ns and heap[0][1] != _STEP_END:
                    continue
                duration = self._start_step()
                heapq.heappush(heap, (time_ns + duration, _STEP_END, next(seq), None))
                busy = True
        self.kv.check_integrity()
        if self.router.tracked_requests or self.running or self.waiting:
            raise SimulationError("run ended with requests still tracked; this is a bug")
        return SimResult(
            policy=self.policy.name,
            num_kv_blocks=self.kv.num_blocks,
            records=[r.record for r in requests],
            samples=self.samples,
            counters=self.counters,
            end_ns=self.now_ns,
        )

    def _arrive(self, req: SimRequest) -> None:
        tail = _REASONING_PROMPT_TAIL if req.spec.is_reasoning else _CHAT_PROMPT_TAIL
        self.router.start(req.rid, SIM_MODEL, tail)
        req.phase = self.router.phase(req.rid)
        self.waiting.append(req)

    # -- one step -----------------------------------------------------------------------------

    def _start_step(self) -> int:
        cfg = self.config
        order, deferred = self.policy.order(self.running, self.step, self.now_ns)
        queue = list(order)
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        victims_left = list(deferred)
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = req.blocks_needed(req.num_computed + n, cfg.block_size_tokens)
            tier = tier_for_phase(req.phase)
            granted = True
            while not self.kv.can_allocate(need, tier):
                victim = self.policy.pick_victim(queue[i:] + victims_left, need, self.step)
                if victim is None:
                    granted = False
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                if victim in victims_left:
                    victims_left.remove(victim)
                else:
                    queue.remove(victim)
            if req.status is not RequestStatus.RUNNING:  # it was its own victim
                queue.pop(i)
                continue
            if not granted:
                i += 1
                continue
            if need:
                self.kv.allocate(req.rid, tier, need)
                req.num_blocks += need
            scheduled.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(scheduled, budget)
        if not scheduled:
            raise SimulationError(
                f"step {self.step}: nothing could be scheduled ({len(self.running)} running, "
                f"{len(self.waiting)} waiting, {self.kv.num_free_blocks} free blocks)"
            )
        self._scheduled = scheduled
        self.counters.num_scheduled_rows += len(scheduled)
        num_prefill = num_decode = kv_read = 0
        for req, n in scheduled:
            req.last_scheduled_step = self.step
            kv_read += req.num_computed + n - req.num_offloaded_blocks * cfg.block_size_tokens
            if n == 1 and req.num_computed == req.num_tokens - 1 and req.num_generated:
                num_decode += 1
            else:
                num_prefill += n
        shape = BatchShape(num_prefill, num_decode, kv_read, len(scheduled))
        ingest_ns, self._ingest_ns = self._ingest_ns, 0
        return max(1, self.step_model.step_time_ns(shape) + ingest_ns)

    def _admit(self, scheduled: list[tuple[SimRequest, int]], budget: int) -> int:
        cfg = self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.policy.next_waiting(self.waiting)
            if req is None:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            need = req.blocks_needed(req.num_computed + n, cfg.block_size_tokens)
            tier = tier_for_phase(req.phase)
            if not self.kv.can_allocate(need, tier):
                break
            self.waiting.remove(req)
            self.kv.allocate(req.rid, tier, need)
            req.num_blocks = need
            req.status = RequestStatus.RUNNING
            if req.record.preemptions_by_phase:
                req.readmitted_step = self.step
            if req.num_offloaded_blocks:
                fabric = self.config.fabric
                assert fabric is not None
                self._ingest_ns += fabric.transfer_ns(
                    req.num_offloaded_blocks * cfg.block_size_tokens * cfg.kv_bytes_per_token
                )
                self.counters.num_ingested_blocks += req.num_offloaded_blocks
            self.running.append(req)
            self.policy.on_admit(req, self.step)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _preempt(self, req: SimRequest) -> None:
        rid = req.rid
        if req.phase is Phase.OUTPUT:
            self.counters.num_output_critical_evictions += sum(
                1
                for b in self.kv.blocks_for_request(rid)
                if self.kv.block_location(b).tier is Tier.OUTPUT_CRITICAL
            )
        self.kv.free(rid)
        phase = req.phase
        c = self.counters.preemptions_by_phase
        c[phase] = c.get(phase, 0) + 1
        r = req.record.preemptions_by_phase
        r[phase] = r.get(phase, 0) + 1
        pooled = req.num_offloaded_blocks * self.config.block_size_tokens
        recompute = req.num_computed - pooled
        self.counters.num_recomputed_tokens += recompute
        req.record.num_recomputed_tokens += recompute
        # NOTE: offloaded (ThinkComplete) blocks stay in the pool: on resume the engine pulls
        # them back (their transfer time is added to the step that re-admits the request) and
        # starts computing after them instead of recomputing them.
        req.num_computed = pooled
        req.num_blocks = 0
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.policy.on_leave(req)
        self.waiting.appendleft(req)

    def _finish_step(self) -> None:
        now, step = self.now_ns, self.step
        sampled: list[SimRequest] = []
        token_ids: list[list[int]] = []
        for req, n in self._scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                sampled.append(req)
                token_ids.append([req.next_token_id()])
        events = self.router.observe_many([r.rid for r in sampled], token_ids)
        batch_output = batch_think = 0
        for req, evs in zip(sampled, events, strict=True):
            self._emit(req, now, step, evs)
            if req.phase is Phase.THINK:
                batch_think += 1
            else:
                batch_output += 1
        self.counters.num_steps += 1
        self._last_batch = (batch_output, batch_think)
        if step % self._sample_every == 0:
            self._sample()
        self.step += 1
        if self._on_progress is not None:
            self._on_progress(self._num_finished)

    def _emit(self, req: SimRequest, now: int, step: int, events: Sequence[PhaseEvent]) -> None:
        rec = req.record
        if rec.first_token_ns is None:
            rec.first_token_ns = now
        token = req.last_token_id
        if token == THINK_TOKEN_ID:
            req.num_think += 1
            self.policy.after_think_token(req)
        elif token == THINK_END_ID:
            rec.think_end_ns = now
            rec.num_think_tokens = req.num_think
        else:
            req.num_answer += 1
            if rec.first_answer_ns is None:
                rec.first_answer_ns = now
            rec.answer_token_ns.append(now)
            rec.answer_token_step.append(step)
        if events:
            for ev in events:
                if isinstance(ev, ExitThink):
                    self.kv.demote_think_blocks(req.rid)
                    if self.policy.offloads_think_kv():
                        self._start_offload(req)
            req.phase = self.router.phase(req.rid)
            self.policy.on_events(req, events)
        if req.num_answer == req.spec.num_answer_tokens:
            self._complete(req)

    def _start_offload(self, req: SimRequest) -> None:
        """Push the request's ThinkComplete blocks to the pool; slots free when it lands."""
        fabric = self.config.fabric
        assert fabric is not None
        cfg = self.config
        blocks = [
            b
            for b in self.kv.blocks_for_request(req.rid)
            if self.kv.block_location(b).tier is Tier.THINK_COMPLETE
        ]
        # Only full blocks travel: the last, partly filled block stays local (answer tokens
        # continue into it), so offloaded blocks always hold exactly block_size tokens each.
        blocks = blocks[: req.num_computed // cfg.block_size_tokens - req.num_offloaded_blocks]
        if not blocks:
            return
        req.offload_pending = tuple(blocks)
        req.offload_epoch = sum(req.record.preemptions_by_phase.values())
        nbytes = len(blocks) * cfg.block_size_tokens * cfg.kv_bytes_per_token
        done = self.now_ns + fabric.transfer_ns(nbytes)
        heapq.heappush(self._heap, (done, _OFFLOADED, next(self._seq), req))

    def _offloaded(self, req: SimRequest) -> None:
        """The pool acknowledged ``req``'s blocks: free their local slots (if still local)."""
        blocks, req.offload_pending = req.offload_pending, ()
        epoch = sum(req.record.preemptions_by_phase.values())
        if req.status is not RequestStatus.RUNNING or epoch != req.offload_epoch:
            return  # preempted or finished meanwhile: those blocks were already released
        for block in blocks:
            self.kv.offload_block(block)
        req.num_blocks -= len(blocks)
        req.num_offloaded_blocks += len(blocks)
        self.counters.num_offloaded_blocks += len(blocks)

    def _complete(self, req: SimRequest) -> None:
        rec = req.record
        rec.finish_ns = self.now_ns
        rec.num_answer_tokens = req.num_answer
        rec.num_think_tokens = req.num_think
        self.kv.free(req.rid)
        self.router.finish(req.rid)
        req.status = RequestStatus.FINISHED
        req.phase = Phase.COMPLETE
        self.running.remove(req)
        self.policy.on_leave(req)
        self._num_finished += 1

    def _sample(self) -> None:
        kv = self.kv
        think_blocks = kv.num_blocks_in_tier(Tier.THINK_ACTIVE) + kv.num_blocks_in_tier(
            Tier.THINK_COMPLETE
        )
        queue_output = sum(1 for r in self.running if r.phase is not Phase.THINK)
        self.samples.append(
            TimeSample(
                time_ns=self.now_ns,
                num_kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
                num_kv_blocks_think=think_blocks,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                queue_output=queue_output,
                queue_think=len(self.running) - queue_output,
                batch_output=self._last_batch[0],
                batch_think=self._last_batch[1],
            )
        )
