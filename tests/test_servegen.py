"""``servegen-r1``: the derived data file, its rebuild from ServeGen's raw files, and the generator
against the source tables (rates, burstiness, lengths) within stated tolerances.

The raw folder (``/work/shared/data/servegen-deepseek-r1``, or ``$MERIDIAN_SERVEGEN_RAW``) is not
in the repository; the tests that need it skip with that reason when it is absent. Everything
else is tested against the committed file's tables.
"""

from __future__ import annotations

import argparse
import doctest
import importlib.util
import json
import math
import os
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.report import SimReport, load_report
from meridian.bench.servegen import (
    DEFAULT_START_S,
    ServeGenData,
    draw_servegen,
    generate_servegen,
    load_servegen,
    parse_servegen,
    plan_pieces,
    start_of,
)
from meridian.bench.workloads import (
    WorkloadError,
    WorkloadParams,
    default_duration_s,
    generate_workload,
    is_bundled,
)
from meridian.cli import main
from meridian.cli.common import check_workload_args
from meridian.sim.request import RequestKind

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "build_servegen_r1.py"
DATA = REPO / "src" / "meridian" / "bench" / "data" / "servegen-r1.json"
RAW = Path(os.environ.get("MERIDIAN_SERVEGEN_RAW", "/work/shared/data/servegen-deepseek-r1"))
needs_raw = pytest.mark.skipif(
    not (RAW / "chunk-0-trace.csv").is_file(),
    reason=f"ServeGen's raw DeepSeek-R1 folder is not at {RAW} (it is not in the repository; "
    "set MERIDIAN_SERVEGEN_RAW to its path)",
)
FloatArray = npt.NDArray[np.float64]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_servegen_r1", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_servegen_r1"] = module
    spec.loader.exec_module(module)
    return module


def cdf(knots: list[float], quantiles: list[float], x: FloatArray) -> FloatArray:
    """The CDF of inverse-CDF sampling through ``knots`` (linear between knots, right-continuous
    at a run of equal knots, i.e. a mass point)."""
    k = np.asarray(knots, dtype=np.float64)
    q = np.asarray(quantiles, dtype=np.float64)
    j = np.searchsorted(k, x, side="right") - 1  # last knot <= x
    inside = (j >= 0) & (j < k.size - 1)
    jj = np.clip(j, 0, k.size - 2)
    width = k[jj + 1] - k[jj]
    frac = np.where(width > 0, (x - k[jj]) / np.where(width > 0, width, 1.0), 0.0)
    out = np.where(j >= k.size - 1, 1.0, 0.0)
    return np.where(inside, q[jj] + (q[jj + 1] - q[jj]) * frac, out)


def ks_tokens(sample: npt.NDArray[np.int64], reference: Any) -> float:
    """KS distance between whole-token samples and ``reference(x)`` = P(X <= x) of the rounded
    reference, over every integer in the range (exact for integer-valued distributions)."""
    grid = np.arange(0, int(sample.max()) + 2, dtype=np.float64)
    empirical = np.searchsorted(np.sort(sample), grid, side="right") / sample.size
    return float(np.max(np.abs(empirical - reference(grid + 0.5))))


def ks_ratio(sample: FloatArray, reference: Any, knots: list[float]) -> float:
    """KS distance for the (continuous) reason ratio, on a fine grid plus the knots."""
    grid = np.unique(np.concatenate([np.linspace(0, 1, 4001), knots]))
    empirical = np.searchsorted(np.sort(sample), grid, side="right") / sample.size
    return float(np.max(np.abs(empirical - reference(grid))))


def weibull_cv(shape: float) -> float:
    g1, g2 = math.gamma(1 + 1 / shape), math.gamma(1 + 2 / shape)
    return math.sqrt(g2 / g1**2 - 1)


def window_row(data: ServeGenData, client: int, window: int) -> tuple[Any, ...]:
    row = next(w for c in data.clients if c.id == client for w in c.windows if w[0] == window)
    return tuple(row)


def source_rate(data: ServeGenData, window: int) -> float:
    """The source's aggregate rate (requests/s) in a window."""
    count = sum(w[1] for c in data.clients for w in c.windows if w[0] == window)
    return count / data.window_s


