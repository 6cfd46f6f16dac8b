# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""Meridian's vLLM scheduler: a thin adapter of vLLM's ``Scheduler`` over the core policy.

Select it with ``--scheduler-cls meridian.vllm.scheduler.MeridianScheduler`` (or
``MeridianAsyncScheduler``, the GPU default's asynchronous form; the pair follows vLLM's
``DiffusionScheduler``/``DiffusionAsyncScheduler``). Every decision is
:class:`~meridian.core.policy.MeridianPolicy`'s, the object the simulator drives; this class
connects it to narrow vLLM hooks and never copies ``schedule()``:

- ``add_request`` / ``_free_request``: the policy starts (in a batch, at the next ``schedule``) /
  stops tracking the request;
- ``schedule``: ``self.running`` is put in the plan's order (vLLM serves it from the front; its
  FCFS victim ``running[-1]`` is the policy's first choice), skipped requests get
  ``next_decode_eligible_step``, the waiting head is reordered and admission capped; afterwards
  the policy learns the step's shape;
- ``update_from_output``: the step's new tokens (after vLLM's stop checks) go to the policy in
  one batch; verified draft tokens (``make_spec_decoding_stats``) are counted by phase;
- ``_preempt_request``: the policy counts the preemption by phase.

Every hook runs through one guard (:meth:`MeridianScheduler._guarded`,
:class:`~meridian.vllm.failopen.Guard`): an exception in Meridian's code fails open (logged
once per hook and type, counted, vLLM's stock behaviour for the step) and the block's time is
Meridian's overhead. Only start-up configuration errors stop the engine. Configuration comes
from ``$MERIDIAN_CONFIG``/``$MERIDIAN_MODEL`` (:mod:`meridian.vllm.runtime`); the simulator
passes ``meridian_runtime`` and ``meridian_clock`` (virtual time) instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from meridian.core.policy import (
    ADMISSION_CANDIDATES,
    MeridianPolicy,
    PolicyStats,
    TrackingPolicy,
    UntrackedRequestsError,
)
from meridian.errors import ConfigError
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import make_tracer
from meridian.vllm.failopen import FailOpen, Guard
from meridian.vllm.publishing import AdapterStats, MetricsListener, Publisher
from meridian.vllm.replica_state import ReplicaStateWriter
from meridian.vllm.runtime import MeridianRuntime, output_budget_rows, runtime_from_vllm_config
from meridian.vllm.steplog import ENV_STEP_LOG, StepLog

__all__ = [
    "PROMPT_TOKENS_KEY",
    "AdapterStats",
    "MeridianAsyncScheduler",
    "MeridianScheduler",
    "MeridianShadowAsyncScheduler",
    "MeridianShadowScheduler",
]

logger = logging.getLogger(__name__)

# Requests that ran to their end (their lengths teach headroom admission).
_COMPLETED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
# The request's prompt length in its kv_transfer_params, set for a KV connector: Meridian's
# host-tier eviction policy (meridian.vllm.offload.ReasoningFirstPolicy) reads it to tell prompt
# blocks from generated ones. vLLM's scheduler only reads "do_remote_prefill" there.
PROMPT_TOKENS_KEY = "meridian_prompt_tokens"
# The AdapterStats fields a guarded hook's time goes to.
SCHEDULE, UPDATE = "schedule_overhead_s", "update_overhead_s"


