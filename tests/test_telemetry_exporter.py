"""Scrape a live standalone exporter: every catalogue entry with its type and labels; sim export."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from meridian.bench.sim_metrics import record_sim_result
from meridian.config import MeridianConfig
from meridian.core.types import ForceReason, Phase
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.policies import make_sim_policy, parse_policy
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.steptime import BatchShape
from meridian.sim.streams import FORCING_MERIDIAN, build_streams
from meridian.telemetry import catalogue as cat
from meridian.telemetry.catalogue import CATALOGUE, MetricKind
from meridian.telemetry.exporter import (
    ExporterError,
    metrics_server,
    serve_metrics,
    stop_metrics_server,
)
from meridian.telemetry.metrics import MeridianMetrics

Families = dict[str, tuple[str, list[Sample]]]


def scrape(port: int) -> Families:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(response.text)
    }


@pytest.fixture
def served() -> Iterator[tuple[MeridianMetrics, int]]:
    metrics = MeridianMetrics()
    server, port = serve_metrics(metrics)
    try:
        yield metrics, port
    finally:
        stop_metrics_server(server)


def value(families: Families, spec: cat.MetricSpec, suffix: str = "", **labels: str) -> float:
    _type, samples = families[spec.family]
    name = spec.name + suffix
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


# -- the scrape test ----------------------------------------------------------------------------


def test_every_catalogue_entry_is_scraped_with_type_and_labels(
    served: tuple[MeridianMetrics, int],
) -> None:
    _metrics, port = served
    families = scrape(port)
    for spec in CATALOGUE:
        assert spec.family in families, f"{spec.name} missing from /metrics"
        kind, samples = families[spec.family]
        assert kind == spec.kind.value, spec.name
        main = {
            MetricKind.COUNTER: {spec.name},
            MetricKind.GAUGE: {spec.name},
            MetricKind.HISTOGRAM: {f"{spec.name}_{s}" for s in ("bucket", "count", "sum")},
        }[spec.kind]
        assert {s.name for s in samples} == main, spec.name
        for s in samples:
            names = set(s.labels) - ({"le"} if s.name.endswith("_bucket") else set())
            assert names == set(spec.labels), f"{s.name} has labels {sorted(s.labels)}"
        # Every pre-initialised series is there, at 0, before any event.
        series = {
            tuple(s.labels[label] for label in spec.labels): s.value
            for s in samples
            if s.name in (spec.name, f"{spec.name}_count")
        }
        assert set(series) == set(cat.initial_label_sets(spec)), spec.name
        assert all(v == 0 for v in series.values())
        if spec.kind is MetricKind.HISTOGRAM:
            assert spec.buckets is not None
            les = {s.labels["le"] for s in samples if s.name.endswith("_bucket")}
            assert les == {repr(float(b)) for b in spec.buckets} | {"+Inf"}


def test_scrape_reflects_events(served: tuple[MeridianMetrics, int]) -> None:
    metrics, port = served
    metrics.count_force(ForceReason.HARD_CAP)
    metrics.set_queue_depth(Phase.THINK, 42)
    metrics.observe_output_itl(0.012)
    families = scrape(port)
    assert value(families, cat.BUDGET_FORCES, reason="hard_cap") == 1
    assert value(families, cat.QUEUE_DEPTH, phase="think") == 42
    assert value(families, cat.OUTPUT_ITL, "_bucket", le="0.015") == 1
    assert value(families, cat.OUTPUT_ITL, "_bucket", le="0.01") == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20, allow_nan=False), st.integers(0, 50)), max_size=8))
def test_counted_itl_observations_equal_one_by_one(obs: list[tuple[float, int]]) -> None:
    from prometheus_client import generate_latest

    counted, single = MeridianMetrics(), MeridianMetrics()
    for seconds, count in obs:
        counted.observe_output_itl(seconds, count)
        for _ in range(count):
            single.observe_output_itl(seconds)

    def itl(m: MeridianMetrics) -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(generate_latest(m.registry).decode())
        family = next(f for f in families if f.name == cat.OUTPUT_ITL.name)
        return {(s.name, s.labels.get("le", "")): s.value for s in family.samples}

    got, want = itl(counted), itl(single)
    assert got.keys() == want.keys()
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-9, abs=1e-9), key


def test_exporter_binds_loopback_and_stops() -> None:
    metrics = MeridianMetrics()
    with metrics_server(metrics) as port:
        assert port > 0
        assert scrape(port)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0)


def test_exporter_errors_are_clear() -> None:
    metrics = MeridianMetrics()
    with pytest.raises(ExporterError, match=r"port must be in \[0, 65535\]; got 70000"):
        serve_metrics(metrics, port=70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(ExporterError, match=f"cannot serve metrics on 127.0.0.1:{busy}"):
            serve_metrics(metrics, port=busy)


# -- the simulator reports through the same catalogue -------------------------------------------


def record(rid: str, **kw: object) -> RequestRecord:
    base: dict[str, object] = dict(
        kind=RequestKind.REASONING,
        arrival_ns=0,
        num_prompt_tokens=10,
        num_think_tokens_requested=100,
        num_answer_tokens_requested=3,
    )
    base.update(kw)
    return RequestRecord(rid, **base)  # type: ignore[arg-type]


def test_record_sim_result_by_hand() -> None:
    records = [
        record(
            "a",
            arrival_ns=1_000_000_000,
            think_end_ns=3_000_000_000,
            first_answer_ns=3_500_000_000,
            finish_ns=3_540_000_000,
            num_think_tokens=700,
            forced_reason=ForceReason.CONVERGED,
            answer_token_ns=[3_500_000_000, 3_520_000_000, 3_540_000_000],
        ),
        record(  # a chat request: no think phase, so no think-token observation
            "b",
            kind=RequestKind.CHAT,
            first_answer_ns=200_000_000,
            finish_ns=210_000_000,
            answer_token_ns=[200_000_000, 210_000_000],
        ),
        record("c", think_end_ns=5, num_think_tokens=9000, forced_reason=ForceReason.HARD_CAP),
    ]
    counters = RunCounters(
        num_scheduled_tokens=900, preemptions_by_phase={Phase.THINK: 2, Phase.OUTPUT: 1}
    )
    sample = TimeSample(0, 50, 20, 9, 4, 3, 6)
    result = SimResult("meridian", "model", 1000, records, [sample], counters, 4_000_000_000)
    metrics = MeridianMetrics()
    record_sim_result(metrics, result, block_size_bytes=1024)

    def get(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert get("meridian_request_think_tokens_count") == 2
    assert get("meridian_request_think_tokens_sum") == 9700
    assert get("meridian_budget_forces_total", reason="converged") == 1
    assert get("meridian_budget_forces_total", reason="hard_cap") == 1
    assert get("meridian_budget_forces_total", reason="overthinking") == 0
    assert get("meridian_ttfvt_seconds_count") == 2
    assert get("meridian_ttfvt_seconds_sum") == pytest.approx(2.5 + 0.2)
    assert get("meridian_ttot_seconds_sum") == pytest.approx(0.5)
    assert get("meridian_output_itl_seconds_count") == 3  # 2 gaps for a, 1 for b
    assert get("meridian_output_itl_seconds_sum") == pytest.approx(0.05)
    assert get("meridian_preemptions_total", phase="think") == 2
    assert get("meridian_preemptions_total", phase="output") == 1
    assert get("meridian_tracked_requests") == 1  # "c" never finished
    assert get("meridian_queue_depth", phase="output") == 3
    assert get("meridian_queue_depth", phase="think") == 6
    # The simulator has no OutputCritical evictions and samples no batch sizes: those series
    # stay at their initial 0.
    assert get("meridian_output_critical_evictions_total") == 0
    assert get("meridian_batch_size", phase="output") == 0
    assert get("meridian_batch_size", phase="think") == 0
    assert get("meridian_kv_capacity_bytes") == 1000 * 1024
    assert get("meridian_kv_used_bytes", tier="think_active") == 20 * 1024
    assert get("meridian_kv_used_bytes", tier="output_critical") == 30 * 1024
    with pytest.raises(ValueError, match="block_size_bytes must be positive"):
        record_sim_result(metrics, result, block_size_bytes=0)


class LinearStepTime:
    label = "linear"

    def step_time_ns(self, batch: BatchShape) -> int:
        return 1_000_000 + 10_000 * (batch.num_prefill_tokens + batch.num_decode_seqs)


def small_workload(n: int) -> list[RequestSpec]:
    rng = np.random.default_rng(7)
    specs = []
    for i in range(n):
        think = int(rng.integers(300, 900))
        settle = think // 3
        ent = np.full(think, 1.2, dtype=np.float32)
        ent[:settle] += rng.normal(0, 0.4, settle).astype(np.float32)
        specs.append(
            RequestSpec(
                f"r{i}",
                i * 20_000_000,
                int(rng.integers(20, 100)),
                think,
                int(rng.integers(10, 60)),
                RequestKind.REASONING,
                ent.clip(0.01),
                settle,
            )
        )
    return specs


def test_a_real_sim_run_scraped_matches_its_result() -> None:
    config = MeridianConfig.model_validate(
        {"scheduler": {"min_think_tokens": 64, "max_think_tokens": 600}}
    )
    engine = Engine(
        EngineConfig(num_kv_blocks=120, max_num_seqs=16, max_num_batched_tokens=256),
        LinearStepTime(),
        make_sim_policy(parse_policy("meridian"), config, 50_000_000),
    )
    result = engine.run(build_streams(small_workload(24), FORCING_MERIDIAN, config))
    assert result.engine == "model"
    metrics = MeridianMetrics()
    record_sim_result(metrics, result)
    with metrics_server(metrics) as port:
        families = scrape(port)

    forced = [r.forced_reason for r in result.records if r.forced_reason is not None]
    assert forced, "the workload should make the budget policy force some requests"
    for reason in ForceReason:
        assert value(families, cat.BUDGET_FORCES, reason=reason.value) == forced.count(reason)
    thought = [r.num_think_tokens for r in result.records if r.think_end_ns is not None]
    assert value(families, cat.THINK_TOKENS, "_count") == len(thought) == len(result.records)
    assert value(families, cat.THINK_TOKENS, "_sum") == sum(thought)
    num_gaps = sum(max(0, len(r.answer_token_ns) - 1) for r in result.records)
    assert value(families, cat.OUTPUT_ITL, "_count") == num_gaps
    for phase in cat.ROW_PHASES:
        expected = result.counters.preemptions_by_phase.get(phase, 0)
        assert value(families, cat.PREEMPTIONS, phase=cat.phase_label(phase)) == expected
    assert value(families, cat.OUTPUT_CRITICAL_EVICTIONS) == 0  # not a simulator event
    assert value(families, cat.TRACKED_REQUESTS) == 0  # every request finished


def test_the_adapters_listener_observes_exits_and_first_answers_in_batches() -> None:
    """vLLM's listener stamps a think exit and a first answer on the step's path and observes
    them later, in a batch: the same figures as at once, whether the batch is settled by a
    publish or by a request's end (after which its stamps must not linger)."""
    from types import SimpleNamespace

    from meridian.telemetry.otel import Tracer
    from meridian.vllm.publishing import MetricsListener

    clock = [0.0]
    metrics = MeridianMetrics()
    requests = {rid: SimpleNamespace(arrival_time=0.5) for rid in ("a", "b", "c")}
    listener = MetricsListener(metrics, Tracer(), requests, lambda: clock[0])

    def get(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    def at(t: float, event: Callable[[], None]) -> None:
        clock[0] = t
        event()

    at(1.0, lambda: listener.reasoning_started("a"))
    at(1.0, lambda: listener.reasoning_started("b"))
    at(3.0, lambda: listener.think_ended("a", 40, True))
    at(4.0, lambda: listener.first_answer("a"))
    at(5.0, lambda: listener.think_ended("b", 60, False))
    at(5.5, lambda: listener.first_answer("c"))  # answered without reasoning
    assert get("meridian_ttot_seconds_count") == 0  # nothing observed yet
    del requests["a"]  # freed: its arrival was read when it answered
    listener.requests_finished(["a"])  # settles the batch, then forgets "a"
    listener.publish()
    assert get("meridian_reasoning_seconds_count") == 2
    assert get("meridian_reasoning_seconds_sum") == pytest.approx(2.0 + 4.0)
    assert get("meridian_request_think_tokens_sum") == 100
    assert get("meridian_budget_forces_total", reason="hard_cap") == 1
    assert get("meridian_ttfvt_seconds_count") == 2
    assert get("meridian_ttfvt_seconds_sum") == pytest.approx(3.5 + 5.0)
    assert get("meridian_ttot_seconds_count") == 1
    assert get("meridian_ttot_seconds_sum") == pytest.approx(1.0)
    # "b" ended its reasoning in the last batch and answers in the next one: TTOT spans them.
    at(7.0, lambda: listener.first_answer("b"))
    listener.publish()
    assert get("meridian_ttot_seconds_count") == 2
    assert get("meridian_ttot_seconds_sum") == pytest.approx(1.0 + 2.0)
    assert get("meridian_ttfvt_seconds_sum") == pytest.approx(3.5 + 5.0 + 6.5)
    # Nothing of "a" is left to observe again.
    listener.publish()
    assert get("meridian_ttot_seconds_count") == 2
    assert get("meridian_reasoning_seconds_count") == 2
    # A request aborted between its think exit and its first answer leaves nothing behind (the
    # listener lives as long as the engine).
    at(8.0, lambda: listener.reasoning_started("d"))
    at(9.0, lambda: listener.think_ended("d", 10, False))
    listener.requests_finished(["d", "b", "c"])
    listener.publish()
    assert get("meridian_reasoning_seconds_sum") == pytest.approx(2.0 + 4.0 + 1.0)
    assert not listener._think_ended_at and not listener._reasoning_from
    # A request whose max_tokens ran out inside its forced phrase never ends its think phase:
    # its force is counted when it finishes (and only the force: no think tokens observed).
    listener.force_cut_short("e")
    listener.requests_finished(["e"])
    listener.publish()
    assert get("meridian_budget_forces_total", reason="hard_cap") == 2
    assert get("meridian_request_think_tokens_count") == 3


def test_the_adapters_kv_gauges_follow_the_running_requests_across_publishes() -> None:
    """The KV blocks by phase are published with each batch, and only written when they
    changed: an idle engine's zeros stay zeros, and blocks that come back after them are
    written again."""
    import logging
    from types import SimpleNamespace

    from meridian.config import SchedulerConfig
    from meridian.core.format import ReasoningFormat
    from meridian.core.policy import MeridianPolicy
    from meridian.telemetry.otel import Tracer
    from meridian.vllm.failopen import FailOpen
    from meridian.vllm.publishing import AdapterStats, MetricsListener, Publisher

    metrics = MeridianMetrics()
    listener = MetricsListener(metrics, Tracer(), {}, lambda: 0.0)
    fmt = ReasoningFormat(think_start=(7,), think_end=(8,))
    policy = MeridianPolicy(fmt, SchedulerConfig(), block_size=16, capacity=8, listener=listener)
    fail_open = FailOpen(metrics, logging.getLogger(__name__), "scheduler")
    publisher = Publisher(metrics, listener, policy, AdapterStats(), fail_open, kv_block_bytes=100)
    policy.track("think", [1, 7])
    policy.track("answer", [1, 7, 5, 8])

    def running(think_tokens: int, answer_tokens: int) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(
                request_id="think", num_computed_tokens=think_tokens, num_output_tokens=0
            ),
            SimpleNamespace(
                request_id="answer", num_computed_tokens=answer_tokens, num_output_tokens=0
            ),
        ]

    def kv() -> tuple[float | None, ...]:
        get = metrics.registry.get_sample_value
        return (
            get("meridian_kv_blocks", {"phase": "think"}),
            get("meridian_kv_blocks", {"phase": "output"}),
            get("meridian_kv_used_bytes", {"tier": "think_active"}),
            get("meridian_kv_used_bytes", {"tier": "output_critical"}),
        )

    publisher.step_done(running(20, 33), idle=True)
    assert kv() == (2, 3, 200, 300)
    publisher.step_done([], idle=True)
    assert kv() == (0, 0, 0, 0)
    publisher.step_done([], idle=True)  # unchanged: nothing to write
    assert kv() == (0, 0, 0, 0)
    publisher.step_done(running(20, 33), idle=True)
    assert kv() == (2, 3, 200, 300)


def test_a_guard_over_a_batch_fails_each_item_alone_and_times_the_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from meridian.vllm.failopen import FailOpen, Guard
    from meridian.vllm.publishing import AdapterStats

    metrics = MeridianMetrics()
    fail_open = FailOpen(metrics, logging.getLogger(__name__), "scheduler")
    stats = AdapterStats()
    done: list[tuple[str, int]] = []

    def track(rid: str, n: int) -> None:
        if n < 0:
            raise ValueError(f"bad {rid}")
        done.append((rid, n))

    guard = Guard(fail_open, "add_request", None, stats, "update_overhead_s")
    with caplog.at_level(logging.ERROR):
        guard.each(track, [("a", 1), ("b", -1), ("c", 3), ("d", -2)])
    assert done == [("a", 1), ("c", 3)]  # the rest went on past each failure
    assert fail_open.num_errors == 2
    assert "request=b" in caplog.text  # the first of its kind logged, with its request
    assert (
        metrics.registry.get_sample_value("meridian_policy_errors_total", {"where": "add_request"})
        == 2
    )
    assert stats.update_overhead_s > 0
    with pytest.raises(ValueError, match="bad x"):  # no FailOpen: it only times
        Guard.time(stats, "update_overhead_s").each(track, [("x", -1)])
