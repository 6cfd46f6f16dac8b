"""PNG plots of simulator runs and sweeps (matplotlib, Agg, no display needed).

:func:`write_plots` draws one run per policy from either the raw :class:`SimResult` (exact CDFs)
or a :class:`PolicySummary` (CDFs redrawn from its 0..100 % quantile sketch, e.g. from a saved
``report.json``). :func:`write_sweep_plots` draws the headline chart: goodput and output ITL P99
against arrival rate. :func:`write_attainment_plot` draws SLO attainment against the SLO's
scale, a panel per user model (and per load, for a sweep).

NOTE: figures are built with ``matplotlib.figure.Figure`` and the Agg canvas directly instead of
``pyplot``: no global backend switch, no figure registry to leak, nothing to close, and it is
safe to call from any thread.

Length: every chart is a short function over one shared set of helpers (figure sizing, colours,
CDF points, log axes, the sketch note); a module per chart would import them all, and the
charts' look would be set in several places.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from meridian.bench.report import CANDIDATE, SweepPoint, SweepReport
from meridian.bench.slo import GOODPUT_SCALE, SloSpec
from meridian.bench.summary import (
    FloatArray,
    PolicySummary,
    TimeSeries,
    collect_distributions,
    downsample,
)
from meridian.errors import MeridianError
from meridian.sim.records import SimResult

DPI = 100
# A CDF line needs no more points than a figure has pixels across.
MAX_CDF_POINTS = 1000
THINK_HISTOGRAM_BINS = 40
# Log x-axis when the largest value is this many times the median: stalls far out in the tail
# would otherwise squash the body of the distribution into a vertical line.
LOG_TAIL_RATIO = 10.0


@dataclass(frozen=True, slots=True)
class _Curves:
    """What the plots need of one policy. ``exact``: raw values, else a quantile sketch."""

    policy: str
    output_itl_s: FloatArray
    ttfvt_s: FloatArray
    ttot_s: FloatArray
    think_tokens: FloatArray
    series: TimeSeries
    exact: bool


def _curves(policy: str, run: SimResult | PolicySummary) -> _Curves:
    if isinstance(run, SimResult):
        dist = collect_distributions(run.records)
        return _Curves(
            policy=policy,
            output_itl_s=dist.output_itl_s,
            ttfvt_s=dist.ttfvt_s,
            ttot_s=dist.ttot_s,
            think_tokens=dist.think_tokens,
            series=downsample(run.samples, run.num_kv_blocks),
            exact=True,
        )
    sketch = run.distributions
    return _Curves(
        policy=policy,
        output_itl_s=np.asarray(sketch.output_itl_s.quantiles, dtype=np.float64),
        ttfvt_s=np.asarray(sketch.ttfvt_s.quantiles, dtype=np.float64),
        ttot_s=np.asarray(sketch.ttot_s.quantiles, dtype=np.float64),
        think_tokens=np.asarray(sketch.think_tokens.quantiles, dtype=np.float64),
        series=run.series,
        exact=False,
    )


def _color(index: int) -> str:
    return f"C{index % 10}"


def _line_width(policy: str) -> float:
    return 2.2 if policy == CANDIDATE else 1.3


def _figure(width_in: float, height_in: float, top_in: float = 0.55) -> Figure:
    """A figure with fixed margins (in inches, so stacked subplots keep room for their labels).

    NOTE: fixed margins rather than constrained layout: the layout solver was most of the cost
    of a plot (it measures every tick label), and these figures have a known shape.
    """
    fig = Figure(figsize=(width_in, height_in))
    fig.subplots_adjust(
        left=0.8 / width_in,
        right=1.0 - 0.25 / width_in,
        bottom=0.6 / height_in,
        top=1.0 - top_in / height_in,
        hspace=0.45 * 5.0 / max(height_in, 5.0),
    )
    return fig


def _stacked_height(num_rows: int, row_in: float) -> float:
    """Height of a figure of ``num_rows`` stacked subplots: a row each, never squashed."""
    return max(num_rows * row_in + 1.0, 5.0)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def _cdf_points(values: FloatArray, exact: bool) -> tuple[FloatArray, FloatArray]:
    """(x, y) of the empirical CDF; a quantile sketch is already (quantile, probability)."""
    if not exact:
        return values, np.linspace(0.0, 1.0, values.size)
    ordered = np.sort(values)
    if ordered.size > MAX_CDF_POINTS:
        probs = np.linspace(0.0, 1.0, MAX_CDF_POINTS)
        return np.quantile(ordered, probs, method="linear"), probs
    return ordered, np.arange(1, ordered.size + 1) / ordered.size


def _maybe_log_x(ax: Any, arrays: Sequence[FloatArray]) -> None:
    positive = np.concatenate([a[a > 0] for a in arrays] or [np.zeros(0)])
    if positive.size and positive.max() > LOG_TAIL_RATIO * float(np.median(positive)):
        ax.set_xscale("log")
        # Plain numbers (20, 50, 200) rather than 2x10^1: readers compare them with an SLO.
        ax.xaxis.set_major_formatter(FuncFormatter(_plain_tick))
        ax.xaxis.set_minor_formatter(FuncFormatter(_plain_minor_tick))


def _plain_tick(value: float, _pos: int) -> str:
    return f"{value:g}"


def _plain_minor_tick(value: float, _pos: int) -> str:
    # Label 2x and 5x of each decade only, so minor labels never collide.
    leading = f"{value:e}"[0]
    return f"{value:g}" if leading in ("2", "5") else ""


def _sketch_note(curves: Sequence[_Curves]) -> str:
    """A title suffix saying the curves were redrawn from quantiles, not from the raw values."""
    return "" if all(c.exact for c in curves) else "\n(from the report's 1 % quantiles)"


def _title_room(num_title_lines: int, *, stacked: bool) -> float:
    """Inches above the top axes: the title's lines, plus the first panel's own title."""
    return 0.3 + 0.25 * num_title_lines + (0.3 if stacked else 0.0)


def _num_title_lines(curves: Sequence[_Curves]) -> int:
    return 1 + bool(_sketch_note(curves))


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _cdf_figure(
    curves: Sequence[_Curves],
    values_of: Callable[[_Curves], FloatArray],
    scale: float,
    title: str,
    xlabel: str,
    path: Path,
    slo_line: float | None = None,
) -> Path:
    fig = _figure(8.0, 5.0, top_in=_title_room(_num_title_lines(curves), stacked=False))
    ax = fig.add_subplot()
    drawn: list[FloatArray] = []
    for i, c in enumerate(curves):
        values = values_of(c) * scale
        if values.size == 0:
            continue
        x, y = _cdf_points(values, c.exact)
        ax.plot(x, y, color=_color(i), linewidth=_line_width(c.policy), label=c.policy)
        drawn.append(values)
    if drawn:
        _maybe_log_x(ax, drawn)
        if slo_line is not None:
            ax.axvline(slo_line, color="black", linestyle="--", linewidth=1.0, label="SLO")
        ax.legend(loc="lower right")
    else:
        _no_data(ax)
    ax.set_title(title + _sketch_note(curves))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0.0, 1.01)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _think_histogram(curves: Sequence[_Curves], path: Path) -> Path:
    fig = _figure(
        8.0,
        _stacked_height(len(curves), 1.8),
        _title_room(_num_title_lines(curves), stacked=True),
    )
    axes = fig.subplots(len(curves), 1, sharex=True, squeeze=False)[:, 0]
    nonempty = [c.think_tokens for c in curves if c.think_tokens.size]
    top = max((float(a.max()) for a in nonempty), default=1.0)
    bins = np.linspace(0.0, max(top, 1.0), THINK_HISTOGRAM_BINS + 1)
    for i, (ax, c) in enumerate(zip(axes, curves, strict=True)):
        tokens = c.think_tokens
        if tokens.size:
            # Percent of reasoning requests; a quantile point carries 1/101 of the mass.
            weights = np.full(tokens.size, 100.0 / tokens.size)
            ax.hist(tokens, bins=bins, weights=weights, color=_color(i))
        else:
            _no_data(ax)
        ax.set_ylabel("% of reasoning")
        ax.set_title(c.policy, fontsize="medium", loc="left")
        ax.grid(True, alpha=0.3)
    fig.suptitle("Think tokens generated per reasoning request" + _sketch_note(curves))
    axes[-1].set_xlabel("think tokens (tokens)")
    return _save(fig, path)


def _over_time(
    curves: Sequence[_Curves],
    lines: Sequence[tuple[str, Callable[[TimeSeries], Sequence[float] | Sequence[int]], float]],
    title: str,
    ylabel: str,
    path: Path,
) -> Path:
    fig = _figure(9.0, _stacked_height(len(curves), 1.9), _title_room(1, stacked=True))
    axes = fig.subplots(len(curves), 1, sharex=True, squeeze=False)[:, 0]
    for ax, c in zip(axes, curves, strict=True):
        t = c.series.time_s
        if t:
            for label, read, scale in lines:
                ax.plot(t, np.asarray(read(c.series), dtype=np.float64) * scale, label=label)
            ax.legend(loc="upper right", fontsize="small")
        else:
            _no_data(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(c.policy, fontsize="medium", loc="left")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    axes[-1].set_xlabel("simulated time (s)")
    return _save(fig, path)


def write_plots(
    runs: Mapping[str, SimResult | PolicySummary],
    out_dir: Path,
    slo: SloSpec | None = None,
) -> list[Path]:
    """Draw every per-run plot into ``out_dir`` (created if missing); returns the PNG paths.

    ``runs`` maps policy name to its run (raw result or summary), drawn in mapping order with a
    fixed colour per position. ``slo`` adds a line to the ITL CDF: the explicit SLO's ITL bound,
    or the stall bound no answer gap may exceed.
    """
    if not runs:
        raise MeridianError("nothing to plot: no policy runs were given")
    out_dir.mkdir(parents=True, exist_ok=True)
    curves = [_curves(policy, run) for policy, run in runs.items()]
    itl_slo_ms = None if slo is None else _itl_line_s(slo) * 1000.0
    return [
        _cdf_figure(
            curves,
            lambda c: c.output_itl_s,
            1000.0,
            "Output inter-token latency (all answer-token gaps)",
            "output ITL (ms)",
            out_dir / "cdf-output-itl.png",
            slo_line=itl_slo_ms,
        ),
        _cdf_figure(
            curves,
            lambda c: c.ttfvt_s,
            1.0,
            "Time to first visible (answer) token",
            "TTFVT (s)",
            out_dir / "cdf-ttfvt.png",
        ),
        _cdf_figure(
            curves,
            lambda c: c.ttot_s,
            1.0,
            "Time from </think> to first answer token (reasoning requests)",
            "TTOT (s)",
            out_dir / "cdf-ttot.png",
        ),
        _think_histogram(curves, out_dir / "think-tokens.png"),
        _over_time(
            curves,
            [
                ("KV used", lambda s: s.kv_used_fraction, 100.0),
                ("KV held by think", lambda s: s.kv_think_fraction, 100.0),
            ],
            "KV cache usage over time",
            "% of KV blocks",
            out_dir / "kv-usage.png",
        ),
        _over_time(
            curves,
            [
                ("output queue", lambda s: s.queue_output, 1.0),
                ("think queue", lambda s: s.queue_think, 1.0),
                ("running", lambda s: s.num_running, 1.0),
            ],
            "Queue depth over time (bucket maxima)",
            "requests",
            out_dir / "queue-depth.png",
        ),
    ]


def _itl_line_s(slo: SloSpec) -> float:
    return slo.stall_s if slo.explicit is None else slo.explicit.output_itl_s


# (panel title, {policy: (scales, attainment %)}): one panel of an attainment figure.
AttainmentPanel = tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]


def attainment_panels(summaries: Mapping[str, PolicySummary]) -> list[AttainmentPanel]:
    """The two panels of one run: reasoning hidden and shown (policies without curves left
    out)."""
    hidden = {p: (s.attainment.scales, s.attainment.hidden_pct) for p, s in _curved(summaries)}
    shown = {p: (s.attainment.scales, s.attainment.shown_pct) for p, s in _curved(summaries)}
    return [("reasoning hidden (first visible = first answer token)", hidden),
            ("reasoning shown (first visible = first think token)", shown)]  # fmt: skip


def _curved(summaries: Mapping[str, PolicySummary]) -> list[tuple[str, Any]]:
    return [(p, s) for p, s in summaries.items() if s.attainment is not None]


def write_attainment_plot(
    rows: Sequence[Sequence[AttainmentPanel]], title: str, path: Path
) -> Path:
    """SLO attainment (%) against the SLO's scale (x each request's idle latency): ``rows`` of
    panels (a row per run or load; :func:`attainment_panels` gives one run's), a line per
    policy in a fixed colour, the goodput scale marked."""
    if not rows or not any(lines for row in rows for _, lines in row):
        raise MeridianError("nothing to plot: no run has attainment curves")
    num_cols = max(len(row) for row in rows)
    height = _stacked_height(len(rows), 3.2)
    fig = _figure(5.0 * num_cols, height, top_in=0.9)
    fig.subplots_adjust(wspace=0.25)
    fig.suptitle(title)
    policies = list(dict.fromkeys(p for row in rows for _, lines in row for p in lines))
    for r, row in enumerate(rows):
        for c, (panel, lines) in enumerate(row):
            ax = fig.add_subplot(len(rows), num_cols, r * num_cols + c + 1)
            for policy, (scales, pct) in lines.items():
                i = policies.index(policy)
                ax.plot(scales, pct, color=_color(i), linewidth=_line_width(policy), label=policy)
            ax.axvline(GOODPUT_SCALE, color="black", linestyle=":", linewidth=1.0)
            ax.set_title(panel, fontsize="medium")
            ax.set_ylim(0.0, 101.0)
            ax.set_xlabel("SLO scale (× the request's latency on an idle engine)")
            ax.set_ylabel("requests meeting the SLO (%)")
            ax.grid(True, alpha=0.3)
            if r == 0 and c == 0 and lines:
                ax.legend(loc="lower right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)


@dataclass(frozen=True, slots=True)
class _SweepChart:
    file_name: str
    title: str
    ylabel: str
    scale: float
    read: Callable[[SweepPoint], dict[str, float | None]]
    shows_itl_slo: bool


_SWEEP_CHARTS = (
    _SweepChart(
        "sweep-goodput.png",
        "Goodput (requests meeting the SLO per second of arrivals) vs arrival rate",
        "goodput (requests/s)",
        1.0,
        lambda pt: pt.goodput_req_s,
        shows_itl_slo=False,
    ),
    _SweepChart(
        "sweep-output-itl-p99.png",
        "Output ITL P99 vs arrival rate",
        "output ITL P99 (ms)",
        1000.0,
        lambda pt: pt.output_itl_p99_s,
        shows_itl_slo=True,
    ),
)


def write_sweep_plots(sweep: SweepReport, out_dir: Path) -> list[Path]:
    """Goodput and output ITL P99 against arrival rate, a line per policy (the headline chart).

    Writes ``sweep-goodput.png`` and ``sweep-output-itl-p99.png``; with an explicit SLO the ITL
    chart shows its ITL bound as a dashed line (it bounds each request's P95, so it is a
    reference, not a limit).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [pt.arrival_rate for pt in sweep.points]
    paths: list[Path] = []
    for chart in _SWEEP_CHARTS:
        fig = _figure(8.0, 5.0)
        ax = fig.add_subplot()
        for i, policy in enumerate(sweep.policies):
            values = [chart.read(pt).get(policy) for pt in sweep.points]
            # A missing value (None) breaks the line rather than drawing it at zero.
            y = [np.nan if v is None else v * chart.scale for v in values]
            ax.plot(
                rates, y, marker="o", color=_color(i), linewidth=_line_width(policy), label=policy
            )
        if chart.shows_itl_slo and sweep.slo.explicit is not None:
            ax.axhline(
                sweep.slo.explicit.output_itl_s * 1000.0,
                color="black",
                linestyle="--",
                linewidth=1.0,
                label="explicit ITL SLO (per-request P95)",
            )
        ax.set_title(chart.title)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(chart.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out_dir / chart.file_name))
    return paths


