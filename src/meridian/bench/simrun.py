"""Run the simulator for several policies on one workload, and build the reports.

This is the library behind ``meridian bench sim`` and ``meridian bench fidelity``: it resolves
presets and vLLM's defaults, sizes the KV cache, loads or generates the workload once, builds
each forcing's streams once, runs every policy on them (same requests, same seed) on the chosen
engine, and turns the results into the report models of :mod:`meridian.bench.report`.

Engines: ``vllm`` is vLLM's own scheduler on virtual time (:mod:`meridian.sim.vllm_engine`; it
needs the vLLM environment); ``model`` is the fast engine model (:mod:`meridian.sim.engine`),
checked against it by ``meridian bench fidelity``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from meridian.bench.loads import nested
from meridian.bench.offered import offered_load
from meridian.bench.report import ForcingSummary, SimReport
from meridian.bench.slo import IdleLatency, SloSpec, Window
from meridian.bench.summary import PolicySummary, summarize
from meridian.bench.traces import read_trace
from meridian.bench.workloads import WORKLOADS, WorkloadParams, generate_workload, is_bundled
from meridian.config.schema import MeridianConfig
from meridian.errors import ConfigError, MeridianError
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.policies import DEFAULT_POLICIES, PolicySpec, make_sim_policy, parse_policy
from meridian.sim.presets import hardware_preset, model_preset, vllm_defaults
from meridian.sim.records import SimResult
from meridian.sim.request import RequestSpec
from meridian.sim.steptime import FittedStepTime, RooflineStepTime, StepTimeModel
from meridian.sim.streams import (
    FORCING_MERIDIAN,
    FORCING_OFF,
    Forcing,
    ForcingKind,
    Stream,
    build_streams,
    matched_static_cap,
)

ENGINES = ("vllm", "model")
# The most KV blocks one run simulates, over all its replicas: both engines hold an object a block
# (vLLM's block pool about 130 bytes, the fast engine's free queue about 120), so 2**22 blocks take
# about half a GiB and seconds to build. An 8B model's KV at 16 tokens a block fills 2**22 blocks
# with 9.9 TB, four times the HBM of the largest single node today (2.3 TB).
MAX_SIM_KV_BLOCKS = 2**22
CANDIDATE = "meridian"
# The static caps of the forcing table (besides the matched one).
STATIC_CAP_SWEEP = (1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class SimRunSpec:
    """Everything one ``bench sim`` run depends on (a run is a function of this and the seed).

    ``max_num_seqs``/``max_num_batched_tokens`` default (``None``) to vLLM's own defaults on the
    hardware; ``async_scheduling`` ``None`` to vLLM's default on a GPU (on) for the vLLM engine
    (the fast engine models synchronous scheduling only). ``warmup_s``: arrivals before it are
    in no statistic (:class:`~meridian.bench.slo.Window`). ``trace_rate``: draw a bundled
    workload at this rate and thin it to the run's (:mod:`meridian.bench.loads`; ``None``: draw
    it at the run's rate). ``answer_pace_s``: the answer ITL Pascal's token pacer holds (a
    policy's setting, not an SLO).
    """

    workload: str = "synthetic"
    arrival_rate: float = 8.0
    duration_s: float = 30.0
    seed: int = 0
    hardware: str = "h100-sxm"
    model: str = "qwen3-8b"
    policies: Sequence[str] = DEFAULT_POLICIES
    config: MeridianConfig = field(default_factory=MeridianConfig)
    slo: SloSpec = field(default_factory=SloSpec)
    engine: str = "model"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True
    step_time_csv: Path | None = None
    kv_offload_gib: float | None = None
    warmup_s: float = 0.0
    trace_rate: float | None = None
    answer_pace_s: float = 0.050

    def __post_init__(self) -> None:
        if is_bundled(self.workload):
            Window.of_run(self.duration_s, self.warmup_s)  # a clear error before anything runs
        if self.engine not in ENGINES:
            raise MeridianError(
                f"--engine must be one of {', '.join(ENGINES)}; got {self.engine!r}"
            )
        if self.kv_offload_gib is not None and self.engine != "vllm":
            raise MeridianError(
                "--kv-offload-gib drives vLLM's OffloadingConnector: it needs --engine vllm"
            )
        if self.engine == "model" and self.async_scheduling:
            raise MeridianError(
                "--engine model models synchronous scheduling only; use --engine vllm for "
                "asynchronous scheduling"
            )
        for name in self.policies:
            parse_policy(name)  # a clear error for an unknown name, before anything runs

    @property
    def policy_specs(self) -> list[PolicySpec]:
        return [parse_policy(name) for name in self.policies]

    @property
    def effective_async(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.engine == "vllm"


def load_requests(spec: SimRunSpec, arrival_rate: float) -> list[RequestSpec]:
    """The workload's requests: a bundled generator by name (thinned from ``spec.trace_rate``
    when set), or a JSONL trace file by path."""
    if is_bundled(spec.workload) and spec.trace_rate is not None:
        return nested(spec.workload, spec.trace_rate, arrival_rate, spec.duration_s, spec.seed)
    if is_bundled(spec.workload):
        params = WorkloadParams(
            arrival_rate=arrival_rate, duration_s=spec.duration_s, seed=spec.seed
        )
        return generate_workload(spec.workload, params)
    path = Path(spec.workload)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return read_trace(path)
    raise MeridianError(
        f"--workload: {spec.workload!r} is neither a bundled workload ({', '.join(WORKLOADS)}) "
        f"nor an existing trace file (.jsonl)"
    )


def window_for(spec: SimRunSpec, requests: Sequence[RequestSpec]) -> Window:
    """The measured window: a bundled workload's arrivals from the warm-up to its duration, a
    trace's from the warm-up to its last arrival."""
    if is_bundled(spec.workload):
        return Window.of_run(spec.duration_s, spec.warmup_s)
    return Window.spanning((r.arrival_ns for r in requests), spec.warmup_s)


