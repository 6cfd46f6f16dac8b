"""The simulator's reports as files: Markdown for people next to the canonical JSON
(:mod:`meridian.bench.report` holds the models and builds them; this module renders and writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from meridian.bench.ab import (
    HEADLINE_METRICS,
    THRESHOLDS_TEXT,
    AbComparison,
    AbRow,
    compare,
)
from meridian.bench.effects import effect_lines
from meridian.bench.offered import OfferedLoad, describe
from meridian.bench.report import (
    CANDIDATE,
    PREMATURE_NOTE,
    AbReport,
    SimReport,
    SweepPoint,
    SweepReport,
    _RunParameters,
    ab_baselines,
    build_ab_report,
    to_json,
)
from meridian.bench.slo import GOODPUT_SCALE, UserModel
from meridian.bench.summary import PolicySummary
from meridian.bench.workloads import is_bundled

__all__ = [
    "fmt",
    "fmt_comparison",
    "losses_of",
    "render_ab_markdown",
    "render_markdown",
    "render_sweep_markdown",
    "write_ab_report",
    "write_report",
    "write_sweep_report",
]


def write_report(report: SimReport, out_dir: Path) -> list[Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir`` (created if missing)."""
    return _write(out_dir, "report", to_json(report), render_markdown(report))


def write_ab_report(ab: AbReport, out_dir: Path) -> list[Path]:
    """Write ``ab-report.json`` and ``ab-report.md`` into ``out_dir`` (created if missing)."""
    return _write(out_dir, "ab-report", to_json(ab), render_ab_markdown(ab))


def write_sweep_report(sweep: SweepReport, out_dir: Path) -> list[Path]:
    """Write ``sweep-report.json`` and ``sweep-report.md`` into ``out_dir``."""
    return _write(out_dir, "sweep-report", to_json(sweep), render_sweep_markdown(sweep))


