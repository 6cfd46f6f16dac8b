"""What the scheduler adapter reports: the policy's listener and the periodic publication.

:class:`MetricsListener` hears the policy's events (first answers, answer gaps, think exits,
preemptions) and keeps the observations; :class:`Publisher` puts everything on Meridian's
metrics in batches: one ``meridian_schedule_overhead_seconds`` sample per step, and with each
batch the KV the running requests hold, the tokens and draft tokens by phase since the last
one, the listener's observations and the gauges.

Why batches. Publishing a histogram sample on every step cost more than the rest of a quiet
step's work (cold caches after the model's forward pass), and a publish (a pass over the running
requests, every histogram and gauge) costs several steps' work, so they are published when
``PUBLISH_INTERVAL_S`` has passed since the last publish (the clock is read on every step: a
read costs far less than a step, and a batch gated by a count of steps went stale for tens of
seconds when a loaded machine's steps took a second each) and whenever the engine idles. A
scrape sees them about that late (its interval is several seconds anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from meridian.core.policy import TrackingPolicy
from meridian.core.types import ForceReason, Phase, PhaseEvent, Tier
from meridian.telemetry import catalogue as cat
from meridian.telemetry.catalogue import MetricSpec
from meridian.telemetry.latency import ttfvt, ttot
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import Tracer
from meridian.vllm.failopen import FailOpen

__all__ = [
    "PUBLISH_INTERVAL_S",
    "AdapterStats",
    "MetricsListener",
    "Publisher",
]

# meridian_schedule_overhead_seconds samples, and with them the other metrics, are published in
# batches: at most every PUBLISH_INTERVAL_S seconds of the policy's clock, and when the engine
# idles; if the policy's clock fails, every SAMPLES_WITHOUT_CLOCK steps instead.
SAMPLES_WITHOUT_CLOCK = 32
PUBLISH_INTERVAL_S = 1.0


@dataclass(slots=True)
class AdapterStats:
    """The adapter's own counters: steps, work, Meridian's time against vLLM's.

    ``num_scheduled_tokens`` is the engine's work: every token computed, recomputation after
    preemptions included. Meridian's time: ``schedule_overhead_s`` before each ``schedule()``
    (the plan, gauges) and ``update_overhead_s`` in token accounting and request tracking;
    vLLM's: ``stock_schedule_s`` in ``schedule()``, ``stock_update_s`` in
    ``update_from_output()`` (Meridian's part taken out).
    """

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    schedule_overhead_s: float = 0.0
    stock_schedule_s: float = 0.0
    update_overhead_s: float = 0.0
    stock_update_s: float = 0.0


class MetricsListener:
    """The policy's listener (:class:`~meridian.core.interface.PolicyListener`): Meridian's
    metrics and (optionally) OTLP spans.

    ``requests`` is the scheduler's table (for a request's ``arrival_time``) and ``now`` the
    clock ``arrival_time`` is on: wall time in vLLM, the simulator's virtual time there.
    Histogram observations and hard-cap forces are measured when they happen and kept until
    :meth:`publish` (:class:`Publisher` publishes at most every ``PUBLISH_INTERVAL_S`` and when the
    engine idles): one update per histogram and batch costs less than one per request. A think
    exit and a first answer, heard on the step's path, are only stamped there; what they
    observe (reasoning seconds, think tokens, TTFVT, TTOT) is worked out in a batch, before a
    publish or a request's end (:meth:`_settle`).
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
        # Heard and not yet settled, in order: think exits (request id, clock, think tokens,
        # hard cap) and first answers (request id, clock, arrival time or None).
        self._exits: list[tuple[str, float, int, bool]] = []
        self._firsts: list[tuple[str, float, float | None]] = []

    def publish(self) -> None:
        """Put the observations kept so far on the metrics."""
        if self._exits or self._firsts:
            self._settle()
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
        request = self.requests.get(request_id)  # (now: a request may be freed before _settle)
        arrival = None if request is None else request.arrival_time
        self._firsts.append((request_id, self.now(), arrival))

    def _settle(self) -> None:
        """Observe the think exits, then the first answers, heard since the last call (a think
        exit always comes before its request's first answer)."""
        think_ended_at, reasoning_from = self._think_ended_at, self._reasoning_from
        for request_id, now, num_think_tokens, hard_cap in self._exits:
            think_ended_at[request_id] = now
            started = reasoning_from.pop(request_id, None)
            if started is not None:
                self._reasoning.append((max(0.0, now - started), 1))
            self._think_tokens.append((num_think_tokens, 1))
            self._num_hard_caps += hard_cap
        self._exits.clear()
        for request_id, now, arrival in self._firsts:
            if arrival is not None:
                self._ttfvt.append((ttfvt(arrival, now), 1))
            to_answer = ttot(think_ended_at.pop(request_id, None), now)
            if to_answer is not None:
                self._ttot.append((to_answer, 1))
        self._firsts.clear()

    def answer_gaps(self, seconds: float, count: int) -> None:
        self._itl.append((seconds, count))

    def request_started(self, request_id: str) -> None:
        self.tracer.request_started(request_id)  # (called only while tracing: phase_events)

    def requests_finished(self, request_ids: list[str]) -> None:
        if self._exits or self._firsts:
            self._settle()  # (their own exits and first answers among them, maybe)
        think_ended_at, reasoning_from = self._think_ended_at, self._reasoning_from
        if think_ended_at or reasoning_from:
            for request_id in request_ids:
                think_ended_at.pop(request_id, None)
                reasoning_from.pop(request_id, None)
        if self.tracer.enabled:
            for request_id in request_ids:
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
        self._exits.append((request_id, self.now(), num_think_tokens, hard_cap))

    def force_cut_short(self, request_id: str) -> None:
        self._num_hard_caps += 1


