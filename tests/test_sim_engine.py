"""The fast engine model: conservation, determinism, physics, vLLM's mechanics, and policies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import MeridianConfig, SchedulerConfig
from meridian.core.types import Phase
from meridian.sim.engine import Engine, EngineConfig, SimulationError
from meridian.sim.policies import DEFAULT_POLICIES, PolicySpec, make_sim_policy, parse_policy
from meridian.sim.presets import hardware_preset, model_preset
from meridian.sim.records import SimResult
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.state import RequestStatus
from meridian.sim.steptime import BatchShape, RooflineStepTime
from meridian.sim.streams import (
    FORCING_MERIDIAN,
    FORCING_OFF,
    Forcing,
    ForcingKind,
    Stream,
    build_streams,
)

ITL_NS = 50_000_000
CONFIG = MeridianConfig()


class LinearStepTime:
    """1 ms per step + 10 µs per token: easy to reason about."""

    label = "linear"

    def step_time_ns(self, batch: BatchShape) -> int:
        return 1_000_000 + 10_000 * (batch.num_prefill_tokens + batch.num_decode_seqs)


def make_specs(n: int, seed: int, *, gap_s: float = 0.05) -> list[RequestSpec]:
    """Alternating chat and reasoning requests with a settle point and a calm tail."""
    rng = np.random.default_rng(seed)
    specs = []
    t = 0
    for i in range(n):
        t += int(rng.exponential(gap_s) * 1e9)
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
                    ent,
                    settle,
                )
            )
        else:
            spec = RequestSpec(
                f"r{i:04d}", t, int(rng.integers(20, 200)), 0, int(rng.integers(20, 120)),
                RequestKind.CHAT,
            )  # fmt: skip
            specs.append(spec)
    return specs


def streams_for(policy: PolicySpec, specs: Sequence[RequestSpec]) -> list[Stream]:
    forcing = policy.forcing or Forcing(ForcingKind.STATIC, 700)
    return build_streams(specs, forcing, CONFIG)


def run(
    policy: str,
    specs: Sequence[RequestSpec],
    *,
    blocks: int = 400,
    seqs: int = 64,
    prefix_caching: bool = True,
    config: MeridianConfig = CONFIG,
) -> tuple[Engine, SimResult]:
    spec = parse_policy(policy)
    engine = Engine(
        EngineConfig(
            num_kv_blocks=blocks,
            max_num_seqs=seqs,
            max_num_batched_tokens=512,
            enable_prefix_caching=prefix_caching,
        ),
        LinearStepTime(),
        make_sim_policy(spec, config, ITL_NS),
    )
    return engine, engine.run(streams_for(spec, specs))


@pytest.mark.parametrize("policy", DEFAULT_POLICIES)
def test_every_request_finishes_and_tokens_are_conserved(policy: str) -> None:
    specs = make_specs(60, seed=1)
    engine, result = run(policy, specs)
    assert all(r.finished for r in result.records)
    streams = {s.request_id: s for s in streams_for(parse_policy(policy), specs)}
    work = 0
    for rec in result.records:
        stream = streams[rec.request_id]
        assert rec.num_think_tokens == stream.num_think
        assert rec.num_answer_tokens == rec.num_answer_tokens_requested
        assert len(rec.answer_token_ns) == rec.num_answer_tokens
        assert rec.first_token_ns is not None and rec.first_token_ns >= rec.arrival_ns
        # Each token computed once, plus what preemptions made it compute again.
        work += rec.num_prompt_tokens + stream.num_output_tokens - 1 + rec.num_recomputed_tokens
    assert work == result.counters.num_scheduled_tokens
    assert not engine.running and engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    engine.pool.check_integrity()


def test_same_seed_same_result_different_seed_differs() -> None:
    a = run("meridian", make_specs(40, seed=3))[1]
    b = run("meridian", make_specs(40, seed=3))[1]
    c = run("meridian", make_specs(40, seed=4))[1]
    assert [r.finish_ns for r in a.records] == [r.finish_ns for r in b.records]
    assert [r.finish_ns for r in a.records] != [r.finish_ns for r in c.records]


def test_forcing_is_held_equal_across_schedulers() -> None:
    specs = make_specs(40, seed=2)
    think = {}
    for name in ("meridian", "vllm-fcfs+forcing", "pascal+forcing", "vllm-priority+forcing"):
        think[name] = [r.num_think_tokens for r in run(name, specs)[1].records]
    assert len({tuple(v) for v in think.values()}) == 1
    off = [r.num_think_tokens for r in run("vllm-fcfs", specs)[1].records]
    assert sum(think["meridian"]) < sum(off)


class Physics(Engine):
    """Checks, after every step, that a running request holds the KV of all it computed, and
    that a step reads the whole context of every row."""

    def _start_step(self) -> int:
        duration = super()._start_step()
        for req, n in self._scheduled:
            held = self.pool.num_held(req.request_id)
            assert held >= self.pool.blocks_for(req.num_computed_tokens + n)
        if isinstance(self.step_model, Recorder):
            # Every row attends over its whole context: prompt, reasoning and answer so far.
            context = sum(req.num_computed_tokens + n for req, n in self._scheduled)
            assert self.step_model.batches[-1].num_kv_tokens_read == context
        return duration

    def _finish_step(self) -> None:
        super()._finish_step()
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
            assert self.pool.num_held(req.request_id) >= self.pool.blocks_for(
                req.num_computed_tokens
            )


class PhaseAware(Physics):
    """Also checks Meridian's promise at every preemption: an answer stream is a victim only
    when no thinking request holds KV; and that a step whose order the policy left to the
    engine (no order could change it) schedules every running request in full, preempting
    nobody."""

    def _start_step(self) -> int:
        core = self.policy.core  # type: ignore[attr-defined]
        kept = core.stats.num_engine_order_steps
        wanted = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        preempted = sum(self.counters.preemptions_by_phase.values())
        duration = super()._start_step()
        if core.stats.num_engine_order_steps > kept:
            assert sum(self.counters.preemptions_by_phase.values()) == preempted
            scheduled = {r.request_id: n for r, n in self._scheduled}
            assert all(scheduled.get(rid) == n for rid, n in wanted.items())
        return duration

    def _preempt(self, req, scheduled):  # type: ignore[no-untyped-def]
        if req.phase is Phase.OUTPUT:
            thinking = [
                r for r in self.running if r.phase is Phase.THINK and r.num_computed_tokens > 0
            ]
            assert not thinking, (
                f"answer {req.request_id} preempted before {thinking[0].request_id}"
            )
        return super()._preempt(req, scheduled)


class Recorder:
    """A step model that records every batch (and costs what LinearStepTime costs)."""

    label = "recorder"

    def __init__(self) -> None:
        self.batches: list[BatchShape] = []

    def step_time_ns(self, batch: BatchShape) -> int:
        self.batches.append(batch)
        return LinearStepTime().step_time_ns(batch)


@pytest.mark.parametrize("policy", ["meridian", "vllm-fcfs", "pascal"])
def test_a_live_requests_kv_stays_resident_and_is_read_every_step(policy: str) -> None:
    spec = parse_policy(policy)
    specs = make_specs(50, seed=5, gap_s=0.01)
    recorder = Recorder()
    engine = Physics(
        EngineConfig(num_kv_blocks=300, max_num_seqs=32, max_num_batched_tokens=512),
        recorder,
        make_sim_policy(spec, CONFIG, ITL_NS),
    )
    engine.run(streams_for(spec, specs))
    # kv read >= every row's tokens: each row attends over at least what it adds.
    assert all(
        b.num_kv_tokens_read >= b.num_prefill_tokens + b.num_decode_seqs for b in recorder.batches
    )
    # Under this pressure every policy preempts: the check above ran through preemptions.
    assert sum(engine.counters.preemptions_by_phase.values()) > 0


def test_under_pressure_meridian_preempts_think_before_answers() -> None:
    specs = make_specs(80, seed=7, gap_s=0.01)
    _, fcfs = run("vllm-fcfs", specs, blocks=250, seqs=32)
    _, meridian = run("meridian-sched", specs, blocks=250, seqs=32)
    assert fcfs.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) > 0
    assert meridian.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) == 0
    assert meridian.counters.preemptions_by_phase.get(Phase.THINK, 0) > 0


def test_the_engine_order_is_kept_only_where_it_changes_nothing() -> None:
    """Under pressure some steps need Meridian's order and others cannot be changed by any
    order: PhaseAware checks each of the latter schedules everyone in full, preempting nobody."""
    specs = make_specs(80, seed=7, gap_s=0.01)
    spec = parse_policy("meridian-sched")
    engine = PhaseAware(
        EngineConfig(num_kv_blocks=250, max_num_seqs=32, max_num_batched_tokens=512),
        LinearStepTime(),
        make_sim_policy(spec, CONFIG, ITL_NS),
    )
    result = engine.run(streams_for(spec, specs))
    stats = engine.policy.core.stats  # type: ignore[attr-defined]
    assert stats.num_engine_order_steps > 0 and stats.num_reordered_steps > 0
    assert result.counters.preemptions_by_phase.get(Phase.THINK, 0) > 0
    assert result.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) == 0


def test_headroom_admission_turns_preemption_into_queueing(monkeypatch: pytest.MonkeyPatch) -> None:
    # 250 blocks hold a few of these requests; headroom would stand aside (MIN_REQUESTS_IN_CACHE).
    monkeypatch.setattr("meridian.core.admission.MIN_REQUESTS_IN_CACHE", 1)
    specs = make_specs(300, seed=7, gap_s=0.01)
    stock = MeridianConfig(scheduler=SchedulerConfig(admission="vllm"))
    plain, unheld = run("meridian-sched", specs, blocks=250, seqs=32, config=stock)
    engine, held = run("meridian-sched", specs, blocks=250, seqs=32)
    assert all(r.finished for r in held.records)
    assert engine.policy.core.stats.num_admissions_held > 0  # type: ignore[attr-defined]
    assert plain.policy.core.stats.num_admissions_held == 0  # type: ignore[attr-defined]
    before = sum(unheld.counters.preemptions_by_phase.values())
    after = sum(held.counters.preemptions_by_phase.values())
    print(
        f"preemptions {before} -> {after}; recomputed tokens "
        f"{unheld.counters.num_recomputed_tokens} -> {held.counters.num_recomputed_tokens}"
    )
    assert after < before / 2
    assert held.counters.num_recomputed_tokens < unheld.counters.num_recomputed_tokens


def test_pascal_preempts_answers_first_and_paces_their_delivery() -> None:
    specs = make_specs(80, seed=7, gap_s=0.01)
    _, pascal = run("pascal", specs, blocks=250, seqs=32)
    assert pascal.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) > 0
    for rec in pascal.records:
        gaps = np.diff(rec.answer_token_ns)
        assert (gaps >= ITL_NS).all()  # delivered no faster than the pacer's interval


def test_prefix_cache_hits_on_readmission_save_recompute() -> None:
    specs = make_specs(80, seed=7, gap_s=0.01)
    _, cached = run("vllm-fcfs", specs, blocks=250, seqs=32, prefix_caching=True)
    _, uncached = run("vllm-fcfs", specs, blocks=250, seqs=32, prefix_caching=False)
    assert uncached.counters.num_recomputed_tokens > 0
    assert cached.counters.num_recomputed_tokens < uncached.counters.num_recomputed_tokens


def test_vllm_priority_admits_chat_before_reasoning() -> None:
    # Two arrivals at the same instant, room for one at a time: priority takes the chat first.
    specs = [
        RequestSpec("think", 0, 40, 50, 10, RequestKind.REASONING),
        RequestSpec("chat", 0, 40, 0, 10, RequestKind.CHAT),
    ]
    _, priority = run("vllm-priority", specs, blocks=400, seqs=1)
    _, fcfs = run("vllm-fcfs", specs, blocks=400, seqs=1)
    first = {r.request_id: r.first_token_ns for r in priority.records}
    assert first["chat"] < first["think"]
    first_fcfs = {r.request_id: r.first_token_ns for r in fcfs.records}
    assert first_fcfs["think"] < first_fcfs["chat"]


def test_meridian_starts_chat_first_and_pascal_in_arrival_order() -> None:
    # Two arrivals at the same instant, room for one at a time. Meridian's default admission
    # order takes the chat request first; Pascal keeps vLLM's order (it gates no admission).
    specs = [
        RequestSpec("think", 0, 40, 50, 10, RequestKind.REASONING),
        RequestSpec("chat", 0, 40, 0, 10, RequestKind.CHAT),
    ]
    for policy, first in (("meridian-sched", "chat"), ("pascal", "think")):
        _, result = run(policy, specs, blocks=400, seqs=1)
        started = min(result.records, key=lambda r: r.first_token_ns or 0)
        assert started.request_id == first, policy


def test_a_request_larger_than_the_cache_is_a_clear_error() -> None:
    specs = [RequestSpec("huge", 0, 10_000, 0, 10, RequestKind.CHAT)]
    with pytest.raises(SimulationError, match="needs 10010 tokens of KV but the whole cache"):
        run("vllm-fcfs", specs, blocks=50)
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 2"):
        EngineConfig(num_kv_blocks=1)


def test_roofline_engine_runs_on_presets() -> None:
    step = RooflineStepTime(hardware_preset("h100-sxm"), model_preset("qwen3-8b"))
    spec = parse_policy("meridian")
    engine = Engine(EngineConfig(num_kv_blocks=4000), step, make_sim_policy(spec, CONFIG, ITL_NS))
    result = engine.run(build_streams(make_specs(30, seed=9), FORCING_MERIDIAN, CONFIG))
    assert all(r.finished for r in result.records)
    assert result.engine == "model" and result.policy == "meridian"


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["meridian", "meridian-sched", "vllm-fcfs", "pascal", "vllm-priority"]),
    st.integers(120, 500),
    st.integers(2, 24),
)
def test_random_workloads_keep_the_policy_and_pool_consistent(
    seed: int, policy: str, blocks: int, seqs: int
) -> None:
    """The policy's invariants hold through the fast engine's adapter on random pressure."""
    specs = make_specs(30, seed=seed, gap_s=0.02)
    spec = parse_policy(policy)
    sim_policy = make_sim_policy(spec, CONFIG, ITL_NS)
    engine_class = PhaseAware if policy.startswith("meridian") else Physics
    engine = engine_class(
        EngineConfig(num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=256),
        LinearStepTime(),
        sim_policy,
    )
    result = engine.run(build_streams(specs, FORCING_OFF, CONFIG))
    assert all(r.finished for r in result.records)
    core = getattr(sim_policy, "_core", None)
    if core is not None:
        core.check_integrity()
        assert core.num_tracked == 0
        # The policy counted what the engine did.
        for phase in (Phase.THINK, Phase.OUTPUT):
            assert core.stats.num_preemptions[phase] == result.counters.preemptions_by_phase.get(
                phase, 0
            )


def test_the_policy_sees_each_prompt_whole_as_vllm_hands_it_over() -> None:
    # Admission learns a finished request's size (prompt and output) and projects a running
    # one's progress from its prompt length: the fast engine must hand the policy the whole
    # prompt, as vLLM's scheduler does (a prompt's tail alone made every prompt one token).
    specs = make_specs(60, seed=3)
    engine, result = run("meridian-sched", specs)
    streams = {s.request_id: s for s in streams_for(parse_policy("meridian-sched"), specs)}
    sizes = [r.num_prompt_tokens + streams[r.request_id].num_output_tokens for r in result.records]
    lengths = engine.policy.core.admission.lengths  # type: ignore[attr-defined]
    assert min(r.num_prompt_tokens for r in result.records) > 1
    assert lengths.mean_request_tokens == pytest.approx(sum(sizes) / len(sizes))
