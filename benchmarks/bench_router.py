"""Phase-router cost per token on the batched path, against a plain dict update.

Every request sits in THINK (its prompt ends with ``think_start``), so each token goes through the
``think_end`` check. Each step feeds one token per request through ``PhaseRouter.observe_many``;
the baseline is ``d[rid] += 1`` over the same request ids, measured in the same run.

Run: ``.venv/bin/python benchmarks/bench_router.py``. A report, not a test: always exits 0.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from meridian.core.router import PhaseRouter, ReasoningFormat

from meridian.core.types import Phase

NUM_REQUESTS = 256
NUM_STEPS = 2_000
NUM_DISTINCT_BATCHES = 64  # token batches are pre-built and cycled, so timing excludes building
TARGET_NS = 1_000.0

QWEN3 = ReasoningFormat(think_start=(151667,), think_end=(151668,))
# Granite-style prose markers: several ids each ("Here is my thought process:" / "...response:").
GRANITE = ReasoningFormat(think_start=(8_001, 8_002, 8_003, 8_004), think_end=(8_001, 8_002, 8_005))


def _batches(model: ReasoningFormat, rng: random.Random) -> list[list[list[int]]]:
    """Token batches that never complete think_end; Granite's include partial-marker tokens."""
    pool = list(range(1_000, 1_100)) + list(model.think_end[:-1]) * 5
    return [[[rng.choice(pool)] for _ in range(NUM_REQUESTS)] for _ in range(NUM_DISTINCT_BATCHES)]


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        run()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def bench_router(model: ReasoningFormat, rng: random.Random) -> float:
    """ns per token of observe_many over NUM_REQUESTS x NUM_STEPS single-token deltas."""
    router = PhaseRouter()
    rids = [f"req-{i}" for i in range(NUM_REQUESTS)]
    for rid in rids:
        router.start(rid, model, [1, 2, 3, *model.think_start])
    batches = _batches(model, rng)

    def run() -> None:
        observe_many = router.observe_many
        for step in range(NUM_STEPS):
            observe_many(rids, batches[step % NUM_DISTINCT_BATCHES])

    elapsed = _best_of(5, run)
    router.check_integrity()
    if any(router.phase(rid) is not Phase.THINK for rid in rids):
        raise SystemExit("bench_router: a request left THINK; the benchmark stream is wrong")
    return elapsed / (NUM_REQUESTS * NUM_STEPS)


def bench_dict_baseline() -> float:
    """ns per token of ``d[rid] += 1`` over the same request ids and steps."""
    rids = [f"req-{i}" for i in range(NUM_REQUESTS)]
    d = dict.fromkeys(rids, 0)

    def run() -> None:
        for _ in range(NUM_STEPS):
            for rid in rids:
                d[rid] += 1

    return _best_of(5, run) / (NUM_REQUESTS * NUM_STEPS)


def bench_observe_single(model: ReasoningFormat) -> float:
    """ns per token of the unbatched ``observe(rid, token_id)`` path, for reference."""
    router = PhaseRouter()
    rids = [f"req-{i}" for i in range(NUM_REQUESTS)]
    for rid in rids:
        router.start(rid, model, [*model.think_start])
    steps = NUM_STEPS // 4

    def run() -> None:
        observe = router.observe
        for _ in range(steps):
            for rid in rids:
                observe(rid, 1_000)

    return _best_of(5, run) / (NUM_REQUESTS * steps)


def main() -> None:
    rng = random.Random(0)
    baseline = bench_dict_baseline()
    single = bench_router(QWEN3, rng)
    multi = bench_router(GRANITE, rng)
    unbatched = bench_observe_single(QWEN3)
    print(f"phase router, {NUM_REQUESTS} requests x {NUM_STEPS} steps x 1 token, all in THINK")
    print(f"  baseline d[rid] += 1                : {baseline:7.1f} ns/token")
    rows = [
        ("observe_many, single-token markers", single),
        ("observe_many, Granite 3-token marker", multi),
        ("observe(rid, tok), single-token", unbatched),
    ]
    for name, ns in rows:
        verdict = "ok" if ns < TARGET_NS else "OVER TARGET"
        print(
            f"  {name:<37}: {ns:7.1f} ns/token  ({ns / baseline:4.1f}x baseline; "
            f"target < {TARGET_NS:.0f} ns: {verdict})"
        )


if __name__ == "__main__":
    main()
