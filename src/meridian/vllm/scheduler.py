# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""Meridian's vLLM scheduler: a thin adapter of vLLM's ``Scheduler`` over the core policy.

Select it with ``--scheduler-cls meridian.vllm.scheduler.MeridianScheduler`` (or
``MeridianAsyncScheduler`` where vLLM schedules asynchronously, the GPU default). The pair
follows vLLM's own ``DiffusionScheduler``/``DiffusionAsyncScheduler`` pattern: the sync class
holds all the logic, the async one only mixes in ``AsyncScheduler``.

Every decision is :class:`~meridian.core.policy.MeridianPolicy`'s, the same object the simulator
drives; this class only connects it to a few narrow vLLM hooks and never copies ``schedule()``:

- ``add_request`` / ``_free_request``: the policy starts (in a batch, at the next
  ``schedule``) / stops tracking the request (every finished or aborted request passes through
  ``_free_request``);
- ``schedule``: before ``super().schedule()``, ``self.running`` is set to the plan's order
  (vLLM serves it from the front and its FCFS preemption takes ``running[-1]``, the policy's
  first-choice victim) and the plan's skipped requests get ``next_decode_eligible_step``;
  afterwards the policy learns the step's shape (decode-only steps time the output budget);
- ``update_from_output``: the step's new tokens, read from the outputs it returns (after
  vLLM's stop checks), go to the policy in one batch;
- ``_preempt_request``: the policy counts the preemption by phase.

Fail open: an exception in Meridian's code is logged once per hook and error type with its
context, counted in ``meridian_overhead.policy_errors``, and the step runs with vLLM's stock
order. Only configuration errors found at start-up (a non-FCFS policy, a bad meridian.toml, a
named model family that does not fit the tokenizer) stop the engine, with a clear message.

The scheduler runs in the engine-core process; it derives everything from the token stream and
``$MERIDIAN_CONFIG``/``$MERIDIAN_MODEL`` (:mod:`meridian.vllm.runtime`). The simulator builds
it with the ``meridian_runtime`` and ``meridian_clock`` keywords instead (its config and
model, and virtual time).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from prometheus_client import CollectorRegistry
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from meridian.core.policy import (
    ADMISSION_CANDIDATES,
    MeridianPolicy,
    PolicyStats,
    UntrackedRequestsError,
    output_budget_setting,
)
from meridian.core.types import ForceReason, Phase, PhaseEvent, Tier
from meridian.errors import ConfigError
from meridian.telemetry import catalogue as cat
from meridian.telemetry.catalogue import MetricSpec
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import Tracer, make_tracer
from meridian.vllm.runtime import MeridianRuntime, parse_request_budget, runtime_from_vllm_config

__all__ = [
    "ENV_OUTPUT_BUDGET_ROWS",
    "PROMPT_TOKENS_KEY",
    "AdapterStats",
    "MeridianAsyncScheduler",
    "MeridianScheduler",
    "MeridianShadowScheduler",
]

logger = logging.getLogger(__name__)

# Rows per step that keep answer streams within scheduler.output_tpot_budget_ms: the config's
# scheduler.output_budget_rows, overridden by this variable (it reaches the engine-core process
# like $MERIDIAN_CONFIG). "auto": measured (meridian.core.stepfit); 0: the whole batch.
ENV_OUTPUT_BUDGET_ROWS = "MERIDIAN_OUTPUT_BUDGET_ROWS"
# Requests that ran to their end (their lengths teach headroom admission).
_COMPLETED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
# The request's prompt length in its kv_transfer_params, set for a KV connector: Meridian's
# host-tier eviction policy (meridian.vllm.offload.ReasoningFirstPolicy) reads it to tell prompt
# blocks from generated ones. vLLM's scheduler only reads "do_remote_prefill" there.
PROMPT_TOKENS_KEY = "meridian_prompt_tokens"
# meridian_schedule_overhead_seconds samples, and with them the other metrics, are published in
# batches: at most every PUBLISH_INTERVAL_S seconds of the scheduler's clock (a scrape interval
# is several seconds), checked every OVERHEAD_SAMPLES_PER_PUBLISH steps, and when the engine idles.
OVERHEAD_SAMPLES_PER_PUBLISH = 32
PUBLISH_INTERVAL_S = 1.0


