# mypy: disable-error-code="import-not-found", allow-subclassing-any
"""Meridian's vLLM scheduler: phase-aware order and preemption victims, without forking vLLM.

Select it with ``--scheduler-cls meridian.vllm.scheduler.MeridianScheduler`` (or
``MeridianAsyncScheduler`` where vLLM schedules asynchronously, the GPU default). The pair
follows vLLM's own ``DiffusionScheduler``/``DiffusionAsyncScheduler`` pattern: the sync class
holds all the logic, the async one only mixes in ``AsyncScheduler``.

vLLM's ``Scheduler.schedule()`` serves ``self.running`` in list order and, when a request
cannot get KV blocks, preempts ``self.running[-1]`` (FCFS policy). Meridian overrides a few
narrow hooks and never copies ``schedule()``:

- ``add_request``: the phase router starts tracking the request; its initial phase comes
  from the prompt's tail (``<think>`` at the end of the prompt means it starts thinking).
- ``_update_request_with_output`` collects every request's new tokens and
  ``update_from_output`` hands the step's deltas to the router in one batch (phase changes,
  think/answer counts, answer-token gaps in steps); a request freed mid-step is accounted first.
- ``_free_request`` (every finished or aborted request passes there) and ``_preempt_request``
  (counts preemptions by phase): cleanup, so the tracked-request count returns to zero.
- ``schedule``: before ``super().schedule()``, ``self.running`` is re-ordered by
  :class:`~meridian.vllm.policy.RunningOrder`: answer streams first (served first, preempted
  last), thinking requests after them, the core's first-choice victim last, where vLLM's FCFS
  preemption takes it; surplus think requests (dual queue) and answer streams that no one
  could make KV room for are skipped for one step via ``request.next_decode_eligible_step``.

Fail open: an exception in Meridian's code is logged once per hook and error type with its
context, counted in ``meridian_stats.policy_errors``, and the step runs with vLLM's stock
order. Only configuration errors found at start-up (a non-FCFS policy, a bad meridian.toml, a
named model family that does not fit the tokenizer) stop the engine, with a clear message.

The scheduler runs in the engine-core process; it derives everything from the token stream
and ``$MERIDIAN_CONFIG``/``$MERIDIAN_MODEL`` (:mod:`meridian.vllm.runtime`), never from
globals shared with the workers.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from meridian.core.types import Phase
from meridian.errors import ConfigError
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import make_tracer
from meridian.vllm.policy import RunningOrder, SchedulerStats
from meridian.vllm.runtime import MeridianRuntime, runtime_from_vllm_config
from meridian.vllm.steptime import DecodeStepTime

__all__ = [
    "ENV_OUTPUT_BUDGET_ROWS",
    "MeridianAsyncScheduler",
    "MeridianScheduler",
    "MeridianShadowScheduler",
]

logger = logging.getLogger(__name__)

# Rows per step that keep answer streams within scheduler.output_tpot_budget_ms: the config's
# scheduler.output_budget_rows, overridden by this variable (it reaches the engine-core process
# like $MERIDIAN_CONFIG). "auto": measured (meridian.vllm.steptime); 0: the whole batch.
ENV_OUTPUT_BUDGET_ROWS = "MERIDIAN_OUTPUT_BUDGET_ROWS"
# meridian_schedule_overhead_seconds samples are published in batches of this many steps.
OVERHEAD_SAMPLES_PER_PUBLISH = 32
# With "auto", step-time samples are folded into the fit, and the output budget re-derived, in
# batches of this many.
BUDGET_REFIT_STEPS = 16


def _output_budget(configured: int | str) -> int | str | None:
    """The output budget in force: rows, ``None`` (the whole batch) or ``"auto"``."""
    raw = os.environ.get(ENV_OUTPUT_BUDGET_ROWS, "").strip()
    value: int | str = configured
    if raw:
        try:
            value = "auto" if raw == "auto" else int(raw)
        except ValueError:
            value = -1
        if value != "auto" and int(value) < 0:
            raise ConfigError(
                f'${ENV_OUTPUT_BUDGET_ROWS} must be "auto" or a number of rows >= 0; got {raw!r}'
            )
    if value == "auto":
        return "auto"
    return int(value) or None


class MeridianScheduler(Scheduler):
    """vLLM's scheduler with Meridian's phase-aware order (module docstring).

    Contract: Meridian never changes which requests are in ``self.running``, only their order
    and, for skipped requests, ``next_decode_eligible_step``. Every request added is tracked
    until it is freed (``meridian_num_tracked`` is 0 when the engine is idle).
    ``meridian_stats`` holds the counters.
    """

    #: False in :class:`MeridianShadowScheduler`: track and count, but keep vLLM's order.
    meridian_reorders: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.FCFS:
            raise ConfigError(
                f"MeridianScheduler needs --scheduling-policy fcfs; got "
                f"{self.scheduler_config.policy!r}. Meridian decides the order itself: "
                "drop --scheduling-policy (fcfs is the default) or use vLLM's own scheduler"
            )
        self.meridian: MeridianRuntime = runtime_from_vllm_config(self.vllm_config)
        # A registry of its own: several engines may live in one process (tests). Under
        # $PROMETHEUS_MULTIPROC_DIR the values also go to that directory, where the API
        # server's /metrics collects them (the channel `meridian serve` sets up).
        self.meridian_metrics = MeridianMetrics(CollectorRegistry())
        budget = _output_budget(self.meridian.config.scheduler.output_budget_rows)
        # "auto": no deferral until measured decode steps say the budget binds.
        self.meridian_step_time = DecodeStepTime() if budget == "auto" else None
        self.meridian_policy = RunningOrder(
            self.meridian.model,
            self.meridian.config.scheduler,
            block_size=self.block_size,
            capacity=self.max_num_running_reqs,
            output_budget=None if isinstance(budget, str) else budget,
            metrics=self.meridian_metrics,
            transition_len=len(self.meridian.transition_ids),
        )
        self._output_tpot_s = self.meridian.config.scheduler.output_tpot_budget_ms / 1000
        # (rows, start time) of the last step if it was decode-only (a step-time sample).
        self._timed_step: tuple[int, float] | None = None
        # (rows, seconds) of decode-only steps not yet folded into the fit.
        self._step_samples: list[tuple[int, float]] = []
        self._logged_errors: set[tuple[str, str]] = set()
        # (request, new token ids) of the step being processed by update_from_output.
        self._step_tokens: list[tuple[Any, list[int]]] = []
        # The gauge values last written by _publish_gauges (None: nothing written yet).
        self._published_gauges: tuple[int, ...] | None = None
        self._published_revision = -1
        # Per-step overhead samples not yet published (_sample_overhead).
        self._overhead_samples: list[float] = []
        self._sampled_overhead_s = 0.0
        self.meridian_tracer = make_tracer(
            self.meridian.config.telemetry, metrics=self.meridian_metrics
        )
        self.meridian_policy.tracer = self.meridian_tracer
        logger.info(
            "Meridian scheduler: model family %s (%s), config %s, reorders=%s",
            self.meridian.model_name,
            self.meridian.reason,
            self.meridian.config_source or "defaults",
            self.meridian_reorders,
        )

    @property
    def meridian_stats(self) -> SchedulerStats:
        """The counters (preemptions by phase, answer gaps, policy errors, ...)."""
        return self.meridian_policy.stats

    @property
    def meridian_num_tracked(self) -> int:
        """Requests Meridian tracks (0 when the engine is idle)."""
        return self.meridian_policy.num_tracked

    def meridian_phase(self, request_id: str) -> Phase:
        """The phase Meridian tracks for a live request."""
        return self.meridian_policy.phase(request_id)

    # -- vLLM hooks -----------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new:
            start = time.perf_counter()
            try:
                self.meridian_policy.track(request)
            except Exception as exc:
                self._policy_error("add_request", exc, request.request_id)
            self.meridian_stats.update_overhead_s += time.perf_counter() - start

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        stats = self.meridian_stats
        start = time.perf_counter()
        timed = self._timed_step
        if timed is not None:
            # The last step's wall time: a sample of the step-time fit, folded in by batches.
            self._timed_step = None
            self._step_samples.append((timed[0], start - timed[1]))
            if len(self._step_samples) >= BUDGET_REFIT_STEPS:
                self._refit_output_budget()
        if self.meridian_reorders and len(self.running) > 1:
            try:
                free = self.kv_cache_manager.block_pool.get_num_free_blocks()
                order = self.meridian_policy.order(self.running, self.current_step, free)
                if order is not self.running:
                    self.running[:] = order
            except Exception as exc:
                self._policy_error("schedule", exc)
        self._publish_gauges()
        stats.num_steps += 1
        stock_start = time.perf_counter()
        stats.schedule_overhead_s += stock_start - start
        if self.meridian_tracer.enabled:
            with self.meridian_tracer.step_span(
                self.current_step, num_running=len(self.running), num_waiting=len(self.waiting)
            ):
                output = super().schedule(*args, **kwargs)
        else:
            output = super().schedule(*args, **kwargs)
        stats.stock_schedule_s += time.perf_counter() - stock_start
        tokens = int(getattr(output, "total_num_scheduled_tokens", 0))
        stats.num_scheduled_tokens += tokens
        if self.meridian_step_time is not None:
            rows = len(getattr(output, "num_scheduled_tokens", ()))
            # Decode-only (one token per row): its time is what an answer stream waits.
            self._timed_step = (rows, start) if rows and tokens == rows else None
        return output

    def _refit_output_budget(self) -> None:
        """Fold the collected step-time samples into the fit and derive the output budget."""
        samples, step_time = self._step_samples, self.meridian_step_time
        self._step_samples = []
        if step_time is None:
            return
        try:
            for rows, seconds in samples:
                step_time.observe(rows, seconds)
            budget = step_time.rows_within(self._output_tpot_s, self.max_num_running_reqs)
            self.meridian_policy.set_output_budget(budget)
        except Exception as exc:
            self._policy_error("step_time", exc)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        stats = self.meridian_stats
        start, ours_before = time.perf_counter(), stats.update_overhead_s
        try:
            return super().update_from_output(*args, **kwargs)
        finally:
            self._observe_step()
            if self._timed_step is not None and not self.has_unfinished_requests():
                self._timed_step = None  # the engine idles until the next request: no sample
            ours = stats.update_overhead_s - ours_before
            stats.stock_update_s += time.perf_counter() - start - ours
            self._sample_overhead()

    def _sample_overhead(self) -> None:
        """One ``meridian_schedule_overhead_seconds`` sample per step, published in batches.

        A sample is Meridian's time since the previous one (ordering, gauges, token accounting,
        tracking). Publishing a histogram sample on every step cost more than the rest of a
        quiet step's work (cold caches after the model's forward pass), so samples are
        published every ``OVERHEAD_SAMPLES_PER_PUBLISH`` steps and whenever the engine idles.
        """
        stats = self.meridian_stats
        total = stats.schedule_overhead_s + stats.update_overhead_s
        samples = self._overhead_samples
        samples.append(total - self._sampled_overhead_s)
        self._sampled_overhead_s = total
        if len(samples) >= OVERHEAD_SAMPLES_PER_PUBLISH or not self.meridian_policy.num_tracked:
            start = time.perf_counter()
            try:
                for seconds in samples:
                    self.meridian_metrics.observe_schedule_overhead(seconds)
            except Exception as exc:
                self._policy_error("stat_logger", exc)
            samples.clear()
            # Publishing is Meridian's time too: it goes into the next sample.
            stats.update_overhead_s += time.perf_counter() - start

    def _update_request_with_output(
        self, request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any
    ) -> tuple[list[int], bool]:
        new_token_ids, stopped = super()._update_request_with_output(
            request, new_token_ids, *args, **kwargs
        )
        if new_token_ids:
            # Accounted once per step, in a batch (_observe_step).
            self._step_tokens.append((request, new_token_ids))
        return new_token_ids, stopped

    def _observe_step(self) -> None:
        """Feed the step's collected deltas to the policy in one batch."""
        batch = self._step_tokens
        if not batch:
            return
        self._step_tokens = []
        start = time.perf_counter()
        try:
            self.meridian_policy.observe_many(batch, self.current_step)
        except Exception as exc:
            self._policy_error("update_from_output", exc)
        self.meridian_stats.update_overhead_s += time.perf_counter() - start

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        try:
            blocks = -(-request.num_computed_tokens // self.block_size)
            self.meridian_policy.on_preempt(request.request_id, blocks)
        except Exception as exc:
            self._policy_error("preempt_request", exc, request.request_id)
        super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # A request finishing inside update_from_output: its last tokens are in the batch.
        self._observe_step()
        result = super()._free_request(request, *args, **kwargs)
        start = time.perf_counter()
        try:
            self.meridian_policy.untrack(request.request_id)
        except Exception as exc:
            self._policy_error("free_request", exc, request.request_id)
        self.meridian_stats.update_overhead_s += time.perf_counter() - start
        return result

    def _publish_gauges(self) -> None:
        """Tracked requests, queue depths and batch sizes by phase, when one may have changed.

        Checked once per step; most steps change none of them (they move on admissions,
        phase changes, preemptions and new plans, which bump ``meridian_policy.revision``).
        """
        try:
            metrics, policy = self.meridian_metrics, self.meridian_policy
            if policy.revision == self._published_revision:
                return
            self._published_revision = policy.revision
            depths = policy.queues.queue_depths()
            sizes = policy.queues.last_batch_sizes
            values = (policy.num_tracked, *depths.values(), *sizes.values())
            if values == self._published_gauges:
                return
            metrics.set_tracked_requests(policy.num_tracked)
            for phase, n in depths.items():
                metrics.set_queue_depth(phase, n)
            for phase, n in sizes.items():
                metrics.set_batch_size(phase, n)
            self._published_gauges = values
        except Exception as exc:
            self._policy_error("stat_logger", exc)

    # -- fail open ------------------------------------------------------------------------

    def _policy_error(self, hook: str, exc: Exception, request_id: str | None = None) -> None:
        self.meridian_stats.policy_errors += 1
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
