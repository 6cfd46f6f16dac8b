"""The headline's sweep library: a cell run on the fast engine, the targets checked, the JSON
round-tripped and the README/docs blocks rendered from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meridian.bench.targets import (
    MERIDIAN,
    STOCK,
    Cell,
    CellResult,
    TargetsRun,
    WorkloadSweep,
    check,
    parse_variant,
    run_cell,
)
from meridian.bench.targets_render import block_keys, count_misses, render_docs, table

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cell() -> tuple[CellResult, object]:
    seen: list[tuple[int, int]] = []
    row, offered = run_cell(
        Cell("synthetic", "qwen3-8b", "h100-sxm", "model", 4.0, STOCK, 10.0),
        lambda done, total: seen.append((done, total)),
    )
    assert seen and seen[-1][0] <= seen[-1][1] == row.num_requests
    return row, offered


def _run(rows: list[CellResult], offered: object, capacity: float = 4.0) -> TargetsRun:
    sweep = WorkloadSweep(
        workload="synthetic", capacity_req_s=capacity, offered={"4": offered}, cells=rows
    )
    return TargetsRun(
        command="benchmarks/bench_targets.py", engine="model", scheduler="Scheduler",
        vllm_version=None, commit="abc1234", uncommitted_changes=False, date="2026-01-01",
        model="qwen3-8b", hardware="h100-sxm", num_kv_blocks=1, max_num_seqs=1,
        max_num_batched_tokens=1, seed=0, duration_s=10.0, jobs=1, wall_s=1.0,
        workloads=[sweep],
    )  # fmt: skip


def test_variant_parses_ablation_fields() -> None:
    assert parse_variant("meridian@admission=vllm@headroom=0.5@n=3") == (
        "meridian",
        {"admission": "vllm", "headroom": 0.5, "n": 3},
    )


def test_light_load_allows_three_percent_heavy_load_wants_the_ratio(cell: tuple) -> None:
    b = cell[0]
    assert b.num_requests > 0 and b.itl_p99_ms is not None
    near = b.model_copy(update={"policy": MERIDIAN, "itl_p99_ms": b.itl_p99_ms * 1.02})
    far = b.model_copy(update={"policy": MERIDIAN, "itl_p99_ms": b.itl_p99_ms * 1.05})
    fast = b.model_copy(update={"policy": MERIDIAN, "itl_p99_ms": b.itl_p99_ms * 0.6})
    assert check(0.5, "itl_p99_ms", near, b, None)[1] is True
    assert check(0.5, "itl_p99_ms", far, b, None)[1] is False
    assert check(0.8, "itl_p99_ms", far, b, None)[1] is None
    assert check(1.0, "itl_p99_ms", near, b, None)[1] is False
    assert check(1.0, "itl_p99_ms", fast, b, None)[1] is True


def test_json_round_trips_and_renders_into_blocks_only(cell: tuple) -> None:
    b, offered = cell
    m = b.model_copy(update={"policy": MERIDIAN})
    run = _run([b, m], offered)
    again = TargetsRun.model_validate_json(run.model_dump_json())
    assert again == run
    md = table(again.sweep("synthetic"))
    assert md.count("\n") == 2 and "100% (4)" in md
    missed, marked = count_misses(again.sweep("synthetic"))
    assert 0 < missed < marked  # identical figures at capacity miss the ratio targets
    doc = (
        "intro\n<!-- BEGIN targets/qwen3-8b/synthetic/table -->\nold\n"
        "<!-- END targets/qwen3-8b/synthetic/table -->\n"
        "<!-- BEGIN targets/qwen3-32b/synthetic/table -->\nkept\n"
        "<!-- END targets/qwen3-32b/synthetic/table -->\n"
    )
    out = render_docs(doc, [again])
    assert md in out and "old" not in out and "kept" in out and out.startswith("intro\n")
    assert block_keys(out) == block_keys(doc)


def test_render_takes_several_runs_and_names_a_missing_file(cell: tuple, tmp_path: Path) -> None:
    b, offered = cell
    paths = []
    for n in (1, 2):
        path = tmp_path / f"run{n}.json"
        run = _run([b, b.model_copy(update={"policy": MERIDIAN})], offered)
        path.write_text(run.model_dump_json(), encoding="utf-8")
        paths.append(str(path))
    script = str(REPO / "benchmarks" / "bench_targets.py")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, script, "--render", *paths], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert all(f"{p}: 1 workload(s), commit abc1234" in done.stdout for p in paths)
    assert done.stdout.count("| 100% (4) |") == 2
    missing = subprocess.run(
        [sys.executable, script, "--render", str(tmp_path / "nope.json")],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert missing.returncode == 2 and "--render: no results file" in missing.stderr
    assert "Traceback" not in missing.stderr