class MeridianScheduler(Scheduler):
    """vLLM's scheduler with Meridian's phase-aware plan (module docstring).

    Contract: Meridian never changes which requests are in ``self.running``, only their order
    and, for skipped requests, ``next_decode_eligible_step``. Every request added is tracked
    until it is freed (``meridian_num_tracked`` is 0 when the engine is idle).
    ``meridian_stats`` holds the policy's counters, ``meridian_overhead`` the adapter's.
    """

    #: False in :class:`MeridianShadowScheduler`: track and count, but keep vLLM's order.
    meridian_reorders: ClassVar[bool] = True
    #: The policy this adapter drives (the simulator swaps in its baselines' policies).
    policy_class: ClassVar[type[TrackingPolicy]] = MeridianPolicy
    #: vLLM's cap on running requests, lowered for one ``schedule()`` by headroom admission.
    max_num_active_reqs: int

    def __init__(
        self,
        *args: Any,
        meridian_runtime: MeridianRuntime | None = None,
        meridian_clock: Callable[[], float] = time.perf_counter,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.FCFS:
            raise ConfigError(
                f"MeridianScheduler needs --scheduling-policy fcfs; got "
                f"{self.scheduler_config.policy!r}. Meridian decides the order itself: "
                "drop --scheduling-policy (fcfs is the default) or use vLLM's own scheduler"
            )
        self.meridian: MeridianRuntime = meridian_runtime or runtime_from_vllm_config(
            self.vllm_config
        )
        config = self.meridian.config
        # A registry of its own: several engines may live in one process (tests). Under
        # $PROMETHEUS_MULTIPROC_DIR the values also go to that directory, where the API
        # server's /metrics collects them (the channel `meridian serve` sets up).
        self.meridian_metrics = MeridianMetrics(CollectorRegistry())
        self.meridian_tracer = make_tracer(config.telemetry, metrics=self.meridian_metrics)
        self._listener = MetricsListener(
            self.meridian_metrics,
            self.meridian_tracer,
            self.requests,
            # vLLM stamps arrival_time with time.time(); the simulator passes its clock.
            time.time if meridian_clock is time.perf_counter else meridian_clock,
        )
        self.meridian_policy = self.policy_class.from_config(
            self.meridian.format,
            config.scheduler,
            block_size=self.block_size,
            capacity=self.max_num_running_reqs,
            clock=meridian_clock,
            max_step_tokens=self._max_step_tokens(),
            transition_len=len(self.meridian.transition_ids),
            listener=self._listener,
            output_budget=output_budget_rows(config.scheduler.output_budget_rows),
        )
        self.meridian_overhead = AdapterStats()
        self.meridian_fail_open = FailOpen(
            self.meridian_metrics,
            logger,
            "scheduler",
            context=lambda: f"step={self.current_step} running={len(self.running)}",
        )
        # The per-step guards, built once (Guard.run is reentrant): Meridian's part of schedule()
        # and of update_from_output(), and vLLM's own (less Meridian's hooks inside it: drafts,
        # preemptions).
        fail_open, overhead = self.meridian_fail_open, self.meridian_overhead
        self._schedule_guard = Guard(fail_open, "schedule", None, overhead, SCHEDULE)
        self._update_guard = Guard(fail_open, "update_from_output", None, overhead, UPDATE)
        self._stock_schedule = Guard.time(overhead, "stock_schedule_s")
        self._stock_update = Guard.time(overhead, "stock_update_s", net_of=UPDATE)
        # Bytes of one KV block (all layers), for meridian_kv_used_bytes.
        kv_config = self.kv_cache_config
        capacity = sum(int(t.size) for t in kv_config.kv_cache_tensors)
        self.meridian_metrics.set_kv_capacity_bytes(capacity)
        self._publisher = Publisher(
            self.meridian_metrics,
            self._listener,
            self.meridian_policy,
            self.meridian_overhead,
            self.meridian_fail_open,
            capacity // max(1, kv_config.num_blocks),
        )
        # Requests added since the last step, not yet tracked (_track_new), with the policy's
        # clock when each was added.
        self._new_requests: dict[str, tuple[Any, float | None]] = {}
        # Requests freed inside update_from_output, untracked once the step's tokens are
        # observed (None: outside update_from_output, a freed request is untracked at once).
        self._freed: list[Any] | None = None
        # $MERIDIAN_STEP_LOG: every step's shape and duration, for the simulator's calibration.
        step_log = os.environ.get(ENV_STEP_LOG)
        self.meridian_step_log = StepLog(step_log) if step_log else None
        # $MERIDIAN_REPLICA_STATE: routing stats for a Ray Serve replica, with each publish.
        self.meridian_replica_state = ReplicaStateWriter.attach(self, self._publisher)
        logger.info(
            "Meridian scheduler: model family %s (%s), config %s, reorders=%s",
            self.meridian.model_name,
            self.meridian.reason,
            self.meridian.config_source or "defaults",
            self.meridian_reorders,
        )

    def _max_step_tokens(self) -> int | None:
        """The tokens one step can schedule, for the policy's lazy order; ``None`` (plan every
        change) where a request can need more than its own new tokens: speculative decoding
        (draft slots, lookahead blocks) and models with several KV cache groups."""
        if self.num_spec_tokens or self.num_lookahead_tokens:
            return None
        if len(self.kv_cache_config.kv_cache_groups) != 1:
            return None
        return int(min(self.max_num_scheduled_tokens, self.scheduler_config.max_num_batched_tokens))

    @property
    def meridian_stats(self) -> PolicyStats:
        """The policy's counters (preemptions by phase, answer gaps, deferrals, ...)."""
        return self.meridian_policy.stats

    @property
    def meridian_policy_errors(self) -> int:
        """Exceptions Meridian's code raised and vLLM never saw (failed open)."""
        num_errors: int = self.meridian_fail_open.num_errors
        return num_errors

    @property
    def meridian_num_tracked(self) -> int:
        """Requests Meridian tracks (0 when the engine is idle)."""
        self._track_new()
        return self.meridian_policy.num_tracked

    def _guarded(
        self, hook: str, request_id: str | None = None, field: str | None = UPDATE
    ) -> Guard:
        """``with self._guarded(hook):``: the block fails open and its time goes to
        ``meridian_overhead.<field>`` (``None``: not timed, for a block cheaper than a timer)."""
        timed = self.meridian_overhead if field is not None else None
        return Guard(self.meridian_fail_open, hook, request_id, timed, field or "")

    # -- vLLM hooks -----------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        is_new = request.request_id not in self.requests
        if is_new and self.meridian_reorders and self.connector is not None:
            request.kv_transfer_params = {
                **(request.kv_transfer_params or {}),
                PROMPT_TOKENS_KEY: request.num_prompt_tokens,
            }
        super().add_request(request)
        if is_new:
            # Tracked in a batch at the next schedule() (_track_new), on the clock of now (None:
            # the clock failed; track() reads it itself). One clock read, not worth a timer.
            added_at = None
            with self._guarded("add_request", request.request_id, None):
                added_at = self.meridian_policy.clock()
            self._new_requests[request.request_id] = (request, added_at)

    def _track_new(self) -> None:
        """The policy starts tracking the requests added since the last step, in one batch (a
        burst of arrivals runs the tracking code once, hot)."""
        new = self._new_requests
        if not new:
            return
        self._new_requests = {}
        track, budget_of = self.meridian_policy.track, self.meridian.request_budget
        with self._guarded("add_request"):
            for rid, (request, added_at) in new.items():
                with self._guarded("add_request", rid, None):  # this request fails alone
                    try:
                        budget = budget_of(request.sampling_params)
                    except ValueError:
                        # The logits processor rejects such requests at admission; here the knob
                        # only feeds the inferred-force counter: a bad value is not used.
                        budget = None
                    track(rid, request.prompt_token_ids, request.output_token_ids, budget, added_at)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._new_requests:  # (checked here too: a call less on most steps)
            self._track_new()  # timed as update-side overhead, like the tracking it batches
        active_cap = self.max_num_active_reqs
        if self.meridian_reorders:
            self._schedule_guard.run(self._apply_plan, active_cap)
        overhead = self.meridian_overhead
        overhead.num_steps += 1
        stock = self._stock_schedule
        try:
            if self.meridian_tracer.enabled:
                with self.meridian_tracer.step_span(
                    self.current_step + 1,
                    num_running=len(self.running),
                    num_waiting=len(self.waiting),
                ):
                    output = stock.run(super().schedule, *args, **kwargs)
            else:
                output = stock.run(super().schedule, *args, **kwargs)
        finally:
            self.max_num_active_reqs = active_cap
        if self.meridian_step_log is not None:
            with self._guarded("step_log", field=None):
                self.meridian_step_log.scheduled(output, self.requests)
        tokens = int(getattr(output, "total_num_scheduled_tokens", 0))
        overhead.num_scheduled_tokens += tokens
        if self.meridian_reorders:
            rows = len(getattr(output, "num_scheduled_tokens", ()))
            self._schedule_guard.run(self.meridian_policy.on_step, rows, tokens)
        return output

    def _apply_plan(self, active_cap: int) -> None:
        """Put ``running`` in the plan's order, defer the skipped requests one step, reorder the
        waiting head and cap this step's admissions (``max_num_active_reqs``)."""
        policy = self.meridian_policy
        pool = self.kv_cache_manager.block_pool
        step = self.current_step + 1  # schedule() increments current_step first
        plan = policy.plan(self.running, step, pool.get_num_free_blocks())
        if plan.order is not self.running:
            self.running[:] = plan.order
        for request in plan.skip:
            # schedule() skips a request while current_step < next_decode_eligible_step.
            request.next_decode_eligible_step = max(request.next_decode_eligible_step, step + 1)
        waiting = self.waiting
        if not waiting:
            return
        head = list(itertools.islice(waiting, ADMISSION_CANDIDATES))
        if isinstance(waiting, deque):  # FCFS; a priority queue keeps its order
            order = policy.waiting_order(head)
            if order is not None:
                for _ in head:
                    waiting.popleft()
                waiting.extendleft(reversed(order))
                head = order
        # vLLM starts the requests that hold KV blocks (kv_holding_waiting: async KV loads,
        # paused streaming sessions) before the waiting queue.
        holding = self.kv_holding_waiting
        candidates = [*holding, *head] if holding else head
        allowed = policy.admissions(self.running, candidates, pool.num_gpu_blocks - 1)
        if allowed is not None:
            # vLLM admits while len(running) plus its paused streaming sessions is below
            # max_num_active_reqs: for this call.
            self.max_num_active_reqs = min(
                active_cap, len(self.running) + self.num_waiting_for_streaming_input + allowed
            )

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        self._freed = []
        outputs = None
        try:
            outputs = self._stock_update.run(super().update_from_output, *args, **kwargs)
            return outputs
        finally:
            if outputs:
                self._update_guard.run(self._observe_step, outputs)
            freed, self._freed = self._freed, None
            if freed:
                self._untrack(*freed)
            idle = not self.has_unfinished_requests()
            if idle:
                with self._guarded("on_idle"):
                    self.meridian_policy.on_idle()  # idle until the next request: no step time
                    if self.meridian_step_log is not None:
                        self.meridian_step_log.idle()
            self._publisher.step_done(self.running, idle)  # idle: a publish (the gauges go to 0)

    def _observe_step(self, outputs: dict[int, Any]) -> None:
        """Feed the step's new tokens to the policy in one batch: those of the outputs
        ``update_from_output`` returns (``{client: EngineCoreOutputs}``), after vLLM's stop
        checks, as two aligned lists (ids, tokens). (Plain comprehensions: ``attrgetter`` over
        vLLM's msgspec structs costs twice as much on this cold-cache path.)"""
        if len(outputs) == 1:  # one per front-end client; mostly one
            (client,) = outputs.values()
            outs = client.outputs
        else:
            outs = [out for client in outputs.values() for out in client.outputs]
        ids = [out.request_id for out in outs]
        tokens = [out.new_token_ids for out in outs]
        if not all(tokens):  # not an output without tokens (an error, a pooling result)
            ids = [rid for rid, toks in zip(ids, tokens, strict=True) if toks]
            tokens = [toks for toks in tokens if toks]
        if ids:
            try:
                self.meridian_policy.observe(ids, tokens, self.current_step)
            except UntrackedRequestsError as exc:
                self._adopt(exc.request_ids)

    def _adopt(self, request_ids: list[str]) -> None:
        """Track live requests that got tokens without passing through ``add_request`` (vLLM's
        own tests fill ``requests`` and ``running`` by hand), their output so far included;
        they are Meridian's from the next step on."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished():
                self._new_requests.setdefault(rid, (request, None))
        self._track_new()

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: Any,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: dict[str, int] | None,
        request_id: str,
    ) -> Any:
        """vLLM's accounting of one request's verified drafts (inside ``update_from_output``,
        for a request that had some): the same numbers, drafts a grammar invalidated left out,
        go to the draft counts of the phase the request was in when they were proposed."""
        invalid = num_invalid_spec_tokens.get(request_id, 0) if num_invalid_spec_tokens else 0
        with self._guarded("update_from_output", request_id):
            self._publisher.drafts(request_id, num_draft_tokens - invalid, num_accepted_tokens)
        return super().make_spec_decoding_stats(
            spec_decoding_stats,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            num_invalid_spec_tokens=num_invalid_spec_tokens,
            request_id=request_id,
        )

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        with self._guarded("preempt_request", request.request_id):
            blocks = -(-request.num_computed_tokens // self.block_size)
            self.meridian_policy.on_preempt(request.request_id, blocks)
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._free_request(request, *args, **kwargs)
        if self._new_requests.pop(request.request_id, None) is not None:
            pass  # aborted before its first step: never tracked
        elif self._freed is not None:
            # Finished inside update_from_output: its last tokens are in the step's batch, which
            # is observed once, after every request of the step (update_from_output).
            self._freed.append(request)
        else:
            self._untrack(request)
        return result

    def _untrack(self, *requests: Any) -> None:
        """The policy stops tracking freed requests (their tokens counted, their lengths
        learned), in one timed batch; if it fails, one by one, so that an error in one does not
        stop the others."""
        # A completed request's length teaches headroom admission; an aborted one's not.
        finished = [
            (r.request_id, r.num_output_tokens if r.status in _COMPLETED else None)
            for r in requests
        ]
        batch = self._guarded("free_request")
        with batch:
            self._publisher.count_tokens(requests, done=True)
            self.meridian_policy.untrack_many(finished)
            return
        for rid, num_output_tokens in finished:  # the batch failed open
            with self._guarded("free_request", rid):
                self._publisher.forget(rid)
                self.meridian_policy.untrack(rid, num_output_tokens)


class MeridianAsyncScheduler(MeridianScheduler, AsyncScheduler):
    """:class:`MeridianScheduler` for vLLM's asynchronous scheduling (the GPU default)."""


class MeridianShadowScheduler(MeridianScheduler):
    """Stock vLLM order with Meridian's tracking and counters: the baseline of comparisons.

    It never touches ``self.running``; it counts preemptions by phase and answer gaps exactly
    as :class:`MeridianScheduler` does, so an A/B of the two measures the ordering alone.
    """

    meridian_reorders: ClassVar[bool] = False


class MeridianShadowAsyncScheduler(MeridianShadowScheduler, AsyncScheduler):
    """:class:`MeridianShadowScheduler` for vLLM's asynchronous scheduling."""
