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
        part.write_text(json.dumps({"cells": [c for c in cells if c["seed"] == seed]}))
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