def idle_latency_for(engine_config: EngineConfig, step_model: StepTimeModel) -> IdleLatency:
    """A request's latency alone on an engine of this shape, by this step-time model."""
    return IdleLatency(step_model, engine_config.max_num_batched_tokens)


def step_model_for(spec: SimRunSpec) -> StepTimeModel:
    """The roofline preset, or a model fitted to the user's CSV of measured steps."""
    if spec.step_time_csv is not None:
        return FittedStepTime.from_csv(spec.step_time_csv)
    return RooflineStepTime(hardware_preset(spec.hardware), model_preset(spec.model))


def engine_config_for(spec: SimRunSpec, replicas: int = 1) -> EngineConfig:
    """The engine's shape at vLLM's defaults for the hardware (unless overridden). The KV cache:
    ``kv_memory.capacity_bytes``, or "auto" = vLLM's ``gpu_memory_utilization`` of the device's
    memory minus the model's weights (activation memory is not taken out: an assumption).
    Raises :class:`ConfigError` when ``replicas`` engines of this shape would hold more than
    :data:`MAX_SIM_KV_BLOCKS` blocks."""
    hw, model = hardware_preset(spec.hardware), model_preset(spec.model)
    defaults = vllm_defaults(spec.hardware)
    kv = spec.config.kv_memory
    if kv.capacity_bytes == "auto":
        capacity = kv.resolve_capacity_bytes(hw.memory_bytes) - model.weight_bytes
        if capacity <= 0:
            raise ConfigError(
                f"model {model.name} ({model.weight_bytes / 2**30:.1f} GiB of weights) leaves no "
                f"KV memory on {hw.name}; pick a larger --hardware or set kv_memory.capacity_bytes"
            )
    else:
        capacity = kv.capacity_bytes
    block_bytes = model.kv_bytes_per_token * kv.block_size_tokens
    num_blocks = capacity // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"kv_memory.capacity_bytes ({capacity}) holds fewer than 2 blocks of "
            f"kv_memory.block_size_tokens ({kv.block_size_tokens}) tokens of {model.name} "
            f"({block_bytes} bytes each)"
        )
    if num_blocks * replicas > MAX_SIM_KV_BLOCKS:
        each = f" on each of {replicas} replicas" if replicas > 1 else ""
        raise ConfigError(
            f"kv_memory.capacity_bytes ({capacity}) makes {num_blocks:,} KV blocks of "
            f"kv_memory.block_size_tokens ({kv.block_size_tokens}) tokens of {model.name}{each}; "
            f"the simulator holds at most {MAX_SIM_KV_BLOCKS:,} blocks in all (an object each): "
            "lower capacity_bytes or raise block_size_tokens"
        )
    offload_blocks = 0
    if spec.kv_offload_gib is not None:
        offload_blocks = int(spec.kv_offload_gib * 2**30) // block_bytes
        if offload_blocks < 1:
            raise ConfigError(
                f"--kv-offload-gib {spec.kv_offload_gib} holds no KV block of {model.name} "
                f"({block_bytes} bytes each)"
            )
        if hw.host_link_bandwidth <= 0:
            raise ConfigError(f"hardware.{hw.name}.host_link_bandwidth is unknown: no offload")
    return EngineConfig(
        num_kv_blocks=num_blocks,
        block_size_tokens=kv.block_size_tokens,
        kv_bytes_per_token=model.kv_bytes_per_token,
        max_num_batched_tokens=spec.max_num_batched_tokens or defaults.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs or defaults.max_num_seqs,
        enable_prefix_caching=spec.enable_prefix_caching,
        async_scheduling=spec.effective_async,
        kv_offload_blocks=offload_blocks,
        host_link_bytes_per_s=hw.host_link_bandwidth * hw.bandwidth_efficiency,
    )


