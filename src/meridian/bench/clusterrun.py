"""Run the cluster simulator (:mod:`meridian.sim.cluster`) for routers x policies on one workload.

The library behind ``meridian bench sim --replicas N --router NAME`` and ``meridian bench
fidelity --replicas N``: every replica of a run has the engine shape, step-time model and
scheduling policy a single-engine run would have (:mod:`meridian.bench.simrun`), the workload
is generated at the cluster's arrival rate, and every (router, policy) pair replays the same
streams (forcing held equal). A run is named ``ROUTER/POLICY``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from meridian.bench.attainment import contention
from meridian.bench.report import SimReport
from meridian.bench.simrun import (
    SimRunSpec,
    StreamSet,
    bind_progress,
    forcing_summaries,
    prepare_run,
    run_parameters,
    summaries,
    window_for,
)
from meridian.bench.summary import Sig6
from meridian.core.migration import MigrationPolicy
from meridian.core.routing import RoutingConfig
from meridian.errors import MeridianError
from meridian.sim.cluster import Cluster, ClusterRun, ModelReplica, Replica, VllmReplica
from meridian.sim.engine import Engine, EngineConfig
from meridian.sim.migration import MIGRATIONS, Migrator
from meridian.sim.policies import PolicySpec, make_sim_policy, parse_policy
from meridian.sim.presets import model_preset
from meridian.sim.request import RequestSpec
from meridian.sim.routers import make_router, parse_routers
from meridian.sim.steptime import StepTimeModel

__all__ = ["ClusterReport", "ClusterSpec", "answer_kv_share", "run_cluster", "simulate_cluster"]

ProgressHook = Callable[[str, int], None]


# One process simulates every replica (each an engine with its own scheduler and block pool, all
# stepped on one clock): 1,024 is more than any one Ray Serve deployment of an LLM runs.
MAX_REPLICAS = 1024
# Replica stats refresh every period of virtual time, each refresh a pass over every replica:
# from 10 ms (a tenth of vLLM's coordinator's 100 ms) to an hour (Ray's default is 10 s).
MIN_STATS_PERIOD_S = 0.01
MAX_STATS_PERIOD_S = 3600.0


def answer_kv_share(requests: Sequence[RequestSpec]) -> float:
    """The answer phase's share of the KV ``requests`` hold over their decode steps (each step a
    request holds its prompt and every token so far): with prompt P, T think and A answer tokens,
    ``A (P + T) + A^2 / 2`` against ``T P + T^2 / 2`` for the thinking. What an answer-first
    split of the replicas (``meridian-split``, ``DEFAULT_ANSWER_SHARE``) is sized by."""
    p, t, a = (
        np.array([getattr(r, f) for r in requests], dtype=np.float64)
        for f in ("num_prompt_tokens", "num_think_tokens", "num_answer_tokens")
    )
    answer = float((a * (p + t) + a * a / 2).sum())
    total = answer + float((t * p + t * t / 2).sum())
    return answer / total if total else 0.0


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster around each replica: how many, which routers, how often stats refresh
    (``None``: each router's own period), and Meridian's routing knobs."""

    replicas: int = 2
    routers: Sequence[str] = ("meridian",)
    stats_period_s: float | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise MeridianError(
                f"--replicas must be in [1, {MAX_REPLICAS}] (one process simulates them all); "
                f"got {self.replicas}"
            )
        period = self.stats_period_s
        if period is not None and not MIN_STATS_PERIOD_S <= period <= MAX_STATS_PERIOD_S:
            raise MeridianError(
                f"--stats-period-s must be in [{MIN_STATS_PERIOD_S:g}, {MAX_STATS_PERIOD_S:g}] "
                f"seconds (a refresh visits every replica); got {period:g}"
            )
        parse_routers(",".join(self.routers))


def run_name(router: str, policy: str) -> str:
    return f"{router}/{policy}"


