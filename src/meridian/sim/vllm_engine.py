# mypy: disable-error-code="import-not-found,no-any-unimported,misc"
"""vLLM's own scheduler on virtual time: ``meridian bench sim --engine vllm``.

The engine here is vLLM's real v1 ``Scheduler`` (or ``AsyncScheduler``) with its KV cache
manager, prefix caching and chunked prefill; only the model is missing. A fake runner turns
each ``SchedulerOutput`` into a ``ModelRunnerOutput`` whose sampled ids come from each
request's stream (:mod:`meridian.sim.streams`: think tokens, ``</think>``, answer, EOS, forcing
already applied), and a virtual clock advances by the step-time model. Baselines run vLLM's own
classes (FCFS, priority); Meridian runs its shipped ``MeridianScheduler``; Pascal runs the same
adapter over :class:`~meridian.sim.policies.PascalPolicy`.

How the engine core drives a scheduler is mirrored from ``vllm/v1/engine/core.py``: ``step``
(schedule, execute, update) when scheduling is synchronous; ``step_with_batch_queue`` with a
queue of two when asynchronous (step ``k + 1`` is scheduled while step ``k`` runs, so the
scheduler learns step ``k``'s tokens one step late and may schedule one step past an in-flight
EOS: the runner returns a throw-away token for such a row, which vLLM drops).

Virtual time: a step runs on the (virtual) device for the step model's time of its batch; steps
run back to back; a token reaches the user when its step ends. With ``kv_offload_blocks`` the
scheduler has vLLM's real ``OffloadingConnector`` (as ``meridian serve --kv-offload-gib`` sets it
up) and :class:`~meridian.sim.offload.HostLink` models its worker: copies over the host link,
loads that hold their request back, flushes that hold the step back. Arrivals join the
scheduler when the engine core would next see them (before the next ``schedule()`` call).

This module imports vLLM and is used from the vLLM environment (``.venv-vllm``).

Length: the driver owns vLLM's scheduler, the KV connector's host link and the engine core's
step loop, which must stay in one place to keep vLLM's order of calls.
"""

from __future__ import annotations

import logging
import tempfile
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.utils.math_utils import round_up
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from meridian.config.schema import MeridianConfig
from meridian.core.types import Phase
from meridian.sim.engine import EngineConfig, SimulationError
from meridian.sim.offload import HostLink
from meridian.sim.policies import PascalPolicy, PolicySpec, SchedulerKind
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import MAX_REQUEST_TOKENS
from meridian.sim.steptime import BatchShape, StepTimeModel
from meridian.sim.streams import EOS_ID, SIM_FORMAT, Stream
from meridian.vllm.resolve import stand_in_model
from meridian.vllm.runtime import MeridianRuntime
from meridian.vllm.scheduler import MeridianAsyncScheduler, MeridianScheduler
from meridian.vllm.serve import kv_offload_transfer_config
from meridian.vllm.steplog import step_shape

ENGINE_NAME = "vllm"
# The model directory's context limit: as long as any simulated request may be.
MAX_MODEL_LEN = MAX_REQUEST_TOKENS
OFFLOAD_SCHEDULER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
# Consecutive steps that schedule nothing, with nothing else to wait for: a deadlock.
MAX_EMPTY_STEPS = 1000


class PascalScheduler(MeridianScheduler):
    """vLLM's scheduler over Pascal's plan (the same thin adapter as Meridian's)."""

    policy_class = PascalPolicy


class PascalAsyncScheduler(PascalScheduler, AsyncScheduler):
    """:class:`PascalScheduler` for asynchronous scheduling."""


_CLASSES: dict[SchedulerKind, tuple[type[Scheduler], type[Scheduler]]] = {
    SchedulerKind.FCFS: (Scheduler, AsyncScheduler),
    SchedulerKind.PRIORITY: (Scheduler, AsyncScheduler),
    SchedulerKind.MERIDIAN: (MeridianScheduler, MeridianAsyncScheduler),
    SchedulerKind.PASCAL: (PascalScheduler, PascalAsyncScheduler),
}


