"""Telemetry: the metric catalogue, Prometheus metrics, a standalone exporter, optional OTLP.

- :mod:`meridian.telemetry.catalogue`: every metric as plain data (names, help, labels).
- :mod:`meridian.telemetry.metrics`: ``MeridianMetrics``, one method per event.
- :mod:`meridian.telemetry.exporter`: ``serve_metrics`` for processes that are not vLLM.
- :mod:`meridian.telemetry.otel`: ``make_tracer``, OTLP/HTTP traces and metrics (off by
  default; imports OpenTelemetry only when enabled).

A simulator run is reported through the same catalogue by :mod:`meridian.bench.sim_metrics`
(telemetry imports neither the simulator nor the benchmarks). Only the catalogue is re-exported
here, so that importing the package (the docs generator does) pulls in no ``prometheus_client``.
"""

from __future__ import annotations

from meridian.telemetry.catalogue import CATALOGUE, MetricKind, MetricSpec, by_name

__all__ = ["CATALOGUE", "MetricKind", "MetricSpec", "by_name"]
