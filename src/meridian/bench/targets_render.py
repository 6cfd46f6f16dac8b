"""The README's and docs' tables of a :class:`~meridian.bench.targets.TargetsRun`, and the
blocks of those files they fill.

A rendered block sits between two comments, ``<!-- BEGIN targets/MODEL/WORKLOAD/PART -->`` and
``<!-- END ... -->`` (PART: ``table``, ``misses``, ``summary``; ``targets/MODEL/run`` says how
the run was made). :func:`render_docs` rewrites every block a file has from the committed JSON;
``tests/test_docs.py`` fails when a file differs from what it renders, so no figure of the
headline is typed by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from meridian.bench.targets import (
    HEAVY,
    LIGHT,
    MERIDIAN,
    METRICS,
    PASCAL,
    STOCK,
    CellResult,
    TargetsRun,
    WorkloadSweep,
    better,
    check,
    gap_ok,
    ratio,
)

# A ratio this far on the wrong side of 1 is printed bold in the table: a loss.
LOSS_FROM = 0.01
_BLOCK = re.compile(
    r"(<!-- BEGIN (?P<key>targets/[\w./-]+) -->\n)(?P<body>.*?)(<!-- END (?P=key) -->)", re.S
)


def fmt(v: float | None) -> str:
    """Three significant figures, thousands separated; ``-`` for no value."""
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def _x(r: float) -> str:
    return f"{r:.3f}×"


def _is_loss(field: str, m: CellResult, b: CellResult) -> bool:
    mine, theirs = getattr(m, field), getattr(b, field)
    if mine is None or theirs is None or mine == theirs:
        return False
    if theirs == 0:
        return not better(field, mine, theirs)
    worse = not better(field, mine, theirs)
    return worse and abs(mine / theirs - 1.0) > LOSS_FROM


def _rows(
    sweep: WorkloadSweep,
) -> Iterator[tuple[float, float, CellResult, CellResult, CellResult | None]]:
    for rate in sweep.rates:
        m, b = sweep.cell(rate, MERIDIAN), sweep.cell(rate, STOCK)
        if m is not None and b is not None:
            yield rate, rate / sweep.capacity_req_s, m, b, sweep.cell(rate, PASCAL)


def table(sweep: WorkloadSweep) -> str:
    """One row per load: Meridian vs stock (ratio), ✓/✗ against the load's target, bold ratios
    where Meridian is worse by more than 1 %, "P" = Pascal's TTFVT P95."""
    header = ["load (req/s)", "fullest 10 s", "stock queue"]
    header += [label for _, label, _ in METRICS]
    header += ["preemptions think/answer", "worst answer gap (steps)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rate, load, m, b, p in _rows(sweep):
        offered = sweep.offered.get(f"{rate:g}")
        peak = "-" if offered is None else f"{offered.peak_rate_req_s / sweep.capacity_req_s:.0%}"
        cells = [f"{load:.0%} ({rate:g})", peak, "bounded" if b.queue_bounded else "grows"]
        for field, _, _ in METRICS:
            r, ok = check(load, field, m, b, p)
            mark = "" if ok is None else " ✓" if ok else " ✗"
            pas = f"; P {fmt(p.ttfvt_p95_s)}" if p and field == "ttfvt_p95_s" else ""
            shown = "" if r is None else _x(r)
            shown = f"**{shown}**" if shown and _is_loss(field, m, b) else shown
            ratio_text = f" ({shown})" if shown else ""
            cells.append(
                f"{fmt(getattr(m, field))} vs {fmt(getattr(b, field))}{ratio_text}{pas}{mark}"
            )
        cells.append(
            f"{m.preemptions_think}/{m.preemptions_answer} vs "
            f"{b.preemptions_think}/{b.preemptions_answer}"
        )
        cells.append(
            f"{m.worst_answer_gap_steps} vs {b.worst_answer_gap_steps}"
            + (" ✓" if gap_ok(m) else " ✗")
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def count_misses(sweep: WorkloadSweep) -> tuple[int, int]:
    """(cells marked ✗, cells with a target)."""
    misses = marked = 0
    for _, load, m, b, p in _rows(sweep):
        for field, _, _ in METRICS:
            ok = check(load, field, m, b, p)[1]
            marked += ok is not None
            misses += ok is False
        marked += 1
        misses += not gap_ok(m)
    return misses, marked


def _why(field: str, load: float, m: CellResult, b: CellResult, p: CellResult | None) -> str:
    """What the per-request data say about a missed target."""
    if field in ("itl_p99_ms", "ttft_p95_s", "throughput_tok_s") and not (
        m.preemptions_think + m.preemptions_answer + b.preemptions_think + b.preemptions_answer
    ):
        gaps = f"P99 answer gap {fmt(m.itl_p99_gap_steps)} vs {fmt(b.itl_p99_gap_steps)} steps"
        return (
            f"no preemption under either scheduler ({gaps}, so answer ITL P99 is a step's "
            "duration): nothing to win"
        )
    if field == "itl_p99_ms":
        return (
            f"P99 answer gap {fmt(m.itl_p99_gap_steps)} vs {fmt(b.itl_p99_gap_steps)} steps: "
            "every answer stream gets a token each step, so answer ITL P99 is the length of a "
            f"step at this batch (KV in use {m.kv_used_mean:.0%} vs {b.kv_used_mean:.0%})"
        )
    if field == "ttfvt_p95_s":
        pascal = "" if p is None else f"; Pascal {fmt(p.ttfvt_p95_s)} s"
        return (
            f"the requests at or above P95 spent {fmt(m.ttfvt_top_wait_s)} s queued and "
            f"{fmt(m.ttfvt_top_think_s)} s reasoning at {fmt(m.ttfvt_top_ms_per_think_token)} ms "
            f"per think token ({m.ttfvt_top_preempted_pct:.0f} % preempted), stock's "
            f"{fmt(b.ttfvt_top_wait_s)} s and {fmt(b.ttfvt_top_think_s)} s at "
            f"{fmt(b.ttfvt_top_ms_per_think_token)} ms ({b.ttfvt_top_preempted_pct:.0f} %)"
            f"{pascal}"
        )
    if field == "goodput_req_s":
        return (
            f"requests out of goodput for a late first answer {m.slo_missed_ttfvt} vs "
            f"{b.slo_missed_ttfvt}, for answer gaps over the ITL SLO {m.slo_missed_itl} vs "
            f"{b.slo_missed_itl}, for a wrong answer {m.slo_wrong_answer} vs {b.slo_wrong_answer}"
        )
    return (
        f"preemptions think/answer {m.preemptions_think}/{m.preemptions_answer} vs "
        f"{b.preemptions_think}/{b.preemptions_answer}, KV in use {m.kv_used_mean:.0%} vs "
        f"{b.kv_used_mean:.0%}"
    )


def misses(sweep: WorkloadSweep) -> str:
    """Every ✗ of the table with Meridian's and stock's figures and why (a bullet each), and
    every loss of more than 1 % that no target marks."""
    labels = {f: label for f, label, _ in METRICS}
    lines: list[str] = []
    for rate, load, m, b, p in _rows(sweep):
        at = f"{load:.0%} ({rate:g} req/s)"
        for field, _, _ in METRICS:
            r, ok = check(load, field, m, b, p)
            mine, theirs = getattr(m, field), getattr(b, field)
            ratio_text = "" if r is None else f" ({_x(r)})"
            name, _, unit = labels[field].rpartition(" ")
            if unit == "tokens":  # "recomputed tokens": a count, no unit
                name, unit = labels[field], ""
            unit = f" {unit}" if unit else ""
            what = f"{name} {fmt(mine)} vs {fmt(theirs)}{unit}{ratio_text}"
            if ok is False:
                side = (
                    "a loss"
                    if _is_loss(field, m, b)
                    else ("in Meridian's favour" if load <= LIGHT + 1e-9 else "missed")
                )
                lines.append(f"- {at}: {what}, {side}: {_why(field, load, m, b, p)}.")
            elif ok is None and _is_loss(field, m, b):
                lines.append(f"- {at}: {what}, a loss (no target here).")
        if not gap_ok(m):
            lines.append(f"- {at}: worst answer gap {m.worst_answer_gap_steps} steps, missed.")
    return "\n".join(lines) if lines else "- Nothing: every target met."


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


def summary(sweep: WorkloadSweep) -> str:
    """One sentence: Meridian's ratios to stock above capacity, and from 90 % up to it."""
    bands = (
        ("above capacity", 1.0 + 1e-9, float("inf")),
        (f"from {HEAVY:.0%} to capacity", HEAVY - 1e-9, 1.0 + 1e-9),
    )
    parts: list[str] = []
    for name, lo, hi in bands:
        rows = [(load, m, b) for _, load, m, b, _ in _rows(sweep) if lo < load <= hi]
        if not rows:
            continue
        figures = []
        for field, label, _ in METRICS[:5]:
            pairs = [ratio(getattr(m, field), getattr(b, field)) for _, m, b in rows]
            values = [r for r in pairs if r is not None]
            if values:
                figures.append(f"{label.rsplit(' ', 1)[0]} {_span(values)}")
        loads = ", ".join(f"{load:.0%}" for load, _, _ in rows)
        parts.append(f"{name} ({loads}): " + ", ".join(figures))
    return f"Meridian against stock on `{sweep.workload}`, " + "; ".join(parts) + "."


def provenance(run: TargetsRun) -> str:
    """How the run was made, for the line above the tables."""
    minutes = run.wall_s / 60
    dirty = " plus uncommitted changes" if run.uncommitted_changes else ""
    return (
        f"`{run.command}` at commit {run.commit}{dirty} ({run.date}): vLLM {run.vllm_version}'s "
        f"`{run.scheduler}` on virtual time, {run.hardware} / {run.model} "
        f"({run.num_kv_blocks:,} KV blocks, max_num_seqs {run.max_num_seqs:,}, "
        f"max_num_batched_tokens {run.max_num_batched_tokens:,}), {run.duration_s:g} s of "
        f"arrivals per cell, seed {run.seed}, {run.jobs} cells at a time: {minutes:.0f} minutes "
        "of wall time on the shared 2-core development machine. Capacity: "
        + ", ".join(f"`{s.workload}` {s.capacity_req_s:g} req/s" for s in run.workloads)
        + "."
    )


def blocks(run: TargetsRun) -> dict[str, str]:
    """Every block this run fills, by key."""
    out = {f"targets/{run.model}/run": provenance(run)}
    for sweep in run.workloads:
        key = f"targets/{run.model}/{sweep.workload}"
        out[f"{key}/table"] = table(sweep)
        out[f"{key}/misses"] = misses(sweep)
        out[f"{key}/summary"] = summary(sweep)
    return out


def render_docs(text: str, runs: list[TargetsRun]) -> str:
    """``text`` with every block whose key one of ``runs`` fills rewritten; other blocks kept."""
    filled: dict[str, str] = {}
    for run in runs:
        filled.update(blocks(run))

    def replace(match: re.Match[str]) -> str:
        key = match["key"]
        if key not in filled:
            return match[0]
        return f"{match[1]}{filled[key]}\n{match[4]}"

    return _BLOCK.sub(replace, text)


def block_keys(text: str) -> list[str]:
    """The keys of the rendered blocks in ``text``."""
    return [m["key"] for m in _BLOCK.finditer(text)]


__all__ = ["HEAVY", "block_keys", "blocks", "count_misses", "misses", "render_docs", "table"]
