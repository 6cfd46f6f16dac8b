"""The simulated engine: determinism, conservation, no leaks, phase-aware preemption."""

from __future__ import annotations

import numpy as np
import pytest

from meridian.config import MeridianConfig
from meridian.core.types import Phase
from meridian.sim.engine import Engine, EngineConfig, SimulationError
from meridian.sim.fabric import fabric_model
from meridian.sim.policies import POLICIES, make_policy
from meridian.sim.presets import hardware_preset, model_preset
from meridian.sim.records import SimResult
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.state import SimRequest
from meridian.sim.steptime import BatchShape, RooflineStepTime

ITL_NS = 50_000_000


class LinearStepTime:
    """1 ms per step + 10 µs per token: easy to reason about."""

    label = "linear"

    def step_time_ns(self, batch: BatchShape) -> int:
        return 1_000_000 + 10_000 * (batch.num_prefill_tokens + batch.num_decode_seqs)


def make_specs(n: int, seed: int, *, settled_entropy: bool = True) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    specs = []
    t = 0
    for i in range(n):
        t += int(rng.exponential(0.05) * 1e9)
        if i % 2:
            think = int(rng.integers(600, 1500))
            settle = think // 3
            noise = rng.normal(0, 0.4, think)
            noise[settle:] = rng.normal(0, 0.005, think - settle)
            ent = (1.2 + noise).clip(0.01).astype(np.float32)
            specs.append(
                RequestSpec(
                    f"r{i:04d}",
                    t,
                    int(rng.integers(20, 200)),
                    think,
                    int(rng.integers(20, 120)),
                    RequestKind.REASONING,
                    ent if settled_entropy else None,
                    settle,
                )
            )
        else:
            specs.append(
                RequestSpec(
                    f"r{i:04d}",
                    t,
                    int(rng.integers(20, 200)),
                    0,
                    int(rng.integers(20, 120)),
                    RequestKind.CHAT,
                )
            )
    return specs


