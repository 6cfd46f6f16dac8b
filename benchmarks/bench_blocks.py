"""Benchmark: preemption-victim ranking (``meridian.core.victims.rank_victims``).

- ``rank_victims`` over 1,024 running requests (``Candidate`` tuples of all four
  ``VictimClass`` es, seeded), µs per call, for a typical need (4 victims), the cap at the
  default ``scheduler.preempt_max_fraction`` of 0.25 (256 victims) and every request ranked
  (1,024).
  Baseline in the same run: ``sorted()`` of the same 1,024 tuples by (class, computed tokens),
  the full sort a naive ranking would do; the ratio to it is printed.

The block manager's ``evict_for`` used to be measured here too; the block manager no longer
evicts (a live request's answer attends over all of its KV), so there is nothing to time.

Run: ``.venv/bin/python benchmarks/bench_blocks.py`` (deterministic workload, seed 0).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from operator import itemgetter

from meridian.core.types import Phase
from meridian.core.victims import VICTIM_CLASS, Candidate, VictimClass, rank_victims
from timing import seconds_per_call

NUM_RUNNING = 1024
MAX_VICTIMS = 256
BLOCK_SIZE_TOKENS = 16

# (class, computed tokens): the fields of a Candidate tuple the baseline sorts by.
_CLASS_THEN_TOKENS = itemgetter(1, 2)


def candidates(rng: random.Random) -> list[Candidate]:
    """1,024 running requests: mostly thinking or answering, a few prefilling, ~10% guarded."""
    out: list[Candidate] = []
    for i in range(NUM_RUNNING):
        phase = rng.choice([Phase.PREFILL, Phase.THINK, Phase.THINK, Phase.OUTPUT, Phase.OUTPUT])
        guarded = rng.random() < 0.1
        num_computed_tokens = rng.randrange(1, 200) * BLOCK_SIZE_TOKENS + rng.randrange(16)
        out.append(Candidate(f"req-{i}", VICTIM_CLASS[phase, guarded], num_computed_tokens))
    return out


def naive_rank(running: list[Candidate]) -> list[Candidate]:
    """Baseline: sort every candidate by (class, computed tokens)."""
    return sorted(running, key=_CLASS_THEN_TOKENS)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 rounds of the mean µs per call."""
    return seconds_per_call(fn, calls) * 1e6


def main() -> None:
    running = candidates(random.Random(0))
    by_class = {c: sum(r.victim_class is c for r in running) for c in VictimClass}
    print(
        f"{NUM_RUNNING} running requests: "
        + ", ".join(f"{c.name} {n}" for c, n in by_class.items())
    )

    # The ranking agrees with the baseline on (class, computed tokens); ties may differ in order
    # (rank_victims breaks them toward later entries, as vLLM's running[-1]).
    want = [_CLASS_THEN_TOKENS(c) for c in naive_rank(running)]
    for max_victims in (4, MAX_VICTIMS, NUM_RUNNING):
        got = [_CLASS_THEN_TOKENS(c) for c in rank_victims(running, max_victims=max_victims)]
        assert got == want[:max_victims], f"rank_victims disagrees at max_victims={max_victims}"

    baseline_us = per_call_us(lambda: naive_rank(running), 2000)
    print(f"rank_victims over {NUM_RUNNING} running requests (µs/call):")
    for label, max_victims, calls in (
        ("typical need", 4, 2000),
        ("default cap (a quarter)", MAX_VICTIMS, 2000),
        ("every request", NUM_RUNNING, 1000),
    ):

        def rank(max_victims: int = max_victims) -> list[Candidate]:
            return rank_victims(running, max_victims=max_victims)

        us = per_call_us(rank, calls)
        print(
            f"  {label:24s} max_victims {max_victims:5d} {us:7.1f} µs "
            f"({us / baseline_us:4.2f}x baseline)"
        )
    print(
        f"  baseline sorted() of the same {NUM_RUNNING} tuples by (class, computed tokens): "
        f"{baseline_us:7.1f} µs"
    )


if __name__ == "__main__":
    main()
