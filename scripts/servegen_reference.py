#!/usr/bin/env python3
"""Record what ServeGen's own generator draws for DeepSeek-R1, as reference figures for
``servegen-r1`` (``src/meridian/bench/data/servegen-reference.json``; ``tests/test_servegen.py``
compares Meridian's generator with them).

For each start time of the day (00:00, ServeGen's examples' start, and 10:00, ``servegen-r1``'s
default), ServeGen's ``generate_workload`` over ``pool.span(start, start + DURATION)`` at a
constant ``RATE`` req/s (``get_constant_rate_fn``), once per seed 0..SEEDS-1: the mean and the
pooled P50/P90 of input tokens, output tokens and reasoning tokens (output x reason ratio, as
ServeGen's fields define them), and the standard deviation of the per-seed means.

It runs ServeGen's code from a checkout of https://github.com/alibaba/ServeGen (Apache-2.0, not
part of this repository) over ServeGen's raw ``data/reason/deepseek-r1`` folder, and needs numpy
and scipy (ServeGen's requirements; not in Meridian's environment)::

    python3 -m venv /tmp/sg && /tmp/sg/bin/pip install numpy scipy
    /tmp/sg/bin/python scripts/servegen_reference.py --servegen /path/to/ServeGen \\
        --data /work/shared/data/servegen-deepseek-r1

The figures were made at ServeGen commit f891d11 with numpy 2 and scipy 1.x (the draw goes through
``numpy.random.RandomState`` and ``scipy.stats``, whose streams are stable across versions).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

RATE = 3.0
DURATION_S = 600
SEEDS = 30
STARTS = {"00:00": 0, "10:00": 36_000}
OUT = Path(__file__).resolve().parents[1] / "src" / "meridian" / "bench" / "data"
FIELDS = ("input_tokens", "output_tokens", "reason_tokens")


def _stats(per_seed: list[np.ndarray]) -> dict[str, float]:
    pooled = np.concatenate(per_seed)
    p50, p90 = np.percentile(pooled, [50, 90])
    means = np.array([x.mean() for x in per_seed])
    return {
        "mean": round(float(pooled.mean()), 1),
        "seed_mean_sd": round(float(means.std(ddof=1)), 1),
        "p50": round(float(p50), 1),
        "p90": round(float(p90), 1),
    }


def reference(checkout: Path, data: Path) -> dict[str, Any]:
    sys.path.insert(0, str(checkout))
    from servegen import Category, ClientPool  # type: ignore[import-not-found]
    from servegen.construct import generate_workload  # type: ignore[import-not-found]
    from servegen.utils import get_constant_rate_fn  # type: ignore[import-not-found]

    # ServeGen reads data/<category>/<model> relative to the working directory.
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data" / "reason"
        folder.mkdir(parents=True)
        (folder / "deepseek-r1").symlink_to(data.resolve())
        here = Path.cwd()
        os.chdir(tmp)
        try:
            pool = ClientPool(Category.REASON, "deepseek-r1")
        finally:
            os.chdir(here)
    starts: dict[str, Any] = {}
    for label, start in STARTS.items():
        view = pool.span(start, start + DURATION_S)
        rate_fn = get_constant_rate_fn(view, RATE)
        columns: dict[str, list[np.ndarray]] = {f: [] for f in FIELDS}
        counts = []
        for seed in range(SEEDS):
            requests = generate_workload(view, rate_fn, duration=DURATION_S, seed=seed)
            counts.append(len(requests))
            output = np.array([r.data["output_tokens"] for r in requests], dtype=np.float64)
            ratio = np.array([r.data["reason_ratio"] for r in requests], dtype=np.float64)
            columns["input_tokens"].append(
                np.array([r.data["input_tokens"] for r in requests], dtype=np.float64)
            )
            columns["output_tokens"].append(output)
            columns["reason_tokens"].append(output * ratio)
        starts[label] = {
            "requests_mean": round(float(np.mean(counts)), 1),
            **{f: _stats(columns[f]) for f in FIELDS},
        }
    return starts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servegen", type=Path, required=True, help="a checkout of ServeGen")
    ap.add_argument(
        "--data", type=Path, required=True, help="ServeGen's data/reason/deepseek-r1 folder"
    )
    ap.add_argument("--out", type=Path, default=OUT / "servegen-reference.json")
    args = ap.parse_args()
    if not (args.servegen / "servegen" / "construct.py").is_file():
        ap.error(f"--servegen {args.servegen}: no servegen/construct.py there")
    if not (args.data / "chunk-0-trace.csv").is_file():
        ap.error(f"--data {args.data}: no chunk-0-trace.csv there")
    commit = subprocess.run(
        ["git", "-C", str(args.servegen), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    doc = {
        "what": (
            "ServeGen's own generate_workload (servegen/construct.py) over DeepSeek-R1's data: "
            f"constant {RATE:g} req/s for {DURATION_S} s from each start, seeds 0..{SEEDS - 1}; "
            "mean and pooled P50/P90 of input, output and reasoning tokens (output x "
            "reason_ratio), and the standard deviation of the per-seed means"
        ),
        "command": shlex.join(
            [
                "scripts/servegen_reference.py",
                "--servegen",
                "SERVEGEN_CHECKOUT",
                "--data",
                "SERVEGEN_DATA/reason/deepseek-r1",
            ]
        ),
        "servegen_commit": commit or "f891d11",
        "rate_req_s": RATE,
        "duration_s": DURATION_S,
        "seeds": SEEDS,
        "starts": reference(args.servegen, args.data),
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(doc["starts"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