def run(policy: str, specs: list[RequestSpec], blocks: int = 400, seqs: int = 64):  # type: ignore[no-untyped-def]
    engine = Engine(
        EngineConfig(
            num_kv_blocks=blocks,
            max_num_seqs=seqs,
            max_num_batched_tokens=512,
            fabric=fabric_model("rdma"),
        ),
        LinearStepTime(),
        make_policy(policy, MeridianConfig(), ITL_NS),
    )
    return engine, engine.run(specs)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_finishes_and_tokens_are_conserved(policy: str) -> None:
    specs = make_specs(60, seed=1)
    engine, result = run(policy, specs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # no leaked blocks
    assert engine.router.tracked_requests == 0
    assert len(result.records) == len(specs)
    for spec, rec in zip(specs, result.records, strict=True):
        assert rec.finished
        assert rec.num_answer_tokens == spec.num_answer_tokens == len(rec.answer_token_ns)
        saved = spec.num_think_tokens - rec.num_think_tokens
        assert saved >= 0
        if rec.forced_reason is None:
            assert saved == 0  # tokens generated == tokens requested minus forced savings
        if spec.kind is RequestKind.REASONING:
            assert rec.think_end_ns is not None and rec.first_answer_ns is not None
            assert rec.think_end_ns < rec.first_answer_ns
        assert rec.answer_token_ns == sorted(rec.answer_token_ns)
        assert rec.first_token_ns is not None and rec.first_token_ns >= spec.arrival_ns


def test_same_seed_same_result_different_seed_differs() -> None:
    a = run("meridian", make_specs(40, seed=3))[1]
    b = run("meridian", make_specs(40, seed=3))[1]
    c = run("meridian", make_specs(40, seed=4))[1]
    key = [(r.request_id, r.finish_ns, r.answer_token_ns, r.forced_reason) for r in a.records]
    assert key == [
        (r.request_id, r.finish_ns, r.answer_token_ns, r.forced_reason) for r in b.records
    ]
    assert a.end_ns == b.end_ns and a.samples == b.samples
    assert a.end_ns != c.end_ns


def test_meridian_forces_after_the_settle_point_and_saves_tokens() -> None:
    specs = make_specs(40, seed=5)
    _, meridian = run("meridian", specs)
    _, fcfs = run("vllm-fcfs", specs)
    forced = [r for r in meridian.records if r.forced_reason is not None]
    assert forced, "the settled entropy traces must trigger convergence forcing"
    assert all(r.num_think_tokens >= 512 for r in forced)  # min_think_tokens floor
    think = sum(r.num_think_tokens for r in meridian.records)
    assert think < sum(r.num_think_tokens for r in fcfs.records)
    assert not any(r.forced_reason for r in fcfs.records)


def test_static_budget_caps_think_tokens() -> None:
    specs = make_specs(30, seed=6)
    _, result = run("static-budget", specs)
    for spec, rec in zip(specs, result.records, strict=True):
        assert rec.num_think_tokens == min(spec.num_think_tokens, 4096)


class RecordingEngine(Engine):
    """Notes, at every preemption of an answering request, whether a think request held KV."""

    avoidable: int = 0

    def _preempt(self, req: SimRequest) -> None:
        if req.phase is Phase.OUTPUT and any(
            r.phase is Phase.THINK and r.num_blocks > 0 for r in self.running
        ):
            self.avoidable += 1
        super()._preempt(req)


def test_under_pressure_meridian_preempts_think_before_answers() -> None:
    specs = make_specs(80, seed=7, settled_entropy=False)
    counts = {}
    for policy in ("vllm-fcfs", "meridian"):
        engine = RecordingEngine(
            EngineConfig(num_kv_blocks=260, max_num_seqs=64, max_num_batched_tokens=512),
            LinearStepTime(),
            make_policy(policy, MeridianConfig(), ITL_NS),
        )
        result = engine.run(specs)
        counts[policy] = (engine.avoidable, result.counters.preemptions_by_phase)
    fcfs_avoidable, fcfs_preemptions = counts["vllm-fcfs"]
    meridian_avoidable, meridian_preemptions = counts["meridian"]
    # Stock vLLM preempts answer streams while thinking requests hold KV; Meridian never does
    # (it takes an answer stream only when no think-phase request holds a block).
    assert fcfs_avoidable > 0
    assert meridian_avoidable == 0
    assert meridian_preemptions.get(Phase.THINK, 0) > 0
    assert meridian_preemptions.get(Phase.OUTPUT, 0) < fcfs_preemptions.get(Phase.OUTPUT, 0)


def test_a_request_larger_than_the_cache_is_a_clear_error() -> None:
    spec = RequestSpec("big", 0, 5000, 0, 10, RequestKind.CHAT)
    engine = Engine(
        EngineConfig(num_kv_blocks=10),
        LinearStepTime(),
        make_policy("vllm-fcfs", MeridianConfig(), ITL_NS),
    )
    with pytest.raises(SimulationError, match="request big needs 5011 tokens of KV"):
        engine.run([spec])


def test_roofline_engine_runs_on_presets() -> None:
    model = RooflineStepTime(hardware_preset("h100-sxm"), model_preset("qwen3-8b"))
    engine = Engine(
        EngineConfig(num_kv_blocks=2000), model, make_policy("meridian", MeridianConfig(), ITL_NS)
    )
    result = engine.run(make_specs(20, seed=8))
    assert all(r.finished for r in result.records)
    assert result.counters.num_steps == len(result.samples)


def test_disagg_offloads_think_kv_and_pulls_it_back_instead_of_recomputing() -> None:
    specs = make_specs(80, seed=7, settled_entropy=False)
    results = {}
    for policy in ("meridian", "meridian-disagg"):
        engine = Engine(
            EngineConfig(
                num_kv_blocks=260,
                max_num_seqs=64,
                max_num_batched_tokens=512,
                fabric=fabric_model("rdma"),
            ),
            LinearStepTime(),
            make_policy(policy, MeridianConfig(), ITL_NS),
        )
        results[policy] = engine.run(specs)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing leaked
        assert all(r.finished for r in results[policy].records)
    plain, disagg = results["meridian"], results["meridian-disagg"]
    assert plain.counters.num_offloaded_blocks == 0
    assert disagg.counters.num_offloaded_blocks > 0

    # Freed local slots let more requests run at once, and the run ends sooner.
    def mean_running(result: SimResult) -> float:
        return sum(s.num_running for s in result.samples) / len(result.samples)

    assert mean_running(disagg) > mean_running(plain)
    assert disagg.end_ns < plain.end_ns
    for a, b in zip(plain.records, disagg.records, strict=True):
        assert a.num_answer_tokens == b.num_answer_tokens


def test_a_policy_that_offloads_needs_a_fabric() -> None:
    engine = Engine(
        EngineConfig(num_kv_blocks=100),
        LinearStepTime(),
        make_policy("meridian-disagg", MeridianConfig(), ITL_NS),
    )
    with pytest.raises(SimulationError, match="offloads KV but has no fabric"):
        engine.run(make_specs(2, seed=1))


def test_resumed_requests_pull_offloaded_blocks_instead_of_recomputing() -> None:
    # Four long answers after short think phases in a cache too small for all: answer streams
    # must be preempted. With a KV pool, their think KV is pulled back, not recomputed.
    specs = [RequestSpec(f"t{i}", i * 1000, 32, 300, 600, RequestKind.REASONING) for i in range(4)]
    plain = run("meridian", specs, blocks=90)[1]
    disagg = run("meridian-disagg", specs, blocks=90)[1]
    assert disagg.counters.num_ingested_blocks > 0
    assert disagg.counters.num_recomputed_tokens < plain.counters.num_recomputed_tokens
    assert disagg.end_ns < plain.end_ns
