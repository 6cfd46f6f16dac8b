"""The headline's evidence from one command: Meridian against stock vLLM FCFS (forcing held
equal) and the Pascal-like baseline, over a load sweep around capacity, per workload.

Run (vLLM's own scheduler, needs the vLLM environment: `make vllm-venv`):

    .venv-vllm/bin/python benchmarks/bench_targets.py            # both workloads, H100/Qwen3-8B
    .venv-vllm/bin/python benchmarks/bench_targets.py --model qwen3-32b --workloads synthetic \\
        --rates 0.4,0.56,0.72,0.8,0.88,0.96                      # KV-tight
    .venv-vllm/bin/python benchmarks/bench_targets.py --render   # rewrite README/docs from the JSON
    .venv-vllm/bin/python benchmarks/bench_targets.py --render meridian-out/targets/*.json
    .venv-vllm/bin/python benchmarks/bench_targets.py --workloads servegen-r1 \\
        --policies vllm-fcfs+forcing --rates 1.6,1.8,2.0         # find a capacity
    .venv-vllm/bin/python benchmarks/bench_targets.py --rates 6.05 \\
        --policies vllm-fcfs+forcing,meridian,meridian@admission=vllm   # an ablation

    .venv-vllm/bin/python benchmarks/bench_targets.py --workloads synthetic --loads 1.1 \
        --duration 120 --warmup 40 --engine model                # a short check, minutes
    .venv-vllm/bin/python benchmarks/bench_targets.py --workloads synthetic --seeds 0 \
        --out synthetic-seed0.json                               # the sweep a part at a time,
    .venv-vllm/bin/python benchmarks/bench_targets.py --merge *-seed*.json   # then pooled
    .venv-vllm/bin/python benchmarks/bench_targets.py --merge \
        benchmarks/results/targets-h100-sxm-qwen3-8b.json meridian-rerun.json --replace
                                       # a policy rerun (--policies meridian) replaces its cells

Each finished cell is logged beside the results file (``OUT.cells.jsonl``); a sweep cut short
goes on from it with the same arguments (the same ``--out``) and ``--resume``.

Every cell runs each of ``--seeds`` (default 0,1,2); per workload and seed one trace is drawn at
the sweep's highest rate and thinned to each rate (nested loads), and the first ``--warmup``
seconds of arrivals (default 200 of the 600) are in no statistic.

The full sweep (the default workloads, loads, policies, engine, seeds, warm-up and duration)
writes ``benchmarks/results/targets-HARDWARE-MODEL.json`` (engine, vLLM version, commit, seeds,
wall time and every cell, :class:`meridian.bench.targets.TargetsRun`) and rewrites the README's
and ``docs/benchmarks.md``'s blocks from it (:mod:`meridian.bench.targets_render`); anything
else writes a file of its own, ``meridian-out/targets/targets-HARDWARE-MODEL-WORKLOADS-TIME.json``,
and prints its tables. Every run also draws its SLO attainment curves (medians over the seeds)
beside its JSON (``.png``; the full sweep's to ``docs/img/``). vLLM's log lines are hidden unless
``-v``. Each cell prints a line when it starts, one a minute while it runs and its figures when
it ends. Methodology and targets: :mod:`meridian.bench.targets`; the cells' figures do not
depend on ``--jobs`` (virtual time).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from meridian.bench import provenance
from meridian.bench.offered import OfferedLoad
from meridian.bench.targets import (
    CAPACITY,
    DURATION_S,
    LOADS,
    MERIDIAN,
    POLICIES,
    SEEDS,
    STOCK,
    WARMUP_S,
    Cell,
    CellResult,
    TargetsRun,
    WorkloadSweep,
)
from meridian.bench.targets_merge import (
    PASCAL_FROM,
    WORKLOADS,
    CellLog,
    LoggedCell,
    MergeError,
    full_sweep,
    is_full_sweep,
    load_rates,
    merge_runs,
    sweep_keys,
)
from meridian.bench.targets_render import (
    at_scale,
    count_misses,
    fmt,
    misses,
    render_docs,
    table,
    write_attainment,
)
from meridian.cli.common import hide_vllm_logs

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = (REPO / "README.md", REPO / "docs" / "benchmarks.md")
PROGRESS_EVERY_S = 60.0


def results_path(hardware: str, model: str) -> Path:
    return RESULTS / f"targets-{hardware}-{model}.json"


def partial_name(hardware: str, model: str, workloads: list[str], stamp: str) -> str:
    """A run that is not the full sweep gets a file of its own: two runs never overwrite each
    other, and ``--render`` takes them together."""
    return f"targets-{hardware}-{model}-{'+'.join(workloads)}-{stamp}.json"


def _cell(cell: Cell) -> tuple[CellResult, OfferedLoad]:
    """One cell in a worker process, a progress line a minute."""
    from meridian.bench.targets import run_cell

    name = f"{cell.workload} {cell.rate:g} req/s {cell.policy} seed {cell.seed}"
    print(f"  start  {name}", flush=True)
    started = last = time.perf_counter()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            print(f"  ...    {name}: {done}/{total} requests finished, "
                  f"{(now - started) / 60:.0f} min", flush=True)  # fmt: skip

    return run_cell(cell, progress)


def _line(row: CellResult) -> str:
    contended = {None: "?", True: "yes", False: "none"}[row.contended]
    return (
        f"  done   {row.workload} {row.rate:g} req/s {row.policy} seed {row.seed} in "
        f"{row.wall_s / 60:.1f} min: ITL P99 {fmt(row.itl_p99_ms)} ms, TTFVT P95 "
        f"{fmt(row.ttfvt_p95_s)} s, TTFT P95 {fmt(row.ttft_p95_s)} s, "
        f"{fmt(row.throughput_tok_s)} tok/s, SLO met at 3x hidden/shown "
        f"{fmt(row.slo_hidden_pct)}/{fmt(row.slo_shown_pct)} %, goodput "
        f"{fmt(row.goodput_req_s)} req/s, recomputed {row.recomputed_tokens:,}, preemptions "
        f"{row.preemptions_think}/{row.preemptions_answer}, peak KV "
        f"{fmt(row.kv_used_peak)}, contention {contended}, worst gap "
        f"{row.worst_answer_gap_steps}, queue {'bounded' if row.queue_bounded else 'grows'}"
    )


def _engine_shape(model: str, hardware: str) -> Any:
    from meridian.bench.simrun import SimRunSpec, engine_config_for

    return engine_config_for(SimRunSpec(model=model, hardware=hardware, engine="vllm"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "model"))
    ap.add_argument("--capacity", type=float, help="req/s (default: the measured one)")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)), help="fractions of capacity")
    ap.add_argument("--rates", help="req/s instead of --loads (comma list; one workload)")
    ap.add_argument(
        "--duration", type=float, default=DURATION_S, help=f"seconds of arrivals ({DURATION_S:g})"
    )
    ap.add_argument(
        "--warmup", type=float, default=WARMUP_S,
        help=f"seconds of arrivals at the start in no statistic ({WARMUP_S:g})",
    )  # fmt: skip
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--pascal-from", type=float, default=PASCAL_FROM, help="run Pascal from this load"
    )
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--seeds", default=",".join(map(str, SEEDS)),
        help="the workload's seeds, a cell per seed (comma list; default 0,1,2)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, help="the JSON to write (default: see above)")
    ap.add_argument(
        "--render", nargs="*", metavar="JSON",
        help="run nothing: print the tables of saved runs (default: this model's committed "
        "results file) and, for a committed one, rewrite the README's and docs' blocks from it",
    )  # fmt: skip
    ap.add_argument(
        "--merge", nargs="+", metavar="JSON",
        help="run nothing: pool runs made apart (a seed or a workload at a time) into one; the "
        "full sweep's cells go to the committed results file and the docs, others to --out",
    )  # fmt: skip
    ap.add_argument(
        "--replace", action="store_true",
        help="with --merge: a later part's cell replaces the same cell of an earlier part (a "
        "policy rerun after a change that touches only it)",
    )  # fmt: skip
    ap.add_argument(
        "--resume", action="store_true",
        help="go on from the cells a run cut short logged beside its --out (OUT.cells.jsonl)",
    )  # fmt: skip
    ap.add_argument("-v", "--verbose", action="store_true", help="show vLLM's own log lines")
    args = ap.parse_args()
    if not args.verbose:
        hide_vllm_logs()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.render is not None:
        paths = [Path(p) for p in args.render] or [results_path(args.hardware, args.model)]
        for path in paths:
            if not path.is_file():
                ap.error(f"--render: no results file {path}")
            run = TargetsRun.model_validate_json(path.read_text(encoding="utf-8"))
            print(f"{path}: {len(run.workloads)} workload(s), commit {run.commit}")
            _print(run)
            if path.resolve().parent == RESULTS.resolve():
                _write_docs(run)
        return 0
    if args.replace and args.merge is None:
        ap.error("--replace goes with --merge")
    if args.merge is not None:
        return _merge(ap, args.merge, args.out, replace=args.replace)
    if args.rates and len(workloads) != 1:
        ap.error("--rates needs exactly one workload (--workloads NAME)")
    capacities: dict[str, float] = {}
    for workload in workloads:
        capacity = args.capacity or CAPACITY.get((workload, args.model, args.hardware))
        if capacity is None:
            ap.error(f"no measured capacity for {workload} on {args.model}/{args.hardware}: "
                     "pass --capacity")  # fmt: skip
        capacities[workload] = capacity
    policies = args.policies.split(",")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be a comma list of integers; got {args.seeds!r}")
    if not 0 <= args.warmup < args.duration:
        ap.error(
            f"--warmup ({args.warmup:g}) must be >= 0 and below --duration ({args.duration:g})"
        )
    cells = []
    trace_rates: dict[str, float] = {}
    keys: dict[str, tuple[float, list[tuple[float, str, int]]]] = {}
    for workload, capacity in capacities.items():
        if args.rates:
            rates = [float(x) for x in args.rates.split(",")]
        else:
            rates = load_rates(map(float, args.loads.split(",")), capacity)
        # Nested loads: each seed's trace is drawn at the highest rate, thinned to the others.
        trace_rates[workload] = max(rates)
        keys[workload] = (capacity, sweep_keys(rates, capacity, policies, seeds, args.pascal_from))
        cells += [
            Cell(
                workload,
                args.model,
                args.hardware,
                args.engine,
                rate,
                policy,
                args.duration,
                seed,
                args.warmup,
                trace_rates[workload],
            )
            for rate, policy, seed in keys[workload][1]
        ]
    full = args.out is None and full_sweep(
        args.engine, args.model, args.hardware, args.duration, args.warmup, keys
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or (
        results_path(args.hardware, args.model)
        if full
        else REPO / "meridian-out" / "targets" / partial_name(args.hardware, args.model,
                                                              workloads, stamp)
    )  # fmt: skip
    commit = provenance.commit(REPO)
    dirty = provenance.has_changes(REPO, "src", "benchmarks/bench_targets.py")
    vllm = provenance.vllm_version()
    print(
        f"{args.model} on {args.hardware}, engine {args.engine} (vLLM {vllm}), commit "
        f"{commit}{' + uncommitted changes' if dirty else ''}; capacity "
        + ", ".join(f"{w} {c:g} req/s" for w, c in capacities.items())
        + f"; {len(cells)} runs of {args.duration:g} s of arrivals (the first {args.warmup:g} s "
        f"warm-up; seeds {args.seeds}; loads nested), {args.jobs} at a time; results to {out}",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)  # before the first cell, not after it
    log = CellLog(out)
    resumed: list[LoggedCell] = []
    if log.path.exists():
        if not args.resume:
            ap.error(f"{log.path} holds the cells of an earlier run of this sweep: --resume to go "
                     "on from them, or delete it to start again")  # fmt: skip
        planned = set(cells)
        resumed = [e for e in log.read() if e.key in planned]
        print(f"resuming: {len(resumed)} of {len(cells)} cells done in {log.path}", flush=True)
    elif args.resume:
        ap.error(f"--resume: no cell log {log.path}")
    started = time.perf_counter()
    before_s = max((e.elapsed_s for e in resumed), default=0.0)
    done = {e.key for e in resumed}
    # The longest cells (overloaded ones) first, so that the last ones overlap less.
    order = [c for c in sorted(cells, key=lambda c: -c.rate / capacities[c.workload])
             if c not in done]  # fmt: skip
    entries = list(resumed)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_cell, cell): cell for cell in order}
        try:
            for n, future in enumerate(as_completed(futures)):
                cell, (row, load) = futures[future], future.result()
                entry = LoggedCell(
                    cell=dataclasses.asdict(cell), commit=commit, uncommitted_changes=dirty,
                    row=row, offered=load, elapsed_s=before_s + time.perf_counter() - started,
                )  # fmt: skip
                log.append(entry)
                entries.append(entry)
                print(f"{_line(row)} [{len(done) + n + 1}/{len(cells)}, "
                      f"{(time.perf_counter() - started) / 60:.0f} min]", flush=True)  # fmt: skip
        except BaseException:
            # NOTE: the cells not started yet are dropped: leaving the block would run them all
            # before the error shows. Those logged so far stay for --resume.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    rows = [e.row for e in entries]
    offered: dict[str, dict[str, OfferedLoad]] = {w: {} for w in workloads}
    for e in entries:
        if e.row.seed == seeds[0]:
            offered[e.row.workload][f"{e.row.rate:g}"] = e.offered
    commits = list(dict.fromkeys([*(e.commit for e in resumed), commit]))
    shape = _engine_shape(args.model, args.hardware)
    scheduler = "AsyncScheduler" if shape.async_scheduling else "Scheduler"
    run = TargetsRun(
        command=shlex.join(["benchmarks/bench_targets.py", *sys.argv[1:]]),
        engine=args.engine,
        scheduler=scheduler if args.engine == "vllm" else "the fast engine model (synchronous)",
        vllm_version=vllm,
        commit=", ".join(commits),
        uncommitted_changes=any(e.uncommitted_changes for e in entries) or dirty,
        date=datetime.date.today().isoformat(),
        model=args.model,
        hardware=args.hardware,
        num_kv_blocks=shape.num_kv_blocks,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        seed=seeds[0],
        seeds=seeds,
        warmup_s=args.warmup,
        duration_s=args.duration,
        jobs=args.jobs,
        wall_s=round(before_s + time.perf_counter() - started, 1),
        workloads=[
            WorkloadSweep(
                workload=w,
                capacity_req_s=capacities[w],
                offered=dict(sorted(offered[w].items(), key=lambda kv: float(kv[0]))),
                cells=sorted(
                    (r for r in rows if r.workload == w),
                    key=lambda r: (r.rate, r.policy, r.seed),
                ),
                trace_rate=trace_rates[w],
            )
            for w in workloads
        ],
    )
    _save(run, out, full)
    log.remove()
    return 0


def _save(run: TargetsRun, path: Path, full: bool) -> None:
    """Write ``run`` to ``path``, print its tables, draw its attainment curves (the full
    sweep's to ``docs/img/``) and, for the full sweep, rewrite the docs' blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.model_dump(mode="json"), indent=1) + "\n", encoding="utf-8")
    _print(run)
    print(f"wrote {path}" + (" (the full sweep)" if full else ""))
    base = REPO / "docs" / "img" / path.stem if full else path.with_suffix("")
    for plot in write_attainment(run, base):
        print(f"wrote {plot}")
    if full:
        _write_docs(run)


