"""``benchmarks/bench_cluster.py`` measures as the single-engine sweep does: seeds, nested loads,
warm-up, SLO attainment and contention (the path issue 45's cluster sweeps take)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_small_cluster_sweep_keeps_every_seed_and_measures_after_the_warmup(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cluster.json"
    args = [
        sys.executable, str(REPO / "benchmarks" / "bench_cluster.py"), "--replicas", "2",
        "--loads", "0.5,1.0", "--duration-s", "8", "--warmup-s", "2", "--seeds", "0,1",
        "--routers", "pow2,meridian", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "the first 2 s warm-up), seeds 0,1, loads nested" in done.stdout
    assert "(no contention)" in done.stdout  # 2 x H100 at these loads for 8 s: nothing to do
    doc = json.loads(out.read_text())
    cells = doc["cells"]
    runs = {(c["load"], c["run"]) for c in cells}
    assert len(cells) == 2 * len(runs) and {c["seed"] for c in cells} == {0, 1}
    for c in cells:
        assert 0 <= c["slo_hidden"] <= 100 and 0 <= c["slo_shown"] <= 100
        assert 0 < c["kv_peak_replica"] < 1 and c["queued"] == 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # Runs made apart (seed 0 in one, seed 1 in another) render as one table: the median over
    # every seed they hold, the same cells as the run that made both.
    parts = []
    for seed in (0, 1):
        part = tmp_path / f"seed{seed}.json"
        kept = {"cells": [c for c in cells if c["seed"] == seed]}
        if seed == 0:  # the run's own cost per decision, kept in its JSON
            kept["router_cost_us"] = doc["router_cost_us"]
        part.write_text(json.dumps(kept))
        parts.append(str(part))
    render = [sys.executable, str(REPO / "benchmarks" / "bench_cluster.py"), "--render", *parts]
    shown = subprocess.run(render, capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "seeds [0, 1], the median over them" in shown.stdout
    both = [c["ttfvt"] for c in cells if c["load"] == 1.0 and c["run"] == "meridian/meridian"]
    median = f"{(both[0] + both[1]) / 2:.4g}"
    row = next(
        line
        for line in shown.stdout.splitlines()
        if line.startswith("| 100%") and "| `meridian/meridian` |" in line
    )
    assert row.split(" | ")[2] == median, row
    # The render prints the cost per decision the runs measured, from the JSON that kept it.
    cost = doc["router_cost_us"]["meridian"]
    assert "router cost per decision (µs; choose + routed, in seed0.json):" in shown.stdout
    assert f"meridian     median {cost['median']:7.1f}  P99 {cost['p99']:7.1f}" in shown.stdout
    # Every table marks a comparison in which no run contended, the gate's as well.
    contended = {(c["load"], c["run"]) for c in cells if c["contended"]}
    gate = [
        line
        for line in shown.stdout.split("issue 45's gate")[1].splitlines()
        if line.startswith(("| 50%", "| 100%"))
    ]
    assert len(gate) == len(runs) - 2  # every run but the baseline, at each load
    for line in gate:
        load = 0.5 if line.startswith("| 50%") else 1.0
        name = line.split(" | ")[1].strip("`")
        quiet = not {(load, name), (load, "pow2/vllm-fcfs+forcing")} & contended
        assert ("(no contention)" in line) == quiet, line


def test_the_answer_share_is_the_answer_phases_kv_over_decode_steps() -> None:
    from meridian.bench.clusterrun import answer_kv_share
    from meridian.sim.request import RequestKind, RequestSpec

    thinking = RequestSpec("r", 0, 10, 4, 2, RequestKind.REASONING)  # P 10, T 4, A 2
    chat = RequestSpec("c", 0, 6, 0, 4, RequestKind.CHAT)
    # Answer: 2 x (10 + 4) + 4 / 2 = 30 and 4 x 6 + 16 / 2 = 32; thinking: 4 x 10 + 16 / 2 = 48.
    assert answer_kv_share([thinking, chat]) == (30 + 32) / (30 + 32 + 48)
    assert answer_kv_share([chat]) == 1.0 and answer_kv_share([]) == 0.0
    args = [
        sys.executable, str(REPO / "benchmarks" / "bench_cluster.py"), "--answer-share",
        "--workload", "servegen-r1", "--duration-s", "60", "--seeds", "0,1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith("servegen-r1, seed 1, ")
    # The split's share (core.migration.DEFAULT_ANSWER_SHARE, 0.125) is this share, rounded.
    shares = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert all(0.1 < s < 0.15 for s in shares), shares
