"""Optional OTLP/HTTP export of traces and metrics (``[telemetry] otlp_enabled``, the otel extra).

Traces:

- one span ``meridian.step`` per scheduling step (:meth:`Tracer.step_span`);
- one span ``meridian.request`` per request, a root span of its own trace, opened by
  :meth:`Tracer.request_started` and ended by :meth:`Tracer.request_finished`; phase events
  (``EnterThink``, ``ExitThink``, ``ForceBudget``) are span events on it.

Metrics: :meth:`Tracer.export_metrics` mirrors every :class:`MeridianMetrics` event onto
OpenTelemetry instruments named by the catalogue's dotted names (``meridian.queue_depth``),
exported periodically to ``<otlp_endpoint>/v1/metrics``.

Off by default, and then free: :func:`make_tracer` returns the no-op :class:`Tracer` and
OpenTelemetry is never imported. The real tracer keeps its own providers and never touches the
global OpenTelemetry ones (vLLM may have configured those for its own tracing).

The request bookkeeping is guarded by a lock; spans are exported by a background thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Final, Protocol, TypeAlias
from urllib.parse import urlsplit

from meridian.config.schema import TelemetryConfig
from meridian.core.types import EnterThink, ExitThink, ForceBudget, PhaseEvent
from meridian.errors import ConfigError
from meridian.telemetry.catalogue import CATALOGUE, MetricKind, MetricSpec

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, _Gauge
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.trace import Span

    from meridian.telemetry.metrics import MeridianMetrics

_log = logging.getLogger(__name__)

AttrValue: TypeAlias = str | bool | int | float

STEP_SPAN: Final = "meridian.step"
REQUEST_SPAN: Final = "meridian.request"
DEFAULT_MAX_OPEN_REQUESTS: Final = 65536

# OpenTelemetry units are UCUM: base units by symbol, counted things in braces.
_OTEL_UNITS: Final[Mapping[str, str]] = {"seconds": "s", "bytes": "By", "": ""}


class SpanHandle(Protocol):
    """What a ``with tracer.step_span(...) as span`` block may do with its span."""

    def set_attribute(self, key: str, value: AttrValue) -> None:
        """Attach ``key = value`` to the span."""
        ...


class _NullSpan:
    """The disabled tracer's step span: a reusable context manager that does nothing."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def set_attribute(self, key: str, value: AttrValue) -> None:
        """Ignored."""


_NULL_SPAN: Final = _NullSpan()


class Tracer:
    """Meridian's tracing interface; this base class is the disabled (no-op) tracer.

    Every method is safe to call in any order: events for a request that was never started
    open its span implicitly (enabled tracer) or are ignored (disabled); finishing an unknown
    request does nothing. :meth:`shutdown` flushes and is idempotent.

    Example::

        tracer = make_tracer(config.telemetry)
        with tracer.step_span(step, num_output=3, num_think=9) as span:
            ...
        tracer.phase_event("req-1", ExitThink("req-1", think_tokens=812, forced=False))
    """

    enabled: bool = False

    def step_span(self, step: int, **attrs: AttrValue) -> AbstractContextManager[SpanHandle]:
        """A span around one scheduling step; ``attrs`` become ``meridian.<key>`` attributes."""
        return _NULL_SPAN

    def request_started(self, request_id: str) -> None:
        """Open the request's span."""

    def phase_event(self, request_id: str, event: PhaseEvent) -> None:
        """Record ``event`` on the request's span."""

    def request_finished(self, request_id: str) -> None:
        """End the request's span."""

    def export_metrics(self, metrics: MeridianMetrics) -> None:
        """Mirror ``metrics``' events to OTLP as well (no-op when disabled)."""

    def shutdown(self) -> None:
        """Flush what is pending and stop exporting."""


def make_tracer(config: TelemetryConfig, *, metrics: MeridianMetrics | None = None) -> Tracer:
    """The tracer ``config`` asks for: OTLP/HTTP when ``otlp_enabled``, else the no-op one.

    With ``metrics``, its events are exported over OTLP too (:meth:`Tracer.export_metrics`).

    Raises:
        ConfigError: OTLP is enabled but the endpoint is not an http(s) URL, or the otel
            extra (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``) is
            not installed.
    """
    if not config.otlp_enabled:
        return Tracer()
    tracer = OtlpTracer(config.otlp_endpoint)
    if metrics is not None:
        tracer.export_metrics(metrics)
    return tracer


def _base_url(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            "telemetry.otlp_endpoint must be an http(s) URL such as http://127.0.0.1:4318; "
            f"got {endpoint!r}"
        )
    return endpoint.rstrip("/")


def _attr_key(key: str) -> str:
    return key if "." in key else f"meridian.{key}"


def _event_attributes(event: PhaseEvent) -> dict[str, AttrValue]:
    if isinstance(event, ExitThink):
        return {"meridian.think_tokens": event.think_tokens, "meridian.forced": event.forced}
    if isinstance(event, ForceBudget):
        return {"meridian.force_reason": event.reason.value}
    return {}


