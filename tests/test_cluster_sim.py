"""The cluster simulator on the fast engine (``meridian.sim.cluster``, ``meridian.sim.routers``):
one replica behind a router is the single-engine run, runs are deterministic per seed, every
router serves every request, Meridian's router holds what no replica has headroom for, and the
baselines choose as their systems do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from meridian.bench.clusterrun import ClusterSpec, run_cluster
from meridian.bench.simrun import (
    SimRunSpec,
    StreamSet,
    engine_config_for,
    load_requests,
    run_policy,
    step_model_for,
)
from meridian.cli import main
from meridian.core.routing import NewRequest, ReplicaStats
from meridian.core.types import Phase
from meridian.sim.cluster import ClusterRun
from meridian.sim.policies import parse_policy
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.routers import ROUTERS, make_router

SPEC = SimRunSpec(arrival_rate=30.0, duration_s=4.0)


def run(
    spec: SimRunSpec,
    replicas: int,
    router: str,
    policy: str,
    requests: list[RequestSpec],
    num_kv_blocks: int | None = None,
) -> ClusterRun:
    shape = engine_config_for(spec)
    if num_kv_blocks is not None:
        shape = dataclasses.replace(shape, num_kv_blocks=num_kv_blocks)
    return run_cluster(
        spec,
        ClusterSpec(replicas=replicas, routers=[router]),
        router,
        parse_policy(policy),
        StreamSet(requests, spec.config),
        engine_config=shape,
        step_model=step_model_for(spec),
        engine="model",
    )


@pytest.mark.parametrize("policy", ["meridian", "vllm-fcfs"])
def test_one_replica_behind_a_router_is_the_single_engine_run(policy: str) -> None:
    requests = load_requests(SPEC, SPEC.arrival_rate)
    alone = run_policy(SPEC, parse_policy(policy), StreamSet(requests, SPEC.config))
    behind = run(SPEC, 1, "round-robin", policy, requests).result
    assert [r.finish_ns for r in behind.records] == [r.finish_ns for r in alone.records]
    assert [r.answer_token_ns for r in behind.records] == [r.answer_token_ns for r in alone.records]
    assert behind.counters == alone.counters


def test_runs_are_deterministic_per_seed(tmp_path: Path) -> None:
    args = ["bench", "sim", "--replicas", "3", "--router", "all", "--duration-s", "3"]
    args += ["--arrival-rate", "20", "--policies", "meridian,vllm-fcfs", "--no-plots"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    first = (tmp_path / "a" / "report.json").read_text()
    assert first == (tmp_path / "b" / "report.json").read_text()
    for router in ROUTERS:
        assert f'"{router}/meridian"' in first and f'"{router}/vllm-fcfs"' in first
    assert main([*args, "--seed", "1", "--out-dir", str(tmp_path / "c")]) == 0
    assert first != (tmp_path / "c" / "report.json").read_text()


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_serves_every_request_on_every_replica(router: str) -> None:
    requests = load_requests(SPEC, SPEC.arrival_rate)
    cluster = run(SPEC, 4, router, "vllm-fcfs", requests, num_kv_blocks=800)
    assert all(r.finished for r in cluster.result.records)
    served = [len([r for r in replica.records]) for replica in cluster.replicas]
    assert sum(served) == len(requests)
    if router == "meridian-split":  # most requests finish on the answer-first replica
        assert min(r.counters.num_scheduled_tokens for r in cluster.replicas) > 0
    else:
        assert min(served) > 0, served
    # Tight caches: the counters are the replicas' summed.
    preempted = sum(sum(r.counters.preemptions_by_phase.values()) for r in cluster.replicas)
    assert sum(cluster.result.counters.preemptions_by_phase.values()) == preempted > 0


def burst(n: int, seed: int) -> list[RequestSpec]:
    """``n`` short requests (half reasoning) arriving over a second after a calm warm-up."""
    rng = np.random.default_rng(seed)
    specs, t = [], 0
    for i in range(n):
        t += int(rng.exponential(0.25 if i < 200 else 0.002) * 1e9)
        if i % 2:
            specs.append(RequestSpec(f"q{i:04d}", t, 50, int(rng.integers(100, 400)), 30,
                                     RequestKind.REASONING))  # fmt: skip
        else:
            specs.append(RequestSpec(f"q{i:04d}", t, 50, 0, int(rng.integers(20, 120)),
                                     RequestKind.CHAT))  # fmt: skip
    return specs


def test_meridians_router_holds_what_no_replica_has_headroom_for() -> None:
    # 2,100 blocks of 16 tokens hold about 140 of these requests (mean size about 230 tokens):
    # the replicas' admission projects, and a burst of 1,200 outgrows both replicas.
    spec = dataclasses.replace(SPEC, policies=["meridian"])
    requests = burst(1400, seed=3)
    held = run(spec, 2, "meridian-hold", "meridian", requests, num_kv_blocks=2100)
    assert all(r.finished for r in held.result.records)
    assert held.num_held > 50 and max(held.hold_s) > 0
    placed = run(spec, 2, "pow2", "meridian", requests, num_kv_blocks=2100)
    assert placed.num_held == 0
    # By default Meridian's router holds nothing; held only where vLLM's admission could not
    # take a request, fewer are held than on the projection.
    assert run(spec, 2, "meridian", "meridian", requests, num_kv_blocks=2100).num_held == 0
    admission = run(spec, 2, "meridian-hold-admission", "meridian", requests, num_kv_blocks=2100)
    assert all(r.finished for r in admission.result.records)
    assert 0 < admission.num_held < held.num_held
    # What was held at the router did not queue in a replica.
    queued = [
        max(s.num_waiting for replica in run_.replicas for s in replica.samples)
        for run_ in (held, placed)
    ]
    assert queued[0] < queued[1], queued


def stats(running: int, waiting: int, answering: int, used: int) -> ReplicaStats:
    return ReplicaStats(
        time_s=0.0,
        num_running=running,
        num_waiting=waiting,
        num_answering=answering,
        num_thinking=running - answering,
        num_kv_blocks=100,
        num_kv_blocks_used=used,
    )


THINKING = NewRequest(Phase.THINK, 10)
CHAT = NewRequest(Phase.OUTPUT, 10)


def test_the_baselines_choose_as_their_systems_do() -> None:
    # vLLM's DP score: max(in-flight, waiting + running) + waiting x 6 x max(0, kv - 0.5).
    dp = make_router("vllm-dp", 3)
    dp.observe(0, stats(10, 2, 0, 90))  # 12 + 2 x 6 x 0.4 = 16.8
    dp.observe(1, stats(15, 0, 0, 100))  # 15
    dp.observe(2, stats(13, 1, 0, 55))  # 14 + 1 x 6 x 0.05 = 14.3
    assert dp.choose(THINKING, 0.0, 0.0) == 2
    dp.routed(2, "a", THINKING, 0.0)
    # Its waiting count went up by one until the next stats: 15 + 2 x 0.3 = 15.6 > 15.
    assert dp.choose(THINKING, 0.0, 0.0) == 1
    # Pascal-like: reasoning to the fewest thinking, chat to the fewest answer streams.
    pascal = make_router("pascal-like", 2)
    pascal.observe(0, stats(10, 0, 8, 50))  # 2 thinking, 8 answering
    pascal.observe(1, stats(10, 0, 2, 50))  # 8 thinking, 2 answering
    assert pascal.choose(THINKING, 0.0, 0.0) == 0 and pascal.choose(CHAT, 0.0, 0.0) == 1
    for i in range(7):
        pascal.routed(0, f"r{i}", THINKING, 1.0)  # sent since: 0 now has 9 thinking
    assert pascal.choose(THINKING, 1.0, 0.0) == 1
    # Round robin cycles; power of two takes the shorter queue of its pair, ties to the first.
    rr = make_router("round-robin", 3, seed=5)
    picks = [rr.choose(CHAT, 0.0, 0.0) for _ in range(6)]
    assert picks[:3] == picks[3:] and sorted(picks[:3]) == [0, 1, 2]
    pow2 = make_router("pow2", 2, seed=1)
    for i in range(5):
        pow2.routed(0, f"x{i}", CHAT, 0.0)
    assert {pow2.choose(CHAT, 0.0, 0.0) for _ in range(20)} == {1}
    pow2.completed(0, "x0")
