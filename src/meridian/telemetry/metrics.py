"""Meridian's metrics as ``prometheus_client`` collectors, behind one method per event.

The simulator and the vLLM integration both report through :class:`MeridianMetrics`; neither
touches a Prometheus object. Every collector is built from
:data:`meridian.telemetry.catalogue.CATALOGUE`, and every known label value is created at
construction so each series exists at 0 from the first scrape.

Two ways to expose the metrics:

- inside vLLM, pass ``prometheus_client.REGISTRY`` so vLLM's ``/metrics`` serves them next to
  ``vllm:*`` (the stat-logger plugin does this);
- anywhere else (tests, tools), keep the private registry and serve it with
  :func:`meridian.telemetry.exporter.serve_metrics`.

Example::

    metrics = MeridianMetrics()
    metrics.count_force(ForceReason.CONVERGED)
    metrics.set_queue_depth(Phase.THINK, 12)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Final, Protocol, TypeAlias, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meridian.core.types import ForceReason, Phase, Tier
from meridian.errors import MeridianError
from meridian.telemetry import catalogue as cat
from meridian.telemetry.catalogue import (
    QUEUE_PHASES,
    ROW_PHASES,
    MetricKind,
    MetricSpec,
)

_LabelSet: TypeAlias = tuple[str, ...]
_ChildT = TypeVar("_ChildT", Counter, Gauge)

_NO_LABELS: Final[_LabelSet] = ()


class MetricsRegistrationError(MeridianError):
    """The registry already holds Meridian's metrics (or a collector with one of their names)."""


