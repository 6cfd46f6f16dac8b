"""OTLP/HTTP export: a receiver on 127.0.0.1 decodes what arrives; the disabled tracer is free."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pydantic import ValidationError

from meridian.config.schema import TelemetryConfig
from meridian.core.types import (
    EnterThink,
    ExitThink,
    ForceBudget,
    ForceReason,
    Phase,
    Tier,
)
from meridian.errors import ConfigError
from meridian.telemetry import catalogue as cat
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import OtlpTracer, Tracer, make_tracer

# -- disabled: no-op and no import --------------------------------------------------------------


def test_disabled_tracer_is_a_no_op() -> None:
    tracer = make_tracer(TelemetryConfig())
    assert type(tracer) is Tracer and not tracer.enabled
    span_a = tracer.step_span(1, num_output=2)
    span_b = tracer.step_span(2)
    assert span_a is span_b  # one shared object: nothing allocated per step
    with span_a as span:
        span.set_attribute("x", 1)
    tracer.request_started("r")
    tracer.phase_event("r", ExitThink("r", 3, False))
    tracer.request_finished("r")
    metrics = MeridianMetrics()
    tracer.export_metrics(metrics)
    metrics.count_force(ForceReason.CONVERGED)
    tracer.shutdown()
    tracer.shutdown()


def test_disabled_tracer_never_imports_opentelemetry() -> None:
    code = """
import sys
from meridian.config.schema import TelemetryConfig
from meridian.core.types import EnterThink
from meridian.telemetry.metrics import MeridianMetrics
from meridian.telemetry.otel import make_tracer
metrics = MeridianMetrics()
tracer = make_tracer(TelemetryConfig(otlp_enabled=False), metrics=metrics)
with tracer.step_span(0, num_think=1):
    tracer.request_started("r")
    tracer.phase_event("r", EnterThink("r"))
    tracer.request_finished("r")
tracer.shutdown()
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
assert not loaded, loaded
print("clean")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "clean"


def test_bad_endpoint_is_a_config_error() -> None:
    # The config refuses it (naming the field); a config built without validation is refused
    # when the tracer starts.
    with pytest.raises(ValidationError, match=r"otlp_endpoint must be an http:// or https:// URL"):
        TelemetryConfig(otlp_enabled=True, otlp_endpoint="127.0.0.1:4318")
    config = TelemetryConfig.model_construct(otlp_enabled=True, otlp_endpoint="127.0.0.1:4318")
    with pytest.raises(ConfigError, match=r"telemetry.otlp_endpoint must be an http\(s\) URL"):
        make_tracer(config)


def test_missing_otel_extra_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    config = TelemetryConfig(otlp_enabled=True)
    with pytest.raises(
        ConfigError, match=r"install the otel extra: pip install 'vllm-meridian\[otel\]'"
    ):
        make_tracer(config)


# -- a small OTLP/HTTP receiver -----------------------------------------------------------------


