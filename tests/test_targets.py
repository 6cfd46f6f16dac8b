"""The headline's sweep library: a cell run on the fast engine (nested load, warm-up, SLO
attainment, contention), the targets checked on the median over seeds, the JSON round-tripped
(the schema-1 file committed before seeds still renders) and the README/docs blocks rendered."""

from __future__ import annotations

import dataclasses
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
    paired,
    parse_variant,
    run_cell,
)
from meridian.bench.targets_render import (
    block_keys,
    count_misses,
    misses,
    render_docs,
    table,
    write_attainment,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cell() -> tuple[CellResult, object]:
    seen: list[tuple[int, int]] = []
    row, offered = run_cell(
        Cell(
            "synthetic", "qwen3-8b", "h100-sxm", "model", 4.0, STOCK, 10.0,
            seed=0, warmup_s=2.0, trace_rate=8.0,
        ),
        lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    assert seen and seen[-1][0] <= seen[-1][1] == row.num_requests + row.num_warmup_requests
    return row, offered


def _seeds(row: CellResult, policy: str, **scaled: float) -> list[CellResult]:
    """Three seeds of ``row`` as ``policy``, each field of ``scaled`` multiplied by the factor."""
    update = {k: getattr(row, k) * v for k, v in scaled.items()}
    return [row.model_copy(update={"policy": policy, "seed": s, **update}) for s in (0, 1, 2)]


def _run(rows: list[CellResult], offered: object, capacity: float = 4.0) -> TargetsRun:
    sweep = WorkloadSweep(
        workload="synthetic", capacity_req_s=capacity, offered={"4": offered}, cells=rows,
        trace_rate=8.0,
    )  # fmt: skip
    return TargetsRun(
        command="benchmarks/bench_targets.py", engine="model", scheduler="Scheduler",
        vllm_version=None, commit="abc1234", uncommitted_changes=False, date="2026-01-01",
        model="qwen3-8b", hardware="h100-sxm", num_kv_blocks=1, max_num_seqs=1,
        max_num_batched_tokens=1, seed=0, seeds=[0, 1, 2], warmup_s=2.0, duration_s=10.0,
        jobs=1, wall_s=1.0, workloads=[sweep],
    )  # fmt: skip


def test_variant_parses_ablation_fields() -> None:
    assert parse_variant("meridian@admission=vllm@headroom=0.5@n=3") == (
        "meridian",
        {"admission": "vllm", "headroom": 0.5, "n": 3},
    )


def test_a_cell_measures_after_the_warmup_with_attainment_and_contention(cell: tuple) -> None:
    row = cell[0]
    assert row.num_warmup_requests > 0 and row.num_requests > 0
    assert row.slo_hidden_pct is not None and 0 < row.slo_hidden_pct <= 100
    assert row.attainment_hidden_pct == sorted(row.attainment_hidden_pct or [])
    assert row.attainment_scales is not None and row.attainment_scales[0] == 1.5
    assert row.kv_used_peak is not None and 0 < row.kv_used_peak < 1
    # 4 req/s on an H100 for 10 s: nothing preempted, nothing queued.
    assert row.contended is False and row.num_queued_requests == 0


def test_light_load_allows_three_percent_heavy_load_wants_the_ratio(cell: tuple) -> None:
    b = cell[0]
    stock = _seeds(b, STOCK)
    assert b.itl_p99_ms is not None
    near = _seeds(b, MERIDIAN, itl_p99_ms=1.02)
    far = _seeds(b, MERIDIAN, itl_p99_ms=1.05)
    fast = _seeds(b, MERIDIAN, itl_p99_ms=0.45)
    itl = "itl_p99_ms"
    assert check(0.5, itl, paired(itl, near, stock)) is True
    assert check(0.5, itl, paired(itl, far, stock)) is False
    assert check(1.0, itl, paired(itl, far, stock)) is None  # no ITL target below 110 %
    assert check(1.1, itl, paired(itl, near, stock)) is False
    assert check(1.1, itl, paired(itl, fast, stock)) is True
    # TTFT P95 <= 1.1x at every load, within 3 % at light load.
    ttft = "ttft_p95_s"
    slower = _seeds(b, MERIDIAN, ttft_p95_s=1.08)
    assert check(1.0, ttft, paired(ttft, slower, stock)) is True
    assert check(0.5, ttft, paired(ttft, slower, stock)) is False


def test_the_target_is_on_the_median_of_the_per_seed_comparisons(cell: tuple) -> None:
    b = cell[0]
    stock = _seeds(b, STOCK)
    mine = [
        m.model_copy(update={"itl_p99_ms": b.itl_p99_ms * r})  # type: ignore[operator]
        for m, r in zip(_seeds(b, MERIDIAN), (0.4, 0.45, 0.9), strict=True)
    ]
    p = paired("itl_p99_ms", mine, stock)
    assert p.median == pytest.approx(0.45) and (p.low, p.high) == pytest.approx((0.4, 0.9))
    assert p.num_seeds == 3 and check(1.1, "itl_p99_ms", p) is True
    # Attainment is compared in points: +10 with the reasoning hidden, +0 shown, from 110 %.
    hidden = "slo_hidden_pct"
    lo = [c.model_copy(update={hidden: 65.0}) for c in stock]
    better = [c.model_copy(update={hidden: 80.0}) for c in mine]
    slightly = [c.model_copy(update={hidden: 70.0}) for c in mine]
    assert paired(hidden, better, lo).median == pytest.approx(15.0)
    assert check(1.1, hidden, paired(hidden, better, lo)) is True
    assert check(1.1, hidden, paired(hidden, slightly, lo)) is False
    # A seed only one side ran is not compared.
    assert paired(hidden, better[:2], lo).num_seeds == 2


def test_json_round_trips_and_renders_into_blocks_only(cell: tuple, tmp_path: Path) -> None:
    b, offered = cell
    run = _run([*_seeds(b, STOCK), *_seeds(b, MERIDIAN)], offered, capacity=3.0)
    again = TargetsRun.model_validate_json(run.model_dump_json())
    assert again == run
    md = table(again.sweep("synthetic"))
    assert md.count("\n") == 2 and "133% (4)" in md and "| none |" in md
    missed, marked = count_misses(again.sweep("synthetic"))
    assert 0 < missed < marked  # identical figures above capacity miss the ratio targets
    assert "(no contention: not a claim)" in misses(again.sweep("synthetic"))
    doc = (
        "intro\n<!-- BEGIN targets/qwen3-8b/synthetic/table -->\nold\n"
        "<!-- END targets/qwen3-8b/synthetic/table -->\n"
        "<!-- BEGIN targets/qwen3-32b/synthetic/table -->\nkept\n"
        "<!-- END targets/qwen3-32b/synthetic/table -->\n"
    )
    out = render_docs(doc, [again])
    assert md in out and "old" not in out and "kept" in out and out.startswith("intro\n")
    assert block_keys(out) == block_keys(doc)
    plots = write_attainment(again, tmp_path / "run")
    assert [p.name for p in plots] == ["run-synthetic.png"]
    assert plots[0].read_bytes()[:4] == b"\x89PNG"


def test_a_schema_1_run_still_renders() -> None:
    # Cells of the schema-1 run committed before seeds (48fb6b5): no attainment, no contention.
    saved = REPO / "tests" / "data" / "targets-schema1.json"
    run = TargetsRun.model_validate_json(saved.read_text(encoding="utf-8"))
    assert run.schema_version == 1
    sweep = run.workloads[0]
    assert all(c.contended is None and c.slo_hidden_pct is None for c in sweep.cells)
    assert "| - | " in table(sweep)  # contention and attainment unknown, not "none" or 0


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


def test_merge_pools_runs_made_apart_and_refuses_what_does_not_pool(
    cell: tuple, tmp_path: Path
) -> None:
    b, offered = cell
    script = str(REPO / "benchmarks" / "bench_targets.py")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    paths = []
    for seed, commit in ((0, "aaa1111"), (1, "bbb2222")):
        rows = [b.model_copy(update={"policy": p, "seed": seed}) for p in (STOCK, MERIDIAN)]
        run = _run(rows, offered).model_copy(
            update={"commit": commit, "seed": seed, "seeds": [seed], "command": f"part {seed}"}
        )
        path = tmp_path / f"seed{seed}.json"
        path.write_text(run.model_dump_json(), encoding="utf-8")
        paths.append(str(path))
    out = tmp_path / "pooled.json"

    def merge(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, script, "--merge", *args, "--out", str(out)],
            capture_output=True, text=True, env=env,
        )  # fmt: skip

    done = merge(*reversed(paths))
    assert done.returncode == 0, done.stderr
    pooled = TargetsRun.model_validate_json(out.read_text(encoding="utf-8"))
    sweep = pooled.sweep("synthetic")
    assert pooled.all_seeds == [0, 1] and pooled.commit == "bbb2222, aaa1111"
    assert [(c.policy, c.seed) for c in sweep.cells] == [
        (MERIDIAN, 0), (MERIDIAN, 1), (STOCK, 0), (STOCK, 1),
    ]  # fmt: skip
    assert "part 0" in pooled.command and "part 1" in pooled.command
    assert pooled.wall_s == 2.0 and "seeds [0, 1]" in done.stdout
    # The same cell twice, or parts of different arrival windows, do not pool: one line each.
    twice = merge(paths[0], paths[0])
    assert twice.returncode == 2 and "repeats synthetic 4 req/s" in twice.stderr
    other = TargetsRun.model_validate_json(Path(paths[1]).read_text(encoding="utf-8"))
    Path(paths[1]).write_text(
        other.model_copy(update={"duration_s": 20.0}).model_dump_json(), encoding="utf-8"
    )
    longer = merge(*paths)
    assert longer.returncode == 2 and "differs in duration_s: 20.0 vs 10.0" in longer.stderr
    assert "Traceback" not in twice.stderr + longer.stderr
    # A policy rerun replaces that policy's cells of an earlier part, and only those.
    rerun = _run([b.model_copy(update={"policy": MERIDIAN, "seed": 0, "ttft_p95_s": 9.5})], offered)
    again = tmp_path / "rerun.json"
    again.write_text(rerun.model_copy(update={"commit": "ccc3333"}).model_dump_json(), "utf-8")
    replaced = merge(str(out), str(again), "--replace")
    assert replaced.returncode == 0, replaced.stderr
    cells = TargetsRun.model_validate_json(out.read_text(encoding="utf-8")).sweep("synthetic").cells
    assert [(c.policy, c.seed, c.ttft_p95_s == 9.5) for c in cells] == [
        (MERIDIAN, 0, True), (MERIDIAN, 1, False), (STOCK, 0, False), (STOCK, 1, False),
    ]  # fmt: skip
    assert merge(str(again), str(again)).returncode == 2  # without --replace: refused


def test_a_pooled_run_is_the_full_sweep_only_with_every_cell(cell: tuple) -> None:
    from meridian.bench.targets import CAPACITY, LOADS, PASCAL, POLICIES, SEEDS
    from meridian.bench.targets_merge import is_full_sweep

    b, offered = cell
    sweeps = []
    for workload in ("synthetic", "servegen-r1"):
        capacity = CAPACITY[(workload, "qwen3-8b", "h100-sxm")]
        rows = [
            b.model_copy(update={
                "workload": workload, "rate": round(load * capacity, 4), "policy": policy,
                "seed": seed,
            })
            for load in LOADS
            for policy in POLICIES
            for seed in SEEDS
            if policy != PASCAL or load >= 0.9
        ]  # fmt: skip
        sweeps.append(
            WorkloadSweep(workload=workload, capacity_req_s=capacity, offered={}, cells=rows)
        )
    full = _run([b], offered).model_copy(
        update={"engine": "vllm", "duration_s": 600.0, "warmup_s": 200.0, "workloads": sweeps}
    )
    assert is_full_sweep(full)
    # One workload alone would overwrite the committed file's other one: not the full sweep.
    assert not is_full_sweep(full.model_copy(update={"workloads": sweeps[:1]}))
    short = sweeps[0].model_copy(update={"cells": sweeps[0].cells[1:]})
    assert not is_full_sweep(full.model_copy(update={"workloads": [short, sweeps[1]]}))
    other = sweeps[0].model_copy(update={"capacity_req_s": 6.0})
    assert not is_full_sweep(full.model_copy(update={"workloads": [other, sweeps[1]]}))
    assert not is_full_sweep(full.model_copy(update={"warmup_s": 0.0}))


def test_a_sweep_cut_short_resumes_from_its_cell_log(tmp_path: Path) -> None:
    from meridian.bench.targets_merge import CellLog, LoggedCell

    script = str(REPO / "benchmarks" / "bench_targets.py")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    common = ["--engine", "model", "--workloads", "synthetic", "--loads", "0.5", "--duration",
              "10", "--warmup", "2", "--policies", STOCK, "--jobs", "1"]  # fmt: skip

    def sweep(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, script, *common, *args], capture_output=True, text=True, env=env
        )

    first = tmp_path / "new" / "seed0.json"  # into a folder that does not exist yet
    done = sweep("--seeds", "0", "--out", str(first))
    assert done.returncode == 0, done.stderr
    assert not CellLog(first).path.exists()  # removed once the results are written
    seed0 = TargetsRun.model_validate_json(first.read_text(encoding="utf-8"))
    row = seed0.sweep("synthetic").cells[0]
    # A two-seed sweep killed after its seed-0 cell: that cell is in its log, from another commit.
    out = tmp_path / "two.json"
    cell = Cell("synthetic", "qwen3-8b", "h100-sxm", "model", row.rate, STOCK, 10.0, 0, 2.0,
                seed0.sweep("synthetic").trace_rate)  # fmt: skip
    log = CellLog(out)
    offered = next(iter(seed0.sweep("synthetic").offered.values()))
    entry = LoggedCell(
        cell=dataclasses.asdict(cell), commit="old1234", uncommitted_changes=False, row=row,
        offered=offered, elapsed_s=5.0,
    )  # fmt: skip
    log.append(entry)
    with log.path.open("a", encoding="utf-8") as f:
        f.write('{"cell": {"workload": "synth')  # a line the kill cut short
    again = sweep("--seeds", "0,1", "--out", str(out))
    assert again.returncode == 2 and "--resume to go on" in again.stderr
    resumed = sweep("--seeds", "0,1", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 1 of 2 cells done" in resumed.stdout
    assert resumed.stdout.count("  start  ") == 1  # only seed 1 ran
    run = TargetsRun.model_validate_json(out.read_text(encoding="utf-8"))
    cells = run.sweep("synthetic").cells
    assert [c.seed for c in cells] == [0, 1] and cells[0] == row
    assert run.commit.startswith("old1234, ") and run.wall_s >= 5.0
    assert not log.path.exists()
    missing = sweep("--seeds", "0", "--out", str(tmp_path / "none.json"), "--resume")
    assert missing.returncode == 2 and "--resume: no cell log" in missing.stderr


def test_render_prints_attainment_at_ten_times_with_the_stalled_out(cell: tuple) -> None:
    from meridian.bench.targets_render import at_scale

    b, offered = cell
    assert b.attainment_scales and 10.0 in b.attainment_scales
    i = b.attainment_scales.index(10.0)
    assert b.attainment_hidden_pct is not None
    mine = [b.model_copy(update={"policy": MERIDIAN, "seed": s, "slo_missed_stall": s})
            for s in (0, 1, 2)]  # fmt: skip
    line = at_scale(_run([*_seeds(b, STOCK), *mine], offered).sweep("synthetic"))
    pct = b.attainment_hidden_pct[i]
    assert line == (
        f"- 100% (4 req/s): {MERIDIAN} {pct:.1f} % (1 stalled out), "
        f"{STOCK} {pct:.1f} % ({b.slo_missed_stall:g} stalled out)"
    )