def _output_budget(configured: int | Literal["auto"]) -> int | Literal["auto"] | None:
    """The output budget in force: rows, ``None`` (the whole batch) or ``"auto"``."""
    raw = os.environ.get(ENV_OUTPUT_BUDGET_ROWS, "").strip()
    if not raw:
        return output_budget_setting(configured)
    if raw == "auto":
        return "auto"
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ConfigError(
            f'${ENV_OUTPUT_BUDGET_ROWS} must be "auto" or a number of rows >= 0; got {raw!r}'
        )
    return output_budget_setting(rows)


@dataclass(slots=True)
class AdapterStats:
    """The adapter's own counters: steps, work, Meridian's time against vLLM's, errors.

    ``num_scheduled_tokens`` is the engine's work: every token computed, recomputation after
    preemptions included. Meridian's time: ``schedule_overhead_s`` before each ``schedule()``
    (the plan, gauges) and ``update_overhead_s`` in token accounting and request tracking;
    vLLM's: ``stock_schedule_s`` in ``schedule()``, ``stock_update_s`` in
    ``update_from_output()`` (Meridian's part taken out).
    """

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    policy_errors: int = 0
    schedule_overhead_s: float = 0.0
    stock_schedule_s: float = 0.0
    update_overhead_s: float = 0.0
    stock_update_s: float = 0.0


