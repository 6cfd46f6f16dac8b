"""The metric catalogue: every metric Meridian exports, as plain data.

This module is the single source of truth for names, types, help texts, labels, units and
histogram buckets. :class:`meridian.telemetry.metrics.MeridianMetrics` builds the Prometheus
collectors from it, the OTLP bridge (:mod:`meridian.telemetry.otel`) builds OpenTelemetry
instruments from it, the documentation lists it, and ``tests/test_deploy.py`` checks that every
metric the dashboard and the alert rules query is defined here. It imports no Prometheus code.

Naming (an ADR in the docs records it):

- Prometheus names are ``meridian_<what>[_<base unit>]``; counters end in ``_total``; units are
  base units (``seconds``, ``bytes``), never milliseconds or megabytes.
- Each metric also has the design's dotted name (``meridian.queue_depth``), which is the name
  the OTLP export uses.
- Label values are enum values lower-cased (``phase="think"``, ``tier="output_critical"``,
  ``reason="hard_cap"``). Every known label value is pre-initialised, so every series exists at
  0 from the first scrape: ``increase()`` and ``absent()`` behave, alerts see a baseline.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from meridian.core.types import ForceReason, Phase, Tier


class MetricKind(enum.Enum):
    """The Prometheus metric type."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric of the catalogue.

    Invariants (checked by ``tests/test_telemetry_catalogue.py``): ``name`` is a legal
    Prometheus name starting with ``meridian_``; counters and only counters end in ``_total``;
    a ``seconds``/``bytes`` unit appears as the name's suffix (before ``_total``); histograms
    and only histograms have sorted, positive ``buckets``.
    """

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    dotted: str = ""
    unit: str = ""
    buckets: tuple[float, ...] | None = None

    @property
    def family(self) -> str:
        """The metric family name in the exposition format (counters lose ``_total``)."""
        if self.kind is MetricKind.COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


def phase_label(phase: Phase) -> str:
    """``Phase.THINK`` -> ``"think"``."""
    return phase.name.lower()


def tier_label(tier: Tier) -> str:
    """``Tier.OUTPUT_CRITICAL`` -> ``"output_critical"``."""
    return tier.name.lower()


# Label values every series is created with. Unknown error sites still work: their series
# appear on first use.
QUEUE_PHASES: Final = (Phase.THINK, Phase.OUTPUT)
ROW_PHASES: Final = (Phase.PREFILL, Phase.THINK, Phase.OUTPUT)
# A verified draft token was accepted or rejected.
DRAFT_OUTCOMES: Final = ("accepted", "rejected")
POLICY_ERROR_SITES: Final = (
    "schedule",
    "update_from_output",
    "free_request",
    "logits_processor",
    "kv_connector",
    "stat_logger",
)

_TOKENS_BUCKETS: Final = tuple(float(2**k) for k in range(6, 17))  # 64 .. 65536
_OVERHEAD_BUCKETS: Final = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
)  # fmt: skip
_ITL_BUCKETS: Final = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0,
)  # fmt: skip
_WAIT_BUCKETS: Final = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
_TTOT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

C, G, H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

# -- scheduling ---------------------------------------------------------------------------------
THINK_TOKENS: Final = MetricSpec(
    "meridian_request_think_tokens", H,
    "Think tokens a request generated, observed once when its think phase ends.",
    dotted="meridian.think_tokens", unit="tokens", buckets=_TOKENS_BUCKETS,
)  # fmt: skip
BUDGET_FORCES: Final = MetricSpec(
    "meridian_budget_forces_total", C,
    "Think phases ended by the budget policy injecting </think>, by reason "
    "(sum over reason for the total).",
    ("reason",), "meridian.budget_forces", "requests",
)  # fmt: skip
OUTPUT_CRITICAL_EVICTIONS: Final = MetricSpec(
    "meridian_output_critical_evictions_total", C,
    "OutputCritical KV blocks lost (evicted, or freed by preempting an answering request): "
    "each one is a user-visible stall.",
    (), "meridian.output_critical_evictions", "blocks",
)  # fmt: skip
TRACKED_REQUESTS: Final = MetricSpec(
    "meridian_tracked_requests", G,
    "Requests the phase router is tracking (should follow running + waiting); about once a "
    "second and when the engine idles.",
    (), "meridian.tracked_requests", "requests",
)  # fmt: skip
SCHEDULE_OVERHEAD: Final = MetricSpec(
    "meridian_schedule_overhead_seconds", H,
    "Wall time Meridian's policy adds to one scheduler step.",
    dotted="meridian.schedule_overhead", unit="seconds", buckets=_OVERHEAD_BUCKETS,
)  # fmt: skip
QUEUE_DEPTH: Final = MetricSpec(
    "meridian_queue_depth", G,
    "Running requests per dual-queue phase (output, think) after the last step; about once a "
    "second and when the engine idles.",
    ("phase",), "meridian.queue_depth", "requests",
)  # fmt: skip
BATCH_SIZE: Final = MetricSpec(
    "meridian_batch_size", G,
    "Rows scheduled in the last step, by phase; about once a second, and 0 when idle.",
    ("phase",), "meridian.batch_size", "requests",
)  # fmt: skip
PREEMPTIONS: Final = MetricSpec(
    "meridian_preemptions_total", C,
    "Requests preempted (recompute), by the phase they were in.",
    ("phase",), "meridian.preemptions", "requests",
)  # fmt: skip
POLICY_ERRORS: Final = MetricSpec(
    "meridian_policy_errors_total", C,
    "Exceptions caught in Meridian's hooks (the request fell back to stock vLLM behaviour), "
    "by hook.",
    ("where",), "meridian.policy_errors", "errors",
)  # fmt: skip

# -- user-felt latency, split by phase (vLLM's own histograms mix think and answer tokens) ----
TTFVT: Final = MetricSpec(
    "meridian_ttfvt_seconds", H,
    "Time to first visible token (GuideLLM/aiperf: time to first output token): request "
    "arrival to the first answer token (a request that did not reason: its first token); "
    "measured by the engine-core scheduler when it receives the token.",
    dotted="meridian.ttfvt", unit="seconds", buckets=_WAIT_BUCKETS,
)  # fmt: skip
TTOT: Final = MetricSpec(
    "meridian_ttot_seconds", H,
    "Time from </think> to the first answer token, as the engine-core scheduler receives them.",
    dotted="meridian.ttot", unit="seconds", buckets=_TTOT_BUCKETS,
)  # fmt: skip
OUTPUT_ITL: Final = MetricSpec(
    "meridian_output_itl_seconds", H,
    "Inter-token latency between consecutive answer tokens (think tokens excluded), as the "
    "engine-core scheduler receives them: a stalled stream's gap includes the stall.",
    dotted="meridian.output_itl", unit="seconds", buckets=_ITL_BUCKETS,
)  # fmt: skip

REASONING_SECONDS: Final = MetricSpec(
    "meridian_reasoning_seconds", H,
    "Reasoning duration (vLLM #54829: generation time of the reasoning phase): from a request's "
    "first generated token to the token that ends its think phase, as the engine-core scheduler "
    "receives them.",
    dotted="meridian.reasoning_duration", unit="seconds", buckets=_WAIT_BUCKETS,
)  # fmt: skip
GENERATED_TOKENS: Final = MetricSpec(
    "meridian_generated_tokens_total", C,
    "Tokens generated, by phase: think (reasoning tokens, as in usage.completion_tokens_details."
    "reasoning_tokens) and output (the answer's content tokens); the boundary markers count in "
    "neither. Counted about once a second and when the engine idles (a finished request's last "
    "tokens with the next count).",
    ("phase",), "meridian.generated_tokens", "tokens",
)  # fmt: skip

# -- speculative decoding -----------------------------------------------------------------------
DRAFT_TOKENS: Final = MetricSpec(
    "meridian_spec_decode_draft_tokens_total", C,
    "Draft tokens of speculative decoding the engine verified, by the phase the request was in "
    "when they were proposed (think: thinking, or its phase not yet known; output: answering) "
    "and by outcome (accepted, rejected): vLLM's counts (vllm:spec_decode_num_draft_tokens, "
    "num_accepted_tokens) split by phase. Counted about once a second and when the engine idles.",
    ("phase", "outcome"), "meridian.spec_decode_draft_tokens", "tokens",
)  # fmt: skip

# -- KV tiers -----------------------------------------------------------------------------------
KV_BLOCKS: Final = MetricSpec(
    "meridian_kv_blocks", G,
    "KV blocks the running requests hold for their computed tokens, by phase: think (thinking "
    "and prefilling requests) and output (answer streams, their prompt and reasoning included). "
    "A shared prefix block counts once per holder. About once a second, and 0 when idle.",
    ("phase",), "meridian.kv_blocks", "blocks",
)  # fmt: skip
KV_USED: Final = MetricSpec(
    "meridian_kv_used_bytes", G,
    "KV cache bytes held, by tier: in vLLM thinking and prefilling requests' blocks under "
    "think_active, answer streams' (their prompt and reasoning included) under output_critical.",
    ("tier",), "meridian.kv_used", "bytes",
)  # fmt: skip
KV_CAPACITY: Final = MetricSpec(
    "meridian_kv_capacity_bytes", G,
    "KV cache capacity in bytes (the denominator of KV usage).",
    (), "meridian.kv_capacity", "bytes",
)  # fmt: skip
KV_EVICTIONS: Final = MetricSpec(
    "meridian_kv_evicted_blocks_total", C,
    "KV blocks lost to a preemption (vLLM recomputes them), by the victim's tier.",
    ("tier",), "meridian.kv_evictions", "blocks",
)  # fmt: skip

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    THINK_TOKENS,
    BUDGET_FORCES,
    OUTPUT_CRITICAL_EVICTIONS,
    TRACKED_REQUESTS,
    SCHEDULE_OVERHEAD,
    QUEUE_DEPTH,
    BATCH_SIZE,
    PREEMPTIONS,
    POLICY_ERRORS,
    TTFVT,
    TTOT,
    OUTPUT_ITL,
    REASONING_SECONDS,
    GENERATED_TOKENS,
    DRAFT_TOKENS,
    KV_BLOCKS,
    KV_USED,
    KV_CAPACITY,
    KV_EVICTIONS,
)

# The cluster's front door (``meridian serve-cluster``'s ingress) exports these beside every
# replica's catalogue above: they count what happens between replicas, which no replica sees.
REPLICA_FAILURES: Final = MetricSpec(
    "meridian_replica_failures_total", C,
    "Requests that found their replica's engine no longer answering (the replica is then out "
    "of rotation until it answers again).",
    (), "meridian.replica_failures", "requests",
)  # fmt: skip
REQUESTS_REPLACED: Final = MetricSpec(
    "meridian_requests_replaced_total", C,
    "Requests placed on another replica after their replica failed, before anything of them "
    "reached the client.",
    (), "meridian.requests_replaced", "requests",
)  # fmt: skip
STREAMS_BROKEN: Final = MetricSpec(
    "meridian_streams_broken_total", C,
    "Streams whose replica failed after part of the answer reached the client: they end with "
    "an error event.",
    (), "meridian.streams_broken", "requests",
)  # fmt: skip

CLUSTER_CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    REPLICA_FAILURES,
    REQUESTS_REPLACED,
    STREAMS_BROKEN,
)

_BY_NAME: Final[Mapping[str, MetricSpec]] = {
    spec.name: spec for spec in (*CATALOGUE, *CLUSTER_CATALOGUE)
}

_PHASES_Q: Final = tuple(phase_label(p) for p in QUEUE_PHASES)
_PHASES_R: Final = tuple(phase_label(p) for p in ROW_PHASES)
_TIERS: Final = tuple(tier_label(t) for t in Tier)
_REASONS: Final = tuple(r.value for r in ForceReason)

# Pre-initialised label values per metric and label.
_INITIAL_VALUES: Final[Mapping[str, Mapping[str, tuple[str, ...]]]] = {
    BUDGET_FORCES.name: {"reason": _REASONS},
    QUEUE_DEPTH.name: {"phase": _PHASES_Q},
    BATCH_SIZE.name: {"phase": _PHASES_R},
    PREEMPTIONS.name: {"phase": _PHASES_R},
    POLICY_ERRORS.name: {"where": POLICY_ERROR_SITES},
    GENERATED_TOKENS.name: {"phase": _PHASES_Q},
    DRAFT_TOKENS.name: {"phase": _PHASES_Q, "outcome": DRAFT_OUTCOMES},
    KV_BLOCKS.name: {"phase": _PHASES_Q},
    KV_USED.name: {"tier": _TIERS},
    KV_EVICTIONS.name: {"tier": _TIERS},
}


def by_name(name: str) -> MetricSpec:
    """The catalogue entry called ``name`` (the Prometheus name, counters with ``_total``).

    >>> by_name("meridian_queue_depth").dotted
    'meridian.queue_depth'
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"no metric {name!r} in Meridian's catalogue; known: {', '.join(sorted(_BY_NAME))}"
        ) from None


def label_values(spec: MetricSpec, label: str) -> tuple[str, ...]:
    """The pre-initialised values of ``label`` on ``spec`` (empty for an unknown label)."""
    return _INITIAL_VALUES.get(spec.name, {}).get(label, ())


def initial_label_sets(spec: MetricSpec) -> tuple[tuple[str, ...], ...]:
    """Every label-value tuple (in ``spec.labels`` order) created at start-up.

    An unlabelled metric has one series, ``()``. A labelled one has the cartesian product of
    its labels' pre-initialised values.
    """
    return tuple(itertools.product(*(label_values(spec, label) for label in spec.labels)))
