"""The report of ``meridian bench accuracy``: the table (Markdown and console cells),
``accuracy.json`` and the plot of accuracy against think tokens."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meridian.bench.accuracy.client import Outcome
from meridian.bench.accuracy.summary import ForcingSummary, pareto_front
from meridian.bench.eat_probe import ProbeSummary

__all__ = ["COLUMNS", "cells", "markdown", "write_accuracy_report"]


def _fmt(x: float, spec: str = ".1f") -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


COLUMNS = (
    "policy", "accuracy", "95 % Wilson", "think tokens mean / P50 / P95", "answer tokens mean",
    "think tokens saved vs none", "EAT probe: fired / probes / probe tokens", "failed", "wall s",
    "Pareto",
)  # fmt: skip


def _probe_cell(probe: ProbeSummary | None) -> str:
    """``fired/requests / probes per request / probe tokens per request`` ("≥": the floor, the
    server did not report its cached tokens); "—" for the other policies."""
    if probe is None:
        return "—"
    floor = "" if probe.measured else "≥"
    return (f"{probe.fired}/{probe.requests} / {_fmt(probe.probes_mean)} / "
            f"{floor}{_fmt(probe.probe_tokens_mean, ',.0f')}")  # fmt: skip


def cells(row: ForcingSummary, on_front: bool) -> list[str]:
    """One row of the report table, a string per :data:`COLUMNS` entry (Markdown and console)."""
    r = row
    return [
        r.policy,
        f"{r.correct}/{r.items} ({_fmt(100 * r.accuracy)} %)",
        f"{100 * r.accuracy_low:.1f}–{100 * r.accuracy_high:.1f} %",
        f"{_fmt(r.think_tokens_mean)} / {_fmt(r.think_tokens_p50, '.0f')} / "
        f"{_fmt(r.think_tokens_p95, '.0f')}",
        _fmt(r.answer_tokens_mean),
        "n/a" if math.isnan(r.think_tokens_saved) else f"{100 * r.think_tokens_saved:.1f} %",
        _probe_cell(r.probe),
        str(r.failed),
        f"{r.wall_s:.1f}",
        "yes" if on_front else "",
    ]


def markdown(rows: Sequence[ForcingSummary], title: str) -> str:
    """The report table (Markdown)."""
    front = {r.policy for r in pareto_front(rows)}
    lines = [
        f"# {title}",
        "",
        f"| {' | '.join(COLUMNS)} |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        policy, *rest = cells(r, r.policy in front)
        lines.append(f"| `{policy}` | {' | '.join(rest)} |")
    return "\n".join(lines) + "\n"


def write_accuracy_report(
    out_dir: Path,
    rows: Sequence[ForcingSummary],
    outcomes: Sequence[Outcome],
    meta: dict[str, Any],
    plot: bool = True,
) -> list[Path]:
    """``accuracy.json`` (summary, every outcome, the run's settings), ``accuracy.md`` and, with
    ``plot``, ``accuracy.png`` (accuracy against mean think tokens, the Pareto front drawn)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "summary": [asdict(r) for r in rows],
        "pareto_front": [r.policy for r in pareto_front(rows)],
        "outcomes": [asdict(o) for o in outcomes],
    }
    paths = [out_dir / "accuracy.json", out_dir / "accuracy.md"]
    paths[0].write_text(json.dumps(data, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(rows, f"Accuracy of forcing policies: {meta.get('dataset')}"))
    if plot:
        paths.append(_plot(out_dir / "accuracy.png", rows))
    return paths


def _plot(path: Path, rows: Sequence[ForcingSummary]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    usable = [r for r in rows if not math.isnan(r.think_tokens_mean)]
    for r in usable:
        err = [
            [max(0.0, 100 * (r.accuracy - r.accuracy_low))],
            [max(0.0, 100 * (r.accuracy_high - r.accuracy))],
        ]
        ax.errorbar(r.think_tokens_mean, 100 * r.accuracy, yerr=err, fmt="o", capsize=3)
        ax.annotate(r.policy, (r.think_tokens_mean, 100 * r.accuracy), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)  # fmt: skip
    front = pareto_front(usable)
    if len(front) > 1:
        ax.step([r.think_tokens_mean for r in front], [100 * r.accuracy for r in front],
                where="post", color="grey", linestyle="--", label="Pareto front")  # fmt: skip
        ax.legend(loc="lower right")
    ax.set_xlabel("think tokens per item (mean)")
    ax.set_ylabel("accuracy % (95 % Wilson interval)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