class MetricSink(Protocol):
    """A second destination for every metric event (the OTLP bridge implements it).

    ``record`` receives the catalogue entry, the value and the label values in
    ``spec.labels`` order. For a counter the value is the increment, for a gauge the new
    value, for a histogram the observation.
    """

    def record(self, spec: MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        """Forward one event."""
        ...


def _build(spec: MetricSpec) -> Counter | Gauge | Histogram:
    # ``registry=None``: registration happens in MeridianMetrics so a clash can be rolled back.
    if spec.kind is MetricKind.COUNTER:
        return Counter(spec.name, spec.help, spec.labels, registry=None)
    if spec.kind is MetricKind.GAUGE:
        # Under vLLM's multi-process Prometheus mode each process writes its own value; the
        # latest one from a live process is the truth for a state gauge.
        return Gauge(
            spec.name, spec.help, spec.labels, registry=None, multiprocess_mode="livemostrecent"
        )
    if spec.buckets is None:
        raise ValueError(f"histogram {spec.name} has no buckets in the catalogue")
    return Histogram(spec.name, spec.help, spec.labels, registry=None, buckets=spec.buckets)


class MeridianMetrics:
    """Meridian's metric catalogue on one ``CollectorRegistry``.

    Args:
        registry: where to register; ``None`` creates a fresh private registry. Pass
            ``prometheus_client.REGISTRY`` to appear on the process's global ``/metrics``
            (vLLM's). One ``MeridianMetrics`` per registry: a second one on the same registry
            raises :class:`MetricsRegistrationError` (call :meth:`unregister` first).

    Methods are thread-safe (``prometheus_client`` locks per series) and cheap: label children
    are bound once here, so an event is a dict lookup and an increment.
    """

    __slots__ = (
        "_accepted",
        "_batch",
        "_collectors",
        "_evictions",
        "_forces",
        "_generated",
        "_kv_blocks",
        "_kv_capacity",
        "_kv_used",
        "_oc_evictions",
        "_output_itl",
        "_overhead",
        "_policy_errors",
        "_preemptions",
        "_queue",
        "_reasoning",
        "_rejected",
        "_sink",
        "_think_tokens",
        "_tracked",
        "_ttfvt",
        "_ttot",
        "registry",
    )

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._sink: MetricSink | None = None
        self._collectors: dict[str, Counter | Gauge | Histogram] = {}
        for spec in cat.CATALOGUE:
            collector = _build(spec)
            try:
                self.registry.register(collector)
            except ValueError as exc:
                self.unregister()
                raise MetricsRegistrationError(
                    f"cannot register {spec.name} on this Prometheus registry ({exc}); create "
                    "one MeridianMetrics per registry, or call unregister() on the old one"
                ) from None
            self._collectors[spec.name] = collector
            for values in cat.initial_label_sets(spec):
                if values:
                    collector.labels(*values)

        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self._think_tokens = histogram(cat.THINK_TOKENS)
        self._oc_evictions = counter(cat.OUTPUT_CRITICAL_EVICTIONS)
        self._tracked = gauge(cat.TRACKED_REQUESTS)
        self._overhead = histogram(cat.SCHEDULE_OVERHEAD)
        self._ttfvt = histogram(cat.TTFVT)
        self._ttot = histogram(cat.TTOT)
        self._output_itl = histogram(cat.OUTPUT_ITL)
        self._reasoning = histogram(cat.REASONING_SECONDS)
        self._kv_capacity = gauge(cat.KV_CAPACITY)
        forces = counter(cat.BUDGET_FORCES)
        self._forces = {r: forces.labels(r.value) for r in ForceReason}
        queue = gauge(cat.QUEUE_DEPTH)
        self._queue = {p: queue.labels(cat.phase_label(p)) for p in QUEUE_PHASES}
        batch = gauge(cat.BATCH_SIZE)
        self._batch = {p: batch.labels(cat.phase_label(p)) for p in ROW_PHASES}
        preemptions = counter(cat.PREEMPTIONS)
        self._preemptions = {p: preemptions.labels(cat.phase_label(p)) for p in ROW_PHASES}
        generated = counter(cat.GENERATED_TOKENS)
        self._generated = {p: generated.labels(cat.phase_label(p)) for p in QUEUE_PHASES}
        drafts = counter(cat.DRAFT_TOKENS)
        accepted, rejected = cat.DRAFT_OUTCOMES
        self._accepted = {p: drafts.labels(cat.phase_label(p), accepted) for p in QUEUE_PHASES}
        self._rejected = {p: drafts.labels(cat.phase_label(p), rejected) for p in QUEUE_PHASES}
        kv_blocks = gauge(cat.KV_BLOCKS)
        self._kv_blocks = {p: kv_blocks.labels(cat.phase_label(p)) for p in QUEUE_PHASES}
        kv_used = gauge(cat.KV_USED)
        self._kv_used = {t: kv_used.labels(cat.tier_label(t)) for t in Tier}
        evictions = counter(cat.KV_EVICTIONS)
        self._evictions = {t: evictions.labels(cat.tier_label(t)) for t in Tier}
        # Per-site children: known sites bound now, others on first use.
        self._policy_errors = _Children(counter(cat.POLICY_ERRORS), "where", cat.POLICY_ERROR_SITES)

    def _counter(self, spec: MetricSpec) -> Counter:
        collector = self._collectors[spec.name]
        assert isinstance(collector, Counter)  # built from spec.kind, never user input
        return collector

    def _gauge(self, spec: MetricSpec) -> Gauge:
        collector = self._collectors[spec.name]
        assert isinstance(collector, Gauge)
        return collector

    def _histogram(self, spec: MetricSpec) -> Histogram:
        collector = self._collectors[spec.name]
        assert isinstance(collector, Histogram)
        return collector

    # -- plumbing ---------------------------------------------------------------------------------

    def set_sink(self, sink: MetricSink | None) -> None:
        """Mirror every later event to ``sink`` as well (``None`` stops mirroring)."""
        self._sink = sink

    def unregister(self) -> None:
        """Remove Meridian's collectors from the registry (tests; re-initialising vLLM)."""
        for collector in self._collectors.values():
            self.registry.unregister(collector)
        self._collectors.clear()

    def _mirror(self, spec: MetricSpec, value: float, labels: _LabelSet = _NO_LABELS) -> None:
        if self._sink is not None:
            self._sink.record(spec, value, labels)

    # -- scheduling -------------------------------------------------------------------------------

    def observe_think_tokens(self, n: int) -> None:
        """A request's think phase ended after ``n`` think tokens (once per request)."""
        self._think_tokens.observe(n)
        self._mirror(cat.THINK_TOKENS, n)

    def count_force(self, reason: ForceReason, n: int = 1) -> None:
        """The budget policy forced ``</think>`` for ``reason`` (``n`` times)."""
        self._forces[reason].inc(n)
        self._mirror(cat.BUDGET_FORCES, n, (reason.value,))

    def count_output_critical_eviction(self, n: int = 1) -> None:
        """``n`` OutputCritical blocks were lost other than through :meth:`count_kv_eviction`.

        Typically: an answering request was preempted and its blocks freed.
        """
        self._oc_evictions.inc(n)
        self._mirror(cat.OUTPUT_CRITICAL_EVICTIONS, n)

    def set_tracked_requests(self, n: int) -> None:
        """The phase router tracks ``n`` requests."""
        self._tracked.set(n)
        self._mirror(cat.TRACKED_REQUESTS, n)

    def observe_schedule_overhead(self, seconds: float) -> None:
        """Meridian's policy took ``seconds`` of wall time in one scheduler step."""
        self._overhead.observe(seconds)
        self._mirror(cat.SCHEDULE_OVERHEAD, seconds)

    def set_queue_depth(self, phase: Phase, n: int) -> None:
        """``n`` running requests are in the ``phase`` queue (THINK or OUTPUT)."""
        _child(self._queue, phase, "queue depth").set(n)
        self._mirror(cat.QUEUE_DEPTH, n, (cat.phase_label(phase),))

    def set_batch_size(self, phase: Phase, n: int) -> None:
        """The last step scheduled ``n`` rows of requests in ``phase`` (PREFILL/THINK/OUTPUT)."""
        _child(self._batch, phase, "batch size").set(n)
        self._mirror(cat.BATCH_SIZE, n, (cat.phase_label(phase),))

    def count_preemption(self, phase: Phase, n: int = 1) -> None:
        """``n`` requests in ``phase`` were preempted."""
        _child(self._preemptions, phase, "preemptions").inc(n)
        self._mirror(cat.PREEMPTIONS, n, (cat.phase_label(phase),))

    def count_policy_error(self, where: str) -> None:
        """A Meridian hook (``where``, e.g. ``"schedule"``) caught an exception."""
        self._policy_errors.get(where).inc()
        self._mirror(cat.POLICY_ERRORS, 1, (where,))

    # -- user-felt latency ------------------------------------------------------------------------

    def observe_ttfvt(self, seconds: float) -> None:
        """A request's first answer token came ``seconds`` after its arrival."""
        self._ttfvt.observe(seconds)
        self._mirror(cat.TTFVT, seconds)

    def observe_ttot(self, seconds: float) -> None:
        """A request's first answer token came ``seconds`` after its ``</think>``."""
        self._ttot.observe(seconds)
        self._mirror(cat.TTOT, seconds)

    def observe_output_itl(self, seconds: float, count: int = 1) -> None:
        """``count`` times: two consecutive answer tokens of a request were ``seconds`` apart.

        One call per step in vLLM (every stream served in consecutive steps waited the same step
        time): ``count`` observations cost one, through the histogram's own sum and buckets.
        """
        if count == 1:
            self._output_itl.observe(seconds)
            self._mirror(cat.OUTPUT_ITL, seconds)
        elif count > 1:
            self.observe_counted(cat.OUTPUT_ITL, ((seconds, count),))

    def observe_counted(self, spec: MetricSpec, observations: Sequence[tuple[float, int]]) -> None:
        """Each ``(value, count)`` of ``observations``, ``count`` times, on the unlabelled
        histogram ``spec``: what as many calls of its ``observe_*`` method record, for one
        update of the sum and one per bucket touched (the vLLM scheduler publishes its
        observations in batches this way).
        """
        histogram = self._histogram(spec)
        bounds = histogram._upper_bounds
        hits = [0] * len(bounds)
        total = 0.0
        for value, count in observations:
            total += value * count
            # The first bucket observe() counts it in; NaN, like observe(), in none (the
            # comparison fails).
            i = bisect_left(bounds, value)
            if i < len(bounds) and value <= bounds[i]:
                hits[i] += count
        histogram._sum.inc(total)
        buckets = histogram._buckets
        for i, n in enumerate(hits):
            if n:
                buckets[i].inc(n)
        if self._sink is not None:
            for value, count in observations:
                for _ in range(count):
                    self._sink.record(spec, value, _NO_LABELS)

    def count_generated_tokens(self, phase: Phase, n: int) -> None:
        """``n`` more tokens were generated in ``phase`` (THINK or OUTPUT)."""
        _child(self._generated, phase, "generated tokens").inc(n)
        self._mirror(cat.GENERATED_TOKENS, n, (cat.phase_label(phase),))

    def count_draft_tokens(self, phase: Phase, accepted: int, rejected: int) -> None:
        """Speculative decoding: ``accepted`` and ``rejected`` more draft tokens of requests in
        ``phase`` (THINK, undecided ones included, or OUTPUT) when they were proposed."""
        label = cat.phase_label(phase)
        for children, outcome, n in (
            (self._accepted, cat.DRAFT_OUTCOMES[0], accepted),
            (self._rejected, cat.DRAFT_OUTCOMES[1], rejected),
        ):
            if n:
                _child(children, phase, "draft tokens").inc(n)
                self._mirror(cat.DRAFT_TOKENS, n, (label, outcome))

    # -- KV tiers ---------------------------------------------------------------------------------

    def set_kv_blocks(self, phase: Phase, n: int) -> None:
        """Running requests in ``phase`` (THINK, prefilling included, or OUTPUT) hold ``n``
        KV blocks."""
        _child(self._kv_blocks, phase, "KV blocks").set(n)
        self._mirror(cat.KV_BLOCKS, n, (cat.phase_label(phase),))

    def set_kv_used_bytes(self, tier: Tier, n: int) -> None:
        """Blocks of ``tier`` hold ``n`` bytes."""
        self._kv_used[tier].set(n)
        self._mirror(cat.KV_USED, n, (cat.tier_label(tier),))

    def set_kv_capacity_bytes(self, n: int) -> None:
        """The KV cache holds at most ``n`` bytes (the KV-usage alert divides by this)."""
        self._kv_capacity.set(n)
        self._mirror(cat.KV_CAPACITY, n)

    def count_kv_eviction(self, tier: Tier, n: int = 1) -> None:
        """The block manager evicted ``n`` blocks of ``tier``.

        An OUTPUT_CRITICAL eviction also counts toward
        ``meridian_output_critical_evictions_total`` (do not report it twice), so that counter
        is always at least the ``tier="output_critical"`` series of this one.
        """
        self._evictions[tier].inc(n)
        self._mirror(cat.KV_EVICTIONS, n, (cat.tier_label(tier),))
        if tier is Tier.OUTPUT_CRITICAL:
            self.count_output_critical_eviction(n)


class _Children:
    """Children of a one-label collector by label value, bound lazily past the known ones."""

    __slots__ = ("_by_value", "_collector", "_label")

    def __init__(self, collector: Counter, label: str, known: tuple[str, ...]) -> None:
        self._collector = collector
        self._label = label
        self._by_value: dict[str, Counter] = {v: collector.labels(v) for v in known}

    def get(self, value: str) -> Counter:
        child = self._by_value.get(value)
        if child is None:
            _check_label(self._label, value)
            child = self._by_value[value] = self._collector.labels(value)
        return child


def _check_label(label: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"metric label {label} must be a non-empty string; got {value!r}")


def _child(children: dict[Phase, _ChildT], phase: Phase, what: str) -> _ChildT:
    try:
        return children[phase]
    except KeyError:
        allowed = ", ".join(p.name for p in children)
        raise ValueError(f"{what} is reported for phases {allowed}; got {phase!r}") from None


class ClusterMetrics:
    """The cluster front door's counters (:data:`~meridian.telemetry.catalogue.CLUSTER_CATALOGUE`)
    on their own registry (the ingress process has no engine, so none of the catalogue's
    engine metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._counters: dict[str, Counter] = {}
        for spec in cat.CLUSTER_CATALOGUE:
            counter = _build(spec)
            assert isinstance(counter, Counter)
            self.registry.register(counter)
            self._counters[spec.name] = counter

    def count(self, spec: MetricSpec, n: int = 1) -> None:
        """Add ``n`` to the cluster counter ``spec``."""
        self._counters[spec.name].inc(n)