def write_cluster_plots(
    rows: Mapping[tuple[float, str], Mapping[str, float]], title: str, path: Path
) -> Path:
    """TTFVT P95 and goodput against load, a line per router (``benchmarks/bench_cluster.py``).

    ``rows`` maps (load, ``ROUTER/POLICY``) to the run's figures (``ttfvt`` in s, ``goodput`` in
    req/s); a router's line is solid with Meridian's scheduling and dashed with stock's, in one
    colour per router.
    """
    loads = sorted({load for load, _ in rows})
    runs = list(dict.fromkeys(name for _, name in rows))
    routers = list(dict.fromkeys(name.split("/", 1)[0] for name in runs))
    fig = _figure(8.0, 8.0, top_in=0.8)
    fig.suptitle(title)
    panels = (("ttfvt", "TTFVT P95 (s)"), ("goodput", "goodput (requests/s)"))
    for k, (key, label) in enumerate(panels):
        ax = fig.add_subplot(2, 1, k + 1)
        for name in runs:
            router, policy = name.split("/", 1)
            y = [rows.get((load, name), {}).get(key, np.nan) for load in loads]
            ax.plot(
                [100.0 * x for x in loads],
                y,
                marker="o",
                color=_color(routers.index(router)),
                linestyle="-" if policy == CANDIDATE else "--",
                linewidth=2.2 if name == f"{CANDIDATE}/{CANDIDATE}" else 1.3,
                label=name,
            )
        ax.set_xlabel("load (% of the cluster's capacity)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if k == 0:
            ax.legend(fontsize="small", ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)