class StreamSet:
    """Each forcing's streams of one workload, built once and shared by every policy."""

    def __init__(self, requests: Sequence[RequestSpec], config: MeridianConfig) -> None:
        self.requests = list(requests)
        self.config = config
        self._streams: dict[str, list[Stream]] = {}

    def streams(self, forcing: Forcing) -> list[Stream]:
        label = forcing.label
        if label not in self._streams:
            self._streams[label] = build_streams(self.requests, forcing, self.config)
        return self._streams[label]

    def matched_cap(self) -> int:
        """The static cap whose think-token saving matches Meridian's forcing."""
        forced = sum(s.num_think for s in self.streams(FORCING_MERIDIAN))
        return matched_static_cap(self.requests, forced)

    def forcing_of(self, spec: PolicySpec) -> Forcing:
        if spec.forcing is not None:
            return spec.forcing
        return Forcing(ForcingKind.STATIC, self.matched_cap())


def forcing_summaries(streams: StreamSet, static_caps: Sequence[int]) -> list[ForcingSummary]:
    """Forcing apart from scheduling: think tokens and accuracy (model) of each forcing."""
    forcings = [FORCING_OFF, FORCING_MERIDIAN]
    forcings += [Forcing(ForcingKind.STATIC, cap) for cap in sorted(set(static_caps))]
    baseline = sum(s.num_think for s in streams.streams(FORCING_OFF))
    rows: list[ForcingSummary] = []
    for forcing in forcings:
        chains = [s for s in streams.streams(forcing) if s.is_reasoning]
        total = sum(s.num_think for s in chains)
        correct = sum(1 for s in chains if s.correct)
        rows.append(
            ForcingSummary(
                forcing=forcing.label,
                num_reasoning=len(chains),
                think_tokens_avg=total / len(chains) if chains else None,
                think_tokens_saved_pct=(
                    100.0 * (baseline - total) / baseline if baseline else None
                ),
                num_forced=sum(1 for s in chains if s.forced is not None),
                answer_accuracy_pct=100.0 * correct / len(chains) if chains else None,
            )
        )
    return rows


ProgressHook = Callable[[str, int], None]


def run_policy(
    spec: SimRunSpec,
    policy: PolicySpec,
    streams: StreamSet,
    on_progress: Callable[[int], None] | None = None,
    *,
    engine_config: EngineConfig | None = None,
    step_model: StepTimeModel | None = None,
    engine: str | None = None,
) -> SimResult:
    """Simulate one policy on the workload of ``streams`` (``engine`` overrides the spec's)."""
    if engine_config is None:
        engine_config = engine_config_for(spec)
    if step_model is None:
        step_model = step_model_for(spec)
    itl_ns = int(spec.answer_pace_s * 1e9)
    chosen = streams.streams(streams.forcing_of(policy))
    if (engine or spec.engine) == "vllm":
        from meridian.sim.vllm_engine import VllmEngine

        return VllmEngine(
            engine_config,
            step_model,
            policy,
            spec.config,
            itl_ns,
            on_progress=on_progress,
        ).run(chosen)
    if engine_config.kv_offload_blocks:
        raise MeridianError("--kv-offload-gib drives vLLM's OffloadingConnector: --engine vllm")
    sim_policy = make_sim_policy(policy, spec.config, itl_ns)
    sync = replace(engine_config, async_scheduling=False)
    return Engine(sync, step_model, sim_policy, on_progress=on_progress).run(chosen)