class OtlpTracer(Tracer):
    """Exports spans (and, after :meth:`export_metrics`, metrics) over OTLP/HTTP.

    Args:
        endpoint: the collector's base URL (``/v1/traces`` and ``/v1/metrics`` are appended).
        service_name: the ``service.name`` resource attribute.
        metrics_interval_s: how often metrics are exported.
        max_open_requests: bound on open request spans; past it the oldest is ended with
            ``meridian.abandoned = true`` (a request never finished must not leak memory).
        timeout_s: per-export HTTP timeout.
    """

    enabled = True

    def __init__(
        self,
        endpoint: str,
        *,
        service_name: str = "meridian",
        metrics_interval_s: float = 15.0,
        max_open_requests: int = DEFAULT_MAX_OPEN_REQUESTS,
        timeout_s: float = 5.0,
    ) -> None:
        self._base = _base_url(endpoint)
        if max_open_requests < 1:
            raise ValueError(f"max_open_requests must be at least 1; got {max_open_requests}")
        if metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s must be positive; got {metrics_interval_s}")
        try:
            from opentelemetry.context import Context
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                "telemetry.otlp_enabled is true but OpenTelemetry is not installed "
                f"({exc.name} is missing); install the otel extra: "
                "pip install 'vllm-meridian[otel]'"
            ) from None
        self._resource = Resource.create({"service.name": service_name})
        self._provider = TracerProvider(resource=self._resource)
        exporter = OTLPSpanExporter(endpoint=f"{self._base}/v1/traces", timeout=timeout_s)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("meridian")
        # An empty context: request spans are roots, never children of the current step span.
        self._root = Context()
        self._metrics_interval_s = metrics_interval_s
        self._timeout_s = timeout_s
        self._max_open = max_open_requests
        self._requests: dict[str, Span] = {}
        self._lock = threading.Lock()
        self._meter_provider: MeterProvider | None = None
        self._metrics: MeridianMetrics | None = None
        self._closed = False

    @property
    def num_open_requests(self) -> int:
        """Request spans opened and not yet ended."""
        return len(self._requests)

    @contextmanager
    def _step(self, step: int, attrs: dict[str, AttrValue]) -> Iterator[SpanHandle]:
        attributes: dict[str, AttrValue] = {"meridian.step": step}
        attributes.update((_attr_key(k), v) for k, v in attrs.items())
        with self._tracer.start_as_current_span(STEP_SPAN, attributes=attributes) as span:
            yield span

    def step_span(self, step: int, **attrs: AttrValue) -> AbstractContextManager[SpanHandle]:
        """A ``meridian.step`` span with ``meridian.step = step`` and ``attrs``."""
        return self._step(step, attrs)

    def request_started(self, request_id: str) -> None:
        """Open ``request_id``'s span (a second start of an open request does nothing)."""
        with self._lock:
            self._open(request_id)

    def phase_event(self, request_id: str, event: PhaseEvent) -> None:
        """Add ``event`` as a span event; ``ExitThink``/``ForceBudget`` also set attributes."""
        with self._lock:
            span = self._open(request_id)
            attributes = _event_attributes(event)
            span.add_event(type(event).__name__, attributes=attributes)
            if isinstance(event, ExitThink | ForceBudget):
                span.set_attributes(attributes)
            elif isinstance(event, EnterThink):
                span.set_attribute("meridian.thinking", True)

    def request_finished(self, request_id: str) -> None:
        """End ``request_id``'s span (unknown ids are ignored)."""
        with self._lock:
            self._end(request_id)

    def export_metrics(self, metrics: MeridianMetrics) -> None:
        """Mirror ``metrics`` to ``<endpoint>/v1/metrics`` every ``metrics_interval_s``."""
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        if self._meter_provider is not None:
            raise ValueError("this tracer already exports a MeridianMetrics")
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{self._base}/v1/metrics", timeout=self._timeout_s),
            export_interval_millis=self._metrics_interval_s * 1000.0,
        )
        self._meter_provider = MeterProvider(metric_readers=[reader], resource=self._resource)
        metrics.set_sink(_OtlpSink(self._meter_provider))
        self._metrics = metrics

    def shutdown(self) -> None:
        """End open request spans (``meridian.open_at_shutdown``), flush, stop exporting."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for span in self._requests.values():
                span.set_attribute("meridian.open_at_shutdown", True)
                span.end()
            self._requests.clear()
        if self._metrics is not None:
            self._metrics.set_sink(None)
        self._provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()

    def _open(self, request_id: str) -> Span:
        span = self._requests.get(request_id)
        if span is None:
            if len(self._requests) >= self._max_open:
                oldest = next(iter(self._requests))
                self._requests[oldest].set_attribute("meridian.abandoned", True)
                self._end(oldest)
            span = self._tracer.start_span(
                REQUEST_SPAN, context=self._root, attributes={"meridian.request_id": request_id}
            )
            self._requests[request_id] = span
        return span

    def _end(self, request_id: str) -> None:
        span = self._requests.pop(request_id, None)
        if span is not None:
            span.end()


class _OtlpSink:
    """Forwards MeridianMetrics events to OpenTelemetry instruments built from the catalogue."""

    __slots__ = ("_counters", "_gauges", "_histograms")

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter("meridian")
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, _Gauge] = {}
        self._histograms: dict[str, Histogram] = {}
        for spec in CATALOGUE:
            unit = _OTEL_UNITS.get(spec.unit, f"{{{spec.unit}}}")
            if spec.kind is MetricKind.COUNTER:
                self._counters[spec.name] = meter.create_counter(
                    spec.dotted, unit=unit, description=spec.help
                )
            elif spec.kind is MetricKind.GAUGE:
                self._gauges[spec.name] = meter.create_gauge(
                    spec.dotted, unit=unit, description=spec.help
                )
            else:
                self._histograms[spec.name] = meter.create_histogram(
                    spec.dotted,
                    unit=unit,
                    description=spec.help,
                    explicit_bucket_boundaries_advisory=spec.buckets,
                )

    def record(self, spec: MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        """Add (counter), set (gauge) or record (histogram) ``value``."""
        attributes = dict(zip(spec.labels, labels, strict=True))
        if spec.kind is MetricKind.COUNTER:
            self._counters[spec.name].add(value, attributes)
        elif spec.kind is MetricKind.GAUGE:
            self._gauges[spec.name].set(value, attributes)
        else:
            self._histograms[spec.name].record(value, attributes)
