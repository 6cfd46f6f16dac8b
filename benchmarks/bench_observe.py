"""Token accounting cost per token, against a plain dict update.

Two ways a step's tokens are accounted, each over 256 requests x 2,000 steps x 1 token:

- :func:`meridian.core.state.advance_many`, the batched transition over request states (the
  logits processor's forcer calls it each step; the policy's tracker for the deltas it cannot
  count in bulk). Every request sits in THINK (its prompt ends with ``think_start``), so each
  token goes through the ``think_end`` check; Granite's 3-token marker includes partial-marker
  tokens.
- :attr:`MeridianPolicy.observe <meridian.core.policy.TrackingPolicy.observe>`, the policy's one
  observe path, as vLLM's scheduler calls it after each step: the same thinking batch (counted
  in bulk once it repeats), and a batch of answer streams (the steady step of a busy engine).

The baseline is ``d[rid] += 1`` over the same request ids, measured in the same run; the
unbatched ``advance(state, [token])`` is printed for reference.

Run: ``.venv/bin/python benchmarks/bench_observe.py``. A report, not a test: always exits 0.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from meridian.config.schema import SchedulerConfig
from meridian.core.format import ReasoningFormat
from meridian.core.policy import MeridianPolicy
from meridian.core.state import advance, advance_many, integrity_problem, start
from meridian.core.types import Phase

NUM_REQUESTS = 256
NUM_STEPS = 2_000
NUM_DISTINCT_BATCHES = 64  # token batches are pre-built and cycled, so timing excludes building
TARGET_NS = 1_000.0

QWEN3 = ReasoningFormat(think_start=(151667,), think_end=(151668,))
# Granite-style prose markers: several ids each ("Here is my thought process:" / "...response:").
GRANITE = ReasoningFormat(think_start=(8_001, 8_002, 8_003, 8_004), think_end=(8_001, 8_002, 8_005))
RIDS = [f"req-{i}" for i in range(NUM_REQUESTS)]


def _batches(fmt: ReasoningFormat, rng: random.Random) -> list[list[list[int]]]:
    """Token batches that never complete think_end; Granite's include partial-marker tokens."""
    pool = list(range(1_000, 1_100)) + list(fmt.think_end[:-1]) * 5
    return [[[rng.choice(pool)] for _ in range(NUM_REQUESTS)] for _ in range(NUM_DISTINCT_BATCHES)]


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        run()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def bench_advance_many(fmt: ReasoningFormat, rng: random.Random) -> float:
    """ns per token of advance_many over NUM_REQUESTS x NUM_STEPS single-token deltas."""
    states = [start(rid, fmt, [1, 2, 3, *fmt.think_start]) for rid in RIDS]
    batches = _batches(fmt, rng)

    def run() -> None:
        for step in range(NUM_STEPS):
            advance_many(states, batches[step % NUM_DISTINCT_BATCHES])

    elapsed = _best_of(5, run)
    if any(st.phase is not Phase.THINK or integrity_problem(st) for st in states):
        raise SystemExit("bench_observe: a request left THINK; the benchmark stream is wrong")
    return elapsed / (NUM_REQUESTS * NUM_STEPS)


def bench_policy_observe(fmt: ReasoningFormat, rng: random.Random, *, answering: bool) -> float:
    """ns per token of the policy's observe over the same steps: thinking requests (their
    prompt ends with ``think_start``) or answer streams (a plain prompt, answering from their
    first token)."""
    policy = MeridianPolicy(fmt, SchedulerConfig(), block_size=16, capacity=NUM_REQUESTS)
    prompt = [1, 2, 3] if answering else [1, 2, 3, *fmt.think_start]
    for rid in RIDS:
        policy.track(rid, prompt)
    batches = _batches(fmt, rng)
    step = 0

    def run() -> None:
        nonlocal step
        observe = policy.observe
        for i in range(NUM_STEPS):
            step += 1
            observe(RIDS, batches[i % NUM_DISTINCT_BATCHES], step)

    elapsed = _best_of(5, run)
    policy.check_integrity()
    want = Phase.OUTPUT if answering else Phase.THINK
    if any(policy.phase(rid) is not want for rid in RIDS):
        raise SystemExit("bench_observe: a request changed phase; the benchmark stream is wrong")
    if not answering and policy.tokens_by_phase(RIDS[0], step) != (step, 0):
        raise SystemExit("bench_observe: the policy lost count of a request's think tokens")
    return elapsed / (NUM_REQUESTS * NUM_STEPS)


def bench_dict_baseline() -> float:
    """ns per token of ``d[rid] += 1`` over the same request ids and steps."""
    d = dict.fromkeys(RIDS, 0)

    def run() -> None:
        for _ in range(NUM_STEPS):
            for rid in RIDS:
                d[rid] += 1

    return _best_of(5, run) / (NUM_REQUESTS * NUM_STEPS)


def bench_advance_single(fmt: ReasoningFormat) -> float:
    """ns per token of the unbatched ``advance(state, [token])``, for reference."""
    states = [start(rid, fmt, [*fmt.think_start]) for rid in RIDS]
    steps = NUM_STEPS // 4
    token = [1_000]

    def run() -> None:
        for _ in range(steps):
            for st in states:
                advance(st, token)

    return _best_of(5, run) / (NUM_REQUESTS * steps)


def main() -> None:
    rng = random.Random(0)
    baseline = bench_dict_baseline()
    rows = [
        ("advance_many, single-token markers", bench_advance_many(QWEN3, rng)),
        ("advance_many, Granite 3-token marker", bench_advance_many(GRANITE, rng)),
        (
            "policy.observe, thinking, single-token",
            bench_policy_observe(QWEN3, rng, answering=False),
        ),
        ("policy.observe, thinking, Granite", bench_policy_observe(GRANITE, rng, answering=False)),
        ("policy.observe, answer streams", bench_policy_observe(QWEN3, rng, answering=True)),
        ("advance(state, [tok]), single-token", bench_advance_single(QWEN3)),
    ]
    print(f"token accounting, {NUM_REQUESTS} requests x {NUM_STEPS} steps x 1 token")
    print(f"  {'baseline d[rid] += 1':<40}: {baseline:7.1f} ns/token")
    for name, ns in rows:
        verdict = "ok" if ns < TARGET_NS else "OVER TARGET"
        print(
            f"  {name:<40}: {ns:7.1f} ns/token  ({ns / baseline:4.1f}x baseline; "
            f"target < {TARGET_NS:.0f} ns: {verdict})"
        )


if __name__ == "__main__":
    main()