class _Telemetry:
    """The policy's listener: Meridian's metrics and (optionally) OTLP spans.

    ``requests`` is the scheduler's table (for a request's ``arrival_time``) and ``now`` the
    clock ``arrival_time`` is on: wall time in vLLM, the simulator's virtual time there.
    Histogram observations and hard-cap forces are measured when they happen and kept until
    :meth:`publish` (the scheduler publishes at most every ``PUBLISH_INTERVAL_S`` and when it
    idles): one update per histogram and batch costs less than one per request.
    """

    def __init__(
        self,
        metrics: MeridianMetrics,
        tracer: Tracer,
        requests: dict[str, Any],
        now: Callable[[], float],
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.requests = requests
        self.now = now
        # Phase events (request_started, phase_event) feed only the traces: without them the
        # policy spares building and sending them.
        self.phase_events = tracer.enabled
        # When each request's think phase ended (TTOT runs from there to its first answer),
        # and when its reasoning started (its first reasoning token).
        self._think_ended_at: dict[str, float] = {}
        self._reasoning_from: dict[str, float] = {}
        # Observations not yet published, (value, count), by histogram (a list each, held
        # directly: a MetricSpec key is hashed field by field), and hard-cap forces.
        self._ttfvt: list[tuple[float, int]] = []
        self._ttot: list[tuple[float, int]] = []
        self._itl: list[tuple[float, int]] = []
        self._reasoning: list[tuple[float, int]] = []
        self._think_tokens: list[tuple[float, int]] = []
        self._pending: tuple[tuple[MetricSpec, list[tuple[float, int]]], ...] = (
            (cat.TTFVT, self._ttfvt),
            (cat.TTOT, self._ttot),
            (cat.OUTPUT_ITL, self._itl),
            (cat.REASONING_SECONDS, self._reasoning),
            (cat.THINK_TOKENS, self._think_tokens),
        )
        self._num_hard_caps = 0

    def publish(self) -> None:
        """Put the observations kept so far on the metrics."""
        metrics = self.metrics
        for spec, pending in self._pending:
            if pending:
                metrics.observe_counted(spec, pending)
                pending.clear()
        if self._num_hard_caps:
            metrics.count_force(ForceReason.HARD_CAP, self._num_hard_caps)
            self._num_hard_caps = 0

    def reasoning_started(self, request_id: str) -> None:
        self._reasoning_from[request_id] = self.now()

    def first_answer(self, request_id: str) -> None:
        now = self.now()
        request = self.requests.get(request_id)
        if request is not None:
            self._ttfvt.append((max(0.0, now - request.arrival_time), 1))
        ended = self._think_ended_at.pop(request_id, None)
        if ended is not None:
            self._ttot.append((max(0.0, now - ended), 1))

    def answer_gaps(self, seconds: float, count: int) -> None:
        self._itl.append((seconds, count))

    def request_started(self, request_id: str) -> None:
        self.tracer.request_started(request_id)  # (called only while tracing: phase_events)

    def request_finished(self, request_id: str) -> None:
        self._think_ended_at.pop(request_id, None)
        self._reasoning_from.pop(request_id, None)
        if self.tracer.enabled:
            self.tracer.request_finished(request_id)

    def phase_event(self, request_id: str, event: PhaseEvent) -> None:
        self.tracer.phase_event(request_id, event)  # (called only while tracing: phase_events)

    def preempted(self, phase: Phase, num_blocks: int) -> None:
        self.metrics.count_preemption(phase)
        if num_blocks:
            # Recompute frees the victim's blocks: an eviction of its phase's tier (an answer
            # stream's also counts as OutputCritical blocks lost).
            tier = Tier.OUTPUT_CRITICAL if phase is Phase.OUTPUT else Tier.THINK_ACTIVE
            self.metrics.count_kv_eviction(tier, num_blocks)

    def think_ended(self, request_id: str, num_think_tokens: int, hard_cap: bool) -> None:
        now = self._think_ended_at[request_id] = self.now()
        started = self._reasoning_from.pop(request_id, None)
        if started is not None:
            self._reasoning.append((max(0.0, now - started), 1))
        self._think_tokens.append((num_think_tokens, 1))
        self._num_hard_caps += hard_cap


class _Guard:
    """``MeridianScheduler._guarded``: a plain context manager (cheaper than a generator one on
    this per-step path)."""

    __slots__ = ("hook", "request_id", "scheduler", "start", "timed")

    def __init__(
        self, scheduler: MeridianScheduler, hook: str, request_id: str | None, timed: bool
    ) -> None:
        self.scheduler = scheduler
        self.hook = hook
        self.request_id = request_id
        self.timed = timed
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        scheduler = self.scheduler
        if self.timed:
            scheduler.meridian_overhead.update_overhead_s += time.perf_counter() - self.start
        if isinstance(exc, Exception):
            scheduler._policy_error(self.hook, exc, self.request_id)
            return True  # fail open: the step goes on with vLLM's stock behaviour
        return False


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
    policy_class: ClassVar[type[MeridianPolicy]] = MeridianPolicy
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
        self._telemetry = _Telemetry(
            self.meridian_metrics,
            self.meridian_tracer,
            self.requests,
            # vLLM stamps arrival_time with time.time(); the simulator passes its clock.
            time.time if meridian_clock is time.perf_counter else meridian_clock,
        )
        self.meridian_policy = self.policy_class(
            self.meridian.model,
            config.scheduler,
            block_size=self.block_size,
            capacity=self.max_num_running_reqs,
            output_budget=_output_budget(config.scheduler.output_budget_rows),
            clock=meridian_clock,
            transition_len=len(self.meridian.transition_ids),
            listener=self._telemetry,
            admission=config.scheduler.admission,
            max_step_tokens=self._step_token_budget(),
        )
        self.meridian_overhead = AdapterStats()
        # Bytes of one KV block (all layers), for meridian_kv_used_bytes; 0 where unknown.
        kv_config = self.kv_cache_config
        capacity = sum(int(t.size) for t in kv_config.kv_cache_tensors)
        self._kv_block_bytes = capacity // max(1, kv_config.num_blocks)
        self.meridian_metrics.set_kv_capacity_bytes(capacity)
        self._logged_errors: set[tuple[str, str]] = set()
        # Requests added since the last step, not yet tracked (_track_new), with the policy's
        # clock when each was added.
        self._new_requests: dict[str, tuple[Any, float]] = {}
        # Requests freed inside update_from_output, untracked once the step's tokens are
        # observed (None: outside update_from_output, a freed request is untracked at once).
        self._freed: list[Any] | None = None
        # The gauge values last written by _publish_gauges (None: nothing written yet), and the
        # setters of those gauges, in the same order.
        self._published_gauges: tuple[int, ...] | None = None
        metrics = self.meridian_metrics
        self._gauge_setters: tuple[Callable[[int], None], ...] = (
            metrics.set_tracked_requests,
            functools.partial(metrics.set_queue_depth, Phase.OUTPUT),
            functools.partial(metrics.set_queue_depth, Phase.THINK),
            functools.partial(metrics.set_batch_size, Phase.OUTPUT),
            functools.partial(metrics.set_batch_size, Phase.THINK),
        )
        self._published_revision = -1
        # (think, answer) tokens of each live request already on meridian_generated_tokens_total.
        self._tokens_counted: dict[str, tuple[int, int]] = {}
        # Per-step overhead samples not yet published, (seconds, 1) each (_sample_overhead).
        self._overhead_samples: list[tuple[float, int]] = []
        # (think, answer) tokens counted but not yet on meridian_generated_tokens_total.
        self._uncounted = (0, 0)
        self._sampled_overhead_s = 0.0
        self._published_at = self.meridian_policy.clock()
        logger.info(
            "Meridian scheduler: model family %s (%s), config %s, reorders=%s",
            self.meridian.model_name,
            self.meridian.reason,
            self.meridian.config_source or "defaults",
            self.meridian_reorders,
        )

    def _step_token_budget(self) -> int | None:
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
    def meridian_num_tracked(self) -> int:
        """Requests Meridian tracks (0 when the engine is idle)."""
        self._track_new()
        return self.meridian_policy.num_tracked

    def meridian_phase(self, request_id: str) -> Phase:
        """The phase Meridian tracks for a live request."""
        self._track_new()
        return self.meridian_policy.phase(request_id)

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
            # Tracked in a batch at the next schedule() (_track_new), on the clock of now.
            start = time.perf_counter()
            self._new_requests[request.request_id] = (request, self.meridian_policy.clock())
            self.meridian_overhead.update_overhead_s += time.perf_counter() - start

    def _track_new(self) -> None:
        """The policy starts tracking the requests added since the last step, in one batch (a
        burst of arrivals then runs the tracking code once, hot, not once per request)."""
        new = self._new_requests
        if not new:
            return
        self._new_requests = {}
        track = self.meridian_policy.track
        with self._guarded("add_request"):
            for rid, (request, added_at) in new.items():
                try:  # fail open for this request, track the others
                    try:
                        budget = parse_request_budget(
                            getattr(request.sampling_params, "extra_args", None)
                        )
                    except ValueError:
                        # The logits processor rejects such requests at admission; here the
                        # knob only feeds the inferred-force counter: a bad value is not used.
                        budget = None
                    track(
                        rid,
                        request.prompt_token_ids,
                        request.output_token_ids,
                        budget,
                        tracked_at=added_at,
                    )
                except Exception as exc:
                    self._policy_error("add_request", exc, rid)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._track_new()  # timed as update-side overhead, like the tracking it batches
        overhead = self.meridian_overhead
        start = time.perf_counter()
        active_cap = self.max_num_active_reqs
        if self.meridian_reorders:
            try:  # fail open (as _guarded, without its object on this per-step path)
                pool = self.kv_cache_manager.block_pool
                step = self.current_step + 1  # schedule() increments current_step first
                plan = self.meridian_policy.plan(self.running, step, pool.get_num_free_blocks())
                if plan.order is not self.running:
                    self.running[:] = plan.order
                for request in plan.skip:
                    # schedule() skips a request while current_step < next_decode_eligible_step.
                    request.next_decode_eligible_step = max(
                        request.next_decode_eligible_step, step + 1
                    )
                if self.waiting:
                    head = list(itertools.islice(self.waiting, ADMISSION_CANDIDATES))
                    if isinstance(self.waiting, deque):  # FCFS; a priority queue keeps its order
                        head = self.meridian_policy.reorder_waiting(self.waiting, head)
                    # vLLM starts the requests that hold KV blocks (kv_holding_waiting: async
                    # KV loads, paused streaming sessions) before the waiting queue.
                    holding = self.kv_holding_waiting
                    candidates = [*holding, *head] if holding else head
                    allowed = self.meridian_policy.admissions(
                        self.running, candidates, pool.num_gpu_blocks - 1
                    )
                    if allowed is not None:
                        # vLLM admits while len(running) plus its paused streaming sessions is
                        # below max_num_active_reqs: for this call.
                        self.max_num_active_reqs = min(
                            active_cap,
                            len(self.running) + self.num_waiting_for_streaming_input + allowed,
                        )
            except Exception as exc:
                self._policy_error("schedule", exc)
        overhead.num_steps += 1
        stock_start = time.perf_counter()
        overhead.schedule_overhead_s += stock_start - start
        try:
            if self.meridian_tracer.enabled:
                with self.meridian_tracer.step_span(
                    self.current_step + 1,
                    num_running=len(self.running),
                    num_waiting=len(self.waiting),
                ):
                    output = super().schedule(*args, **kwargs)
            else:
                output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs = active_cap
        overhead.stock_schedule_s += time.perf_counter() - stock_start
        tokens = int(getattr(output, "total_num_scheduled_tokens", 0))
        overhead.num_scheduled_tokens += tokens
        if self.meridian_reorders:
            rows = len(getattr(output, "num_scheduled_tokens", ()))
            on_step = time.perf_counter()
            self.meridian_policy.on_step(rows, tokens)
            overhead.schedule_overhead_s += time.perf_counter() - on_step
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        overhead = self.meridian_overhead
        start, ours_before = time.perf_counter(), overhead.update_overhead_s
        self._freed = []
        outputs = None
        try:
            outputs = super().update_from_output(*args, **kwargs)
            return outputs
        finally:
            self._observe_step(outputs)
            freed, self._freed = self._freed, None
            if freed:
                self._untrack(*freed)
            if not self.has_unfinished_requests():
                idle = time.perf_counter()
                self.meridian_policy.on_idle()  # idle until the next request: no step time
                self._publish_gauges()  # nothing runs: the batch sizes go to 0 now
                overhead.update_overhead_s += time.perf_counter() - idle
            ours = overhead.update_overhead_s - ours_before
            overhead.stock_update_s += time.perf_counter() - start - ours
            self._sample_overhead()

    def _observe_step(self, outputs: dict[int, Any] | None) -> None:
        """Feed the step's new tokens to the policy in one batch: those of the outputs
        ``update_from_output`` returns (``{client: EngineCoreOutputs}``), after vLLM's stop
        checks; on the common step (the same answer streams as the step before) only their ids
        (``observe_steady``), on the others the ids and the tokens as two aligned lists
        (``observe_rows``, which counts a steady batch's thinking rows in bulk).
        (Comprehensions: ``attrgetter`` over vLLM's msgspec structs costs twice as much.)"""
        if not outputs:
            return
        start = time.perf_counter()
        try:  # fail open (as _guarded, without its object on this per-step path)
            policy, step = self.meridian_policy, self.current_step
            clients = list(outputs.values())  # one per front-end client; mostly one
            outs = (
                clients[0].outputs
                if len(clients) == 1
                else [out for client in clients for out in client.outputs]
            )
            # Not an output without tokens (an error, a pooling result).
            ids = [out.request_id for out in outs if out.new_token_ids]
            if ids and not policy.observe_steady(ids, step):
                policy.observe_rows(
                    ids, [out.new_token_ids for out in outs if out.new_token_ids], step
                )
        except UntrackedRequestsError as exc:
            self._adopt(exc.request_ids)
        except Exception as exc:
            self._policy_error("update_from_output", exc)
        finally:
            self.meridian_overhead.update_overhead_s += time.perf_counter() - start

    def _adopt(self, request_ids: list[str]) -> None:
        """Track live requests that got tokens without passing through ``add_request``, their
        output so far included. vLLM adds requests only there, but its own tests fill
        ``requests`` and ``running`` by hand; tracked now, they are Meridian's from the next
        step on (a tracking error is still one)."""
        clock = self.meridian_policy.clock()
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished():
                self._new_requests.setdefault(rid, (request, clock))
        self._track_new()

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
        learned), in one timed batch; if it fails, one by one, so an error in one does not
        stop the others."""
        with self._guarded("free_request"):
            # A completed request's length teaches headroom admission; an aborted one's not.
            finished = [
                (r.request_id, r.num_output_tokens if r.status in _COMPLETED else None)
                for r in requests
            ]
            try:
                self._count_tokens(requests, done=True)
                self.meridian_policy.untrack_many(finished)
                return
            except Exception as exc:
                self._policy_error("free_request", exc)
            for request, (rid, num_output_tokens) in zip(requests, finished, strict=True):
                try:
                    self._tokens_counted.pop(rid, None)
                    self.meridian_policy.untrack(rid, num_output_tokens)
                except Exception as exc:
                    self._policy_error("free_request", exc, request.request_id)

    def _sample_overhead(self) -> None:
        """One ``meridian_schedule_overhead_seconds`` sample per step, published in batches (and
        with each batch, the KV held (:meth:`_publish_kv`), the tokens by phase generated since
        the last one (:meth:`_count_tokens`), the listener's observations and the gauges
        (:meth:`_publish_gauges`)).

        A sample is Meridian's time since the previous one (plans, gauges, token accounting,
        tracking). Publishing a histogram sample on every step cost more than the rest of a
        quiet step's work (cold caches after the model's forward pass), and a publish (a pass
        over the running requests, every histogram and gauge) costs several steps' work, so
        they are published when ``PUBLISH_INTERVAL_S`` has passed since the last publish
        (checked every ``OVERHEAD_SAMPLES_PER_PUBLISH`` steps) and whenever the engine idles.
        """
        overhead = self.meridian_overhead
        total = overhead.schedule_overhead_s + overhead.update_overhead_s
        samples = self._overhead_samples
        samples.append((total - self._sampled_overhead_s, 1))
        self._sampled_overhead_s = total
        policy = self.meridian_policy
        if (
            len(samples) % OVERHEAD_SAMPLES_PER_PUBLISH == 0
            and policy.clock() - self._published_at >= PUBLISH_INTERVAL_S
        ) or not policy.num_tracked:
            self._published_at = policy.clock()
            with self._guarded("stat_logger"):
                metrics = self.meridian_metrics
                metrics.observe_counted(cat.SCHEDULE_OVERHEAD, samples)
                self._publish_kv()
                self._count_tokens(self.running)
                think, answer = self._uncounted
                if think:
                    metrics.count_generated_tokens(Phase.THINK, think)
                if answer:
                    metrics.count_generated_tokens(Phase.OUTPUT, answer)
                self._uncounted = (0, 0)
                self._telemetry.publish()
                self._publish_gauges()
            samples.clear()

    def _publish_kv(self) -> None:
        """KV the running requests hold, in blocks by phase and in bytes by tier: thinking
        (and prefilling) requests' under ``think``/``think_active``, answer streams' (prompt and
        reasoning included: the answer attends over them) under ``output``/``output_critical``;
        ``think_complete`` stays 0 inside vLLM.
        Counted from computed tokens (a shared prefix block counts once per holder)."""
        thinking, answering = self.meridian_policy.blocks_by_phase(self.running)
        metrics, size = self.meridian_metrics, self._kv_block_bytes
        metrics.set_kv_blocks(Phase.THINK, thinking)
        metrics.set_kv_blocks(Phase.OUTPUT, answering)
        metrics.set_kv_used_bytes(Tier.THINK_ACTIVE, thinking * size)
        metrics.set_kv_used_bytes(Tier.OUTPUT_CRITICAL, answering * size)

    def _count_tokens(self, requests: Iterable[Any], done: bool = False) -> None:
        """Add what ``requests`` generated since each was last counted to the tokens by phase
        not yet published (``_uncounted``); ``done``: they are leaving (forget their counts)."""
        tokens_by_phase, counted = self.meridian_policy.tokens_by_phase, self._tokens_counted
        settle = counted.pop if done else counted.get
        new_think, new_answer = self._uncounted
        for request in requests:
            rid = request.request_id
            tokens = tokens_by_phase(rid, request.num_output_tokens)
            if tokens is None:
                continue
            think, answer = tokens
            before = settle(rid, None)
            if before is None:
                new_think += think
                new_answer += answer
            else:
                new_think += max(0, think - before[0])
                new_answer += max(0, answer - before[1])
            if not done:
                counted[rid] = tokens
        self._uncounted = (new_think, new_answer)

    def _publish_gauges(self) -> None:
        """Tracked requests, queue depths and batch sizes by phase, when one may have changed.

        Checked with each batch of overhead samples (at most every ``PUBLISH_INTERVAL_S``) and
        when the engine idles: a scrape sees them about that late, as the histograms. Most
        checks find none changed (they move on admissions, phase changes, preemptions and new
        plans, which bump ``meridian_policy.revision``).
        """
        policy = self.meridian_policy
        if policy.revision == self._published_revision:
            return
        with self._guarded("stat_logger", timed=False):
            self._published_revision = policy.revision
            queues = policy.queues
            served_output, served_think = queues.last_served
            values = (
                policy.num_tracked,
                queues.num_output_queued,
                queues.num_think_queued,
                served_output,
                served_think,
            )
            if values == self._published_gauges:
                return
            # Only the gauges whose value changed (all of them the first time).
            last = self._published_gauges or (-1,) * len(values)
            for set_gauge, value, before in zip(self._gauge_setters, values, last, strict=True):
                if value != before:
                    set_gauge(value)
            self._published_gauges = values

    # -- fail open ------------------------------------------------------------------------

    def _guarded(self, hook: str, request_id: str | None = None, *, timed: bool = True) -> _Guard:
        """Fail open on any exception in Meridian's work; with ``timed``, count its time as
        update-side overhead (``schedule`` brackets its own work instead)."""
        return _Guard(self, hook, request_id, timed)

    def _policy_error(self, hook: str, exc: Exception, request_id: str | None = None) -> None:
        self.meridian_overhead.policy_errors += 1
        try:
            self.meridian_metrics.count_policy_error(hook)
        except Exception:
            logger.debug("Meridian: policy error counter failed", exc_info=True)
        key = (hook, type(exc).__name__)
        context = f"hook={hook} step={self.current_step} running={len(self.running)}" + (
            f" request={request_id}" if request_id else ""
        )
        if key in self._logged_errors:
            logger.debug("Meridian policy error again (%s): %s", context, exc)
            return
        self._logged_errors.add(key)
        logger.error(
            "Meridian policy error (%s); vLLM's stock behaviour applies. Further %s errors "
            "in %s are counted in policy_errors but not logged.",
            context,
            type(exc).__name__,
            hook,
            exc_info=exc,
        )


class MeridianAsyncScheduler(MeridianScheduler, AsyncScheduler):
    """:class:`MeridianScheduler` for vLLM's asynchronous scheduling (the GPU default)."""


class MeridianShadowScheduler(MeridianScheduler):
    """Stock vLLM order with Meridian's tracking and counters: the baseline of comparisons.

    It never touches ``self.running``; it counts preemptions by phase and answer gaps exactly
    as :class:`MeridianScheduler` does, so an A/B of the two measures the ordering alone.
    """

    meridian_reorders: ClassVar[bool] = False
