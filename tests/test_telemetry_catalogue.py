"""The metric catalogue (naming rules, required content) and MeridianMetrics' event methods."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from meridian.core.types import ForceReason, Phase, Tier
from meridian.telemetry import catalogue as cat
from meridian.telemetry.catalogue import CATALOGUE, MetricKind, by_name
from meridian.telemetry.metrics import MeridianMetrics, MetricsRegistrationError

# Letters and underscores only: tests/test_deploy.py finds names in PromQL with this pattern.
NAME = re.compile(r"^meridian_[a-z_]+[a-z]$")
LABEL = re.compile(r"^[a-z][a-z_]*$")
DOTTED = re.compile(r"^meridian(\.[a-z_]+)+$")


def sample(m: MeridianMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


# -- naming rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda s: s.name)
def test_names_follow_prometheus_conventions(spec: cat.MetricSpec) -> None:
    assert NAME.match(spec.name)
    assert (spec.kind is MetricKind.COUNTER) == spec.name.endswith("_total")
    base = spec.name.removesuffix("_total")
    for unit in ("seconds", "bytes"):
        # Base units appear as the suffix, and a suffix promises the unit.
        assert (spec.unit == unit) == base.endswith(f"_{unit}"), spec.name
    assert not re.search(r"_(ms|milliseconds|mb|kb|gb|percent)(_|$)", spec.name)
    assert spec.help and spec.help[0].isupper() and spec.help.endswith(".")
    assert DOTTED.match(spec.dotted)
    for label in spec.labels:
        assert LABEL.match(label) and label not in ("le", "quantile")


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda s: s.name)
def test_buckets_on_histograms_only(spec: cat.MetricSpec) -> None:
    if spec.kind is MetricKind.HISTOGRAM:
        assert spec.buckets
        assert list(spec.buckets) == sorted(set(spec.buckets))
        assert spec.buckets[0] > 0
    else:
        assert spec.buckets is None


def test_names_and_dotted_names_are_unique() -> None:
    assert len({s.name for s in CATALOGUE}) == len(CATALOGUE)
    assert len({s.dotted for s in CATALOGUE}) == len(CATALOGUE)
    assert len({s.family for s in CATALOGUE}) == len(CATALOGUE)


def test_every_label_is_pre_initialised() -> None:
    for spec in CATALOGUE:
        for label in spec.labels:
            assert cat.label_values(spec, label), f"{spec.name}: no initial values for {label}"
        sets = cat.initial_label_sets(spec)
        assert sets and all(len(s) == len(spec.labels) for s in sets)


def test_by_name_finds_entries_and_explains_misses() -> None:
    assert by_name("meridian_queue_depth").dotted == "meridian.queue_depth"
    assert by_name("meridian_budget_forces_total").labels == ("reason",)
    with pytest.raises(KeyError, match="meridian_queue_depth"):
        by_name("meridian_queue_dept")


def test_counter_family_drops_total() -> None:
    assert by_name("meridian_preemptions_total").family == "meridian_preemptions"
    assert by_name("meridian_queue_depth").family == "meridian_queue_depth"


# -- required content (issue 6) -----------------------------------------------------------------


def values(name: str, label: str) -> set[str]:
    return set(cat.label_values(by_name(name), label))


def test_catalogue_has_what_the_issue_requires() -> None:
    kinds = {s.name: s.kind for s in CATALOGUE}
    required = {
        "meridian_request_think_tokens": MetricKind.HISTOGRAM,
        "meridian_budget_forces_total": MetricKind.COUNTER,
        "meridian_output_critical_evictions_total": MetricKind.COUNTER,
        "meridian_tracked_requests": MetricKind.GAUGE,
        "meridian_schedule_overhead_seconds": MetricKind.HISTOGRAM,
        "meridian_queue_depth": MetricKind.GAUGE,
        "meridian_kv_used_bytes": MetricKind.GAUGE,
        "meridian_kv_capacity_bytes": MetricKind.GAUGE,
        "meridian_kv_evicted_blocks_total": MetricKind.COUNTER,
        "meridian_batch_size": MetricKind.GAUGE,
        "meridian_preemptions_total": MetricKind.COUNTER,
        "meridian_policy_errors_total": MetricKind.COUNTER,
    }
    for name, kind in required.items():
        assert kinds.get(name) is kind, name
    # No live process computes entropy row by row: the per-row fallback counter was dropped.
    assert "meridian_vocab_fallbacks_total" not in kinds
    # The KV pool and the offload manager are retired (vLLM's OffloadingConnector offloads):
    # nothing emits the disaggregation metrics any more.
    assert not [name for name in kinds if name.startswith("meridian_disagg_")]
    assert values("meridian_budget_forces_total", "reason") == {
        "converged",
        "overthinking",
        "hard_cap",
    }
    assert values("meridian_queue_depth", "phase") == {"output", "think"}
    tiers = {"think_active", "output_critical"}
    assert values("meridian_kv_used_bytes", "tier") == tiers
    assert values("meridian_kv_evicted_blocks_total", "tier") == tiers
    assert {"output", "think"} <= values("meridian_batch_size", "phase")
    assert {"output", "think"} <= values("meridian_preemptions_total", "phase")


def test_catalogue_module_imports_no_prometheus() -> None:
    code = (
        "import sys, meridian.telemetry.catalogue, meridian.telemetry\n"
        "bad = [m for m in ('prometheus_client', 'opentelemetry', 'meridian.sim') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- MeridianMetrics ----------------------------------------------------------------------------


def test_every_series_exists_at_zero_from_the_start() -> None:
    m = MeridianMetrics()
    for spec in CATALOGUE:
        for label_set in cat.initial_label_sets(spec):
            labels = dict(zip(spec.labels, label_set, strict=True))
            if spec.kind is MetricKind.HISTOGRAM:
                assert sample(m, f"{spec.name}_count", **labels) == 0.0
            else:
                assert sample(m, spec.name, **labels) == 0.0


def test_events_land_on_the_right_series() -> None:
    m = MeridianMetrics()
    m.count_force(ForceReason.HARD_CAP)
    m.count_force(ForceReason.HARD_CAP)
    m.count_force(ForceReason.CONVERGED)
    m.set_queue_depth(Phase.THINK, 7)
    m.set_queue_depth(Phase.OUTPUT, 3)
    m.set_batch_size(Phase.PREFILL, 2)
    m.count_preemption(Phase.THINK, 4)
    m.set_kv_used_bytes(Tier.THINK_ACTIVE, 1 << 20)
    m.set_kv_capacity_bytes(1 << 30)
    m.observe_think_tokens(1000)
    m.observe_schedule_overhead(3e-4)
    m.set_tracked_requests(11)
    m.count_policy_error("schedule")
    m.count_policy_error("somewhere_new")
    m.observe_ttfvt(1.5)
    m.observe_ttot(0.02)
    m.observe_output_itl(0.018)
    assert sample(m, "meridian_budget_forces_total", reason="hard_cap") == 2
    assert sample(m, "meridian_budget_forces_total", reason="converged") == 1
    assert sample(m, "meridian_budget_forces_total", reason="overthinking") == 0
    assert sample(m, "meridian_queue_depth", phase="think") == 7
    assert sample(m, "meridian_queue_depth", phase="output") == 3
    assert sample(m, "meridian_batch_size", phase="prefill") == 2
    assert sample(m, "meridian_preemptions_total", phase="think") == 4
    assert sample(m, "meridian_preemptions_total", phase="output") == 0
    assert sample(m, "meridian_kv_used_bytes", tier="think_active") == 1 << 20
    assert sample(m, "meridian_kv_capacity_bytes") == 1 << 30
    assert sample(m, "meridian_request_think_tokens_sum") == 1000
    assert sample(m, "meridian_request_think_tokens_bucket", le="1024.0") == 1
    assert sample(m, "meridian_request_think_tokens_bucket", le="512.0") == 0
    assert sample(m, "meridian_schedule_overhead_seconds_count") == 1
    assert sample(m, "meridian_tracked_requests") == 11
    assert sample(m, "meridian_policy_errors_total", where="schedule") == 1
    assert sample(m, "meridian_policy_errors_total", where="somewhere_new") == 1
    assert sample(m, "meridian_ttfvt_seconds_sum") == 1.5
    assert sample(m, "meridian_ttot_seconds_count") == 1
    assert sample(m, "meridian_output_itl_seconds_bucket", le="0.02") == 1
    assert sample(m, "meridian_output_itl_seconds_bucket", le="0.015") == 0
    with pytest.raises(ValueError, match="where"):
        m.count_policy_error("")


def test_output_critical_kv_eviction_counts_as_output_critical_eviction() -> None:
    m = MeridianMetrics()
    m.count_kv_eviction(Tier.THINK_ACTIVE, 5)
    assert sample(m, "meridian_output_critical_evictions_total") == 0
    m.count_kv_eviction(Tier.OUTPUT_CRITICAL, 2)
    m.count_output_critical_eviction(3)
    assert sample(m, "meridian_kv_evicted_blocks_total", tier="output_critical") == 2
    assert sample(m, "meridian_kv_evicted_blocks_total", tier="think_active") == 5
    assert sample(m, "meridian_output_critical_evictions_total") == 5


def test_draft_tokens_land_by_phase_and_outcome() -> None:
    """Speculative decoding's verified drafts: one series per phase (think, output) and
    outcome (accepted, rejected), all at 0 from the start; PREFILL is not a label of its own."""
    m = MeridianMetrics()
    assert values("meridian_spec_decode_draft_tokens_total", "outcome") == {"accepted", "rejected"}
    assert values("meridian_spec_decode_draft_tokens_total", "phase") == {"output", "think"}
    m.count_draft_tokens(Phase.THINK, 5, 7)
    m.count_draft_tokens(Phase.OUTPUT, 0, 3)
    m.count_draft_tokens(Phase.THINK, 1, 0)
    name = "meridian_spec_decode_draft_tokens_total"
    assert sample(m, name, phase="think", outcome="accepted") == 6
    assert sample(m, name, phase="think", outcome="rejected") == 7
    assert sample(m, name, phase="output", outcome="accepted") == 0
    assert sample(m, name, phase="output", outcome="rejected") == 3
    with pytest.raises(ValueError, match="draft tokens"):
        m.count_draft_tokens(Phase.PREFILL, 1, 1)


def test_unsupported_phase_is_a_clear_error() -> None:
    m = MeridianMetrics()
    with pytest.raises(ValueError, match=r"THINK, OUTPUT; got <Phase\.PREFILL"):
        m.set_queue_depth(Phase.PREFILL, 1)
    with pytest.raises(ValueError, match="COMPLETE"):
        m.count_preemption(Phase.COMPLETE)
    with pytest.raises(ValueError, match="non-negative"):
        m.count_preemption(Phase.THINK, -1)


def test_one_instance_per_registry() -> None:
    registry = CollectorRegistry()
    first = MeridianMetrics(registry)
    with pytest.raises(MetricsRegistrationError, match="unregister"):
        MeridianMetrics(registry)
    # The failed attempt rolled back: the first instance still works and owns every name.
    first.count_force(ForceReason.CONVERGED)
    assert registry.get_sample_value("meridian_budget_forces_total", {"reason": "converged"})
    first.unregister()
    assert registry.get_sample_value("meridian_tracked_requests") is None
    second = MeridianMetrics(registry)
    assert second.registry.get_sample_value("meridian_tracked_requests") == 0


def test_instances_on_private_registries_are_independent() -> None:
    a, b = MeridianMetrics(), MeridianMetrics()
    a.count_force(ForceReason.OVERTHINKING)
    assert sample(b, "meridian_budget_forces_total", reason="overthinking") == 0


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, float, tuple[str, ...]]] = []

    def record(self, spec: cat.MetricSpec, value: float, labels: tuple[str, ...]) -> None:
        assert len(labels) == len(spec.labels)
        self.events.append((spec.name, value, labels))


def test_sink_receives_every_event_with_labels_in_order() -> None:
    m = MeridianMetrics()
    sink = RecordingSink()
    m.set_sink(sink)
    m.count_force(ForceReason.OVERTHINKING)
    m.count_policy_error("schedule")
    m.count_kv_eviction(Tier.OUTPUT_CRITICAL, 2)
    m.set_sink(None)
    m.count_force(ForceReason.OVERTHINKING)
    assert sink.events == [
        ("meridian_budget_forces_total", 1, ("overthinking",)),
        ("meridian_policy_errors_total", 1, ("schedule",)),
        ("meridian_kv_evicted_blocks_total", 2, ("output_critical",)),
        ("meridian_output_critical_evictions_total", 2, ()),
    ]


# -- property: the registry agrees with a plain model of the events -----------------------------

Event = tuple[str, object, int]

events_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("force"), st.sampled_from(list(ForceReason)), st.just(1)),
        st.tuples(st.just("evict"), st.sampled_from(list(Tier)), st.integers(0, 50)),
        st.tuples(st.just("oc"), st.none(), st.integers(0, 50)),
        st.tuples(st.just("preempt"), st.sampled_from(cat.ROW_PHASES), st.integers(0, 5)),
        st.tuples(st.just("queue"), st.sampled_from(cat.QUEUE_PHASES), st.integers(0, 500)),
        st.tuples(st.just("think"), st.none(), st.integers(0, 70000)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(events_strategy)
def test_registry_matches_a_model_of_the_events(events: list[Event]) -> None:
    m = MeridianMetrics()
    forces = dict.fromkeys(ForceReason, 0)
    evicted = dict.fromkeys(Tier, 0)
    preempted = dict.fromkeys(cat.ROW_PHASES, 0)
    queue = dict.fromkeys(cat.QUEUE_PHASES, 0)
    oc = 0
    think: list[int] = []
    for kind, key, n in events:
        if kind == "force":
            assert isinstance(key, ForceReason)
            m.count_force(key)
            forces[key] += 1
        elif kind == "evict":
            assert isinstance(key, Tier)
            m.count_kv_eviction(key, n)
            evicted[key] += n
            oc += n if key is Tier.OUTPUT_CRITICAL else 0
        elif kind == "oc":
            m.count_output_critical_eviction(n)
            oc += n
        elif kind == "preempt":
            assert isinstance(key, Phase)
            m.count_preemption(key, n)
            preempted[key] += n
        elif kind == "queue":
            assert isinstance(key, Phase)
            m.set_queue_depth(key, n)
            queue[key] = n
        else:
            m.observe_think_tokens(n)
            think.append(n)
    for r, n in forces.items():
        assert sample(m, "meridian_budget_forces_total", reason=r.value) == n
    for t, n in evicted.items():
        assert sample(m, "meridian_kv_evicted_blocks_total", tier=cat.tier_label(t)) == n
    for p, n in preempted.items():
        assert sample(m, "meridian_preemptions_total", phase=cat.phase_label(p)) == n
    for p, n in queue.items():
        assert sample(m, "meridian_queue_depth", phase=cat.phase_label(p)) == n
    assert sample(m, "meridian_output_critical_evictions_total") == oc
    # The documented invariant, read from the registry (not from the model above).
    assert sample(m, "meridian_output_critical_evictions_total") >= sample(
        m, "meridian_kv_evicted_blocks_total", tier="output_critical"
    )
    assert sample(m, "meridian_request_think_tokens_count") == len(think)
    assert sample(m, "meridian_request_think_tokens_sum") == sum(think)
    assert sample(m, "meridian_request_think_tokens_bucket", le="+Inf") == len(think)
    assert sample(m, "meridian_request_think_tokens_bucket", le="4096.0") == sum(
        1 for n in think if n <= 4096
    )
