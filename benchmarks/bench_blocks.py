"""Benchmark: tiered block manager eviction and preemption-victim selection.

- ``TieredBlockManager.evict_for`` with 100,000 blocks allocated over 2,000 requests in all three
  tiers: µs to evict 1,000 blocks and 1 block. Baseline in the same run: a naive policy that
  sorts every allocated block by (tier, last touch) and takes the first ones.
- ``select_preemption_victims`` over 1,024 running requests, µs per call, for a typical need
  (a few victims), a need no victim set covers at the default ``preempt_max_fraction`` (256
  victims) and at 1.0 (all 1,024 chosen; building the ``Victim`` objects then dominates).
  Baseline: ``sorted()`` over the same 1,024 ``last_touched`` keys.

Run: ``.venv/bin/python benchmarks/bench_blocks.py`` (deterministic workload, seed 0).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from meridian.config.schema import KvMemoryConfig
from meridian.core.blocks import TieredBlockManager
from meridian.core.preemption import RunningRequest, Victim, select_preemption_victims
from meridian.core.types import Phase, Tier
from timing import seconds_per_call

BLOCK_SIZE = 16384
NUM_SLOTS = 131_072
NUM_ALLOCATED = 100_000
BLOCKS_PER_REQUEST = 50
NUM_RUNNING = 1024


def build_manager(rng: random.Random) -> TieredBlockManager:
    config = KvMemoryConfig(block_size_bytes=BLOCK_SIZE, think_phase_memory_fraction=0.7)
    mgr = TieredBlockManager(config, NUM_SLOTS * BLOCK_SIZE)
    tiers = list(Tier)
    for i in range(NUM_ALLOCATED // BLOCKS_PER_REQUEST):
        mgr.allocate(f"r{i}", tiers[i % 3], BLOCKS_PER_REQUEST)
    for i in rng.sample(range(NUM_ALLOCATED // BLOCKS_PER_REQUEST), 1000):
        mgr.touch(f"r{i}")  # shuffle recency so the LRU order is not the allocation order
    mgr.check_integrity()
    return mgr


def time_evictions(mgr: TieredBlockManager, num_blocks: int, repeats: int) -> list[float]:
    """µs per ``evict_for`` freeing ``num_blocks`` more; the state is refilled between runs."""
    samples: list[float] = []
    for rep in range(repeats):
        target = mgr.num_free_blocks + num_blocks
        start = time.perf_counter_ns()
        evicted = mgr.evict_for(target)
        samples.append((time.perf_counter_ns() - start) / 1e3)
        assert len(evicted) == num_blocks
        mgr.allocate(f"refill{num_blocks}-{rep}", Tier.THINK_COMPLETE, num_blocks)
    return samples


def naive_evict(keys: list[tuple[int, int, int]], num_blocks: int) -> list[tuple[int, int, int]]:
    """Baseline: rank every allocated block by (tier, last touch, -block) and take the head."""
    return sorted(keys)[:num_blocks]


def running_requests(rng: random.Random) -> list[RunningRequest]:
    out: list[RunningRequest] = []
    for i in range(NUM_RUNNING):
        phase = rng.choice([Phase.PREFILL, Phase.THINK, Phase.THINK, Phase.OUTPUT, Phase.OUTPUT])
        think_done = phase is Phase.OUTPUT and rng.random() < 0.2
        readmitted = 990 + rng.randrange(10) if rng.random() < 0.1 else None
        out.append(
            RunningRequest(
                f"req-{i}",
                phase,
                rng.randrange(1, 200),
                rng.randrange(10**6),
                readmitted,
                think_done,
            )
        )
    return out


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median over 5 rounds of the mean µs per call."""
    return seconds_per_call(fn, calls) * 1e6


def main() -> None:
    rng = random.Random(0)
    mgr = build_manager(rng)
    print(
        f"block manager: {mgr.num_blocks} slots, {mgr.num_blocks - mgr.num_free_blocks} "
        f"allocated over {mgr.num_requests} requests "
        f"(TC {mgr.num_blocks_in_tier(Tier.THINK_COMPLETE)}, "
        f"TA {mgr.num_blocks_in_tier(Tier.THINK_ACTIVE)}, "
        f"OC {mgr.num_blocks_in_tier(Tier.OUTPUT_CRITICAL)})"
    )
    keys = [
        (int(loc.tier), mgr.last_touched(loc.request_id) or 0, -b)
        for b in range(NUM_ALLOCATED)
        for loc in (mgr.block_location(b),)
    ]
    naive_1000 = per_call_us(lambda: naive_evict(keys, 1000), 3)

    evict_1000 = statistics.median(time_evictions(mgr, 1000, 50))
    evict_1 = statistics.median(time_evictions(mgr, 1, 2000))
    mgr.check_integrity()
    print(f"evict_for 1,000 blocks: {evict_1000:9.1f} µs (median of 50)")
    print(f"evict_for 1 block:      {evict_1:9.2f} µs (median of 2,000)")
    print(
        f"baseline naive sort-all-blocks eviction of 1,000: {naive_1000:9.1f} µs "
        f"-> evict_for is {naive_1000 / evict_1000:.1f}x faster (1,000), "
        f"{naive_1000 / evict_1:.0f}x (1 block)"
    )

    running = running_requests(rng)
    total_blocks = sum(r.num_blocks for r in running)

    def typical() -> list[Victim]:
        return select_preemption_victims(256, running, step=1000, max_fraction=0.25)

    def capped() -> list[Victim]:
        return select_preemption_victims(total_blocks, running, step=1000, max_fraction=0.25)

    def everything() -> list[Victim]:
        return select_preemption_victims(total_blocks, running, step=1000, max_fraction=1.0)

    last_touched = [r.last_touched for r in running]
    baseline_us = per_call_us(lambda: sorted(last_touched), 2000)
    print(f"select_preemption_victims over {NUM_RUNNING} running requests (µs/call):")
    for label, fn, calls in (
        ("typical need", typical, 500),
        ("need > all, max_fraction 0.25", capped, 300),
        ("need > all, max_fraction 1.0", everything, 200),
    ):
        us = per_call_us(fn, calls)
        print(
            f"  {label:30s} {len(fn()):5d} victims {us:7.1f} µs ({us / baseline_us:4.1f}x baseline)"
        )
    print(f"  baseline sorted() over the same {NUM_RUNNING} keys:  {baseline_us:7.1f} µs")


if __name__ == "__main__":
    main()