def _write(out_dir: Path, stem: str, json_text: str, markdown: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    md_path = out_dir / f"{stem}.md"
    # newline="" keeps "\n" on every platform, part of the byte-identical promise.
    json_path.write_text(json_text, encoding="utf-8", newline="")
    md_path.write_text(markdown, encoding="utf-8", newline="")
    return [json_path, md_path]


# --- Markdown -------------------------------------------------------------------------------------


def fmt(value: float | None, scale: float = 1.0) -> str:
    """A table cell: ``—`` for no value, integers as such, floats to 4 significant digits.

    >>> fmt(None), fmt(3), fmt(4096), fmt(0.0123456), fmt(0.05, 1000), fmt(123456.7)
    ('—', '3', '4,096', '0.01235', '50', '123,457')
    """
    if value is None:
        return "—"
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    scaled = value * scale
    if abs(scaled) >= 1000:
        return f"{scaled:,.0f}"
    return f"{scaled:.4g}"


def fmt_comparison(comparison: AbComparison) -> str:
    """``-12.3 % WIN``; ``base 0: LOSS`` against a zero baseline; ``—`` when there is no value."""
    if comparison.flag is None:
        return "—"
    if comparison.delta_pct is None:
        return f"base 0: {comparison.flag.value}"
    return f"{comparison.delta_pct:+.1f} % {comparison.flag.value}"


def _table(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


_Reader = Callable[[PolicySummary], float | None]
HIDDEN, SHOWN = UserModel.HIDDEN, UserModel.SHOWN

# (label, unit, scale, reader): the rows of report.md's summary table.
_SUMMARY_ROWS: tuple[tuple[str, str, float, _Reader], ...] = (
    ("requests", "count", 1.0, lambda s: s.num_requests),
    ("finished", "count", 1.0, lambda s: s.num_finished),
    ("reasoning requests", "count", 1.0, lambda s: s.num_reasoning),
    ("chat requests", "count", 1.0, lambda s: s.num_chat),
    ("TTFT P50", "s", 1.0, lambda s: s.ttft_s.p50),
    ("TTFT P95", "s", 1.0, lambda s: s.ttft_s.p95),
    ("TTFT P99", "s", 1.0, lambda s: s.ttft_s.p99),
    ("TTFVT mean", "s", 1.0, lambda s: s.ttfvt_s.mean),
    ("TTFVT P50", "s", 1.0, lambda s: s.ttfvt_s.p50),
    ("TTFVT P95", "s", 1.0, lambda s: s.ttfvt_s.p95),
    ("TTFVT P99", "s", 1.0, lambda s: s.ttfvt_s.p99),
    ("TTOT P50", "s", 1.0, lambda s: s.ttot_s.p50),
    ("TTOT P95", "s", 1.0, lambda s: s.ttot_s.p95),
    ("TTOT P99", "s", 1.0, lambda s: s.ttot_s.p99),
    ("output ITL P50", "ms", 1000.0, lambda s: s.output_itl_s.p50),
    ("output ITL P95", "ms", 1000.0, lambda s: s.output_itl_s.p95),
    ("output ITL P99", "ms", 1000.0, lambda s: s.output_itl_s.p99),
    ("think tokens avg", "tokens", 1.0, lambda s: s.think_tokens.mean),
    ("think tokens P95", "tokens", 1.0, lambda s: s.think_tokens.p95),
    ("output tokens avg", "tokens", 1.0, lambda s: s.answer_tokens.mean),
    ("forced: converged", "% reasoning", 1.0, lambda s: s.forced_pct.converged),
    ("forced: overthinking", "% reasoning", 1.0, lambda s: s.forced_pct.overthinking),
    ("forced: hard cap", "% reasoning", 1.0, lambda s: s.forced_pct.hard_cap),
    ("premature force rate (model)", "% forced", 1.0, lambda s: s.premature_force_pct),
    ("think tokens saved", "tokens", 1.0, lambda s: s.think_tokens_saved),
    ("think tokens saved", "% requested", 1.0, lambda s: s.think_tokens_saved_pct),
    ("preemptions (prefill)", "count", 1.0, lambda s: s.preemptions.prefill),
    ("preemptions (think)", "count", 1.0, lambda s: s.preemptions.think),
    ("preemptions (output)", "count", 1.0, lambda s: s.preemptions.output),
    ("recomputed tokens", "tokens", 1.0, lambda s: s.num_recomputed_tokens),
    ("computed tokens (work)", "tokens", 1.0, lambda s: s.num_scheduled_tokens),
    ("KV blocks reloaded (offload)", "blocks", 1.0, lambda s: s.num_offload_loaded_blocks),
    ("worst answer gap", "steps", 1.0, lambda s: s.worst_answer_gap_steps),
    ("throughput", "tokens/s", 1.0, lambda s: s.throughput_tok_s),
    ("goodput", "requests/s", 1.0, lambda s: s.goodput_req_s),
    ("answer accuracy (model)", "% reasoning", 1.0, lambda s: s.answer_accuracy_pct),
    ("SLO met (goodput's SLO)", "% requests", 1.0, lambda s: s.slo_met_pct),
    ("SLO attainment at 3×, reasoning hidden", "% requests", 1.0, lambda s: _at(s, HIDDEN)),
    ("SLO attainment at 3×, reasoning shown", "% requests", 1.0, lambda s: _at(s, SHOWN)),
    ("goodput, reasoning shown", "requests/s", 1.0, lambda s: _shown_goodput(s)),
    ("peak KV use", "% blocks", 100.0, lambda s: _contention(s, "kv_used_peak")),
    ("longest waiting queue", "requests", 1.0, lambda s: _contention(s, "max_waiting")),
    ("requests preempted", "count", 1.0, lambda s: _preempted(s)),
)


def _at(s: PolicySummary, user: UserModel) -> float | None:
    return None if s.attainment is None else s.attainment.pct_at(user, GOODPUT_SCALE)


def _shown_goodput(s: PolicySummary) -> float | None:
    return None if s.attainment is None else s.attainment.goodput_shown_req_s


def _preempted(s: PolicySummary) -> float | None:
    return _contention(s, "num_preempted_requests")


def _contention(s: PolicySummary, name: str) -> float | None:
    return None if s.contention is None else float(getattr(s.contention, name))


ENGINE_TEXT = {
    "vllm": "vLLM's own scheduler driven on virtual time (`--engine vllm`)",
    "model": "the fast engine model (`--engine model`), checked against vLLM's scheduler by "
    "`meridian bench fidelity`",
    "real": "a live server",
}


def _header(title: str, params: _RunParameters, rate_text: str) -> list[str]:
    slo = params.slo
    engine = ENGINE_TEXT.get(params.engine, params.engine)
    shape = ""
    if params.max_num_seqs is not None:
        mode = "asynchronous" if params.async_scheduling else "synchronous"
        shape = (
            f" Engine shape: max_num_seqs {fmt(params.max_num_seqs)}, max_num_batched_tokens "
            f"{fmt(params.max_num_batched_tokens)}, {fmt(params.num_kv_blocks)} KV blocks, chunked "
            f"prefill and prefix caching on, {mode} scheduling."
        )
    if is_bundled(params.workload):
        load = f"seed {params.seed}, {rate_text}, {fmt(params.duration_s)} s of arrivals"
    else:  # a trace: its own arrival times, whatever rate and duration the command line had
        load = "replayed at the trace's own arrival times (the load it offered is stated below)"
    warmup = (
        f"the first {fmt(params.warmup_s)} s of arrivals are warm-up, in no statistic"
        if params.warmup_s
        else "no warm-up: every arrival counts"
    )
    return [
        f"# {title}",
        "",
        f"Workload `{params.workload}`, {load} ({warmup}); hardware `{params.hardware}`, "
        f"model `{params.model}`. Engine: {engine}.{shape}",
        "",
        f"SLO: {slo.describe()}. SLO attainment is the share of requests meeting it at each "
        "scale, for reasoning hidden (first visible token = first answer token) and shown (= "
        "first think token; think gaps count); goodput counts the requests meeting goodput's "
        "SLO, finished with an answer that is not wrong (entropy model), per second of the "
        "arrival window.",
        "",
    ]


def _offered_lines(offered: OfferedLoad | None) -> list[str]:
    """The load the requests offered, when the report knows it."""
    return [] if offered is None else [f"Load: {describe(offered)}.", ""]


def _summary_table(policies: Sequence[str], summaries: dict[str, PolicySummary]) -> list[str]:
    rows: list[list[str]] = []
    for label, unit, scale, read in _SUMMARY_ROWS:
        rows.append([label, unit, *(fmt(read(summaries[p]), scale) for p in policies)])
    return _table(
        ["metric", "unit", *(f"`{p}`" for p in policies)],
        ["---", "---", *("--:" for _ in policies)],
        rows,
    )


def _display_unit(row: AbRow) -> tuple[float, str]:
    """Inter-token latencies read better in ms; the JSON keeps seconds everywhere."""
    if row.unit == "s" and row.metric.startswith("output_itl"):
        return 1000.0, "ms"
    return 1.0, row.unit


def _losses(rows: Sequence[AbRow], candidate: str, baselines: Sequence[str]) -> list[str]:
    lines: list[str] = []
    for row in rows:
        for b in baselines:
            c = row.comparisons[b]
            if c.flag is None or not c.flag.is_loss:
                continue
            scale, unit = _display_unit(row)
            change = "from 0" if c.delta_pct is None else f"{c.delta_pct:+.1f} %"
            lines.append(
                f"- **{row.label}** vs `{b}`: {change} ({c.flag.value}): "
                f"{fmt(row.values[candidate], scale)} against {fmt(row.values[b], scale)} {unit}"
            )
    return lines


def losses_of(report: SimReport) -> list[str] | None:
    """The candidate's losses (``- **metric** vs `baseline`: ...``) against the baselines of
    :func:`ab_baselines`; ``None`` when the run has no candidate or no such baseline."""
    if CANDIDATE not in report.summaries:
        return None
    baselines = ab_baselines(report)
    if baselines == []:
        return None
    ab = build_ab_report(report, baselines=baselines)
    return _losses(ab.rows, ab.candidate, ab.baselines)


def _losses_section(rows: Sequence[AbRow], candidate: str, baselines: Sequence[str]) -> list[str]:
    losses = _losses(rows, candidate, baselines)
    return ["## Where Meridian loses", "", *(losses or ["Nowhere on this run."]), ""]


def render_markdown(report: SimReport) -> str:
    """``report.md``: run parameters, one column per policy, and where Meridian loses."""
    lines = _header(
        "Meridian simulator report",
        report,
        f"arrival rate {fmt(report.arrival_rate)} requests/s",
    )
    lines += _offered_lines(report.offered)
    lines += ["## Summary", "", *_summary_table(report.policies, report.summaries), ""]
    lines += _attainment_section(report.policies, report.summaries)
    if report.forcing:
        lines += _forcing_section(report)
    if report.engine != "real" and (effects := effect_lines(report.summaries)):
        lines += ["## Scheduling and forcing, each with the other held equal", ""]
        lines += [line.strip() for line in effects] + [""]
    losses = losses_of(report)
    if losses is not None:
        lines += ["## Where Meridian loses", "", *(losses or ["Nowhere on this run."]), ""]
        lines += [THRESHOLDS_TEXT, ""]
    lines += [PREMATURE_NOTE, ""]
    return "\n".join(lines)


# The scales report.md shows (the JSON and the plot have every one of SCALES).
_SHOWN_SCALES = (1.5, 2.0, 3.0, 5.0, 10.0)


def _attainment_section(policies: Sequence[str], summaries: dict[str, PolicySummary]) -> list[str]:
    """SLO attainment (%) at a few scales, per user model and policy."""
    curves = {p: a for p in policies if (a := summaries[p].attainment) is not None}
    curved = list(curves)
    if not curves:
        return []
    rows = []
    for user in UserModel:
        for scale in _SHOWN_SCALES:
            values = [a.pct_at(user, scale) for a in curves.values()]
            rows.append([f"reasoning {user.value}", f"{scale:g}×", *(fmt(v) for v in values)])
    return [
        "## SLO attainment",
        "",
        "Requests (%) meeting an SLO of scale × their own latency on an idle engine of this shape "
        "(`attainment.png` draws every scale from 1.5 to 10).",
        "",
        *_table(
            ["user model", "scale", *(f"`{p}`" for p in curved)],
            ["---", "--:", *("--:" for _ in curved)],
            rows,
        ),
        "",
    ]


def _forcing_section(report: SimReport) -> list[str]:
    rows = [
        [
            f"`{f.forcing}`",
            fmt(f.think_tokens_avg),
            fmt(f.think_tokens_saved_pct),
            fmt(f.num_forced),
            fmt(f.answer_accuracy_pct),
        ]
        for f in report.forcing
    ]
    cap = (
        f" `static-budget` ran at cap {report.static_cap}: the saving of Meridian's forcing."
        if report.static_cap is not None
        else ""
    )
    return [
        "## Forcing, apart from scheduling",
        "",
        "The same streams feed every engine and scheduler; what a forcing saves and what it costs "
        f"in answers (entropy model).{cap}",
        "",
        *_table(
            ["forcing", "think tokens avg", "saved (%)", "forced", "answer accuracy (model, %)"],
            ["---", "--:", "--:", "--:", "--:"],
            rows,
        ),
        "",
    ]


def render_ab_markdown(ab: AbReport) -> str:
    """``ab-report.md``: a column per policy, Δ% and flag per baseline, the losses, the rules."""
    policies = [ab.candidate, *ab.baselines]
    rows: list[list[str]] = []
    for row in ab.rows:
        scale, unit = _display_unit(row)
        values = [fmt(row.values[p], scale) for p in policies]
        deltas = [fmt_comparison(row.comparisons[b]) for b in ab.baselines]
        rows.append([row.label, unit, f"{row.direction.value} is better", *values, *deltas])
    table = _table(
        [
            "metric",
            "unit",
            "direction",
            *(f"`{p}`" for p in policies),
            *(f"Δ vs `{b}`" for b in ab.baselines),
        ],
        ["---", "---", "---", *("--:" for _ in policies), *("--:" for _ in ab.baselines)],
        rows,
    )
    lines = _header(
        f"A/B: `{ab.candidate}` against the baselines",
        ab,
        f"arrival rate {fmt(ab.arrival_rate)} requests/s",
    )
    lines += _offered_lines(ab.offered)
    lines += [
        f"Δ is `{ab.candidate}`'s change against each baseline: (candidate − baseline) / baseline.",
        ""
        if ab.engine == "real"
        else f"The baselines run `{ab.candidate}`'s forcing, so Δ is scheduling's doing; what "
        "forcing did, scheduling held equal, is in `report.md`.",
        "",
        *table,
        "",
        *_losses_section(ab.rows, ab.candidate, ab.baselines),
        "---",
        "",
        THRESHOLDS_TEXT,
        "",
        PREMATURE_NOTE,
        "",
    ]
    return "\n".join(lines)


# (title, unit, scale, column per policy): the tables of sweep-report.md.
_SWEEP_TABLES: tuple[
    tuple[str, str, float, Callable[[SweepPoint], dict[str, float | None]]], ...
] = (
    ("Goodput", "requests/s", 1.0, lambda pt: pt.goodput_req_s),
    ("Output ITL P99", "ms", 1000.0, lambda pt: pt.output_itl_p99_s),
)


def render_sweep_markdown(sweep: SweepReport) -> str:
    """``sweep-report.md``: goodput and output ITL P99 against arrival rate, and the losses."""
    rates = ", ".join(fmt(r) for r in sweep.arrival_rates)
    lines = _header("Meridian arrival-rate sweep", sweep, f"arrival rates {rates} requests/s")
    lines += [
        f"- at {fmt(pt.arrival_rate)} requests/s: {_offered_lines(pt.offered)[0]}"
        for pt in sweep.points
        if pt.offered is not None
    ]
    lines += [""] if any(pt.offered is not None for pt in sweep.points) else []
    policies = sweep.policies
    for title, unit, scale, table_of in _SWEEP_TABLES:
        rows = [
            [fmt(pt.arrival_rate), *(fmt(table_of(pt).get(p), scale) for p in policies)]
            for pt in sweep.points
        ]
        lines += [f"## {title} ({unit})", ""]
        lines += _table(
            ["arrival rate (requests/s)", *(f"`{p}`" for p in policies)],
            ["--:", *("--:" for _ in policies)],
            rows,
        )
        lines.append("")
    lines += ["## Where Meridian loses", ""]
    chosen = ab_baselines(sweep) if CANDIDATE in policies else []
    baselines = [p for p in policies if p != CANDIDATE] if chosen is None else chosen
    if baselines:
        losses: list[str] = []
        for pt in sweep.points:
            rows_at_rate = compare(pt.summaries, CANDIDATE, baselines, HEADLINE_METRICS)
            losses += [
                f"- at {fmt(pt.arrival_rate)} requests/s: {line[2:]}"
                for line in _losses(rows_at_rate, CANDIDATE, baselines)
            ]
        lines += [*(losses or ["Nowhere on this sweep."]), "", THRESHOLDS_TEXT, ""]
    else:
        lines += [f"No `{CANDIDATE}` run, or no baseline with its forcing, to compare.", ""]
    lines += [PREMATURE_NOTE, ""]
    return "\n".join(lines)