# ---------------------------------------------------------------------------------------------
# The data file and its provenance


def test_committed_file_validates_and_names_source_commit_and_license() -> None:
    data = load_servegen()
    assert data.source.commit == "f891d11" and data.source.license == "Apache-2.0"
    assert "alibaba/ServeGen" in data.source.repository and "2505.09999" in data.source.paper
    assert "LICENSE-servegen.txt" in data.notice and "scripts/build_servegen_r1.py" in data.notice
    license_text = (DATA.parent / "LICENSE-servegen.txt").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    # Compact: the raw data are 13 MB.
    assert DATA.stat().st_size < 400_000
    assert len(data.clients) == 73 and data.day_s == 86_400


@needs_raw
def test_script_rebuilds_the_committed_file_from_the_raw_data(tmp_path: Path) -> None:
    out = tmp_path / "servegen-r1.json"
    assert load_script().main([str(RAW), "--out", str(out)]) == 0
    assert out.read_bytes() == DATA.read_bytes()


@needs_raw
def test_committed_tables_are_within_the_quantisation_bound_of_the_raw_tables() -> None:
    """Each table's CDF is exact at the knots and within 1/64 of the raw PDF's anywhere (the
    widest step of the quantile grid); the windows keep the raw counts, CVs and shapes."""
    script = load_script()
    data = load_servegen()
    bound = max(b - a for a, b in zip(data.quantiles, data.quantiles[1:], strict=False))
    worst = {"input_tokens": 0.0, "output_tokens": 0.0, "reason_ratio": 0.0}
    for client in data.clients:
        raw = json.loads((RAW / f"chunk-{client.id}-dataset.json").read_text(encoding="utf-8"))
        for table in client.tables:
            for field in worst:
                pdf = script.parse_table(raw[str(table.start_s)][field], field)
                values = np.array(sorted(v for v, p in pdf.items() if p > 0))
                probs = np.array([pdf[v] for v in values])
                raw_cdf = np.cumsum(probs) / probs.sum()
                knots = getattr(table, field)
                if field == "reason_ratio":  # keys i/501, knots rounded to 4 decimals
                    ours = cdf(knots, data.quantiles, values + 1e-4)
                else:  # whole tokens: P(round(X) <= v)
                    ours = cdf(knots, data.quantiles, values + 0.5)
                worst[field] = max(worst[field], float(np.max(np.abs(ours - raw_cdf))))
        rows = {int(r[0]) // 600: r for r in _csv_rows(RAW / f"chunk-{client.id}-trace.csv")}
        for index, count, cv, name, shape in client.windows:
            row = rows[index]
            assert count == round(float(row[1]) * 600) and name == row[3]
            assert cv == pytest.approx(float(row[2]), rel=1e-3)
            assert shape == pytest.approx(float(row[4]), rel=1e-5)
        active = sum(1 for r in rows.values() if r[3])
        assert active == len(client.windows)
    print({k: round(v, 4) for k, v in worst.items()}, "bound", bound)
    assert max(worst.values()) <= bound + 1e-3


def _csv_rows(path: Path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["source"].update(commit="main"), "source.commit"),
        (lambda d: d["clients"][0]["tables"][0]["output_tokens"].reverse(), "non-decreasing"),
        (lambda d: d["clients"][0]["tables"][0]["input_tokens"].pop(), "knots"),
        (lambda d: d["clients"][0]["windows"][0].__setitem__(3, "Pareto"), "windows"),
        (lambda d: d["clients"][1]["windows"][0].__setitem__(1, 0), "greater than or equal to 1"),
        (lambda d: d.update(quantiles=[0.0, 0.7, 0.5, 1.0]), "quantiles must rise"),
        (lambda d: d["clients"][2]["tables"][0].update(start_s=10**6), "has no length table"),
    ],
)
def test_a_bad_data_file_is_a_one_line_error_naming_the_field(edit: Any, message: str) -> None:
    raw = json.loads(DATA.read_text(encoding="utf-8"))
    edit(raw)
    with pytest.raises(WorkloadError) as info:
        parse_servegen(json.dumps(raw), source="bad.json")
    text = str(info.value)
    assert text.startswith("bad.json: ") and message in text and "\n" not in text


# ---------------------------------------------------------------------------------------------
# Names, defaults, determinism