@dataclass
class Received:
    traces: list[Any] = field(default_factory=list)
    metrics: list[Any] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def receiver() -> Iterator[tuple[str, Received]]:
    pytest.importorskip(
        "opentelemetry.exporter.otlp.proto.http",
        reason="the otel extra (opentelemetry-exporter-otlp-proto-http) is not installed",
    )
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    got = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            encoding = self.headers.get("Content-Encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path == "/v1/traces":
                req: Any = trace_service_pb2.ExportTraceServiceRequest()
                resp: Any = trace_service_pb2.ExportTraceServiceResponse()
                sink = got.traces
            elif self.path == "/v1/metrics":
                req = metrics_service_pb2.ExportMetricsServiceRequest()
                resp = metrics_service_pb2.ExportMetricsServiceResponse()
                sink = got.metrics
            else:
                self.send_error(404)
                return
            req.ParseFromString(body)
            with got.lock:
                sink.append(req)
                got.paths.append(self.path)
            payload = resp.SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out


def spans(got: Received) -> list[Any]:
    return [
        span
        for req in got.traces
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def metric_points(got: Received) -> dict[str, list[Any]]:
    by_name: dict[str, list[Any]] = {}
    for req in got.metrics:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    by_name.setdefault(metric.name, []).append(metric)
    return by_name


# -- enabled: what arrives ----------------------------------------------------------------------


def test_spans_and_phase_events_arrive(receiver: tuple[str, Received]) -> None:
    url, got = receiver
    tracer = make_tracer(TelemetryConfig(otlp_enabled=True, otlp_endpoint=url + "/"))
    assert isinstance(tracer, OtlpTracer) and tracer.enabled
    for step in range(3):
        with tracer.step_span(step, num_output=step, num_think=9) as span:
            span.set_attribute("meridian.deferred", step == 1)
            if step == 0:
                tracer.request_started("r1")  # inside a step: must still be a root span
                tracer.phase_event("r1", EnterThink("r1"))
    tracer.phase_event("r1", ForceBudget("r1", ForceReason.OVERTHINKING))
    tracer.phase_event("r1", ExitThink("r1", think_tokens=812, forced=True))
    tracer.request_finished("r1")
    tracer.phase_event("r2", EnterThink("r2"))  # never "started": opened implicitly
    tracer.request_finished("r2")
    tracer.request_started("r3")  # still open at shutdown
    tracer.request_finished("unknown")  # ignored
    assert tracer.num_open_requests == 1
    tracer.shutdown()
    tracer.shutdown()

    assert got.paths and set(got.paths) == {"/v1/traces"}
    resource = attrs(got.traces[0].resource_spans[0].resource.attributes)
    assert resource["service.name"] == "meridian"
    all_spans = spans(got)
    steps = sorted(
        (s for s in all_spans if s.name == "meridian.step"),
        key=lambda s: attrs(s.attributes)["meridian.step"],
    )
    assert [attrs(s.attributes) for s in steps] == [
        {"meridian.step": i, "meridian.num_output": i, "meridian.num_think": 9,
         "meridian.deferred": i == 1}
        for i in range(3)
    ]  # fmt: skip
    requests = {
        attrs(s.attributes)["meridian.request_id"]: s
        for s in all_spans
        if s.name == "meridian.request"
    }
    assert set(requests) == {"r1", "r2", "r3"}
    r1 = requests["r1"]
    assert [e.name for e in r1.events] == ["EnterThink", "ForceBudget", "ExitThink"]
    assert attrs(r1.events[1].attributes) == {"meridian.force_reason": "overthinking"}
    assert attrs(r1.events[2].attributes) == {"meridian.think_tokens": 812, "meridian.forced": True}
    assert attrs(r1.attributes)["meridian.force_reason"] == "overthinking"
    assert attrs(r1.attributes)["meridian.think_tokens"] == 812
    assert r1.parent_span_id == b""
    assert r1.trace_id != steps[0].trace_id
    assert [e.name for e in requests["r2"].events] == ["EnterThink"]
    assert attrs(requests["r3"].attributes)["meridian.open_at_shutdown"] is True
    assert r1.end_time_unix_nano >= r1.start_time_unix_nano > 0


def test_open_request_spans_are_bounded(receiver: tuple[str, Received]) -> None:
    url, got = receiver
    tracer = OtlpTracer(url, max_open_requests=2)
    for rid in ("a", "b", "c"):
        tracer.request_started(rid)
    assert tracer.num_open_requests == 2
    tracer.shutdown()
    by_id = {attrs(s.attributes)["meridian.request_id"]: attrs(s.attributes) for s in spans(got)}
    assert by_id["a"].get("meridian.abandoned") is True
    assert "meridian.abandoned" not in by_id["c"]


def test_metrics_arrive_under_their_dotted_names(receiver: tuple[str, Received]) -> None:
    url, got = receiver
    metrics = MeridianMetrics()
    config = TelemetryConfig(otlp_enabled=True, otlp_endpoint=url)
    tracer = make_tracer(config, metrics=metrics)
    metrics.count_force(ForceReason.HARD_CAP)
    metrics.count_force(ForceReason.HARD_CAP)
    metrics.set_queue_depth(Phase.THINK, 17)
    metrics.observe_output_itl(0.012)
    metrics.observe_output_itl(0.3)
    metrics.set_kv_used_bytes(Tier.THINK_ACTIVE, 65536)
    metrics.count_kv_eviction(Tier.THINK_ACTIVE, 4)
    tracer.shutdown()  # the final collection is exported on shutdown
    metrics.count_force(ForceReason.HARD_CAP)  # after shutdown: Prometheus only, no error

    points = metric_points(got)
    forces = points[cat.BUDGET_FORCES.dotted][-1]
    assert forces.sum.is_monotonic
    assert [(attrs(p.attributes), p.as_double or p.as_int) for p in forces.sum.data_points] == [
        ({"reason": "hard_cap"}, 2)
    ]
    queue = points[cat.QUEUE_DEPTH.dotted][-1]
    assert [(attrs(p.attributes), p.as_double or p.as_int) for p in queue.gauge.data_points] == [
        ({"phase": "think"}, 17)
    ]
    itl = points[cat.OUTPUT_ITL.dotted][-1]
    assert itl.unit == "s"
    (hist,) = itl.histogram.data_points
    assert hist.count == 2
    assert list(hist.explicit_bounds) == list(cat.OUTPUT_ITL.buckets or ())
    used = points[cat.KV_USED.dotted][-1]
    assert used.unit == "By"
    assert {"tier": "think_active"} in [attrs(p.attributes) for p in used.gauge.data_points]
    assert points[cat.KV_EVICTIONS.dotted][-1].unit == "{blocks}"
    assert (
        metrics.registry.get_sample_value("meridian_budget_forces_total", {"reason": "hard_cap"})
        == 3
    )