def run_cluster(
    run: SimRunSpec,
    cluster: ClusterSpec,
    router: str,
    policy: PolicySpec,
    streams: StreamSet,
    on_progress: Callable[[int], None] | None = None,
    *,
    engine_config: EngineConfig,
    step_model: StepTimeModel,
    engine: str,
) -> ClusterRun:
    """One (router, policy) pair on ``cluster.replicas`` engines of kind ``engine``."""
    itl_ns = int(run.answer_pace_s * 1e9)
    chosen = streams.streams(streams.forcing_of(policy))

    def make_replica(on_finish: Callable[[str], None]) -> Replica:
        if engine == "vllm":
            from meridian.sim.vllm_engine import VllmEngine

            vllm = VllmEngine(engine_config, step_model, policy, run.config, itl_ns)
            return VllmReplica(vllm, on_finish)
        if engine_config.kv_offload_blocks:
            raise MeridianError("--kv-offload-gib drives vLLM's OffloadingConnector: --engine vllm")
        sim_policy = make_sim_policy(policy, run.config, itl_ns)
        sync = replace(engine_config, async_scheduling=False)
        return ModelReplica(Engine(sync, step_model, sim_policy), on_finish)

    chooser = make_router(
        router,
        cluster.replicas,
        seed=run.seed,
        stats_period_s=cluster.stats_period_s,
        config=cluster.routing,
    )
    migrator = None
    if router in MIGRATIONS:
        kv_bytes = float(model_preset(run.model).kv_bytes_per_token)
        moves = getattr(chooser, "migration", None)  # the same router state decides the moves
        if not isinstance(moves, MigrationPolicy):
            raise MeridianError(f"router {router}: migrations need Meridian's routing policy")
        migrator = Migrator(
            moves,
            MIGRATIONS[router],
            kv_bytes_per_token=kv_bytes,
            step_model=step_model,
            engine_config=engine_config,
        )
    name = run_name(router, policy.name)
    return Cluster(
        make_replica,
        cluster.replicas,
        chooser,
        name=name,
        on_progress=on_progress,
        migrator=migrator,
    ).run(chosen)


class HoldSummary(BaseModel):
    """Requests the router held (at least one attempt answered "wait") and how long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_held: int
    hold_p95_s: Sig6 | None = None
    hold_max_s: Sig6 | None = None

    @classmethod
    def of(cls, run: ClusterRun) -> HoldSummary:
        if not run.hold_s:
            return cls(num_held=0)
        held = np.asarray(run.hold_s)
        return cls(
            num_held=run.num_held,
            hold_p95_s=float(np.percentile(held, 95)),
            hold_max_s=float(held.max()),
        )


class ClusterReport(SimReport):
    """A :class:`~meridian.bench.report.SimReport` of ``ROUTER/POLICY`` runs, with the cluster:
    replicas (each of the report's engine shape: ``num_kv_blocks`` is one replica's), the stats
    period (``None``: each router's own) and each run's holds at the router."""

    replicas: int
    stats_period_s: Sig6 | None = None
    holds: dict[str, HoldSummary]
    migrations: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Each migrating run's moves by reason (preempted, waited, answer) and by "
        "transfer (recompute, link).",
    )
    kv_used_peak_replica: dict[str, Sig6] = Field(
        default_factory=dict,
        description="Each run's fullest replica: the largest share of one replica's KV blocks "
        "in use, from the warm-up's end on (the summaries' peak is the cluster's total).",
    )


def replica_kv_peak(run: ClusterRun, spec: SimRunSpec, requests: Sequence[RequestSpec]) -> float:
    """The largest KV share any one replica reached after the warm-up."""
    window = window_for(spec, requests)
    return max(
        (contention(r, window.measured(r.records), window).kv_used_peak for r in run.replicas),
        default=0.0,
    )


def simulate_cluster(
    spec: SimRunSpec,
    cluster: ClusterSpec,
    arrival_rate: float,
    requests: Sequence[RequestSpec] | None = None,
    on_progress: ProgressHook | None = None,
) -> tuple[ClusterReport, dict[str, ClusterRun]]:
    """Every router of ``cluster`` with every policy of ``spec`` at ``arrival_rate`` (the
    cluster's); the report and the runs."""
    requests, streams, engine_config, step_model = prepare_run(
        spec, arrival_rate, requests, cluster.replicas
    )
    runs: dict[str, ClusterRun] = {}
    for router in cluster.routers:
        for name in spec.policies:
            policy = parse_policy(name)
            key = run_name(router, policy.name)
            hook = None if on_progress is None else bind_progress(on_progress, key)
            runs[key] = run_cluster(
                spec,
                cluster,
                router,
                policy,
                streams,
                hook,
                engine_config=engine_config,
                step_model=step_model,
                engine=spec.engine,
            )
    has_reasoning = any(r.is_reasoning for r in requests)
    report = ClusterReport(
        **run_parameters(spec, engine_config),
        policies=list(runs),
        arrival_rate=arrival_rate,
        summaries=summaries(
            spec, {k: r.result for k, r in runs.items()}, requests, engine_config, step_model
        ),
        forcing=forcing_summaries(streams, []) if has_reasoning else [],
        replicas=cluster.replicas,
        stats_period_s=cluster.stats_period_s,
        holds={name: HoldSummary.of(run) for name, run in runs.items()},
        kv_used_peak_replica={k: replica_kv_peak(r, spec, requests) for k, r in runs.items()},
        migrations={
            k: {**r.migrations.by_reason, **r.migrations.by_transfer}
            for k, r in runs.items()
            if r.migrations is not None
        },
    )
    return report, runs