def test_names_start_times_and_default_duration() -> None:
    assert is_bundled("servegen-r1") and is_bundled("servegen-r1@08:30")
    assert not is_bundled("servegen-r2") and not is_bundled("my-trace.jsonl")
    assert start_of("servegen-r1") == DEFAULT_START_S == 10 * 3600
    assert start_of("servegen-r1@08:30") == 8 * 3600 + 30 * 60
    assert default_duration_s("servegen-r1") == 600.0 == default_duration_s("servegen-r1@01:00")
    assert default_duration_s("synthetic") == 30.0 == default_duration_s("x.jsonl")
    for bad in ("servegen-r1@24:00", "servegen-r1@8:30", "servegen-r1@"):
        with pytest.raises(WorkloadError, match="HH:MM"):
            generate_workload(bad, WorkloadParams(arrival_rate=1.0, duration_s=1.0, seed=0))
    with pytest.raises(WorkloadError, match="reasoning_ratio must be None"):
        generate_servegen(WorkloadParams(1.0, 1.0, 0, reasoning_ratio=0.5))


def test_same_seed_identical_other_seed_or_start_differs() -> None:
    def key(name: str, seed: int) -> list[tuple[Any, ...]]:
        specs = generate_workload(
            name, WorkloadParams(arrival_rate=3.0, duration_s=40.0, seed=seed)
        )
        return [
            (s.arrival_ns, s.num_prompt_tokens, s.num_think_tokens, s.num_answer_tokens,
             s.settle_token, None if s.think_entropy is None else s.think_entropy.tobytes())
            for s in specs
        ]  # fmt: skip

    a = key("servegen-r1", 5)
    assert a == key("servegen-r1", 5)
    assert a != key("servegen-r1", 6)
    assert a != key("servegen-r1@08:00", 5)


def test_requests_are_well_formed_reasoning_with_entropy() -> None:
    specs = generate_servegen(WorkloadParams(arrival_rate=4.0, duration_s=60.0, seed=1))
    arrivals = [s.arrival_ns for s in specs]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 60 * 10**9
    assert [s.request_id for s in specs] == [f"r{i:06d}" for i in range(len(specs))]
    for s in specs:
        assert s.num_prompt_tokens >= 1 and s.num_answer_tokens >= 1
        if s.kind is RequestKind.REASONING:
            assert s.think_entropy is not None and len(s.think_entropy) == s.num_think_tokens
        else:
            assert s.num_think_tokens == 0
    # DeepSeek-R1 reasons on (almost) every request.
    assert sum(s.is_reasoning for s in specs) >= 0.99 * len(specs)


# ---------------------------------------------------------------------------------------------
# Rates and burstiness against the source tables


