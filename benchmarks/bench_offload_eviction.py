# mypy: disable-error-code="import-not-found"
"""The host tier's eviction order, ablated: vLLM's LRU against Meridian's ``ReasoningFirstPolicy``
(finished requests' generated blocks evicted first), on vLLM's own scheduler in the simulator.

Workload: the synthetic workload at 24 req/s for ``--duration-s`` seconds (default 5), H100 /
Qwen3-8B roofline, a KV cache squeezed to 1,200 blocks so vLLM preempts, Meridian's scheduling
without forcing; vLLM's ``OffloadingConnector`` as ``meridian serve --kv-offload-gib`` sets it
up, with host tiers of ``--tiers`` blocks (small enough to fill) over a 51.2 GB/s host link.
Only the eviction order differs between the two runs of a tier. Printed per tier and order:
recomputed tokens, computed tokens, KV blocks reloaded and stored, preemptions and the
makespan (virtual time), and the ratio of recomputed tokens against LRU in the same run. Every
figure is an exact count from vLLM's scheduler on virtual time.

Run from the repo root: ``.venv-vllm/bin/python benchmarks/bench_offload_eviction.py
[--duration-s 5] [--tiers 1000,3000]``.
"""

from __future__ import annotations

import argparse
import dataclasses

from meridian.bench.simrun import (
    SimRunSpec,
    StreamSet,
    engine_config_for,
    load_requests,
    run_policy,
)
from meridian.sim.policies import parse_policy
from meridian.sim.records import SimResult

ORDERS = ("lru", "reasoning-first")


def run(duration_s: float, tier_blocks: int) -> dict[str, SimResult]:
    """Both eviction orders on the same streams, with a host tier of ``tier_blocks``."""
    spec = SimRunSpec(arrival_rate=24.0, duration_s=duration_s, engine="vllm")
    streams = StreamSet(load_requests(spec, spec.arrival_rate), spec.config)
    base = dataclasses.replace(
        engine_config_for(spec),
        num_kv_blocks=1200,
        host_link_bytes_per_s=51.2e9,
        kv_offload_blocks=tier_blocks,
    )
    return {
        order: run_policy(spec, parse_policy("meridian-sched"), streams,
                          engine_config=dataclasses.replace(base, kv_offload_eviction=order))
        for order in ORDERS
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds of arrivals (5)")
    parser.add_argument(
        "--tiers", default="1000,3000", help="host tier sizes in blocks (1000,3000)"
    )
    args = parser.parse_args()
    print(
        f"{'tier':>6} {'eviction':<16} {'recomputed':>10} {'computed':>9} {'reloaded':>8} "
        f"{'stored':>7} {'preempt':>7} {'makespan s':>10}"
    )
    for tier in (int(t) for t in args.tiers.split(",")):
        results = run(args.duration_s, tier)
        for order, result in results.items():
            c = result.counters
            print(
                f"{tier:>6} {order:<16} {c.num_recomputed_tokens:>10} "
                f"{c.num_scheduled_tokens:>9} {c.num_offload_loaded_blocks:>8} "
                f"{c.num_offload_stored_blocks:>7} {sum(c.preemptions_by_phase.values()):>7} "
                f"{result.end_ns / 1e9:>10.2f}"
            )
        lru, ours = (results[o].counters.num_recomputed_tokens for o in ORDERS)
        print(f"{tier:>6} reasoning-first / lru recomputed tokens: {ours / max(lru, 1):.3f}x")


if __name__ == "__main__":
    main()
