# mypy: disable-error-code="import-not-found"
"""What a :class:`~meridian.vllm.scheduler.MeridianScheduler` is built from, once, at start-up.

The scheduler's hooks read these parts as its own attributes (no lookup through this object on
the per-step path): the runtime (config, family, boundaries), the policy, the metrics and their
tracer and listener, the fail-open guards and timers, the publisher and the step log.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from vllm.v1.core.sched.request_queue import SchedulingPolicy

from meridian.core.policy import TrackingPolicy
from meridian.errors import ConfigError
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import Tracer, make_tracer
from meridian.vllm.failopen import FailOpen, Guard
from meridian.vllm.publishing import AdapterStats, MetricsListener, Publisher
from meridian.vllm.replica_state import ReplicaStateWriter
from meridian.vllm.runtime import MeridianRuntime, output_budget_rows, runtime_from_vllm_config
from meridian.vllm.steplog import ENV_STEP_LOG, StepLog

__all__ = ["SCHEDULE", "UPDATE", "AdapterParts"]

# The AdapterStats fields a guarded hook's time goes to.
SCHEDULE, UPDATE = "schedule_overhead_s", "update_overhead_s"


@dataclass(slots=True)
class AdapterParts:
    """The scheduler's collaborators (:meth:`build`)."""

    runtime: MeridianRuntime
    metrics: MeridianMetrics
    tracer: Tracer
    policy: TrackingPolicy
    overhead: AdapterStats
    fail_open: FailOpen
    publisher: Publisher
    #: Meridian's part of ``schedule()`` and of ``update_from_output()`` (fail open, timed).
    schedule_guard: Guard
    update_guard: Guard
    #: vLLM's own part of them (less Meridian's hooks inside it: drafts, preemptions).
    stock_schedule: Guard
    stock_update: Guard
    #: ``$MERIDIAN_STEP_LOG``: every step's shape and duration, for the simulator's calibration.
    step_log: StepLog | None
    #: ``$MERIDIAN_REPLICA_STATE``: routing stats for a Ray Serve replica, with each publish.
    replica_state: ReplicaStateWriter | None

    @classmethod
    def build(
        cls,
        scheduler: Any,
        runtime: MeridianRuntime | None,
        clock: Callable[[], float],
        logger: logging.Logger,
    ) -> AdapterParts:
        """The parts of ``scheduler`` (vLLM's ``Scheduler``, initialised): ``runtime`` (``None``:
        from ``$MERIDIAN_CONFIG`` and the engine) and the policy's ``clock``. Raises
        :class:`~meridian.errors.ConfigError` for a configuration Meridian cannot run under."""
        if scheduler.policy != SchedulingPolicy.FCFS:
            raise ConfigError(
                f"MeridianScheduler needs --scheduling-policy fcfs; got "
                f"{scheduler.scheduler_config.policy!r}. Meridian decides the order itself: "
                "drop --scheduling-policy (fcfs is the default) or use vLLM's own scheduler"
            )
        runtime = runtime or runtime_from_vllm_config(scheduler.vllm_config)
        config = runtime.config
        # A registry of its own: several engines may live in one process (tests). Under
        # $PROMETHEUS_MULTIPROC_DIR the values also go to that directory, where the API
        # server's /metrics collects them (the channel `meridian serve` sets up).
        metrics = MeridianMetrics(CollectorRegistry())
        tracer = make_tracer(config.telemetry, metrics=metrics)
        # vLLM stamps arrival_time with time.time(); the simulator passes its clock.
        now = time.time if clock is time.perf_counter else clock
        listener = MetricsListener(metrics, tracer, scheduler.requests, now)
        policy = scheduler.policy_class.from_config(
            runtime.format,
            config.scheduler,
            block_size=scheduler.block_size,
            capacity=scheduler.max_num_running_reqs,
            clock=clock,
            max_step_tokens=max_step_tokens(scheduler),
            transition_len=len(runtime.transition_ids),
            listener=listener,
            output_budget=output_budget_rows(config.scheduler.output_budget_rows),
        )
        overhead = AdapterStats()
        fail_open = FailOpen(
            metrics,
            logger,
            "scheduler",
            context=lambda: f"step={scheduler.current_step} running={len(scheduler.running)}",
        )
        # Bytes of one KV block (all layers), for meridian_kv_used_bytes.
        kv_config = scheduler.kv_cache_config
        kv_bytes = sum(int(t.size) for t in kv_config.kv_cache_tensors)
        metrics.set_kv_capacity_bytes(kv_bytes)
        publisher = Publisher(
            metrics,
            listener,
            policy,
            overhead,
            fail_open,
            kv_bytes // max(1, kv_config.num_blocks),
        )
        step_log = os.environ.get(ENV_STEP_LOG)
        logger.info(
            "Meridian scheduler: model family %s (%s), config %s, reorders=%s",
            runtime.model_name,
            runtime.reason,
            runtime.config_source or "defaults",
            scheduler.meridian_reorders,
        )
        # Guards built once (Guard.run is reentrant).
        return cls(
            runtime,
            metrics,
            tracer,
            policy,
            overhead,
            fail_open,
            publisher,
            schedule_guard=Guard(fail_open, "schedule", None, overhead, SCHEDULE),
            update_guard=Guard(fail_open, "update_from_output", None, overhead, UPDATE),
            stock_schedule=Guard.time(overhead, "stock_schedule_s"),
            stock_update=Guard.time(overhead, "stock_update_s", net_of=UPDATE),
            step_log=StepLog(step_log) if step_log else None,
            replica_state=ReplicaStateWriter.attach(scheduler, publisher),
        )


def max_step_tokens(scheduler: Any) -> int | None:
    """The tokens one step of ``scheduler`` can schedule, for the policy's lazy order; ``None``
    (plan every change) where a request can need more than its own new tokens: speculative
    decoding (draft slots, lookahead blocks) and models with several KV cache groups."""
    if scheduler.num_spec_tokens or scheduler.num_lookahead_tokens:
        return None
    if len(scheduler.kv_cache_config.kv_cache_groups) != 1:
        return None
    return int(
        min(scheduler.max_num_scheduled_tokens, scheduler.scheduler_config.max_num_batched_tokens)
    )