class Publisher:
    """Meridian's metrics of one scheduler, published in batches (module docstring).

    ``policy`` is the scheduler's, ``stats`` its timing counters, ``kv_block_bytes`` the bytes of
    one KV block (all layers; 0 where unknown).
    """

    def __init__(
        self,
        metrics: MeridianMetrics,
        listener: MetricsListener,
        policy: TrackingPolicy,
        stats: AdapterStats,
        fail_open: FailOpen,
        kv_block_bytes: int,
    ) -> None:
        self.metrics = metrics
        self.listener = listener
        self.policy = policy
        self.stats = stats
        self.fail_open = fail_open
        self.kv_block_bytes = kv_block_bytes
        # The gauge values last written (None: nothing written yet), and the setters of those
        # gauges, in the same order.
        self._published_gauges: tuple[int, ...] | None = None
        self._gauge_setters: tuple[Callable[[int], None], ...] = (
            metrics.set_tracked_requests,
            functools.partial(metrics.set_queue_depth, Phase.OUTPUT),
            functools.partial(metrics.set_queue_depth, Phase.THINK),
            functools.partial(metrics.set_batch_size, Phase.OUTPUT),
            functools.partial(metrics.set_batch_size, Phase.THINK),
            functools.partial(metrics.set_kv_blocks, Phase.THINK),
            functools.partial(metrics.set_kv_blocks, Phase.OUTPUT),
            functools.partial(metrics.set_kv_used_bytes, Tier.THINK_ACTIVE),
            functools.partial(metrics.set_kv_used_bytes, Tier.OUTPUT_CRITICAL),
        )
        # (think, answer) tokens of each live request already on meridian_generated_tokens_total.
        self._tokens_counted: dict[str, tuple[int, int]] = {}
        # Per-step overhead samples not yet published, (seconds, 1) each.
        self._overhead_samples: list[tuple[float, int]] = []
        # (think, answer) tokens counted but not yet on meridian_generated_tokens_total.
        self._uncounted = (0, 0)
        # Draft tokens verified and not yet on meridian_spec_decode_draft_tokens_total: think
        # accepted, think rejected, output accepted, output rejected.
        self._drafts = [0, 0, 0, 0]
        self._sampled_overhead_s = 0.0
        self._published_at = policy.clock()
        # Called after each publish (a Ray Serve replica's routing stats: replica_state.py).
        self.on_publish: Callable[[], None] | None = None

    def drafts(self, request_id: str, drafted: int, accepted: int) -> None:
        """A request's ``drafted`` draft tokens were verified, ``accepted`` of them: counted by
        the phase it was in when they were proposed (its tokens of the step are observed after
        this). An untracked request (its tracking failed, and was counted then) is left out."""
        try:
            answering = self.policy.phase(request_id) is Phase.OUTPUT
        except KeyError:
            return
        at = 2 if answering else 0
        self._drafts[at] += accepted
        self._drafts[at + 1] += max(0, drafted - accepted)

    def forget(self, request_id: str) -> None:
        """A request left without its tokens counted (an untracking that failed)."""
        self._tokens_counted.pop(request_id, None)

    def step_done(self, running: Sequence[Any], idle: bool) -> None:
        """A step ended: its ``meridian_schedule_overhead_seconds`` sample (Meridian's time since
        the previous one: plans, gauges, token accounting, tracking), and a publish when one is
        due (module docstring); ``running`` are the engine's running requests, ``idle``: the
        engine has nothing left to run (always a publish: the gauges go to 0 now)."""
        overhead = self.stats
        total = overhead.schedule_overhead_s + overhead.update_overhead_s
        samples = self._overhead_samples
        samples.append((total - self._sampled_overhead_s, 1))
        self._sampled_overhead_s = total
        try:  # fail open by hand: a context manager costs too much on this per-step path
            now = self.policy.clock()
            due = idle or now - self._published_at >= PUBLISH_INTERVAL_S
            if due:
                self._published_at = now
        except Exception as exc:
            self.fail_open.error("stat_logger", exc)
            due = idle or len(samples) >= SAMPLES_WITHOUT_CLOCK
        if due:
            with self.fail_open("stat_logger", timed=self.stats):
                metrics = self.metrics
                metrics.observe_counted(cat.SCHEDULE_OVERHEAD, samples)
                self.count_tokens(running)
                think, answer = self._uncounted
                if think:
                    metrics.count_generated_tokens(Phase.THINK, think)
                if answer:
                    metrics.count_generated_tokens(Phase.OUTPUT, answer)
                self._uncounted = (0, 0)
                drafts = self._drafts
                if any(drafts):
                    metrics.count_draft_tokens(Phase.THINK, drafts[0], drafts[1])
                    metrics.count_draft_tokens(Phase.OUTPUT, drafts[2], drafts[3])
                    self._drafts = [0, 0, 0, 0]
                self.listener.publish()
                self.publish_gauges(running)
                if self.on_publish is not None:
                    self.on_publish()
            samples.clear()

    def count_tokens(self, requests: Iterable[Any], done: bool = False) -> None:
        """Add what ``requests`` generated since each was last counted to the tokens by phase
        not yet published (``_uncounted``); ``done``: they are leaving (forget their counts)."""
        tokens_by_phase, counted = self.policy.tokens_by_phase, self._tokens_counted
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

    def publish_gauges(self, running: Sequence[Any]) -> None:
        """Tracked requests, queue depths and batch sizes by phase, and the KV the ``running``
        requests hold, those that changed.

        The KV in blocks by phase and in bytes by tier: thinking (and prefilling) requests'
        under ``think``/``think_active``, answer streams' (prompt and reasoning included: the
        answer attends over them) under ``output``/``output_critical``. Counted from computed
        tokens (a shared prefix block counts once per holder).

        Checked with each batch of overhead samples (at most every ``PUBLISH_INTERVAL_S``) and
        when the engine idles: a scrape sees them about that late, as the histograms.
        """
        policy = self.policy
        with self.fail_open("stat_logger"):
            thinking, answering = policy.blocks_by_phase(running)
            size = self.kv_block_bytes
            values = (
                policy.num_tracked,
                *policy.queue_gauges(),
                thinking,
                answering,
                thinking * size,
                answering * size,
            )
            if values == self._published_gauges:
                return
            # Only the gauges whose value changed (all of them the first time).
            last = self._published_gauges or (-1,) * len(values)
            for set_gauge, value, before in zip(self._gauge_setters, values, last, strict=True):
                if value != before:
                    set_gauge(value)
            self._published_gauges = values