@pytest.mark.parametrize(
    ("start_s", "duration_s", "rate"), [(8 * 3600, 3600.0, 5.0), (85_800, 1200.0, 2.0)]
)
def test_every_clients_count_is_its_scaled_source_rate(
    start_s: int, duration_s: float, rate: float
) -> None:
    """Every client gets its source share of every window, scaled by one factor so the run's
    mean is the requested rate: each (client, window) count is within one request of
    ``rate * duration * client's count / the span's total count`` (the rounding of a
    fractional expectation), and the rounding is unbiased: the total is within 3 standard
    deviations of ``rate * duration`` (ServeGen's own rounding would lose about half a request
    per client and window). The second span crosses midnight."""
    data = load_servegen()
    counts = {(c.id, w[0]): w[1] for c in data.clients for w in c.windows}
    windows = [int(((start_s + t) % 86_400) // 600) for t in range(0, int(duration_s), 600)]
    span_total = sum(n for (_, w), n in counts.items() if w in windows)
    draw = draw_servegen(data, rate, duration_s, np.random.default_rng(3), start_s=start_s)
    got: dict[tuple[int, int], int] = {}
    for client, window in zip(draw.client.tolist(), draw.window.tolist(), strict=True):
        got[client, window] = got.get((client, window), 0) + 1
    variance = 0.0
    for key, n in counts.items():
        if key[1] in windows:
            expected = rate * duration_s * n / span_total
            assert abs(got.get(key, 0) - expected) < 1.0, key
            fraction = expected - math.floor(expected)
            variance += fraction * (1 - fraction)
    assert set(got) <= {k for k in counts if k[1] in windows}
    assert abs(draw.arrival_ns.size - rate * duration_s) <= 3 * math.sqrt(variance) + 1e-9


@pytest.mark.parametrize(
    ("client", "window"),
    [(28, 132), (35, 39), (1, 3), (13, 136)],  # Gamma CV 1.79 and 2.34; Weibull shape 1.28, 0.54
)
def test_inter_arrival_cv_matches_the_fitted_distribution(client: int, window: int) -> None:
    """With 20,000 requests from the client in the window (its source share, scaled up), its
    gaps have the CV of its fitted distribution within 8 % (for Gamma that is the table's CV,
    which ServeGen's fit matches; for Weibull the fitted shape's, which ServeGen also
    follows)."""
    data = load_servegen()
    _, count, cv, name, shape = window_row(data, client, window)
    rate = source_rate(data, window) * 20_000 / count
    draw = draw_servegen(data, rate, 600.0, np.random.default_rng(7), start_s=window * 600)
    gaps = np.diff(np.sort(draw.arrival_ns[draw.client == client]) / 1e9)
    measured = gaps.std() / gaps.mean()
    expected = 1 / math.sqrt(shape) if name == "Gamma" else weibull_cv(shape)
    if name == "Gamma":
        assert expected == pytest.approx(cv, rel=2e-3)
    assert measured == pytest.approx(expected, rel=0.08), (name, shape)


def test_bursty_windows_are_bursty_and_poisson_like_ones_are_not() -> None:
    """The aggregate of the morning's bursty clients (rate-weighted client CV above 5 at 08:00)
    is burstier than the night's (about 1 at 01:00): peak 10-s rate over mean."""
    data = load_servegen()

    def peak_over_mean(start_s: int) -> float:
        draw = draw_servegen(data, 10.0, 600.0, np.random.default_rng(0), start_s=start_s)
        bins = np.bincount(draw.arrival_ns // 10**10)
        return float(bins.max() / bins.mean())

    assert peak_over_mean(8 * 3600) > 1.5 * peak_over_mean(3600)


# ---------------------------------------------------------------------------------------------
# Lengths against the source tables


def test_each_clients_lengths_follow_its_table() -> None:
    """Per client with 3,000+ requests in one window: prompt, output and reason-ratio samples are
    within KS 1.63/sqrt(n) (the 99 % band) + 0.005 of the table's distribution."""
    data = load_servegen()
    window = 13
    draw = draw_servegen(
        data, 4 * source_rate(data, window), 600.0, np.random.default_rng(11), start_s=window * 600
    )
    checked = 0
    for client in data.clients:
        mine = draw.client == client.id
        n = int(mine.sum())
        if n < 3000:
            continue
        table = next(t for t in reversed(client.tables) if t.start_s <= window * 600)
        q = data.quantiles
        band = 1.63 / math.sqrt(n) + 0.005
        for field, sample in (("input_tokens", draw.prompt), ("output_tokens", draw.output)):
            reference = partial(cdf, getattr(table, field), q)
            assert ks_tokens(sample[mine], reference) < band, field
        reference = partial(cdf, table.reason_ratio, q)
        assert ks_ratio(draw.reason_ratio[mine], reference, table.reason_ratio) < band
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("start_s", [DEFAULT_START_S, 22 * 3600])
def test_a_runs_lengths_follow_the_rate_weighted_mixture_of_the_tables(start_s: int) -> None:
    """Over a whole run the lengths are the mixture of the clients' tables weighted by their
    expected requests: KS within the 99 % band + 0.005 for prompt and output, and mean think
    and answer tokens within 3 % of the mixture's (think = output x ratio, both from the
    request's one uniform: the mean of the product of the two inverse CDFs)."""
    data = load_servegen()
    draw = draw_servegen(data, 20.0, 1800.0, np.random.default_rng(5), start_s=start_s)
    pieces = plan_pieces(data, 20.0, 1800.0, start_s)
    weights = np.array([p.expected for p in pieces]) / sum(p.expected for p in pieces)
    q = data.quantiles
    band = 1.63 / math.sqrt(draw.prompt.size) + 0.005
    for field, sample in (("input_tokens", draw.prompt), ("output_tokens", draw.output)):

        def mixture(x: FloatArray, field: str = field) -> FloatArray:
            parts = [
                w * cdf(getattr(p.table, field), q, x) for w, p in zip(weights, pieces, strict=True)
            ]
            return np.sum(parts, axis=0)

        assert ks_tokens(sample, mixture) < band, field
    # Means of each table by the trapezoid rule over the inverse CDF.
    dq = np.diff(q)

    def mean(knots: list[float]) -> float:
        k = np.asarray(knots, dtype=np.float64)
        return float(np.sum((k[1:] + k[:-1]) / 2 * dq))

    think = sum(
        w * mean(list(np.multiply(p.table.output_tokens, p.table.reason_ratio)))
        for w, p in zip(weights, pieces, strict=True)
    )
    output = sum(w * mean(p.table.output_tokens) for w, p in zip(weights, pieces, strict=True))
    assert draw.think.mean() == pytest.approx(think, rel=0.03)
    assert draw.answer.mean() == pytest.approx(output - think, rel=0.03)
    assert np.all(draw.think + draw.answer == draw.output) and draw.answer.min() >= 1
    assert np.all(np.abs(draw.think - draw.output * draw.reason_ratio) <= 0.5 + (draw.answer == 1))


def test_reasoning_lengths_are_bimodal_where_the_source_is() -> None:
    """The source's signature, in the default run (10:00-10:10): log10(think tokens) has two
    modes (about 500 and 3,000 tokens) with a dip between them (a third lower than the smaller
    mode)."""
    data = load_servegen()
    draw = draw_servegen(data, 8.0, 600.0, np.random.default_rng(2), start_s=DEFAULT_START_S)
    bins = np.arange(2.0, 4.6, 0.2)
    hist, _ = np.histogram(np.log10(np.maximum(draw.think, 1)), bins=bins)
    low, high = hist[:6], hist[6:]  # below and above 10^3.2 = 1,585 tokens
    assert hist.sum() > 0.95 * draw.think.size
    assert 10 ** bins[np.argmax(low)] < 1000 < 2000 < 10 ** bins[6 + np.argmax(high)]
    valley = hist[np.argmax(low) : 6 + np.argmax(high)].min()
    assert valley < 0.67 * min(low.max(), high.max()), hist.tolist()


# ---------------------------------------------------------------------------------------------
# End to end on the fast engine (vLLM's scheduler: tests/vllm_e2e/test_sim_vllm.py)


def test_an_unset_duration_is_the_workloads_default() -> None:
    args = argparse.Namespace(workload="servegen-r1@10:00", duration_s=None, seed=0)
    check_workload_args(args)
    assert args.duration_s == 600.0
    args = argparse.Namespace(workload="synthetic", duration_s=None, seed=0)
    check_workload_args(args)
    assert args.duration_s == 30.0


def test_bench_sim_runs_servegen_and_reports_the_offered_load(tmp_path: Path) -> None:
    args = ["bench", "sim", "--workload", "servegen-r1", "--arrival-rate", "2", "--no-plots"]
    args += ["--duration-s", "30", "--policies", "meridian,vllm-fcfs+forcing", "--seed", "4"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    report = load_report(tmp_path / "a" / "report.json", SimReport)
    requests = generate_workload("servegen-r1", WorkloadParams(2.0, 30.0, 4))
    offered = report.offered
    assert report.workload == "servegen-r1" and report.duration_s == 30
    assert offered is not None and offered.num_requests == len(requests)
    assert offered.rate_req_s == pytest.approx(len(requests) / 30, rel=1e-5)
    assert offered.peak_rate_req_s >= offered.rate_req_s
    for name in report.policies:
        assert report.summaries[name].num_finished == len(requests)
    assert "Load: offered" in (tmp_path / "a" / "report.md").read_text()
    assert "Load: offered" in (tmp_path / "a" / "ab-report.md").read_text()


def test_module_examples_run() -> None:
    from meridian.bench import offered, servegen

    assert doctest.testmod(servegen).failed == 0
    assert doctest.testmod(offered).failed == 0


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(min_value=0.01, max_value=50.0),
    duration=st.floats(min_value=0.01, max_value=4000.0),
    start=st.integers(min_value=0, max_value=86_399),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_any_span_is_well_formed(rate: float, duration: float, start: int, seed: int) -> None:
    """Any rate, duration (fractions of a second, several windows, across midnight) and start:
    arrivals sorted inside the run, lengths whole and positive, think + answer = output, and a
    total within the rounding of each (client, window) piece of ``rate * duration``."""
    data = load_servegen()
    draw = draw_servegen(data, rate, duration, np.random.default_rng(seed), start_s=start)
    pieces = plan_pieces(data, rate, duration, start)
    assert sum(p.expected for p in pieces) == pytest.approx(rate * duration, rel=1e-9)
    assert abs(draw.arrival_ns.size - rate * duration) <= len(pieces)
    assert np.all(np.diff(draw.arrival_ns) >= 0)
    if draw.arrival_ns.size:
        assert draw.arrival_ns[0] >= 0 and draw.arrival_ns[-1] < duration * 1e9
    assert np.all(draw.prompt >= 1) and np.all(draw.answer >= 1) and np.all(draw.think >= 0)
    assert np.all(draw.think + draw.answer == draw.output)


REFERENCE = REPO / "src" / "meridian" / "bench" / "data" / "servegen-reference.json"
# Meridian against ServeGen's own generator, over the same seeds, rate and span. Means within
# 2.5 %, medians within 3 %, P90 within 6 %: the committed tables are inverse CDFs at every 1/64
# (plus 0.99, 0.995, 0.999) interpolated linearly, which moves the tails a little (the input
# tokens' P90 is 4.6 % high at 00:00; everything else is within 2 %). Drawn independently, as
# before issue 44, reasoning's mean was 7.9 % short and its P90 10-26 %: outside these bounds.
TOLERANCE = {"mean": 0.025, "p50": 0.03, "p90": 0.06}


@pytest.mark.parametrize("start", ["00:00", "10:00"])
def test_the_coupled_draw_matches_servegens_own_generator(start: str) -> None:
    reference = json.loads(REFERENCE.read_text(encoding="utf-8"))
    assert reference["command"].startswith("scripts/servegen_reference.py")
    assert reference["servegen_commit"] == load_servegen().source.commit[:7]
    figures = reference["starts"][start]
    columns: dict[str, list[FloatArray]] = {"input": [], "output": [], "reason": []}
    for seed in range(reference["seeds"]):
        draw = draw_servegen(
            load_servegen(),
            reference["rate_req_s"],
            float(reference["duration_s"]),
            np.random.default_rng(seed),
            start_s=start_of(f"servegen-r1@{start}"),
        )
        columns["input"].append(draw.prompt.astype(np.float64))
        columns["output"].append(draw.output.astype(np.float64))
        columns["reason"].append(draw.think.astype(np.float64))
    for field, values in columns.items():
        pooled = np.concatenate(values)
        p50, p90 = np.percentile(pooled, [50, 90])
        mine = {"mean": pooled.mean(), "p50": p50, "p90": p90}
        theirs = figures[f"{field}_tokens"]
        for stat, bound in TOLERANCE.items():
            assert mine[stat] == pytest.approx(theirs[stat], rel=bound), (field, stat)
    # ServeGen's examples start at 00:00, where the outputs are half as long as at 10:00 (the
    # default): the time of day is part of the workload.
    other = reference["starts"]["10:00" if start == "00:00" else "00:00"]
    assert abs(figures["output_tokens"]["mean"] / other["output_tokens"]["mean"] - 1) > 0.5


def test_lengths_are_rank_coupled_within_a_clients_window() -> None:
    # One uniform per request: within one client's window, a longer output never comes with a
    # shorter prompt (the tables are inverse CDFs, non-decreasing in the uniform).
    draw = draw_servegen(load_servegen(), 3.0, 600.0, np.random.default_rng(0))
    for client in np.unique(draw.client)[:20]:
        mask = draw.client == client
        order = np.argsort(draw.output[mask], kind="stable")
        prompts = draw.prompt[mask][order]
        outputs = draw.output[mask][order]
        ties = np.diff(outputs) == 0  # equal outputs may come from different uniforms
        assert np.all((np.diff(prompts) >= 0) | ties)
