# mypy: disable-error-code="import-not-found"
"""The cluster simulator on vLLM's own scheduler (``meridian bench sim --engine vllm --replicas
N``): one replica behind a router is the single-engine run, and the fast engine agrees with
vLLM's scheduler at two replicas behind each router (``meridian bench fidelity --replicas 2``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from meridian.bench.clusterrun import ClusterSpec, run_cluster
from meridian.bench.fidelity import compare
from meridian.bench.simrun import (
    SimRunSpec,
    StreamSet,
    engine_config_for,
    load_requests,
    run_policy,
    step_model_for,
)
from meridian.cli import main
from meridian.sim.policies import parse_policy
from meridian.sim.records import SimResult

SMALL = SimRunSpec(arrival_rate=24.0, duration_s=4.0, engine="vllm", async_scheduling=False)


def cluster_run(
    spec: SimRunSpec, replicas: int, router: str, policy: str, engine: str, blocks: int
) -> SimResult:
    shape = dataclasses.replace(engine_config_for(spec), num_kv_blocks=blocks)
    requests = load_requests(spec, spec.arrival_rate)
    return run_cluster(
        spec,
        ClusterSpec(replicas=replicas, routers=[router]),
        router,
        parse_policy(policy),
        StreamSet(requests, spec.config),
        engine_config=shape,
        step_model=step_model_for(spec),
        engine=engine,
    ).result


@pytest.mark.parametrize("policy", ["meridian", "vllm-fcfs"])
def test_one_replica_behind_a_router_is_the_single_engine_run(policy: str) -> None:
    spec = dataclasses.replace(SMALL, async_scheduling=True)
    requests = load_requests(spec, spec.arrival_rate)
    alone = run_policy(spec, parse_policy(policy), StreamSet(requests, spec.config))
    behind = cluster_run(
        spec, 1, "round-robin", policy, "vllm", engine_config_for(spec).num_kv_blocks
    )
    assert [r.finish_ns for r in behind.records] == [r.finish_ns for r in alone.records]
    assert behind.counters == alone.counters


@pytest.mark.parametrize(
    ("router", "policy"), [("meridian", "meridian"), ("pow2", "vllm-fcfs"), ("vllm-dp", "meridian")]
)
def test_the_fast_engine_agrees_with_vllms_scheduler_at_two_replicas(
    router: str, policy: str
) -> None:
    # A tight cache per replica, so that both engines preempt.
    model, vllm = (
        cluster_run(SMALL, 2, router, policy, engine, blocks=1500) for engine in ("model", "vllm")
    )
    row = compare(model, vllm)
    print(row.model_dump())
    assert row.passed, row
    if policy == "vllm-fcfs":
        assert sum(vllm.counters.preemptions_by_phase.values()) > 0, "no pressure: nothing checked"


def test_fidelity_command_at_two_replicas(tmp_path: Path) -> None:
    args = ["bench", "fidelity", "--replicas", "2", "--router", "meridian,pow2"]
    args += ["--policies", "meridian", "--duration-s", "3", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    text = (tmp_path / "fidelity.md").read_text()
    assert "`meridian/meridian`" in text and "`pow2/meridian`" in text
    assert "Every target met." in text
