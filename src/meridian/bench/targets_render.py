"""The README's and docs' tables of a :class:`~meridian.bench.targets.TargetsRun`, and the
blocks of those files they fill.

A rendered block sits between two comments, ``<!-- BEGIN targets/MODEL/WORKLOAD/PART -->`` and
``<!-- END ... -->`` (PART: ``table``, ``misses``, ``summary``; ``targets/MODEL/run`` says how
the run was made). :func:`render_docs` rewrites every block a file has from the committed JSON;
``tests/test_docs.py`` fails when a file differs from what it renders, so no figure of the
headline is typed by hand. Every figure is a median over the run's seeds
(:mod:`meridian.bench.targets`); a comparison shows its range over the seeds when there are
several.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from meridian.bench.targets import (
    HEAVY,
    LIGHT,
    MERIDIAN,
    METRICS,
    PASCAL,
    PERCENT_FIELDS,
    STOCK,
    CellResult,
    Paired,
    TargetsRun,
    WorkloadSweep,
    better,
    check,
    paired,
    uncontended,
)

# A comparison this far on the wrong side is printed bold in the table: a loss (ratio 1 %,
# attainment 1 point).
LOSS_FROM = 0.01
_BLOCK = re.compile(
    r"(<!-- BEGIN (?P<key>targets/[\w./-]+) -->\n)(?P<body>.*?)(<!-- END (?P=key) -->)", re.S
)
Cells = list[CellResult]


def fmt(v: float | None) -> str:
    """Three significant figures, thousands separated, whole numbers as such; ``-`` for no
    value."""
    if v is None:
        return "-"
    if float(v).is_integer():  # counts (and medians of counts) read as such
        return f"{v:,.0f}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def _cmp(field: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:+.1f} pts" if field in PERCENT_FIELDS else f"{v:.3f}×"


def _shown(field: str, p: Paired) -> str:
    """The median comparison, with its range over the seeds when there are several."""
    text = _cmp(field, p.median)
    if p.low is None or p.high is None or _cmp(field, p.low) == _cmp(field, p.high):
        return text
    if p.num_seeds > 1:
        text += f" [{_cmp(field, p.low)} to {_cmp(field, p.high)}]"
    return text


def _is_loss(field: str, p: Paired) -> bool:
    mine, theirs = p.mine, p.theirs
    if mine is None or theirs is None or mine == theirs:
        return False
    if better(field, mine, theirs):
        return False
    if field in PERCENT_FIELDS:
        return theirs - mine > 100 * LOSS_FROM
    return theirs == 0 or abs(mine / theirs - 1.0) > LOSS_FROM


def _rows(sweep: WorkloadSweep) -> Iterator[tuple[float, float, Cells, Cells, Cells]]:
    for rate in sweep.rates:
        ms, bs = sweep.cells_at(rate, MERIDIAN), sweep.cells_at(rate, STOCK)
        if ms and bs:
            yield rate, rate / sweep.capacity_req_s, ms, bs, sweep.cells_at(rate, PASCAL)


def _median(cells: Cells, field: str) -> float | None:
    return paired(field, cells, cells).mine


def at_scale(sweep: WorkloadSweep, scale: float = 10.0) -> str:
    """Per load and policy, the median over seeds of the SLO attainment at ``scale`` (reasoning
    hidden) and of the requests a seed that miss it at every scale for an answer gap over the
    250-ms stall bound: what the attainment curves show at their right end, as text."""
    lines = []
    for rate, load, ms, bs, ps in _rows(sweep):
        parts = []
        for name, cells in ((MERIDIAN, ms), (STOCK, bs), (PASCAL, ps)):
            scales = cells[0].attainment_scales if cells else None
            if not scales or scale not in scales:
                continue
            i = scales.index(scale)
            pct = float(np.median([(c.attainment_hidden_pct or [0.0] * len(scales))[i]
                                   for c in cells]))  # fmt: skip
            stalls = float(np.median([c.slo_missed_stall for c in cells]))
            parts.append(f"{name} {pct:.1f} % ({stalls:g} stalled out)")
        if parts:
            lines.append(f"- {load:.0%} ({rate:g} req/s): " + ", ".join(parts))
    return "\n".join(lines)


def _contention(ms: Cells, bs: Cells) -> str:
    if any(c.contended is None for c in [*ms, *bs]):
        return "-"
    return "none" if uncontended(ms, bs) else "yes"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def table(sweep: WorkloadSweep) -> str:
    """One row per load: Meridian vs stock (medians over the seeds), the median comparison and
    its range, ✓/✗ against the load's target, bold where Meridian is worse; "P" = Pascal's TTFVT
    P95; "contention: none" where neither policy preempted or queued anything (ratios there are
    not claims)."""
    header = ["load (req/s)", "fullest 10 s", "stock queue", "contention"]
    header += [label for _, label, _, _ in METRICS]
    header += ["peak KV", "preemptions think/answer", "worst answer gap (steps)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rate, load, ms, bs, ps in _rows(sweep):
        offered = sweep.offered.get(f"{rate:g}")
        peak = "-" if offered is None else f"{offered.peak_rate_req_s / sweep.capacity_req_s:.0%}"
        bounded = all(b.queue_bounded for b in bs)
        cells = [f"{load:.0%} ({rate:g})", peak, "bounded" if bounded else "grows"]
        cells.append(_contention(ms, bs))
        for field, _, _, _ in METRICS:
            p = paired(field, ms, bs)
            ok = check(load, field, p)
            mark = "" if ok is None else " ✓" if ok else " ✗"
            pas = f"; P {fmt(_median(ps, field))}" if ps and field == "ttfvt_p95_s" else ""
            shown = _shown(field, p)
            shown = f"**{shown}**" if _is_loss(field, p) else shown
            cells.append(f"{fmt(p.mine)} vs {fmt(p.theirs)} ({shown}){pas}{mark}")
        kv = paired("kv_used_peak", ms, bs)
        cells.append(f"{_pct(kv.mine)} vs {_pct(kv.theirs)}")
        think, answer = (paired(f, ms, bs) for f in ("preemptions_think", "preemptions_answer"))
        cells.append(
            f"{fmt(think.mine)}/{fmt(answer.mine)} vs {fmt(think.theirs)}/{fmt(answer.theirs)}"
        )
        gap = paired("worst_answer_gap_steps", ms, bs)
        cells.append(f"{fmt(gap.mine)} vs {fmt(gap.theirs)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def count_misses(sweep: WorkloadSweep) -> tuple[int, int]:
    """(cells marked ✗, cells with a target)."""
    misses = marked = 0
    for _, load, ms, bs, _ in _rows(sweep):
        for field, _, _, _ in METRICS:
            ok = check(load, field, paired(field, ms, bs))
            marked += ok is not None
            misses += ok is False
    return misses, marked


def _why(field: str, m: CellResult, b: CellResult, ps: Cells) -> str:
    """What the per-request data of one seed say about a missed target."""
    seed = f"seed {m.seed}: "
    if not (
        m.preemptions_think + m.preemptions_answer + b.preemptions_think + b.preemptions_answer
    ):
        gaps = f"P99 answer gap {fmt(m.itl_p99_gap_steps)} vs {fmt(b.itl_p99_gap_steps)} steps"
        return f"{seed}no preemption under either scheduler ({gaps})"
    if field == "itl_p99_ms":
        return (
            f"{seed}P99 answer gap {fmt(m.itl_p99_gap_steps)} vs {fmt(b.itl_p99_gap_steps)} "
            f"steps (KV in use {m.kv_used_mean:.0%} vs {b.kv_used_mean:.0%})"
        )
    if field in ("ttfvt_p95_s", "ttft_p95_s"):
        pascal = "" if not ps else f"; Pascal's TTFVT P95 {fmt(_median(ps, 'ttfvt_p95_s'))} s"
        return (
            f"{seed}the requests at or above TTFVT P95 spent {fmt(m.ttfvt_top_wait_s)} s queued "
            f"and {fmt(m.ttfvt_top_think_s)} s reasoning at {fmt(m.ttfvt_top_ms_per_think_token)}"
            f" ms per think token ({m.ttfvt_top_preempted_pct:.0f} % preempted), stock's "
            f"{fmt(b.ttfvt_top_wait_s)} s and {fmt(b.ttfvt_top_think_s)} s at "
            f"{fmt(b.ttfvt_top_ms_per_think_token)} ms ({b.ttfvt_top_preempted_pct:.0f} %)"
            f"{pascal}"
        )
    if field in PERCENT_FIELDS:
        return (
            f"{seed}requests missing the SLO at 3× with the reasoning hidden for a late first "
            f"answer {m.slo_missed_ttfvt} vs {b.slo_missed_ttfvt}, a slow answer stream "
            f"{m.slo_missed_itl} vs {b.slo_missed_itl}, a stall over 250 ms {m.slo_missed_stall}"
            f" vs {b.slo_missed_stall}, a wrong answer {m.slo_wrong_answer} vs "
            f"{b.slo_wrong_answer}"
        )
    return (
        f"{seed}preemptions think/answer {m.preemptions_think}/{m.preemptions_answer} vs "
        f"{b.preemptions_think}/{b.preemptions_answer}, KV in use {m.kv_used_mean:.0%} vs "
        f"{b.kv_used_mean:.0%}"
    )


def misses(sweep: WorkloadSweep) -> str:
    """Every ✗ of the table with Meridian's and stock's figures and why (a bullet each, read
    from the first seed's runs), and every loss that no target marks."""
    lines: list[str] = []
    for rate, load, ms, bs, ps in _rows(sweep):
        at = f"{load:.0%} ({rate:g} req/s)"
        quiet = " (no contention: not a claim)" if uncontended(ms, bs) else ""
        for field, label, _, _ in METRICS:
            p = paired(field, ms, bs)
            ok = check(load, field, p)
            what = f"{label} {fmt(p.mine)} vs {fmt(p.theirs)} ({_shown(field, p)})"
            if ok is False:
                side = "a loss" if _is_loss(field, p) else "missed"
                why = _why(field, ms[0], bs[0], ps)
                lines.append(f"- {at}: {what}, {side}{quiet}: {why}.")
            elif ok is None and _is_loss(field, p):
                lines.append(f"- {at}: {what}, a loss (no target here){quiet}.")
    return "\n".join(lines) if lines else "- Nothing: every target met."


def _span(field: str, values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    if _cmp(field, lo) == _cmp(field, hi):
        return _cmp(field, lo)
    return f"{_cmp(field, lo)} to {_cmp(field, hi)}"


def summary(sweep: WorkloadSweep) -> str:
    """One sentence: Meridian's median comparisons with stock above capacity, and from 90 % up
    to it."""
    bands = (
        ("above capacity", 1.0 + 1e-9, float("inf")),
        (f"from {0.9:.0%} to capacity", 0.9 - 1e-9, 1.0 + 1e-9),
    )
    parts: list[str] = []
    for name, lo, hi in bands:
        rows = [(load, ms, bs) for _, load, ms, bs, _ in _rows(sweep) if lo < load <= hi]
        if not rows:
            continue
        figures = []
        for field, label, _, _ in METRICS:
            values = [v for _, ms, bs in rows if (v := paired(field, ms, bs).median) is not None]
            if values:
                figures.append(f"{label.rsplit(' ', 1)[0]} {_span(field, values)}")
        loads = ", ".join(f"{load:.0%}" for load, _, _ in rows)
        parts.append(f"{name} ({loads}): " + ", ".join(figures))
    return f"Meridian against stock on `{sweep.workload}`, " + "; ".join(parts) + "."


def provenance(run: TargetsRun) -> str:
    """How the run was made, for the line above the tables."""
    minutes = run.wall_s / 60
    dirty = " plus uncommitted changes" if run.uncommitted_changes else ""
    seeds = run.all_seeds
    if run.schema_version < 2:
        how = (
            f"seed {run.seed}, each rate drawn on its own (not nested), no warm-up; SLO "
            "attainment was not measured then (schema 1)"
        )
    else:
        traces = ", ".join(
            f"`{s.workload}` {s.trace_rate:g} req/s" for s in run.workloads if s.trace_rate
        )
        how = (
            f"seeds {', '.join(map(str, seeds))} (tables: medians over them), each seed's trace "
            f"drawn once at the highest rate ({traces}) and thinned to the others, the first "
            f"{run.warmup_s:g} s of arrivals excluded as warm-up"
        )
    return (
        f"`{run.command}` at commit {run.commit}{dirty} ({run.date}): vLLM {run.vllm_version}'s "
        f"`{run.scheduler}` on virtual time, {run.hardware} / {run.model} "
        f"({run.num_kv_blocks:,} KV blocks, max_num_seqs {run.max_num_seqs:,}, "
        f"max_num_batched_tokens {run.max_num_batched_tokens:,}), {run.duration_s:g} s of "
        f"arrivals per cell, {how}; {run.jobs} cells at a time: {minutes:.0f} minutes "
        "of wall time on the shared 2-core development machine. Capacity: "
        + ", ".join(f"`{s.workload}` {s.capacity_req_s:g} req/s" for s in run.workloads)
        + "."
    )


def write_attainment(run: TargetsRun, base: Path) -> list[Path]:
    """SLO attainment against the scale per workload (``BASE-WORKLOAD.png``): a row per load, a
    panel per user model, a line per policy (the median over the seeds at each scale); none for
    cells without curves (schema 1)."""
    from meridian.bench.plots import AttainmentPanel, write_attainment_plot

    written = []
    for sweep in run.workloads:
        rows: list[list[AttainmentPanel]] = []
        for rate in sweep.rates:
            load = f"{rate / sweep.capacity_req_s:.0%} ({rate:g} req/s)"
            row: list[AttainmentPanel] = []
            for user, field in (
                ("hidden", "attainment_hidden_pct"),
                ("shown", "attainment_shown_pct"),
            ):
                lines = {}
                for policy in dict.fromkeys(c.policy for c in sweep.cells):
                    cells = sweep.cells_at(rate, policy)
                    curves = [getattr(c, field) for c in cells if getattr(c, field) is not None]
                    scales = cells[0].attainment_scales if cells else None
                    if curves and scales is not None:
                        lines[policy] = (scales, [float(v) for v in np.median(curves, axis=0)])
                row.append((f"{load}, reasoning {user}", lines))
            if any(lines for _, lines in row):
                rows.append(row)
        if rows:
            title = (
                f"SLO attainment, {sweep.workload}, {run.model} on {run.hardware} "
                f"(median of {len(run.all_seeds)} seed(s))"
            )
            written.append(write_attainment_plot(rows, title, Path(f"{base}-{sweep.workload}.png")))
    return written


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


__all__ = [
    "HEAVY",
    "LIGHT",
    "block_keys",
    "blocks",
    "count_misses",
    "misses",
    "render_docs",
    "table",
]