def _connector_output(done: list[tuple[int, str]]) -> KVConnectorOutput | None:
    """What vLLM's offloading worker reports for the transfer jobs ``done`` (``(job id, request
    id)``, the request id empty for a store): each job completed, each load's request ready."""
    if not done:
        return None
    meta = OffloadingWorkerMetadata()
    recving: set[str] = set()
    for job_id, req_id in done:
        meta.mark_completed(job_id)
        if req_id:
            recving.add(req_id)
    return KVConnectorOutput(
        finished_sending=set(), finished_recving=recving, kv_connector_worker_meta=meta
    )


def model_directory(root: Path) -> Path:
    """A model directory vLLM's config accepts: ``config.json`` only (no weights, no
    tokenizer; the scheduler needs neither), with this simulation's context limit and EOS."""
    return stand_in_model(root, max_position_embeddings=MAX_MODEL_LEN, eos_token_id=EOS_ID)


def build_vllm_config(config: EngineConfig, model_dir: Path, *, priority: bool) -> VllmConfig:
    """vLLM's config for ``config``'s engine shape, on the CPU device (the scheduler runs
    anywhere). The block size is set explicitly: left unset, the CPU platform would pick 128."""
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    scheduler = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        policy="priority" if priority else "fcfs",
    )
    cache = CacheConfig(
        block_size=config.block_size_tokens, enable_prefix_caching=config.enable_prefix_caching
    )
    transfer = None
    if config.kv_offload_blocks:
        # The host tier holds kv_offload_blocks of the scheduler's blocks (their bytes here are
        # the placeholder spec's; the link's copies are timed with the modelled model's).
        chunk = round_up(_kv_spec(config).page_size_bytes, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
        transfer = KVTransferConfig(
            **kv_offload_transfer_config(
                config.kv_offload_blocks * chunk,
                cpu_build=False,
                eviction=config.kv_offload_eviction,
            )
        )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=transfer,
    )
    vllm_config.cache_config.num_gpu_blocks = config.num_kv_blocks
    return vllm_config


def kv_cache_config(config: EngineConfig) -> KVCacheConfig:
    """One full-attention group of ``num_kv_blocks`` blocks (the scheduler never touches the
    tensors, so none are described)."""
    return KVCacheConfig(
        num_blocks=config.num_kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], _kv_spec(config))],
    )


def _kv_spec(config: EngineConfig) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=config.block_size_tokens, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )


@dataclass(slots=True)
class _Live:
    """The runner's view of one request: what it generated, and the work done for it."""

    stream: Stream
    record: RequestRecord
    generated: int = 0
    num_scheduled_tokens: int = 0
    num_wasted_tokens: int = 0  # scheduled past an in-flight EOS (asynchronous scheduling)


@dataclass(slots=True)
class _Step:
    """One scheduled step: its output, sampled tokens and the time it ends on the device."""

    output: Any
    runner_output: ModelRunnerOutput
    tokens: list[tuple[_Live, int]]
    end_ns: int = 0
    index: int = 0


