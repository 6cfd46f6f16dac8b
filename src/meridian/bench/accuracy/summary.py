"""The summary of ``meridian bench accuracy``: a row per forcing policy (accuracy with its Wilson
interval, think and answer tokens) and the Pareto front of accuracy against think tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meridian.bench.accuracy.client import Outcome
from meridian.bench.eat_probe import ProbeSummary, summarize_probes
from meridian.bench.summary import percentiles

__all__ = ["ForcingSummary", "pareto_front", "summarize", "wilson_interval"]

Z95 = 1.959963984540054


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default).

    >>> [round(x, 3) for x in wilson_interval(5, 10)]
    [0.237, 0.763]
    """
    if total <= 0:
        return (0.0, 1.0)
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    # At 0 or all correct the bound is exactly 0 or 1 (the formula rounds to 1 - 1e-16).
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return (low, high)


@dataclass(frozen=True, slots=True)
class ForcingSummary:
    """One policy's row of the report."""

    policy: str
    items: int
    correct: int
    failed: int
    accuracy: float
    accuracy_low: float
    accuracy_high: float
    think_tokens_mean: float
    think_tokens_p50: float
    think_tokens_p95: float
    answer_tokens_mean: float
    think_tokens_saved: float  # against `none`, as a fraction of its mean think tokens
    wall_s: float
    probe: ProbeSummary | None = None  # eat-probe policies only


def summarize(outcomes: Sequence[Outcome], walls: dict[str, float]) -> list[ForcingSummary]:
    """A row per policy, in the order they ran. Failed requests count as wrong."""
    think = {
        policy: percentiles(np.array([o.think_tokens for o in outcomes if o.policy == policy
                                      and o.think_tokens is not None], dtype=np.float64))
        for policy in walls
    }  # fmt: skip
    base = think["none"].mean if "none" in think else None
    rows: list[ForcingSummary] = []
    for policy, wall in walls.items():
        mine = [o for o in outcomes if o.policy == policy]
        probes = [o.probe for o in mine if o.probe is not None]
        correct = sum(o.correct for o in mine)
        answers = [o.answer_tokens for o in mine if o.answer_tokens is not None]
        low, high = wilson_interval(correct, len(mine))
        mean = think[policy].mean
        rows.append(
            ForcingSummary(
                policy=policy,
                items=len(mine),
                correct=correct,
                failed=sum(o.error is not None for o in mine),
                accuracy=correct / len(mine) if mine else math.nan,
                accuracy_low=low,
                accuracy_high=high,
                think_tokens_mean=math.nan if mean is None else mean,
                think_tokens_p50=_or_nan(think[policy].p50),
                think_tokens_p95=_or_nan(think[policy].p95),
                answer_tokens_mean=sum(answers) / len(answers) if answers else math.nan,
                think_tokens_saved=(1 - mean / base if mean is not None and base else math.nan),
                wall_s=wall,
                probe=summarize_probes(probes) if probes else None,
            )
        )
    return rows


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def pareto_front(rows: Sequence[ForcingSummary]) -> list[ForcingSummary]:
    """The policies no other beats on both counts (fewer mean think tokens and higher
    accuracy; ties kept), by mean think tokens."""
    usable = [r for r in rows if not math.isnan(r.think_tokens_mean)]
    front = [
        r
        for r in usable
        if not any(
            o.think_tokens_mean <= r.think_tokens_mean
            and o.accuracy >= r.accuracy
            and (o.think_tokens_mean < r.think_tokens_mean or o.accuracy > r.accuracy)
            for o in usable
        )
    ]
    return sorted(front, key=lambda r: r.think_tokens_mean)