def _merge(
    ap: argparse.ArgumentParser, paths: list[str], out: Path | None, *, replace: bool
) -> int:
    """``--merge``: pool the runs in ``paths`` (see :mod:`meridian.bench.targets_merge`)."""
    parts = []
    for path in map(Path, paths):
        if not path.is_file():
            ap.error(f"--merge: no results file {path}")
        parts.append(TargetsRun.model_validate_json(path.read_text(encoding="utf-8")))
    command = shlex.join(["benchmarks/bench_targets.py", *sys.argv[1:]])
    try:
        run = merge_runs(parts, command, replace=replace)
    except MergeError as exc:
        ap.error(f"--merge: {exc}")
    full = out is None and is_full_sweep(run)
    if out is not None:
        path = out
    elif full:
        path = results_path(run.hardware, run.model)
    else:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        names = [s.workload for s in run.workloads]
        path = REPO / "meridian-out" / "targets"
        path /= partial_name(run.hardware, run.model, names, stamp)
    print(f"pooled {len(parts)} runs, seeds {run.all_seeds}, commits {run.commit}")
    _save(run, path, full)
    return 0


def _print(run: TargetsRun) -> None:
    for sweep in run.workloads:
        print(f"\n{sweep.workload} (capacity {sweep.capacity_req_s:g} req/s):\n")
        names = {c.policy for c in sweep.cells}
        if not names <= set(POLICIES) or not {STOCK, MERIDIAN} <= names:
            _print_all(sweep)
        if {STOCK, MERIDIAN} <= names:
            print(table(sweep))
            missed, marked = count_misses(sweep)
            print(f"\n{missed} of {marked} target cells missed (✗):\n{misses(sweep)}")
            scaled = at_scale(sweep)
            if scaled:
                print(f"\nSLO met at 10× (hidden; median of the seeds; 'stalled out': requests "
                      f"a seed that miss it at any scale for an answer gap over 250 ms):\n"
                      f"{scaled}")  # fmt: skip


def _print_all(sweep: WorkloadSweep) -> None:
    """Every cell, for ablations and capacity searches."""
    for row in sweep.cells:
        print(_line(row))


def _write_docs(run: TargetsRun) -> None:
    others = [
        TargetsRun.model_validate_json(p.read_text(encoding="utf-8"))
        for p in sorted(RESULTS.glob("targets-*.json"))
        if p != results_path(run.hardware, run.model)
    ]
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        rendered = render_docs(text, [*others, run])
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            print(f"rewrote the rendered blocks of {path.relative_to(REPO)}")


if __name__ == "__main__":
    sys.exit(main())
