"""Run the simulator for several policies on one workload, and build the reports.

This is the library behind ``meridian bench sim``: it resolves presets, sizes the KV cache, loads
or generates the workload once, runs every policy on it (same requests, same seed) and turns the
results into the report models of :mod:`meridian.bench.report`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meridian.bench.metrics import SloSpec, summarize
from meridian.bench.report import SimReport
from meridian.bench.traces import read_trace
from meridian.bench.workloads import WORKLOADS, WorkloadParams, generate_workload
from meridian.config.schema import MeridianConfig
from meridian.errors import ConfigError, MeridianError
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.fabric import fabric_model
from meridian.sim.policies import POLICIES, make_policy
from meridian.sim.presets import hardware_preset, model_preset
from meridian.sim.records import SimResult
from meridian.sim.request import RequestSpec
from meridian.sim.steptime import FittedStepTime, RooflineStepTime, StepTimeModel

CANDIDATE = "meridian"
DISAGG = "meridian-disagg"
BASELINES = tuple(name for name in POLICIES if name not in (CANDIDATE, DISAGG))


@dataclass(frozen=True)
class SimRunSpec:
    """Everything one ``bench sim`` run depends on (a run is a function of this and the seed)."""

    workload: str = "synthetic"
    arrival_rate: float = 8.0
    duration_s: float = 30.0
    seed: int = 0
    hardware: str = "h100-sxm"
    model: str = "qwen3-8b"
    policies: Sequence[str] = field(default_factory=lambda: (CANDIDATE, *BASELINES))
    config: MeridianConfig = field(default_factory=MeridianConfig)
    slo: SloSpec = field(default_factory=SloSpec)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_time_csv: Path | None = None
    disagg: str | None = None


def parse_baselines(text: str) -> list[str]:
    """``all`` or a comma list of baseline policy names; the candidate always runs first."""
    if text.strip() == "all":
        return [CANDIDATE, *BASELINES]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise MeridianError(
            f"--baseline: unknown policy {', '.join(unknown) or '(empty)'}; use 'all' or a comma "
            f"list of: {', '.join(BASELINES)}"
        )
    return [CANDIDATE, *[n for n in names if n != CANDIDATE]]


def load_requests(spec: SimRunSpec, arrival_rate: float) -> list[RequestSpec]:
    """The workload's requests: a bundled generator by name, or a JSONL trace file by path."""
    if spec.workload in WORKLOADS:
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


def step_model_for(spec: SimRunSpec) -> StepTimeModel:
    """The roofline preset, or a model fitted to the user's CSV of measured steps."""
    if spec.step_time_csv is not None:
        return FittedStepTime.from_csv(spec.step_time_csv)
    return RooflineStepTime(hardware_preset(spec.hardware), model_preset(spec.model))


def engine_config_for(spec: SimRunSpec) -> EngineConfig:
    """Size the KV cache: ``kv_memory.capacity_bytes``, or "auto" = 85 % of the device's memory
    minus the model's weights (what vLLM's ``gpu_memory_utilization`` leaves for KV)."""
    hw, model = hardware_preset(spec.hardware), model_preset(spec.model)
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
    if num_blocks < 1:
        raise ConfigError(
            f"kv_memory.capacity_bytes ({capacity}) holds no block of {block_bytes} bytes "
            f"({kv.block_size_tokens} tokens of {model.name})"
        )
    return EngineConfig(
        fabric=None if spec.disagg is None else fabric_model(spec.disagg),
        num_kv_blocks=num_blocks,
        block_size_tokens=kv.block_size_tokens,
        kv_bytes_per_token=model.kv_bytes_per_token,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs,
    )


ProgressHook = Callable[[str, int], None]


def run_policy(
    spec: SimRunSpec,
    policy: str,
    requests: Sequence[RequestSpec],
    on_progress: Callable[[int], None] | None = None,
    *,
    engine_config: EngineConfig | None = None,
    step_model: StepTimeModel | None = None,
) -> SimResult:
    """Simulate one policy on ``requests``.

    ``engine_config`` and ``step_model`` default to :func:`engine_config_for` and
    :func:`step_model_for` of ``spec``; a caller running many policies resolves them once.
    """
    if engine_config is None:
        engine_config = engine_config_for(spec)
    if step_model is None:
        step_model = step_model_for(spec)
    itl_ns = int(spec.slo.output_itl_s * 1e9)
    engine = Engine(
        engine_config,
        step_model,
        make_policy(policy, spec.config, itl_ns),
        spec.config.kv_memory,
        on_progress=on_progress,
    )
    return engine.run(requests)


def _bind(on_progress: ProgressHook, name: str) -> Callable[[int], None]:
    def hook(done: int) -> None:
        on_progress(name, done)

    return hook


def simulate(
    spec: SimRunSpec,
    arrival_rate: float,
    requests: Sequence[RequestSpec] | None = None,
    on_progress: ProgressHook | None = None,
) -> tuple[SimReport, dict[str, SimResult]]:
    """Run every policy of ``spec`` at ``arrival_rate``; the report and the raw results."""
    if requests is None:
        requests = load_requests(spec, arrival_rate)
    if not requests:
        raise MeridianError("the workload has no requests; raise --duration-s or --arrival-rate")
    # Resolved once: a --step-time-csv is read and fitted once, not once per policy.
    engine_config, step_model = engine_config_for(spec), step_model_for(spec)
    results: dict[str, SimResult] = {}
    for name in spec.policies:
        hook = None if on_progress is None else _bind(on_progress, name)
        results[name] = run_policy(
            spec, name, requests, hook, engine_config=engine_config, step_model=step_model
        )
    report = SimReport(
        workload=Path(spec.workload).name,
        seed=spec.seed,
        duration_s=spec.duration_s,
        hardware=spec.hardware if spec.step_time_csv is None else "fitted",
        model=spec.model,
        slo=spec.slo,
        policies=list(spec.policies),
        arrival_rate=arrival_rate,
        summaries={name: summarize(res, spec.slo) for name, res in results.items()},
    )
    return report, results
