#!/usr/bin/env python3
"""Rebuild ``src/meridian/bench/data/servegen-r1.json`` from ServeGen's raw DeepSeek-R1 files.

The raw data (13 MB) is ServeGen's reasoning workload, ``data/reason/deepseek-r1/`` of
https://github.com/alibaba/ServeGen at commit f891d11, Apache-2.0 (arXiv:2505.09999): for each
client ``K``, ``chunk-K-trace.csv`` (one row per 10-minute window: start second, rate, CV of the
inter-arrival times, fitted distribution name, shape, scale) and ``chunk-K-dataset.json``
(per 6-hour window, the probability tables of ``input_tokens``, ``output_tokens`` and
``reason_ratio`` as Python dict literals ``{value: probability}``).

What the compact file keeps, and how it changes the data (also stated in its ``notice``):

- per client, only the windows with traffic: ``[window index, requests in the window, CV,
  distribution, shape]``. A rate is requests / 600 s in the raw file (exactly), so the count is
  stored. The fitted scale is dropped: ServeGen rescales each window's gaps to the window, which
  cancels the scale; only the shape (the burstiness) matters;
- per client, the length tables of the 6-hour windows that some window with traffic uses
  (ServeGen's lookup: the latest non-empty table at or before the window), each table reduced to
  its inverse CDF at the probabilities of ``QUANTILES`` (every 1/64, plus 0.99, 0.995 and 0.999
  for the tail). Between two knots the generator interpolates linearly, so the CDF of a sampled
  length is exact at the knots and off by less than 1/64 anywhere. ``reason_ratio`` knots are
  the table's own values (its keys are i/501) rounded to 4 decimals;
- clients without any traffic are dropped.

Usage::

    .venv/bin/python scripts/build_servegen_r1.py /work/shared/data/servegen-deepseek-r1
    .venv/bin/python scripts/build_servegen_r1.py RAW_DIR --out /tmp/servegen-r1.json

The output is deterministic (sorted clients and windows, fixed float formatting), so
``tests/test_servegen.py`` checks that it reproduces the committed file byte for byte.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "meridian" / "bench" / "data" / "servegen-r1.json"
WINDOW_S = 600
NUM_WINDOWS = 144
TABLE_WINDOW_S = 21_600
FIELDS = ("input_tokens", "output_tokens", "reason_ratio")
DISTRIBUTIONS = ("Gamma", "Weibull")
QUANTILES: tuple[float, ...] = tuple(sorted({i / 64 for i in range(65)} | {0.99, 0.995, 0.999}))
# A cumulative probability within this of a knot reaches it (float sums of the raw tables).
CDF_SLACK = 1e-9
SOURCE = {
    "repository": "https://github.com/alibaba/ServeGen",
    "path": "data/reason/deepseek-r1",
    "commit": "f891d11",
    "license": "Apache-2.0",
    "paper": "ServeGen: Workload Characterization of Large Language Model Serving in "
    "Production, arXiv:2505.09999",
    "traffic": "DeepSeek-R1 on Alibaba Cloud Model Studio (Bailian), one day, per client",
}
NOTICE = (
    "Derived from ServeGen by Alibaba (licensed under the Apache License 2.0; the license "
    "text is LICENSE-servegen.txt beside this file), data/reason/deepseek-r1 at commit "
    "f891d11. Changed by scripts/build_servegen_r1.py: clients without traffic dropped; per "
    "10-minute window the rate kept as its request count, the CV and the fitted distribution's "
    "name and shape kept, its scale dropped (it cancels when gaps are rescaled to the window); "
    "each length table reduced to its inverse CDF at the probabilities in 'quantiles'."
)
# One `value: probability` pair of a table's dict literal; values are ints or floats.
_PAIR = re.compile(r"\s*(-?\d+(?:\.\d*)?(?:[eE]-?\d+)?)\s*:\s*(-?\d+(?:\.\d*)?(?:[eE]-?\d+)?)\s*")


class RawDataError(Exception):
    """The raw folder is not ServeGen's DeepSeek-R1 data as this script knows it."""


