"""Sweeps run apart: parts (a workload or a seed at a time) pooled into one :class:`TargetsRun`,
and a sweep's cell log, from which a sweep cut short goes on.

The full sweep takes hours on a 2-core machine; its cells are on virtual time, so a run of one
seed or one workload measures exactly what the same cells of the full run would. Parts pool when
they ran the same engine, model, hardware, arrival window and warm-up, each workload at the same
capacity and trace rate, and no cell (workload, rate, policy, seed) is in two parts, unless
asked to let a later part's cell replace an earlier one's (a policy rerun after a change that
touches nothing else: the other policies' cells stay those measured before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from meridian.bench.offered import OfferedLoad
from meridian.bench.targets import (
    CAPACITY,
    DURATION_S,
    LOADS,
    PASCAL,
    POLICIES,
    SEEDS,
    WARMUP_S,
    Cell,
    CellResult,
    TargetsRun,
    WorkloadSweep,
)

__all__ = [
    "PASCAL_FROM",
    "WORKLOADS",
    "CellLog",
    "LoggedCell",
    "MergeError",
    "full_sweep",
    "is_full_sweep",
    "load_rates",
    "merge_runs",
    "sweep_keys",
]

# The headline sweep's workloads, and the load (of capacity) from which it runs Pascal.
WORKLOADS = ("synthetic", "servegen-r1")
PASCAL_FROM = 0.9

# What every part must share (a field of TargetsRun each).
_SHARED = (
    "engine", "scheduler", "vllm_version", "model", "hardware", "num_kv_blocks", "max_num_seqs",
    "max_num_batched_tokens", "duration_s", "warmup_s", "schema_version",
)  # fmt: skip


class MergeError(ValueError):
    """Parts that cannot pool; the message is one line naming the difference."""


def merge_runs(parts: Sequence[TargetsRun], command: str, *, replace: bool = False) -> TargetsRun:
    """One run holding every cell of ``parts`` (``command``: how they were pooled, recorded
    beside each part's own command); with ``replace`` a cell of a later part replaces the same
    cell of an earlier one. Raises :class:`MergeError`."""
    if not parts:
        raise MergeError("nothing to merge")
    first = parts[0]
    for n, part in enumerate(parts[1:], start=2):
        for name in _SHARED:
            mine, theirs = getattr(part, name), getattr(first, name)
            if mine != theirs:
                raise MergeError(f"part {n} differs in {name}: {mine!r} vs {theirs!r}")
    shapes: dict[str, WorkloadSweep] = {}  # each workload's first sweep: capacity, trace rate
    cells: dict[str, dict[tuple[str, float, str, int], CellResult]] = {}
    offered: dict[str, tuple[int, dict[str, OfferedLoad]]] = {}  # the lowest seed's, as one run
    seen: dict[tuple[str, float, str, int], int] = {}
    for n, part in enumerate(parts, start=1):
        for sweep in part.workloads:
            shape = shapes.setdefault(sweep.workload, sweep)
            if (sweep.capacity_req_s, sweep.trace_rate) != (shape.capacity_req_s, shape.trace_rate):
                raise MergeError(
                    f"part {n}: {sweep.workload} ran at capacity {sweep.capacity_req_s:g} req/s, "
                    f"trace rate {sweep.trace_rate}, another part at "
                    f"{shape.capacity_req_s:g}, {shape.trace_rate}"
                )
            for cell in sweep.cells:
                key = (cell.workload, cell.rate, cell.policy, cell.seed)
                if key in seen and not (replace and seen[key] < n):
                    raise MergeError(
                        f"part {n} repeats {cell.workload} {cell.rate:g} req/s {cell.policy} seed "
                        f"{cell.seed} (also in part {seen[key]})"
                    )
                seen[key] = n
                cells.setdefault(sweep.workload, {})[key] = cell
            low = min((c.seed for c in sweep.cells), default=0)
            if sweep.workload not in offered or low < offered[sweep.workload][0]:
                offered[sweep.workload] = (low, sweep.offered)
    sweeps = {
        name: shape.model_copy(
            update={
                "cells": sorted(cells[name].values(), key=lambda c: (c.rate, c.policy, c.seed)),
                "offered": offered[name][1],
            }
        )
        for name, shape in shapes.items()
    }
    seeds = sorted({c.seed for s in sweeps.values() for c in s.cells})
    commits = list(dict.fromkeys(p.commit for p in parts))
    commands = list(dict.fromkeys(p.command for p in parts))
    return first.model_copy(
        update={
            "command": f"{command} (pooling: {'; '.join(commands)})",
            "commit": ", ".join(commits),
            "uncommitted_changes": any(p.uncommitted_changes for p in parts),
            "date": max(p.date for p in parts),
            "seed": seeds[0],
            "seeds": seeds,
            "jobs": max(p.jobs for p in parts),
            "wall_s": round(sum(p.wall_s for p in parts), 1),
            "workloads": list(sweeps.values()),
        }
    )


def load_rates(loads: Iterable[float], capacity: float) -> list[float]:
    """The arrival rates (req/s) of ``loads`` (fractions of ``capacity``), as a sweep runs them."""
    return [round(load * capacity, 4) for load in loads]


def sweep_keys(
    rates: Sequence[float],
    capacity: float,
    policies: Sequence[str],
    seeds: Sequence[int],
    pascal_from: float = PASCAL_FROM,
) -> list[tuple[float, str, int]]:
    """The cells of a sweep over ``rates``, ``(rate, policy, seed)`` each: every policy and seed,
    Pascal's only from ``pascal_from`` of ``capacity`` up."""
    return [
        (rate, policy, seed)
        for rate in rates
        for policy in policies
        for seed in seeds
        if policy != PASCAL or rate >= (pascal_from - 1e-9) * capacity
    ]


def full_sweep(
    engine: str,
    model: str,
    hardware: str,
    duration_s: float,
    warmup_s: float,
    cells: Mapping[str, tuple[float, Iterable[tuple[float, str, int]]]],
) -> bool:
    """Whether ``cells`` (by workload: its capacity and its ``(rate, policy, seed)`` cells) are
    exactly the full sweep's, the one the committed results file holds: both workloads of
    :data:`WORKLOADS` at their measured capacity, every load of :data:`LOADS`, every policy
    (Pascal from 90 %), every seed of :data:`SEEDS`, the default window and warm-up, vLLM's
    scheduler."""
    if engine != "vllm" or (duration_s, warmup_s) != (DURATION_S, WARMUP_S):
        return False
    if sorted(cells) != sorted(WORKLOADS):
        return False
    for workload, (capacity, keys) in cells.items():
        if capacity != CAPACITY.get((workload, model, hardware)):
            return False
        want = sweep_keys(load_rates(LOADS, capacity), capacity, POLICIES, SEEDS)
        have = list(keys)
        if len(have) != len(want) or set(have) != set(want):
            return False
    return True


def is_full_sweep(run: TargetsRun) -> bool:
    """:func:`full_sweep` of a run's cells."""
    return full_sweep(
        run.engine, run.model, run.hardware, run.duration_s, run.warmup_s,
        {s.workload: (s.capacity_req_s, [(c.rate, c.policy, c.seed) for c in s.cells])
         for s in run.workloads},
    )  # fmt: skip


class LoggedCell(BaseModel):
    """One finished cell of a sweep in its cell log: the cell, the commit that ran it, its
    figures and its offered load, and the sweep's wall time so far."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cell: dict[str, Any]
    commit: str
    uncommitted_changes: bool
    row: CellResult
    offered: OfferedLoad
    elapsed_s: float

    @property
    def key(self) -> Cell:
        return Cell(**self.cell)


class CellLog:
    """Each cell of a sweep, one JSON line as it finishes, beside the results file
    (``OUT.cells.jsonl``): a sweep cut short goes on from it (``bench_targets.py --resume``)
    instead of starting again. Removed once the results file is written."""

    def __init__(self, out: Path) -> None:
        self.path = out.with_name(out.name + ".cells.jsonl")

    def read(self) -> list[LoggedCell]:
        """The cells logged so far (a line cut short by a kill is skipped)."""
        entries = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(LoggedCell.model_validate_json(line))
            except ValidationError:
                continue
        return entries

    def append(self, entry: LoggedCell) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(entry.model_dump_json() + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
