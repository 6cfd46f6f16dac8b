# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""Meridian's vLLM scheduler: vLLM's ``Scheduler`` with narrow hooks calling the core policy.

Select it with ``--scheduler-cls meridian.vllm.scheduler.MeridianScheduler``. Every decision is
:class:`~meridian.core.policy.MeridianPolicy`'s (the simulator's too); the hooks hand it the
engine's events, never copy ``schedule()``, and run through a :class:`~meridian.vllm.failopen.Guard`
(fail open, timed). Its parts come from :mod:`meridian.vllm.adapter_parts`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from meridian.core.admission import ADMISSION_CANDIDATES
from meridian.core.interface import PolicyStats
from meridian.core.policy import MeridianPolicy, TrackingPolicy
from meridian.core.tracking import UntrackedRequestsError
from meridian.vllm.adapter_parts import UPDATE, AdapterParts
from meridian.vllm.failopen import Guard
from meridian.vllm.runtime import MeridianRuntime

__all__ = [
    "PROMPT_TOKENS_KEY",
    "MeridianAsyncScheduler",
    "MeridianScheduler",
    "MeridianShadowAsyncScheduler",
    "MeridianShadowScheduler",
]

logger = logging.getLogger(__name__)

# Requests that ran to their end (their lengths teach headroom admission).
_COMPLETED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
# The prompt length in a request's kv_transfer_params (with a KV connector): the host tier's
# eviction policy (vllm/offload.py) tells prompt blocks from generated ones by it.
PROMPT_TOKENS_KEY = "meridian_prompt_tokens"


class MeridianScheduler(Scheduler):
    """vLLM's scheduler with Meridian's plan. Contract: Meridian changes only the order of
    ``running`` and skipped requests' ``next_decode_eligible_step``; every request added is
    tracked until it is freed."""

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
        parts = AdapterParts.build(self, meridian_runtime, meridian_clock, logger)
        self.meridian: MeridianRuntime = parts.runtime
        self.meridian_metrics, self.meridian_tracer = parts.metrics, parts.tracer
        self.meridian_policy, self.meridian_overhead = parts.policy, parts.overhead
        self.meridian_stats: PolicyStats = parts.policy.stats
        self.meridian_fail_open, self._publisher = parts.fail_open, parts.publisher
        self._schedule_guard, self._update_guard = parts.schedule_guard, parts.update_guard
        self._stock_schedule, self._stock_update = parts.stock_schedule, parts.stock_update
        self.meridian_step_log, self.meridian_replica_state = parts.step_log, parts.replica_state
        # Added since the last step, not yet tracked (_track_new): (request, added on the clock).
        self._new_requests: dict[str, tuple[Any, float | None]] = {}
        # Freed inside update_from_output, untracked after the step's tokens (None: outside it).
        self._freed: list[Any] | None = None

    @property
    def meridian_policy_errors(self) -> int:
        """Exceptions Meridian's code raised and vLLM never saw (failed open)."""
        return int(self.meridian_fail_open.num_errors)

    @property
    def meridian_num_tracked(self) -> int:
        """Requests Meridian tracks (0 when the engine is idle)."""
        self._track_new()
        return self.meridian_policy.num_tracked

    def _guarded(self, hook: str, rid: str | None = None, field: str | None = UPDATE) -> Guard:
        """``with self._guarded(hook):`` fails open, timed into ``meridian_overhead.<field>``."""
        timed = self.meridian_overhead if field is not None else None
        return Guard(self.meridian_fail_open, hook, rid, timed, field or "")

    # -- vLLM hooks -----------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        is_new = request.request_id not in self.requests
        if is_new and self.meridian_reorders and self.connector is not None:
            params = request.kv_transfer_params or {}
            request.kv_transfer_params = {**params, PROMPT_TOKENS_KEY: request.num_prompt_tokens}
        super().add_request(request)
        if is_new:
            added_at = None  # tracked at the next schedule(), as added now (None: track() reads it)
            with self._guarded("add_request", request.request_id, None):
                added_at = self.meridian_policy.clock()
            self._new_requests[request.request_id] = (request, added_at)

    def _track_new(self) -> None:
        """The policy tracks the requests added since the last step, in one (hot) batch."""
        new, self._new_requests = self._new_requests, {}
        if new:  # each request fails alone
            self._guarded("add_request").each(self._track_one, new.items())

    def _track_one(self, rid: str, added: tuple[Any, float | None]) -> None:
        request, added_at = added
        try:
            budget = self.meridian.request_budget(request.sampling_params)
        except ValueError:
            budget = None  # the logits processor rejects it; here it only feeds a counter
        self.meridian_policy.track(
            rid, request.prompt_token_ids, request.output_token_ids, budget, added_at
        )

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
        """Order ``running`` and the waiting head, defer skips, cap ``max_num_active_reqs``."""
        policy = self.meridian_policy
        pool = self.kv_cache_manager.block_pool
        step = self.current_step + 1  # schedule() increments current_step first
        plan = policy.plan(self.running, step, pool.get_num_free_blocks())
        if plan.order is not self.running:
            self.running[:] = plan.order
        for request in plan.skip:  # schedule() skips while current_step < next_decode_eligible_step
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
        # vLLM starts the requests holding KV blocks (async loads, paused streams) first.
        holding = self.kv_holding_waiting
        candidates = [*holding, *head] if holding else head
        allowed = policy.admissions(self.running, candidates, pool.num_gpu_blocks - 1)
        if allowed is not None:
            # vLLM admits while running + paused streams < max_num_active_reqs (this call).
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
        """The step's new tokens (``{client: EngineCoreOutputs}``, after vLLM's stop checks) to the
        policy in one batch. (Comprehensions: ``attrgetter`` on msgspec structs costs twice.)"""
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
                # Live requests that never passed add_request (vLLM's tests add them by hand):
                # tracked now, their output so far included.
                for rid in exc.request_ids:
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
        """One request's verified drafts (less those a grammar invalidated) also count by phase."""
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
        elif self._freed is not None:  # in update_from_output: untracked after the step's tokens
            self._freed.append(request)
        else:
            self._untrack(request)
        return result

    def _untrack(self, *requests: Any) -> None:
        """Untrack freed requests in one batch; if it fails, one by one (each fails alone)."""
        # A completed request's length teaches headroom admission; an aborted one's not.
        finished = [
            (r.request_id, r.num_output_tokens if r.status in _COMPLETED else None)
            for r in requests
        ]
        with self._guarded("free_request"):
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
    """vLLM's order with Meridian's tracking and counters: an A/B measures the ordering alone."""

    meridian_reorders: ClassVar[bool] = False


class MeridianShadowAsyncScheduler(MeridianShadowScheduler, AsyncScheduler):
    """:class:`MeridianShadowScheduler` for vLLM's asynchronous scheduling."""