def parse_table(text: str, where: str) -> dict[float, float]:
    """A table's dict literal ``{value: probability, ...}`` as a dict (exact float parsing)."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise RawDataError(f"{where}: not a dict literal: {text[:40]!r}")
    table: dict[float, float] = {}
    inner = body[1:-1].strip()
    if not inner:
        return table
    for item in inner.split(","):
        match = _PAIR.fullmatch(item)
        if match is None:
            raise RawDataError(f"{where}: cannot parse {item!r}")
        table[float(match[1])] = float(match[2])
    return table


def inverse_cdf(table: dict[float, float], where: str) -> list[float]:
    """The smallest value whose cumulative probability reaches each of :data:`QUANTILES`."""
    values = np.array(sorted(v for v, p in table.items() if p > 0), dtype=np.float64)
    if values.size == 0:
        raise RawDataError(f"{where}: a table without probability")
    probs = np.array([table[v] for v in values], dtype=np.float64)
    if (probs < 0).any():
        raise RawDataError(f"{where}: a negative probability")
    cdf = np.cumsum(probs) / probs.sum()
    index = np.searchsorted(cdf, np.array(QUANTILES) - CDF_SLACK, side="left")
    return [float(v) for v in values[np.minimum(index, values.size - 1)]]


def read_trace(path: Path) -> list[list[Any]]:
    """The windows with traffic: ``[index, count, cv, distribution, shape]``."""
    rows = list(csv.reader(path.read_text(encoding="utf-8").splitlines()))
    if len(rows) != NUM_WINDOWS:
        raise RawDataError(f"{path}: {len(rows)} rows; expected {NUM_WINDOWS}")
    windows: list[list[Any]] = []
    for index, row in enumerate(rows):
        if len(row) != 6 or int(row[0]) != index * WINDOW_S:
            raise RawDataError(f"{path}: row {index + 1} is not window {index * WINDOW_S}: {row}")
        rate, cv, name, shape = float(row[1]), float(row[2]), row[3], float(row[4])
        if not name:
            if rate != 0:
                raise RawDataError(f"{path}: row {index + 1} has a rate but no distribution")
            continue
        if name not in DISTRIBUTIONS or not (rate > 0 and cv > 0 and shape > 0):
            raise RawDataError(f"{path}: row {index + 1}: unexpected values {row}")
        count = round(rate * WINDOW_S)
        if abs(count - rate * WINDOW_S) > 1e-6:
            raise RawDataError(f"{path}: row {index + 1}: rate x 600 s is not a count: {rate}")
        windows.append([index, count, float(f"{cv:.4g}"), name, float(f"{shape:.6g}")])
    return windows


def read_tables(path: Path) -> dict[int, dict[str, list[float]]]:
    """The non-empty 6-hour tables by start second, each field as its quantile knots."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    tables: dict[int, dict[str, list[float]]] = {}
    for start_text, fields in raw.items():
        start = int(start_text)
        if start % TABLE_WINDOW_S or sorted(fields) != sorted(FIELDS):
            raise RawDataError(f"{path}: unexpected table {start_text}: {sorted(fields)}")
        parsed = {f: parse_table(fields[f], f"{path}:{start}:{f}") for f in FIELDS}
        if not all(parsed.values()):
            continue  # ServeGen skips a window with an empty table
        knots = {f: inverse_cdf(parsed[f], f"{path}:{start}:{f}") for f in FIELDS}
        tables[start] = {
            "input_tokens": [int(v) for v in knots["input_tokens"]],
            "output_tokens": [int(v) for v in knots["output_tokens"]],
            "reason_ratio": [round(v, 4) for v in knots["reason_ratio"]],
        }
    return tables


def build(raw_dir: Path) -> dict[str, Any]:
    """The compact data set as a JSON-ready dict."""
    ids = sorted(
        int(m[1])
        for p in raw_dir.glob("chunk-*-trace.csv")
        if (m := re.match(r"chunk-(\d+)-", p.name))
    )
    if not ids:
        raise RawDataError(f"{raw_dir}: no chunk-K-trace.csv files")
    clients: list[dict[str, Any]] = []
    for client in ids:
        windows = read_trace(raw_dir / f"chunk-{client}-trace.csv")
        if not windows:
            continue
        tables = read_tables(raw_dir / f"chunk-{client}-dataset.json")
        used: set[int] = set()
        for index, *_ in windows:
            starts = [s for s in tables if s <= index * WINDOW_S]
            if not starts:
                raise RawDataError(f"client {client}: window {index} has traffic but no table")
            used.add(max(starts))
        clients.append(
            {
                "id": client,
                "windows": windows,
                "tables": [{"start_s": s, **tables[s]} for s in sorted(used)],
            }
        )
    return {
        "schema_version": 1,
        "name": "servegen-r1",
        "source": SOURCE,
        "notice": NOTICE,
        "window_s": WINDOW_S,
        "num_windows": NUM_WINDOWS,
        "quantiles": list(QUANTILES),
        "clients": clients,
    }


def render(data: dict[str, Any]) -> str:
    """JSON with one key, and one client, per line (diffable; a fraction of an indented file)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items() if k != "clients"]
    clients = [f"  {json.dumps(c, separators=(',', ':'))}," for c in data["clients"]]
    clients[-1] = clients[-1].removesuffix(",")
    return "\n".join(["{", *lines, ' "clients": [', *clients, " ]", "}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("raw_dir", type=Path, help="ServeGen's data/reason/deepseek-r1 folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output ({DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if not args.raw_dir.is_dir():
        print(f"error: {args.raw_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        text = render(build(args.raw_dir))
    except (RawDataError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