def bind_progress(on_progress: ProgressHook, name: str) -> Callable[[int], None]:
    """``on_progress`` for the run named ``name``."""

    def hook(done: int) -> None:
        on_progress(name, done)

    return hook


def run_parameters(spec: SimRunSpec, engine_config: EngineConfig) -> dict[str, object]:
    """The report fields that say what was run (all but the policies and the results)."""
    return {
        "workload": Path(spec.workload).name,
        "seed": spec.seed,
        "duration_s": spec.duration_s,
        "warmup_s": spec.warmup_s,
        "hardware": spec.hardware if spec.step_time_csv is None else "fitted",
        "model": spec.model,
        "slo": spec.slo,
        "engine": spec.engine,
        "async_scheduling": engine_config.async_scheduling and spec.engine == "vllm",
        "max_num_seqs": engine_config.max_num_seqs,
        "max_num_batched_tokens": engine_config.max_num_batched_tokens,
        "num_kv_blocks": engine_config.num_kv_blocks,
    }


def prepare_run(
    spec: SimRunSpec,
    arrival_rate: float,
    requests: Sequence[RequestSpec] | None,
    replicas: int = 1,
) -> tuple[Sequence[RequestSpec], StreamSet, EngineConfig, StepTimeModel]:
    """What every policy of a run shares: its requests (generated unless given), their streams,
    the engine's configuration (checked for ``replicas`` engines, before any work) and the
    step-time model (a --step-time-csv is read and fitted once, not once per policy)."""
    engine_config = engine_config_for(spec, replicas)
    step_model = step_model_for(spec)
    if requests is None:
        requests = load_requests(spec, arrival_rate)
    if not requests:
        raise MeridianError("the workload has no requests; raise --duration-s or --arrival-rate")
    streams = StreamSet(requests, spec.config)
    return requests, streams, engine_config, step_model


def summaries(
    spec: SimRunSpec,
    results: dict[str, SimResult],
    requests: Sequence[RequestSpec],
    engine_config: EngineConfig,
    step_model: StepTimeModel,
) -> dict[str, PolicySummary]:
    """Each run's summary over the spec's window, with its idle latency."""
    window = window_for(spec, requests)
    idle = idle_latency_for(engine_config, step_model)
    return {
        name: summarize(result, spec.slo, window=window, idle=idle)
        for name, result in results.items()
    }


def simulate(
    spec: SimRunSpec,
    arrival_rate: float,
    requests: Sequence[RequestSpec] | None = None,
    on_progress: ProgressHook | None = None,
) -> tuple[SimReport, dict[str, SimResult]]:
    """Run every policy of ``spec`` at ``arrival_rate``; the report and the raw results."""
    requests, streams, engine_config, step_model = prepare_run(spec, arrival_rate, requests)
    results: dict[str, SimResult] = {}
    for policy in spec.policy_specs:
        hook = None if on_progress is None else bind_progress(on_progress, policy.name)
        results[policy.name] = run_policy(
            spec, policy, streams, hook, engine_config=engine_config, step_model=step_model
        )
    has_reasoning = any(r.is_reasoning for r in requests)
    static_cap = streams.matched_cap() if has_reasoning else None
    caps = [*STATIC_CAP_SWEEP, *([static_cap] if static_cap else [])]
    report = SimReport(
        **run_parameters(spec, engine_config),
        policies=list(spec.policies),
        static_cap=static_cap,
        arrival_rate=arrival_rate,
        offered=offered_load(requests, spec.duration_s if is_bundled(spec.workload) else None),
        summaries=summaries(spec, results, requests, engine_config, step_model),
        forcing=forcing_summaries(streams, caps) if has_reasoning else [],
    )
    return report, results
