"""What scheduling did and what forcing did, each with the other held equal.

A policy is a scheduler and a forcing (:mod:`meridian.sim.policies`). Comparing ``meridian``
with ``vllm-fcfs`` mixes the two: forcing shortens reasoning (scored by the entropy *model*, an
assumption), scheduling decides who runs and who is preempted. A report that credits the sum to
"Meridian" tells a newcomer nothing about the scheduler. So the first screen pairs policies
that differ in one thing only:

- scheduling, forcing held equal: ``meridian`` vs ``vllm-fcfs+forcing`` and ``meridian-sched``
  vs ``vllm-fcfs``;
- forcing, scheduling held equal: ``meridian`` vs ``meridian-sched`` and ``vllm-fcfs+forcing``
  vs ``vllm-fcfs``.

A pair in which every headline metric is within the FLAT band (:mod:`meridian.bench.ab`) is
said plainly to have changed nothing at this load; no WIN is claimed from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meridian.bench.ab import HEADLINE_METRICS, AbFlag, AbRow, compare
from meridian.bench.summary import PolicySummary
from meridian.errors import MeridianError
from meridian.sim.policies import parse_policy

SCHEDULING, FORCING = "scheduling", "forcing"
# (what differs, candidate, baseline): the pairs the first screen shows, in order.
PAIRS: tuple[tuple[str, str, str], ...] = (
    (SCHEDULING, "meridian", "vllm-fcfs+forcing"),
    (SCHEDULING, "meridian-sched", "vllm-fcfs"),
    (FORCING, "meridian", "meridian-sched"),
    (FORCING, "vllm-fcfs+forcing", "vllm-fcfs"),
)
# The metrics a pair's line names when they moved (the report tables hold the rest).
_SHOWN = (
    "output_itl_p99_s",
    "ttfvt_p95_s",
    "ttft_p95_s",
    "throughput_tok_s",
    "goodput_req_s",
    "think_tokens_avg",
    "answer_accuracy_pct",
    "worst_answer_gap_steps",
    "preemptions_output",
    "preemptions_think",
    "recomputed_tokens",
)


@dataclass(frozen=True, slots=True)
class Effect:
    """One pair: ``candidate`` against ``baseline``, which differ only in ``kind``."""

    kind: str
    candidate: str
    baseline: str
    rows: list[AbRow]

    @property
    def changed(self) -> bool:
        """Whether any headline metric moved past the FLAT band."""
        return any(r.comparisons[self.baseline].flag not in (None, AbFlag.FLAT) for r in self.rows)

    def moved(self) -> list[AbRow]:
        """The shown metrics that moved past the FLAT band, in :data:`_SHOWN` order."""
        by_key = {r.metric: r for r in self.rows}
        return [
            by_key[k]
            for k in _SHOWN
            if k in by_key and by_key[k].comparisons[self.baseline].flag not in (None, AbFlag.FLAT)
        ]


def effects(summaries: Mapping[str, PolicySummary]) -> list[Effect]:
    """Every pair of :data:`PAIRS` whose two policies both ran."""
    return [
        Effect(kind, c, b, compare(summaries, c, [b], HEADLINE_METRICS))
        for kind, c, b in PAIRS
        if c in summaries and b in summaries
    ]


def same_forcing_baselines(candidate: str, policies: Sequence[str]) -> list[str]:
    """The policies that run ``candidate``'s forcing: the baselines a WIN or LOSS may be
    claimed against (a different forcing would credit forcing to scheduling)."""
    forcing = _forcing(candidate)
    return [
        p for p in policies if p != candidate and forcing is not None and _forcing(p) == forcing
    ]


def _forcing(policy: str) -> object | None:
    """The policy's forcing; ``None`` for a name the simulator does not know (a label)."""
    try:
        return parse_policy(policy).forcing
    except MeridianError:
        return None


def _value(row: AbRow, policy: str) -> str:
    from meridian.bench.report_render import fmt

    scale = 1000.0 if row.metric.startswith("output_itl") else 1.0
    return fmt(row.values[policy], scale)


def _change(row: AbRow, effect: Effect) -> str:
    c = row.comparisons[effect.baseline]
    unit = "ms" if row.metric.startswith("output_itl") else row.unit
    unit = "" if unit in ("count", "tokens") else f" {unit}"
    delta = "from 0" if c.delta_pct is None else f"{c.delta_pct:+.0f} %"
    flag = "" if c.flag is None else f" {c.flag.value}"
    return (
        f"{row.label} {_value(row, effect.candidate)} vs {_value(row, effect.baseline)}{unit} "
        f"({delta}{flag})"
    )


def effect_lines(summaries: Mapping[str, PolicySummary]) -> list[str]:
    """Plain sentences, one per pair: what changed (with both values), or that nothing did."""
    lines: list[str] = []
    for kind in (SCHEDULING, FORCING):
        pairs = [e for e in effects(summaries) if e.kind == kind]
        if not pairs:
            continue
        held = "forcing" if kind == SCHEDULING else "scheduling"
        lines.append(f"What {kind} did ({held} held equal):")
        for e in pairs:
            head = f"  {e.candidate} vs {e.baseline}: "
            if not e.changed:
                lines.append(
                    head + f"{kind} changed nothing at this load (every headline metric within "
                    "2 %)."
                )
                continue
            lines.append(head + "; ".join(_change(r, e) for r in e.moved()) + ".")
    if any(e.kind == FORCING and e.changed for e in effects(summaries)):
        lines.append(
            "  Forcing's answer accuracy and goodput come from the workload's entropy model: an "
            "assumption, not a measurement."
        )
    return lines


__all__ = ["FORCING", "PAIRS", "SCHEDULING", "Effect", "effect_lines", "effects"]
