"""The fast engine model: vLLM v1's scheduling loop re-told in a few hundred lines.

``meridian bench sim --engine model`` runs this; ``--engine vllm`` runs vLLM's own scheduler
(:mod:`meridian.sim.vllm_engine`), and ``meridian bench fidelity`` checks that the two agree.
Time is integer nanoseconds of simulated time; the loop is a ``heapq`` of ``(time, priority,
seq)`` events (arrivals, step ends), so ties break deterministically. Nothing reads a wall clock;
the cost of a step comes from a :class:`~meridian.sim.steptime.StepTimeModel`.

One step, as vLLM 0.32's ``Scheduler.schedule()`` does it (defaults: chunked prefill, prefix
caching, ``scheduler_reserve_full_isl``, no watermark, no long-prefill threshold):

1. The policy plans the running list: its order (served from the front) and the requests to
   skip this step (vLLM's ``next_decode_eligible_step``). Stock vLLM keeps admission order.
2. Running requests, in that order, get their next tokens (the rest of a prefill or recompute,
   in chunks up to the step's token budget, else one decode token). When their KV blocks cannot
   be allocated, the engine preempts by recompute: FCFS takes the last running request, the
   priority policy the lowest-priority latest arrival. A request that had to preempt itself ends
   the running pass.
3. Only in a step without preemptions, waiting requests are admitted (head first; the priority
   policy by (priority, arrival)) while sequences, tokens and blocks allow: a request first takes
   back its leading blocks still in the prefix cache, and its whole sequence must fit.
4. At the step's end every row whose context is fully computed samples its stream's next token;
   a request that generated its last token finishes and frees its blocks.

KV physics: a running request holds the KV of every token it has computed, and every step reads
all of it (attention over the prompt and the whole reasoning); a preempted request's blocks are
freed (their content may survive in the prefix cache until reused).

Length: the step above is one loop over one state (running, waiting, the block pool, the
clock), mirrored from vLLM's ``schedule()``; split, its order of effects would be harder to
check against vLLM's, which is what the fidelity benchmark measures.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meridian.core.admission import ADMISSION_CANDIDATES
from meridian.core.interface import Plan
from meridian.errors import MeridianError
from meridian.sim.kvcache import PrefixCachingBlockPool
from meridian.sim.records import RunCounters, SimResult, TimeSample
from meridian.sim.state import RequestStatus, SimRequest
from meridian.sim.steptime import BatchShape, StepTimeModel
from meridian.sim.streams import Stream

ENGINE_NAME = "model"

# Event priorities at the same instant: arrivals before the step's end.
_ARRIVAL, _STEP_END = 0, 1


class SimulationError(MeridianError):
    """The simulated engine cannot make progress (e.g. a request larger than the whole cache)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's shape: vLLM's ``max_num_batched_tokens``, ``max_num_seqs``, KV cache and
    block size, and whether prefix caching is on (vLLM's default) and scheduling asynchronous
    (the vLLM engine honours it; the fast engine models the synchronous loop). ``kv_offload_
    blocks`` is a host tier for vLLM's ``OffloadingConnector`` (0: off; the vLLM engine only),
    reached over a link of ``host_link_bytes_per_s``, evicting in ``kv_offload_eviction``'s
    order (``meridian.vllm.serve.HOST_EVICTION_POLICIES``)."""

    num_kv_blocks: int
    block_size_tokens: int = 16
    kv_bytes_per_token: int = 2
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    kv_offload_blocks: int = 0
    host_link_bytes_per_s: float = 0.0
    kv_offload_eviction: str = "reasoning-first"

    def __post_init__(self) -> None:
        for name in (
            "num_kv_blocks",
            "block_size_tokens",
            "max_num_batched_tokens",
            "max_num_seqs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1; got {getattr(self, name)}")
        if self.num_kv_blocks < 2:
            raise ValueError(f"engine.num_kv_blocks must be >= 2; got {self.num_kv_blocks}")


class SimPolicy:
    """What a scheduling policy decides in the fast engine; the engine does everything else.

    The defaults are stock vLLM FCFS. ``uses_priority`` switches the waiting queue and the
    victim to vLLM's priority policy. A policy that plans gets every event of a request's life.
    """

    name = "base"
    uses_priority = False
    #: Answer tokens reach the user through a token pacer at this interval (``None``: no pacer).
    delivery_pace_ns: int | None = None

    def setup(self, engine: Engine) -> None:
        """Called once before the run."""

    def on_arrival(self, req: SimRequest) -> None:
        """``req`` arrived (it is queued for admission)."""

    def plan(
        self, running: list[SimRequest], step: int, num_free_blocks: int
    ) -> Plan[SimRequest] | None:
        """The plan of step ``step``; ``None`` keeps the running order and skips nobody."""
        return None

    def waiting_order(self, head: list[SimRequest]) -> list[SimRequest] | None:
        """``head``, the first requests of the waiting queue, in the order they should start;
        ``None`` keeps the engine's order."""
        return None

    def admissions(
        self, running: list[SimRequest], waiting: list[SimRequest], num_blocks: int
    ) -> int | None:
        """How many of the waiting requests (from the head) may start this step; ``None``: no
        limit beyond vLLM's own rules."""
        return None

    def on_step(self, num_rows: int, num_tokens: int) -> None:
        """The planned step was scheduled with this shape."""

    def on_idle(self) -> None:
        """The engine has nothing to run until the next arrival."""

    def on_tokens(self, request_ids: list[str], tokens: list[list[int]], step: int) -> None:
        """The tokens each row generated in step ``step`` (``tokens[i]``: ``request_ids[i]``'s)."""

    def on_preempt(self, req: SimRequest) -> None:
        """``req`` is being preempted (its KV is about to be freed)."""

    def on_finish(self, req: SimRequest) -> None:
        """``req`` generated its last token and left the engine."""


def _priority_key(req: SimRequest) -> tuple[int, int, str]:
    return (req.priority, req.stream.spec.arrival_ns, req.request_id)


class Engine:
    """Runs one policy over one set of streams; :meth:`run` returns a :class:`SimResult`."""

    def __init__(
        self,
        config: EngineConfig,
        step_model: StepTimeModel,
        policy: SimPolicy,
        *,
        sample_every_steps: int = 4,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.step_model = step_model
        self.policy = policy
        self.pool = PrefixCachingBlockPool(config.num_kv_blocks, config.block_size_tokens)
        self.counters = RunCounters()
        self.step = 0
        self.now_ns = 0
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self._waiting_heap: list[tuple[tuple[int, int, str], SimRequest]] = []
        self.samples: list[TimeSample] = []
        self._sample_every = max(1, sample_every_steps)
        self._on_progress = on_progress
        self._num_finished = 0
        self._heap: list[tuple[int, int, int, SimRequest | None]] = []
        self._seq = itertools.count()
        # The rows of the step in flight, with their token counts.
        self._scheduled: list[tuple[SimRequest, int]] = []
        self._requests: list[SimRequest] = []
        self._busy = False
        #: Called with each request that generated its last token (the cluster's router).
        self.on_finish: Callable[[SimRequest], None] | None = None
        #: The cluster's migrations (:mod:`meridian.sim.migration`): told of each preemption and
        #: each ``</think>`` generated (a request starting to answer); ``on_adopt`` tracks a
        #: request moved here in place of the policy's ``on_arrival``. Callbacks must not change
        #: the engine: a migration happens between events (:meth:`take`, :meth:`adopt`).
        self.on_preempted: Callable[[SimRequest], None] | None = None
        self.on_answer: Callable[[SimRequest], None] | None = None
        self.on_adopt: Callable[[SimRequest], None] | None = None
        self._adopted: set[str] = set()

    # -- the run ------------------------------------------------------------------------------

    def run(self, streams: Sequence[Stream]) -> SimResult:
        """Serve every stream to completion."""
        self.start()
        for stream in streams:
            self.add(stream, stream.spec.arrival_ns)
        while (time_ns := self.next_event_ns()) is not None:
            self.advance(time_ns)
        return self.finish()

    # -- the run, event by event (the cluster simulator drives several engines this way) ------

    def start(self) -> None:
        """Before the first :meth:`add`."""
        self.policy.setup(self)

    def add(self, stream: Stream, at_ns: int) -> None:
        """``stream`` arrives at ``at_ns`` (not before the engine's last event)."""
        need = stream.spec.num_prompt_tokens + stream.num_output_tokens
        capacity = self.pool.num_usable_blocks * self.config.block_size_tokens
        if need > capacity:
            raise SimulationError(
                f"request {stream.request_id} needs {need} tokens of KV but the whole cache "
                f"holds {capacity}; use a larger cache or shorter requests"
            )
        req = SimRequest.from_stream(stream)
        self._requests.append(req)
        heapq.heappush(self._heap, (at_ns, _ARRIVAL, next(self._seq), req))

    def take(self, request_id: str) -> SimRequest:
        """Take a running or waiting request off this engine (it moves to another): its KV
        blocks freed, out of the step in flight (whose tokens for it are lost, as an aborted
        request's), out of this engine's records. Between events only."""
        req = next((r for r in self.running if r.request_id == request_id), None)
        if req is not None:
            self.running.remove(req)
            self._scheduled = [(r, n) for r, n in self._scheduled if r is not req]
        else:
            req = next(r for r in self.queued() if r.request_id == request_id)
            if self.policy.uses_priority:
                self._waiting_heap = [(k, r) for k, r in self._waiting_heap if r is not req]
                heapq.heapify(self._waiting_heap)
            else:
                self.waiting.remove(req)
        self.pool.free(request_id)
        self._requests.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        return req

    def adopt(self, req: SimRequest, at_ns: int, *, num_computed_tokens: int = 0) -> None:
        """``req``, taken off another engine (:meth:`take`), arrives at ``at_ns``: with its KV
        for ``num_computed_tokens`` tokens (sent over a link: it joins the running requests when
        the blocks are free, else it waits and recomputes) or none (it waits, and its prefill
        recomputes its prompt and generated tokens before it decodes again)."""
        if not 0 <= num_computed_tokens < req.num_tokens:
            raise SimulationError(
                f"request {req.request_id}: {num_computed_tokens} computed of {req.num_tokens}"
            )
        req.num_computed_tokens = num_computed_tokens
        self._requests.append(req)
        self._adopted.add(req.request_id)
        heapq.heappush(self._heap, (at_ns, _ARRIVAL, next(self._seq), req))

    def _arrive(self, req: SimRequest) -> None:
        computed = req.num_computed_tokens
        if req.request_id in self._adopted:
            self._adopted.discard(req.request_id)
            pool = self.pool
            if computed and pool.blocks_for(computed) <= pool.num_free_blocks:
                pool.allocate(req.request_id, pool.blocks_for(computed))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:
                req.num_computed_tokens = 0
                self._enqueue(req)
            if self.on_adopt is not None:
                self.on_adopt(req)
            else:
                self.policy.on_arrival(req)
            return
        self._enqueue(req)
        self.policy.on_arrival(req)

    def next_event_ns(self) -> int | None:
        """When the engine next has something to do (``None``: nothing until an arrival)."""
        return self._heap[0][0] if self._heap else None

    def advance(self, until_ns: int) -> None:
        """Handle every event up to ``until_ns``: arrivals, step ends, and the steps they start."""
        heap = self._heap
        while heap and heap[0][0] <= until_ns:
            time_ns, kind, _, payload = heapq.heappop(heap)
            self.now_ns = time_ns
            if kind == _ARRIVAL:
                assert payload is not None
                self._arrive(payload)
            else:
                self._finish_step()
                self._busy = False
            if not self._busy and (self.running or self._num_waiting()):
                # Arrivals at this same instant are queued before the step starts.
                if heap and heap[0][0] == time_ns and heap[0][1] == _ARRIVAL:
                    continue
                duration = self._start_step()
                heapq.heappush(heap, (time_ns + duration, _STEP_END, next(self._seq), None))
                self._busy = True
            elif not self._busy:
                self.policy.on_idle()

    def finish(self) -> SimResult:
        """The result, once every request has finished."""
        self.pool.check_integrity()
        if self.running or self._num_waiting():
            raise SimulationError("run ended with requests still queued; this is a bug")
        return SimResult.of_run(
            policy=self.policy.name,
            engine=ENGINE_NAME,
            num_kv_blocks=self.config.num_kv_blocks,
            records=[r.record for r in self._requests],
            samples=self.samples,
            counters=self.counters,
            now_ns=self.now_ns,
            delivery_pace_ns=self.policy.delivery_pace_ns,
        )

    def queued(self) -> list[SimRequest]:
        """The waiting requests, in the order they would be admitted."""
        return self._waiting_head(self._num_waiting())

    # -- queues -------------------------------------------------------------------------------

    def _num_waiting(self) -> int:
        return len(self._waiting_heap) if self.policy.uses_priority else len(self.waiting)

    def _enqueue(self, req: SimRequest, *, front: bool = False) -> None:
        if self.policy.uses_priority:
            heapq.heappush(self._waiting_heap, (_priority_key(req), req))
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _peek_waiting(self) -> SimRequest:
        return self._waiting_heap[0][1] if self.policy.uses_priority else self.waiting[0]

    def _waiting_head(self, n: int) -> list[SimRequest]:
        """The first ``n`` waiting requests, in admission order."""
        if self.policy.uses_priority:
            return [req for _, req in heapq.nsmallest(n, self._waiting_heap)]
        return list(itertools.islice(self.waiting, n))

    def _pop_waiting(self) -> None:
        if self.policy.uses_priority:
            heapq.heappop(self._waiting_heap)
        else:
            self.waiting.popleft()

    # -- one step -----------------------------------------------------------------------------

    def _start_step(self) -> int:
        cfg, pool, step = self.config, self.pool, self.step
        plan = self.policy.plan(self.running, step, pool.num_free_blocks)
        skip: set[str] = set()
        if plan is not None:
            if plan.order is not self.running:
                self.running[:] = plan.order
            skip = {r.request_id for r in plan.skip}
        running = self.running
        budget = cfg.max_num_batched_tokens
        block_size = cfg.block_size_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.request_id in skip:
                i += 1
                continue
            computed = req.num_computed_tokens
            n = min(req.num_tokens - computed, budget)
            # A running request holds ceil(computed / block_size) blocks (what it computed).
            need = -(-(computed + n) // block_size) - -(-computed // block_size)
            while need and need > pool.num_free_blocks:
                victim = self._victim()
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it had to preempt itself: vLLM ends the running pass here
            if need > 0:
                pool.allocate(req.request_id, need)
            scheduled.append((req, n))
            budget -= n
            # The priority policy's victim may precede req in the list (vLLM adjusts its index).
            i = running.index(req) + 1 if self.policy.uses_priority else i + 1
        if not preempted:
            budget = self._admit(scheduled, budget)
        if not scheduled:
            raise SimulationError(
                f"step {step}: nothing could be scheduled ({len(self.running)} running, "
                f"{self._num_waiting()} waiting, {pool.num_free_blocks} free blocks)"
            )
        self._scheduled = scheduled
        num_prefill = num_decode = kv_read = num_tokens = 0
        for req, n in scheduled:
            kv_read += req.num_computed_tokens + n
            num_tokens += n
            # One token for a request whose prompt is computed: a decode row (the last token of
            # a recompute costs the same), as the vLLM engine classifies it.
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                num_decode += 1
            else:
                num_prefill += n
        self.policy.on_step(len(scheduled), num_tokens)
        counters = self.counters
        counters.num_scheduled_rows += len(scheduled)
        counters.num_scheduled_tokens += num_tokens
        shape = BatchShape(num_prefill, num_decode, kv_read, len(scheduled))
        return max(1, self.step_model.step_time_ns(shape))

    def _victim(self) -> SimRequest:
        """vLLM's preemption victim: ``running[-1]`` (FCFS) or the lowest priority, latest."""
        if self.policy.uses_priority:
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _admit(self, scheduled: list[tuple[SimRequest, int]], budget: int) -> int:
        cfg, pool = self.config, self.pool
        limit = cfg.max_num_seqs
        if self._num_waiting():
            head = self._waiting_head(ADMISSION_CANDIDATES)
            if not self.policy.uses_priority:
                order = self.policy.waiting_order(head)
                if order is not None:  # the head of the queue in the policy's order
                    waiting = self.waiting
                    for _ in head:
                        waiting.popleft()
                    waiting.extendleft(reversed(order))
                    head = order
            allowed = self.policy.admissions(self.running, head, pool.num_usable_blocks)
            if allowed is not None:
                limit = min(limit, len(self.running) + allowed)
        while self._num_waiting() and budget > 0 and len(self.running) < limit:
            req = self._peek_waiting()
            num_tokens = req.num_tokens
            hit = 0
            if cfg.enable_prefix_caching:
                hit = pool.num_cached_prefix_tokens(req.request_id, num_tokens)
            n = min(num_tokens - hit, budget)
            # scheduler_reserve_full_isl: the whole sequence so far must fit, cached blocks too.
            if pool.blocks_for(num_tokens) > pool.num_free_blocks:
                break
            self._pop_waiting()
            pool.take_cached_prefix(req.request_id, hit)
            pool.allocate(req.request_id, pool.blocks_for(hit + n) - pool.num_held(req.request_id))
            req.num_computed_tokens = hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _preempt(self, req: SimRequest, scheduled: list[tuple[SimRequest, int]]) -> int:
        """Preempt ``req`` by recompute; returns the token budget it gives back (the priority
        policy may take a request already scheduled this step)."""
        phase = req.phase
        self.counters.on_preempt(phase)
        req.record.on_preempt(phase)
        self.policy.on_preempt(req)
        self.pool.free(req.request_id)
        restored = 0
        for k, (r, n) in enumerate(scheduled):
            if r is req:
                del scheduled[k]
                restored = n
                break
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self._enqueue(req, front=True)
        if self.on_preempted is not None:
            self.on_preempted(req)
        return restored

    def _finish_step(self) -> None:
        now, step, pool = self.now_ns, self.step, self.pool
        caching = self.config.enable_prefix_caching
        block_size = self.config.block_size_tokens
        ids: list[str] = []
        tokens: list[list[int]] = []
        done: list[SimRequest] = []
        running = RequestStatus.RUNNING
        for req, n in self._scheduled:
            if req.status is not running:
                continue
            computed = req.num_computed_tokens + n
            req.num_computed_tokens = computed
            req.num_scheduled_tokens += n
            if caching and computed % block_size < n:  # this step filled a block
                pool.cache(req.request_id, computed)
            stream = req.stream
            num_output = req.num_output_tokens
            if computed == stream.spec.num_prompt_tokens + num_output:
                token = stream.token_at(num_output)
                req.num_output_tokens = num_output + 1
                req.record.on_token(token, now, step)
                ids.append(req.request_id)
                tokens.append([token])
                if num_output + 1 == stream.num_output_tokens:
                    done.append(req)
                elif stream.is_reasoning and num_output == stream.num_think and self.on_answer:
                    self.on_answer(req)  # it generated its </think>
        self._scheduled = []
        if ids:
            self.policy.on_tokens(ids, tokens, step)
        for req in done:
            self._complete(req)
        self.counters.num_steps += 1
        if step % self._sample_every == 0:
            self._sample()
        self.step += 1
        if self._on_progress is not None:
            self._on_progress(self._num_finished)

    def _complete(self, req: SimRequest) -> None:
        record = req.record
        record.finish_ns = self.now_ns
        recomputed = req.num_scheduled_tokens - (req.num_tokens - 1)
        record.num_recomputed_tokens = recomputed
        self.counters.num_recomputed_tokens += recomputed
        self.pool.free(req.request_id)
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        self.policy.on_finish(req)
        self._num_finished += 1
        if self.on_finish is not None:
            self.on_finish(req)

    def _sample(self) -> None:
        pool, block_size = self.pool, self.config.block_size_tokens
        think_blocks = queue_think = 0
        for req in self.running:
            stream = req.stream
            if stream.is_reasoning and req.num_output_tokens <= stream.num_think:  # thinking
                queue_think += 1
                think_blocks += -(-req.num_computed_tokens // block_size)
        self.samples.append(
            TimeSample(
                time_ns=self.now_ns,
                num_kv_blocks_used=pool.num_usable_blocks - pool.num_free_blocks,
                num_kv_blocks_think=think_blocks,
                num_running=len(self.running),
                num_waiting=self._num_waiting(),
                queue_output=len(self.running) - queue_think,
                queue_think=queue_think,
            )
        )
