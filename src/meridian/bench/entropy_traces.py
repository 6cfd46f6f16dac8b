"""Statistics of per-token think-entropy traces: a model's recorded ones next to the simulator's.

A trace is one chain's per-think-token entropy in nats (the distribution each think token was
sampled from, as Meridian's logits processor sees it). :func:`trace_stats` reduces a set of
traces to the quantities the simulator's entropy model (:mod:`meridian.bench.entropy_model`)
has parameters for: the level, the transition-token rate, how much interval means wander (from
one 32-token interval to the next, and within a chain), and where in a chain entropy sits (the
first token of a reasoning step, the last tokens before ``</think>``). The EAT stream proxy's
EMA variance is computed by the core tracker itself (:class:`~meridian.core.signals.EatTracker`),
so "which variance threshold would fire" is read off the detector that ships.

:func:`simulated_traces` draws the entropy model's traces at given chain lengths, so that both
sides are summarised by the same code at the same lengths (``benchmarks/
bench_reasoner_traces.py`` does it for ``models/sum-reasoner``).

>>> stats = trace_stats([np.full(64, 0.5, dtype=np.float32)])
>>> stats.mean, stats.transition_rate, stats.eat_variance_max
(0.5, 0.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from meridian.bench.entropy_model import EntropyModelParams, EntropyTraceModel
from meridian.bench.summary import percentiles
from meridian.core.signals import EatTracker

__all__ = ["TraceStats", "comparison_markdown", "simulated_traces", "trace_stats"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class TraceStats:
    """A set of traces, reduced (nats unless named otherwise; ``nan`` where nothing counts).

    ``boundary_mean``/``inside_mean``: the mean entropy of the first token of a reasoning step
    (the token after a ``step_end`` token) and of every other token (``nan`` without the
    tokens' text). ``end_mean``: of each chain's last ``end_tokens`` think tokens.
    ``interval_level``: the mean of the ``interval_tokens``-token interval means;
    ``interval_step_std``: the std of the difference of consecutive interval means (pooled);
    ``interval_std_median``: the median over chains of the std of a chain's interval means.
    ``eat_variance_max``: the largest EMA variance of the interval means (the EAT stream proxy,
    ``alpha``) at any sample after the first, over every chain: a variance threshold above it
    fires as soon as ``eat_min_distance`` allows.
    """

    num_chains: int
    num_tokens: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float
    boundary_mean: float
    inside_mean: float
    end_mean: float
    transition_rate: float
    interval_level: float
    interval_step_std: float
    interval_std_median: float
    eat_variance_max: float


def _interval_means(entropy: F32, size: int) -> npt.NDArray[np.float64]:
    """Means of the complete ``size``-token intervals (the EAT stream proxy's samples)."""
    k = entropy.size // size
    means: npt.NDArray[np.float64] = (
        entropy[: k * size].astype(np.float64).reshape(k, size).mean(axis=1)
    )
    return means


def _eat_variances(samples: npt.NDArray[np.float64], alpha: float) -> list[float]:
    """``V[n]`` of the core EAT recursion for every sample after the first."""
    tracker = EatTracker(alpha=alpha, variance_threshold=0.0, min_distance=1, interval_tokens=1)
    variances = []
    for n, x in enumerate(samples.tolist()):
        tracker.add_sample(x)  # a threshold of 0 never fires: the tracker never latches
        if n >= 1:
            variances.append(tracker.variance)
    return variances


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def _mean(values: Sequence[float] | npt.NDArray[np.float64]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def trace_stats(
    traces: Sequence[F32],
    *,
    tokens: Sequence[Sequence[str]] | None = None,
    step_end: str = ";",
    interval_tokens: int = 32,
    alpha: float = 0.05,
    transition_threshold: float = 2.5,
    end_tokens: int = 10,
) -> TraceStats:
    """Reduce ``traces`` (one float array per chain; see :class:`TraceStats`).

    ``tokens``, when given, holds each chain's think tokens as text (same lengths as the
    traces); a step starts after a token equal to ``step_end``.

    >>> s = trace_stats([np.array([0.1, 3.0, 0.1, 0.1], dtype=np.float32)],
    ...                 tokens=[["a", ";", "b", "c"]], interval_tokens=2, end_tokens=2)
    >>> [round(x, 3) for x in (s.boundary_mean, s.inside_mean, s.transition_rate, s.interval_level)]
    [0.1, 1.067, 0.25, 0.825]
    """
    if not traces:
        raise ValueError("no traces to summarise")
    if tokens is not None and [len(t) for t in tokens] != [len(h) for h in traces]:
        raise ValueError("tokens must hold one text per think token of each trace")
    pooled = np.concatenate([np.asarray(h, dtype=np.float64) for h in traces])
    if pooled.size == 0:
        raise ValueError("the traces hold no think token")
    spread = percentiles(pooled)
    boundary: list[float] = []
    inside: list[float] = []
    ends: list[float] = []
    steps: list[float] = []
    within: list[float] = []
    variances: list[float] = []
    levels: list[float] = []
    for i, h in enumerate(traces):
        values = np.asarray(h, dtype=np.float64)
        ends += values[-end_tokens:].tolist()
        if tokens is not None:
            starts = [j > 0 and tokens[i][j - 1] == step_end for j in range(values.size)]
            boundary += values[np.array(starts, dtype=bool)].tolist()
            inside += values[~np.array(starts, dtype=bool)].tolist()
        means = _interval_means(np.asarray(h, dtype=np.float32), interval_tokens)
        levels += means.tolist()
        steps += np.diff(means).tolist()
        if means.size >= 2:
            within.append(float(means.std()))
        variances += _eat_variances(means, alpha)
    return TraceStats(
        num_chains=len(traces),
        num_tokens=int(pooled.size),
        mean=_or_nan(spread.mean),
        p50=_or_nan(spread.p50),
        p95=_or_nan(spread.p95),
        p99=_or_nan(spread.p99),
        max=_or_nan(spread.max),
        boundary_mean=_mean(boundary),
        inside_mean=_mean(inside),
        end_mean=_mean(ends),
        transition_rate=float((pooled > transition_threshold).mean()),
        interval_level=_mean(levels),
        interval_step_std=float(np.std(steps)) if steps else math.nan,
        interval_std_median=float(np.median(within)) if within else math.nan,
        eat_variance_max=max(variances) if variances else math.nan,
    )


def simulated_traces(
    lengths: Sequence[int], seed: int = 0, params: EntropyModelParams | None = None
) -> list[F32]:
    """The simulator's entropy model sampled once per chain length (one seeded generator)."""
    model = EntropyTraceModel(params)
    rng = np.random.default_rng(seed)
    return [model.sample(int(n), rng).entropy for n in lengths]


_ROWS = (
    ("token entropy mean / P50 / P99 / max (nats)", ("mean", "p50", "p99", "max"), ".3g"),
    ("first token of a step / other tokens (nats)", ("boundary_mean", "inside_mean"), ".3g"),
    ("last think tokens before </think> (nats)", ("end_mean",), ".3g"),
    ("transition tokens (> threshold), share", ("transition_rate",), ".2%"),
    ("interval-mean level (nats)", ("interval_level",), ".3g"),
    ("consecutive interval means differ by (std, nats)", ("interval_step_std",), ".3g"),
    ("a chain's interval means wander (median std, nats)", ("interval_std_median",), ".3g"),
    ("largest EAT EMA variance after sample 0 (nats^2)", ("eat_variance_max",), ".3g"),
)


def comparison_markdown(columns: Sequence[tuple[str, TraceStats]]) -> str:
    """A Markdown table: one row per quantity, one column per named set of traces."""

    def cell(stats: TraceStats, names: tuple[str, ...], spec: str) -> str:
        values = [getattr(stats, n) for n in names]
        return " / ".join("n/a" if math.isnan(v) else format(v, spec) for v in values)

    head = ["quantity", *(name for name, _ in columns)]
    lines = [f"| {' | '.join(head)} |", "|---" + "|--:" * len(columns) + "|"]
    chains = ["chains / think tokens", *(f"{s.num_chains} / {s.num_tokens}" for _, s in columns)]
    lines.append(f"| {' | '.join(chains)} |")
    for label, names, spec in _ROWS:
        lines.append(f"| {label} | {' | '.join(cell(s, names, spec) for _, s in columns)} |")
    return "\n".join(lines) + "\n"