@dataclass(slots=True)
class VllmEngine:
    """Runs one policy's streams through vLLM's scheduler (module docstring)."""

    config: EngineConfig
    step_model: StepTimeModel
    spec: PolicySpec
    meridian_config: MeridianConfig
    output_itl_ns: int
    sample_every_steps: int = 4
    on_progress: Callable[[int], None] | None = None
    now_ns: int = 0
    counters: RunCounters = field(default_factory=RunCounters)
    samples: list[TimeSample] = field(default_factory=list)
    _live: dict[str, _Live] = field(default_factory=dict)
    _num_finished: int = 0
    _num_steps: int = 0
    _link: HostLink | None = None
    #: Called with each request id as its last token is delivered (the cluster's router).
    on_finish: Callable[[str], None] | None = None
    scheduler: Any = None
    # The loop's state (_next): arrivals in time order, the next to admit, the steps in flight
    # (a pop pending once the newest was scheduled), the device's next free time.
    _records: dict[str, RequestRecord] = field(default_factory=dict)
    _arrivals: list[Stream] = field(default_factory=list)
    _times: list[int] = field(default_factory=list)
    _next_arrival: int = 0
    _queue: deque[_Step] = field(default_factory=deque)
    _pending_pop: bool = False
    _device_free_ns: int = 0
    _num_empty: int = 0
    _depth: int = 1
    _fail_open: Any = None
    _hasher: Any = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def run(self, streams: Sequence[Stream]) -> SimResult:
        """Serve every stream to completion."""
        self.start()
        for stream in sorted(streams, key=lambda s: (s.spec.arrival_ns, s.request_id)):
            self.add(stream, stream.spec.arrival_ns)
        while self.next_event_ns() is not None:
            self._next()
        return self.finish([s.request_id for s in streams])

    # -- the engine core's loop, event by event (the cluster simulator drives several) --------

    def start(self) -> None:
        """Build the scheduler; before the first :meth:`add`."""
        config = self.config
        if config.kv_offload_blocks:
            block_bytes = config.kv_bytes_per_token * config.block_size_tokens
            self._link = HostLink(block_bytes, config.host_link_bytes_per_s)
            # A full host tier is a state the simulator explores, not news: vLLM warns once per
            # request and step that cannot store ("cannot store chunks").
            logging.getLogger(OFFLOAD_SCHEDULER_LOGGER).setLevel(logging.ERROR)
        self._tmp = tempfile.TemporaryDirectory(prefix="meridian-vllm-")
        scheduler = self.scheduler = self._scheduler(model_directory(Path(self._tmp.name)))
        if self.config.enable_prefix_caching:
            algo = scheduler.vllm_config.cache_config.prefix_caching_hash_algo
            hash_fn = get_hash_fn_by_name(algo)
            init_none_hash(hash_fn)
            self._hasher = get_request_block_hasher(self.config.block_size_tokens, hash_fn)
        self._depth = 2 if self.config.async_scheduling else 1
        # Meridian's scheduler fails open in serving (vLLM's stock behaviour applies); a run
        # that did would measure the wrong policy, so the simulator stops at the first error.
        self._fail_open = getattr(scheduler, "meridian_fail_open", None)

    def add(self, stream: Stream, at_ns: int) -> None:
        """``stream`` arrives at ``at_ns``: the engine core sees it before its next
        ``schedule()`` from then on (arrivals are added in time order)."""
        self._records[stream.request_id] = RequestRecord.for_stream(stream)
        self._arrivals.append(stream)
        self._times.append(at_ns)

    def next_event_ns(self) -> int | None:
        """When the loop next does something: the end of the oldest step in flight, else now
        (a step to schedule), else the next arrival's time (``None``: idle, nothing queued)."""
        if self._pending_pop:
            return self._queue[-1].end_ns
        if self.scheduler.has_requests() or self._queue:
            return self.now_ns
        if self._next_arrival < len(self._arrivals):
            return max(self.now_ns, self._times[self._next_arrival])
        return None

    def advance(self, until_ns: int) -> None:
        """Run the loop through every event up to ``until_ns``."""
        while (time_ns := self.next_event_ns()) is not None and time_ns <= until_ns:
            self._next()

    def finish(self, order: Sequence[str] | None = None) -> SimResult:
        """The result (records in ``order`` of request ids, else in arrival order)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._link is not None:
            self.counters.num_offload_stored_blocks = self._link.counters.num_stored_blocks
            self.counters.num_offload_loaded_blocks = self._link.counters.num_loaded_blocks
        paced = self.spec.scheduler is SchedulerKind.PASCAL
        ids = order if order is not None else [s.request_id for s in self._arrivals]
        return SimResult.of_run(
            policy=self.spec.name,
            engine=ENGINE_NAME,
            num_kv_blocks=self.config.num_kv_blocks,
            records=[self._records[rid] for rid in ids],
            samples=self.samples,
            counters=self.counters,
            now_ns=self.now_ns,
            delivery_pace_ns=self.output_itl_ns if paced else None,
        )

    def _scheduler(self, model_dir: Path) -> Scheduler:
        kind = self.spec.scheduler
        vllm_config = build_vllm_config(
            self.config, model_dir, priority=kind is SchedulerKind.PRIORITY
        )
        cls = _CLASSES[kind][int(self.config.async_scheduling)]
        kwargs: dict[str, Any] = {}
        if issubclass(cls, MeridianScheduler):
            kwargs["meridian_runtime"] = MeridianRuntime(
                self.meridian_config, None, "sim", SIM_FORMAT, None, "the simulator's streams"
            )
            kwargs["meridian_clock"] = lambda: self.now_ns / 1e9
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config(self.config),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.config.block_size_tokens,
            log_stats=False,
            **kwargs,
        )

    def _admit_until(self, time_ns: int) -> None:
        """Arrivals up to ``time_ns`` join the scheduler."""
        end = bisect_right(self._times, time_ns, lo=self._next_arrival)
        for stream in self._arrivals[self._next_arrival : end]:
            self._add(self.scheduler, stream, self._records[stream.request_id], self._hasher)
        self._next_arrival = end

    def _next(self) -> None:
        """One event of ``vllm/v1/engine/core.py``'s loop: at ``now``, admit the arrivals and
        schedule a step (``step_with_batch_queue`` schedules a second one before waiting on the
        first); at the end of the oldest step in flight, its output and
        ``update_from_output``."""
        scheduler, queue = self.scheduler, self._queue
        if self._pending_pop:
            self._pending_pop = False
            done = queue.pop()
            self.now_ns = max(self.now_ns, done.end_ns)
            self._deliver(done)
            scheduler.update_from_output(done.output, done.runner_output)
            if self._fail_open is not None and self._fail_open.num_errors:
                raise SimulationError(
                    f"Meridian's policy raised an exception in {self.spec.name!r} (logged "
                    "above): the run would measure vLLM's stock behaviour, not the policy"
                )
            if not scheduler.has_requests() and self._next_arrival < len(self._arrivals):
                self.now_ns = max(self.now_ns, self._times[self._next_arrival])
            return
        self._admit_until(self.now_ns)
        if not scheduler.has_requests() and not queue:
            self.now_ns = self._times[self._next_arrival]  # idle until the next arrival
            return
        if scheduler.has_requests():
            step = self._schedule(scheduler, max(self.now_ns, self._device_free_ns))
            self._device_free_ns = step.end_ns
            scheduled = step.tokens or step.output.total_num_scheduled_tokens
            self._num_empty = 0 if scheduled else self._num_empty + 1
            if self._num_empty > MAX_EMPTY_STEPS:
                raise SimulationError(
                    f"the scheduler scheduled nothing {self._num_empty} times in a row "
                    f"({len(scheduler.running)} running, {len(scheduler.waiting)} waiting)"
                )
            queue.appendleft(step)
            if len(queue) < self._depth and step.output.total_num_scheduled_tokens:
                return  # the next schedule() comes before waiting on this step
        self._pending_pop = True

    def _add(
        self, scheduler: Scheduler, stream: Stream, record: RequestRecord, hasher: Any
    ) -> None:
        params = SamplingParams(max_tokens=stream.max_tokens)
        params.update_from_generation_config({}, EOS_ID)
        index = len(self._live)
        request = Request(
            request_id=stream.request_id,
            prompt_token_ids=stream.prompt_token_ids(index),
            sampling_params=params,
            pooling_params=None,
            arrival_time=stream.spec.arrival_ns / 1e9,
            priority=1 if stream.is_reasoning else 0,
            block_hasher=hasher,
        )
        self._live[stream.request_id] = _Live(stream, record)
        scheduler.add_request(request)

    def _schedule(self, scheduler: Scheduler, start_ns: int) -> _Step:
        """Schedule one step at ``start_ns`` and run the fake model on it."""
        now_before = self.now_ns
        self.now_ns = start_ns
        output = scheduler.schedule()
        self.now_ns = max(now_before, self.now_ns)
        link = self._link
        if link is not None:  # the step waits for the stores it must flush
            start_ns = link.start_step(output.kv_connector_metadata, start_ns)
        for rid in output.preempted_req_ids:
            phase = self.phase(rid)
            self.counters.on_preempt(phase)
            self._live[rid].record.on_preempt(phase)
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        tokens: list[tuple[_Live, int]] = []
        for rid in req_ids:
            n = output.num_scheduled_tokens[rid]
            request = scheduler.requests[rid]
            live = self._live[rid]
            live.num_scheduled_tokens += n
            if request.is_prefill_chunk:
                sampled.append([])
            elif live.generated >= live.stream.num_output_tokens:
                live.num_wasted_tokens += n
                sampled.append([EOS_ID])  # past an in-flight EOS: vLLM drops it
            else:
                token = live.stream.token_at(live.generated)
                live.generated += 1
                sampled.append([token])
                tokens.append((live, token))
        duration = 1
        if req_ids:
            # Counted as a live engine's step log counts it (meridian.vllm.steplog).
            shape = BatchShape(*step_shape(output.num_scheduled_tokens, scheduler.requests))
            duration = max(1, self.step_model.step_time_ns(shape))
            self.counters.num_steps += 1
            self.counters.num_scheduled_rows += len(req_ids)
            self.counters.num_scheduled_tokens += output.total_num_scheduled_tokens
        elif link is not None and (finish_ns := link.next_finish_ns()) is not None:
            duration = max(1, finish_ns - start_ns)  # nothing to run until a copy ends
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=None
            if link is None
            else _connector_output(link.end_step(start_ns + duration)),
        )
        step = _Step(output, runner_output, tokens, start_ns + duration, self._num_steps)
        if req_ids:
            self._num_steps += 1
            if step.index % self.sample_every_steps == 0:
                self._sample(scheduler, start_ns)
        return step

    def phase(self, request_id: str) -> Phase:
        """The phase of a request the scheduler holds, by the tokens it has been given."""
        request = self.scheduler.requests.get(request_id)
        live = self._live[request_id]
        delivered = len(request.output_token_ids) if request is not None else live.generated
        stream = live.stream
        thinking = stream.is_reasoning and delivered <= stream.num_think
        return Phase.THINK if thinking else Phase.OUTPUT

    def _deliver(self, step: _Step) -> None:
        """The step ended: its tokens reach the user; finished requests are accounted."""
        for live, token in step.tokens:
            record = live.record
            record.on_token(token, step.end_ns, step.index)
            if live.generated == live.stream.num_output_tokens and token == EOS_ID:
                self._finish(live, step.end_ns)

    def _finish(self, live: _Live, now_ns: int) -> None:
        record = live.record
        record.finish_ns = now_ns
        final_tokens = live.stream.spec.num_prompt_tokens + live.stream.num_output_tokens
        # Work beyond computing each token once (the last one is sampled, never computed).
        recomputed = live.num_scheduled_tokens - live.num_wasted_tokens - (final_tokens - 1)
        record.num_recomputed_tokens = recomputed
        self.counters.num_recomputed_tokens += recomputed
        self._num_finished += 1
        if self.on_progress is not None:
            self.on_progress(self._num_finished)
        if self.on_finish is not None:
            self.on_finish(live.stream.request_id)

    def _sample(self, scheduler: Scheduler, time_ns: int) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        block_size = self.config.block_size_tokens
        think_blocks = queue_think = 0
        for request in scheduler.running:
            stream = self._live[request.request_id].stream
            if stream.is_reasoning and len(request.output_token_ids) <= stream.num_think:
                queue_think += 1
                think_blocks += -(-request.num_computed_tokens // block_size)
        num_running = len(scheduler.running)
        self.samples.append(
            TimeSample(
                time_ns=time_ns,
                num_kv_blocks_used=pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                num_kv_blocks_think=think_blocks,
                num_running=num_running,
                num_waiting=len(scheduler.waiting),
                queue_output=num_running - queue_think,
                queue_think=queue_think,
            )
        )
