"""A/B comparison: the candidate policy (``meridian``) against each baseline, metric by metric.

Δ% is the candidate's relative change against the baseline, ``(candidate - baseline) /
|baseline| * 100``; whether a positive Δ is good depends on the metric's :class:`Direction`.

Flags (thresholds on |Δ|, inclusive at the lower edge):

====================  ==========  ==========
|Δ|                   better      worse
====================  ==========  ==========
< 2 %                 FLAT        FLAT
2 % to < 10 %         win         loss
>= 10 %               WIN         LOSS
====================  ==========  ==========

When the baseline is 0 a relative change is undefined, so the comparison is absolute: equal is
FLAT, a better candidate is WIN and a worse one LOSS (for counts such as preemptions: any
preemption where the baseline had none is a LOSS), and Δ% is ``None``. A metric missing on
either side (``None``, e.g. no TTOT because there were no reasoning requests) has no Δ and no
flag.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from meridian.bench.slo import GOODPUT_SCALE, UserModel
from meridian.bench.summary import PolicySummary, Sig6

FLAT_BELOW_PCT = 2.0
BIG_FROM_PCT = 10.0
THRESHOLDS_TEXT = (
    "Flags: |Δ| < 2 % is FLAT; 2–10 % better is win, ≥ 10 % better is WIN; 2–10 % worse is "
    "loss, ≥ 10 % worse is LOSS. Better means lower for latencies, think tokens, answer gaps, "
    "preemptions and recomputed tokens, and higher for throughput, goodput, SLO attainment and "
    "accuracy. When the baseline is 0 the comparison is absolute: equal is FLAT, better is WIN, "
    "worse is LOSS."
)


class Direction(enum.Enum):
    """Which way a metric improves."""

    LOWER = "lower"
    HIGHER = "higher"


class AbFlag(enum.Enum):
    """The verdict on one metric against one baseline, from the candidate's point of view."""

    WIN = "WIN"
    WIN_SMALL = "win"
    FLAT = "FLAT"
    LOSS_SMALL = "loss"
    LOSS = "LOSS"

    @property
    def is_loss(self) -> bool:
        """True for ``loss`` and ``LOSS``."""
        return self in (AbFlag.LOSS, AbFlag.LOSS_SMALL)


@dataclass(frozen=True, slots=True)
class HeadlineMetric:
    """One row of the A/B table: how to read the value from a summary and which way is better."""

    key: str
    label: str
    unit: str
    direction: Direction
    read: Callable[[PolicySummary], float | None]


def _attained(summary: PolicySummary, user: UserModel) -> float | None:
    a = summary.attainment
    return None if a is None else a.pct_at(user, GOODPUT_SCALE)


# The order is the order of the report: the metrics users feel first.
HEADLINE_METRICS: tuple[HeadlineMetric, ...] = (
    HeadlineMetric(
        "output_itl_p99_s", "output ITL P99", "s", Direction.LOWER, lambda s: s.output_itl_s.p99
    ),
    HeadlineMetric(
        "output_itl_p95_s", "output ITL P95", "s", Direction.LOWER, lambda s: s.output_itl_s.p95
    ),
    HeadlineMetric("ttfvt_p95_s", "TTFVT P95", "s", Direction.LOWER, lambda s: s.ttfvt_s.p95),
    HeadlineMetric("ttfvt_p50_s", "TTFVT P50", "s", Direction.LOWER, lambda s: s.ttfvt_s.p50),
    HeadlineMetric("ttot_p95_s", "TTOT P95", "s", Direction.LOWER, lambda s: s.ttot_s.p95),
    HeadlineMetric("ttft_p95_s", "TTFT P95", "s", Direction.LOWER, lambda s: s.ttft_s.p95),
    HeadlineMetric(
        "throughput_tok_s", "throughput", "tokens/s", Direction.HIGHER, lambda s: s.throughput_tok_s
    ),
    HeadlineMetric(
        "goodput_req_s", "goodput", "requests/s", Direction.HIGHER, lambda s: s.goodput_req_s
    ),
    HeadlineMetric(
        "slo_hidden_pct", f"SLO attainment at {GOODPUT_SCALE:g}× (reasoning hidden)", "%",
        Direction.HIGHER, lambda s: _attained(s, UserModel.HIDDEN),
    ),
    HeadlineMetric(
        "slo_shown_pct", f"SLO attainment at {GOODPUT_SCALE:g}× (reasoning shown)", "%",
        Direction.HIGHER, lambda s: _attained(s, UserModel.SHOWN),
    ),
    HeadlineMetric(
        "think_tokens_avg", "think tokens avg", "tokens", Direction.LOWER,
        lambda s: s.think_tokens.mean,
    ),
    HeadlineMetric(
        "answer_accuracy_pct", "answer accuracy (model)", "%", Direction.HIGHER,
        lambda s: s.answer_accuracy_pct,
    ),
    HeadlineMetric(
        "worst_answer_gap_steps", "worst answer gap", "steps", Direction.LOWER,
        lambda s: s.worst_answer_gap_steps,
    ),
    HeadlineMetric(
        "preemptions_output", "preemptions (output phase)", "count", Direction.LOWER,
        lambda s: s.preemptions.output,
    ),
    HeadlineMetric(
        "preemptions_think", "preemptions (think phase)", "count", Direction.LOWER,
        lambda s: s.preemptions.think,
    ),
    HeadlineMetric(
        "recomputed_tokens", "recomputed tokens", "tokens", Direction.LOWER,
        lambda s: s.num_recomputed_tokens,
    ),
)  # fmt: skip


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AbComparison(_Model):
    """The candidate against one baseline on one metric."""

    delta_pct: Sig6 | None
    flag: AbFlag | None


class AbRow(_Model):
    """One metric: every policy's value and the candidate's comparison with each baseline."""

    metric: str
    label: str
    unit: str
    direction: Direction
    values: dict[str, Sig6 | None]
    comparisons: dict[str, AbComparison]


def delta_pct(candidate: float, baseline: float) -> float | None:
    """``(candidate - baseline) / |baseline| * 100``; ``None`` when the baseline is 0.

    >>> delta_pct(90.0, 100.0)
    -10.0
    """
    if baseline == 0:
        return None
    return (candidate - baseline) * 100.0 / abs(baseline)


def classify(candidate: float | None, baseline: float | None, direction: Direction) -> AbComparison:
    """Δ% and flag of ``candidate`` against ``baseline`` (see the module docstring).

    >>> classify(0.045, 0.050, Direction.LOWER).flag
    <AbFlag.WIN: 'WIN'>
    >>> classify(3, 0, Direction.LOWER).flag
    <AbFlag.LOSS: 'LOSS'>
    """
    if candidate is None or baseline is None:
        return AbComparison(delta_pct=None, flag=None)
    delta = delta_pct(candidate, baseline)
    if delta is None:
        if candidate == baseline:
            return AbComparison(delta_pct=None, flag=AbFlag.FLAT)
        better = candidate < baseline if direction is Direction.LOWER else candidate > baseline
        return AbComparison(delta_pct=None, flag=AbFlag.WIN if better else AbFlag.LOSS)
    magnitude = abs(delta)
    if magnitude < FLAT_BELOW_PCT:
        return AbComparison(delta_pct=delta, flag=AbFlag.FLAT)
    better = delta < 0 if direction is Direction.LOWER else delta > 0
    big = magnitude >= BIG_FROM_PCT
    if better:
        flag = AbFlag.WIN if big else AbFlag.WIN_SMALL
    else:
        flag = AbFlag.LOSS if big else AbFlag.LOSS_SMALL
    return AbComparison(delta_pct=delta, flag=flag)


def compare(
    summaries: Mapping[str, PolicySummary],
    candidate: str,
    baselines: Sequence[str],
    metrics: Sequence[HeadlineMetric] = HEADLINE_METRICS,
) -> list[AbRow]:
    """One :class:`AbRow` per metric, in ``metrics`` order; ``values`` lists the candidate first.

    The flags are computed from the summaries' (rounded) values, so a reloaded report gives the
    same flags.
    """
    policies = [candidate, *baselines]
    rows: list[AbRow] = []
    for metric in metrics:
        values = {p: _as_float(metric.read(summaries[p])) for p in policies}
        rows.append(
            AbRow(
                metric=metric.key,
                label=metric.label,
                unit=metric.unit,
                direction=metric.direction,
                values=values,
                comparisons={
                    b: classify(values[candidate], values[b], metric.direction) for b in baselines
                },
            )
        )
    return rows


def _as_float(value: float | None) -> float | None:
    return None if value is None else float(value)
