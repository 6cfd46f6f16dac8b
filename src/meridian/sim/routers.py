"""The routers the cluster simulator compares (:mod:`meridian.sim.cluster`), as their systems
define them. Each sees what it would see in production: its own in-flight requests, and, for
those that read replica stats, the stats as last refreshed (every ``stats_period_s``).

================  ==================================================================================
``meridian``      Meridian's routing policy (:class:`~meridian.core.routing.RoutingPolicy`, the
                  object Ray Serve runs in :mod:`meridian.ray.router`): projected KV headroom,
                  never holds (its default, ``hold = never``). Stats every 1 s (Meridian's
                  deployment polls at ``request_routing_stats_period_s = 1``).
``meridian-hold`` The same, holding a request no replica's projection fits (``hold = headroom``).
``meridian-hold-admission``
                  The same, holding a request only when no replica's vLLM admission could take it
                  (``hold = admission``).
``meridian-replace``
                  ``meridian`` with re-placement by recompute (:mod:`meridian.sim.migration`): a
                  request preempted on a replica, or waiting there over 10 s, moves to the replica
                  with the most room, whose prefill recomputes it. An upper bound: no driver yet.
``meridian-move``  ``meridian`` with answer streams moved at ``</think>`` from a replica under
                  pressure to one with room, over a 25 GB/s link or recomputed, whichever is
                  quicker (:mod:`meridian.sim.migration`). An upper bound: no driver yet.
``meridian-split``
                  A split after Pascal: the last eighth of the replicas (at least one) answer
                  first. Requests that start thinking are ranked over the others, those that answer
                  from their start over the answer-first ones, and every ``</think>`` on a
                  thinking replica moves its request to the answer-first replica with the most
                  room, as ``meridian-move`` moves one (:meth:`~meridian.core.migration.
                  MigrationPolicy.placement`). An upper bound: no driver yet.
``clairvoyant``   A reference no router can be: Meridian's ranking (hold never) over every
                  replica's true state at each decision (its requests' true remaining lengths and
                  progress, on the KV cache's real size) and the request's true length.
``pow2``          Ray Serve's default, ``PowerOfTwoChoicesRequestRouter``
                  (``ray/serve/_private/request_router/pow_2_router.py``, Ray 2.60): two distinct
                  replicas at random, the one with the shorter queue; the queue is the replica's
                  ongoing requests, which Serve's queue-length cache keeps from its own sends
                  and the replicas' replies: this router's in-flight count. Ties go to the first
                  of the pair (``_select_from_candidate_replicas`` takes a strictly shorter
                  queue). LLM deployments set ``max_ongoing_requests`` to 1e9: no replica is full.
``round-robin``   Ray Serve's ``RoundRobinRouter`` (``ray/serve/experimental/round_robin_router
                  .py``): a cursor from a random start, advanced by one each request.
``vllm-dp``       vLLM's data-parallel balancer (``DPLBAsyncMPClient.get_core_engine_for_request``,
                  ``vllm/v1/engine/core_client.py``, vLLM 0.32): the lowest
                  ``max(in-flight, waiting + running) + waiting x 6 x max(0, KV usage - 0.5)`` (the
                  penalty only while waiting > 0), scanning from a start index that rotates by one
                  each request; the chosen engine's waiting count goes up by one until the next
                  stats, which come every 100 ms (the DP coordinator's
                  ``min_stats_update_interval_ms``).
``pascal-like``   Pascal's instance placement (arXiv:2602.11530, HPCA 2026), as far as its abstract
                  and summaries describe it (the method section could not be read here): reasoning
                  work is spread across instances by their reasoning load, answering by their
                  answering load. A reasoning request goes to the replica with the fewest thinking
                  requests, a chat request (it only answers) to the one with the fewest answer
                  streams; ties to the shorter queue, then the lower index. Counts are the stats
                  (every 1 s, as Meridian's) plus the requests of that kind this router sent since.
                  Not rendered: Pascal's migration of a request between instances at its phase
                  boundary (vLLM cannot move a running request's KV).
================  ==================================================================================
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from meridian.core import routing
from meridian.core.migration import DEFAULT_ANSWER_SHARE, MigrationConfig, MigrationPolicy
from meridian.core.routing import Hold, NewRequest, ReplicaStats, RoutingConfig, RoutingPolicy
from meridian.errors import MeridianError
from meridian.sim.streams import SIM_FORMAT, Stream

FloatArray = npt.NDArray[np.float64]

__all__ = ["ROUTERS", "ClusterRouter", "make_router"]

# Meridian's deployment polls replicas every second (meridian.ray.app.DEFAULT_STATS_PERIOD_S).
RAY_STATS_PERIOD_S = 1.0
# vLLM's DP coordinator publishes engine stats at most every 100 ms.
VLLM_DP_STATS_PERIOD_S = 0.1


class ClusterRouter(Protocol):
    """What the cluster asks a router. Replicas are indices ``0 .. num_replicas - 1``.

    ``stats_period_s``: how often it gets every replica's stats (``None``: it reads none);
    ``needs_projection``: whether those stats must carry Meridian's projection.
    """

    name: str
    stats_period_s: float | None
    needs_projection: bool

    def observe(self, replica: int, stats: ReplicaStats) -> None: ...

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        """The replica for ``request``; ``None``: hold it (it is asked again later)."""

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None: ...

    def completed(self, replica: int, request_id: str) -> None: ...


@dataclass
class _InFlight:
    """A router's own count of the requests it sent each replica that have not completed."""

    num_replicas: int
    counts: list[int] = field(default_factory=list)
    where: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = [0] * self.num_replicas

    def routed(self, replica: int, request_id: str) -> None:
        self.counts[replica] += 1
        self.where[request_id] = replica

    def completed(self, request_id: str) -> None:
        replica = self.where.pop(request_id, None)
        if replica is not None:
            self.counts[replica] -= 1


class _Baseline:
    """What a baseline router does by default: reads no stats, keeps no record of what it sent."""

    needs_projection = False

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        pass

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        pass

    def completed(self, replica: int, request_id: str) -> None:
        pass


class _CountingBaseline(_Baseline):
    """A baseline that counts its own in-flight requests per replica (``in_flight``)."""

    in_flight: _InFlight

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        self.in_flight.routed(replica, request_id)

    def completed(self, replica: int, request_id: str) -> None:
        self.in_flight.completed(request_id)


class MeridianClusterRouter:
    """The core routing policy over replicas named ``r000``, ``r001``, ... (in index order);
    ``migration``: the moves' decisions over the same router state (``moves``: their knobs),
    whose split, if it has one, also chooses where a new request may go."""

    needs_projection = True

    def __init__(
        self,
        num_replicas: int,
        config: RoutingConfig,
        stats_period_s: float,
        name: str,
        moves: MigrationConfig | None = None,
    ) -> None:
        self.name = name
        self.policy = RoutingPolicy(config)
        self.migration = MigrationPolicy(self.policy, moves)
        self.names = [f"r{i:03d}" for i in range(num_replicas)]
        self._index = {name: i for i, name in enumerate(self.names)}
        self.stats_period_s: float | None = stats_period_s

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        self.policy.observe(self.names[replica], stats)

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        names = self.migration.placement(self.names, request)
        ranked = self.policy.rank(names, request, now_s, waited_s)
        return self._index[ranked[0]] if ranked else None

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        self.policy.routed(self.names[replica], request_id, request, now_s)

    def completed(self, replica: int, request_id: str) -> None:
        self.policy.completed(request_id)


class PowerOfTwoRouter(_CountingBaseline):
    """Ray Serve's default (module docstring)."""

    name = "pow2"
    stats_period_s: float | None = None

    def __init__(self, num_replicas: int, seed: int) -> None:
        self.in_flight = _InFlight(num_replicas)
        self.rng = random.Random(seed)
        self.num_replicas = num_replicas

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        n, rng = self.num_replicas, self.rng
        if n == 1:
            return 0
        if n == 2:
            pair = (0, 1) if rng.getrandbits(1) else (1, 0)
        else:  # Ray's i, j: uniform over ordered pairs of distinct replicas
            i = rng.randrange(n)
            j = rng.randrange(n - 1)
            pair = (i, j + 1 if j >= i else j)
        counts = self.in_flight.counts
        return pair[1] if counts[pair[1]] < counts[pair[0]] else pair[0]


class RoundRobinRouter(_Baseline):
    """Ray Serve's ``RoundRobinRouter`` (module docstring)."""

    name = "round-robin"
    stats_period_s: float | None = None

    def __init__(self, num_replicas: int, seed: int) -> None:
        self.num_replicas = num_replicas
        self.counter = random.Random(seed).randrange(2**31)

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        index = self.counter % self.num_replicas
        self.counter += 1
        return index


class VllmDpRouter(_CountingBaseline):
    """vLLM's data-parallel balancer (module docstring)."""

    name = "vllm-dp"

    def __init__(self, num_replicas: int, stats_period_s: float) -> None:
        self.num_replicas = num_replicas
        self.stats_period_s: float | None = stats_period_s
        self.in_flight = _InFlight(num_replicas)
        # [waiting, running, kv usage] per engine, as the coordinator last published them.
        self.counts: list[list[float]] = [[0.0, 0.0, 0.0] for _ in range(num_replicas)]
        self.start = 0

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        self.counts[replica] = [float(stats.num_waiting), float(stats.num_running), stats.kv_usage]

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        n = self.num_replicas
        best, chosen = float("inf"), 0
        for k in range(n):
            i = (self.start + k) % n
            waiting, running, kv_usage = self.counts[i]
            score = max(float(self.in_flight.counts[i]), waiting + running)
            if waiting:
                score += waiting * 6.0 * max(0.0, kv_usage - 0.5)
            if score < best:
                best, chosen = score, i
        self.counts[chosen][0] += 1
        self.start = (self.start + 1) % n
        return chosen


class PascalLikeRouter(_Baseline):
    """Pascal-like instance placement (module docstring)."""

    name = "pascal-like"

    def __init__(self, num_replicas: int, stats_period_s: float) -> None:
        self.num_replicas = num_replicas
        self.stats_period_s: float | None = stats_period_s
        self.stats: list[ReplicaStats | None] = [None] * num_replicas
        # Requests sent since each replica's stats: (reasoning, chat), with their send times.
        self.sent: list[list[tuple[float, bool]]] = [[] for _ in range(num_replicas)]

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        self.stats[replica] = stats
        self.sent[replica] = [(t, r) for t, r in self.sent[replica] if t >= stats.time_s]

    def _load(self, i: int, reasoning: bool) -> tuple[int, int, int]:
        stats = self.stats[i]
        since = self.sent[i]
        same = sum(1 for _, r in since if r == reasoning)
        queue = len(since)
        if stats is not None:
            same += stats.num_thinking if reasoning else stats.num_answering
            queue += stats.num_running + stats.num_waiting
        return same, queue, i

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        return min(self._load(i, request.reasoning) for i in range(self.num_replicas))[2]

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        self.sent[replica].append((now_s, request.reasoning))


class ClairvoyantRouter:
    """The clairvoyant reference (module docstring): fresh, true stats of every replica at each
    decision, for :class:`~meridian.core.routing.RoutingPolicy` to rank by."""

    name = "clairvoyant"
    needs_projection = False
    stats_period_s: float | None = None
    GRID_POINTS = 64

    def __init__(self, num_replicas: int) -> None:
        self.policy = RoutingPolicy(RoutingConfig(hold=Hold.NEVER))
        self.names = [f"r{i:03d}" for i in range(num_replicas)]
        self.engines: list[Any] = []

    def attach(self, engines: list[Any]) -> None:
        """The replicas' fast engines (:class:`~meridian.sim.engine.Engine`), read at every
        decision."""
        self.engines = engines

    @staticmethod
    def describe(stream: Stream) -> NewRequest:
        """The request with its true length as its bound."""
        phase = SIM_FORMAT.initial_phase(stream.prompt_tail())
        return NewRequest(phase, stream.spec.num_prompt_tokens, stream.num_output_tokens)

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        pass

    def choose(self, request: NewRequest, now_s: float, waited_s: float) -> int | None:
        engines = self.engines
        states = [
            [(r.num_tokens, r.stream.num_output_tokens - r.num_output_tokens)
             for r in (*e.running, *e.queued())]
            for e in engines
        ]  # fmt: skip
        longest = max([request.max_tokens or 1, *(g for s in states for _, g in s)])
        grid = np.linspace(0.0, float(longest), self.GRID_POINTS)
        ones = np.ones_like(grid)
        for k, (engine, state) in enumerate(zip(engines, states, strict=True)):
            self.policy.observe(self.names[k], _true_stats(engine, state, grid, ones, now_s))
        ranked = self.policy.rank(self.names, request, now_s, waited_s)
        return self.names.index(ranked[0])

    def routed(self, replica: int, request_id: str, request: NewRequest, now_s: float) -> None:
        self.policy.routed(self.names[replica], request_id, request, now_s)

    def completed(self, replica: int, request_id: str) -> None:
        self.policy.completed(request_id)


def _true_stats(
    engine: Any, state: list[tuple[int, int]], grid: FloatArray, ones: FloatArray, now_s: float
) -> ReplicaStats:
    """A replica's true stats now: the KV its requests hold at each grid step from now (their
    tokens so far plus those generated by then, while they run), on its real cache."""
    pool = engine.pool
    block_size = engine.config.block_size_tokens
    load = np.zeros_like(grid)
    if state:
        tokens, remaining = np.asarray(state, dtype=np.float64).T
        alive = grid[None, :] < remaining[:, None]
        held = (tokens[:, None] + np.minimum(grid[None, :], remaining[:, None])) / block_size + 0.5
        load = (held * alive).sum(axis=0)
    usable = pool.num_usable_blocks
    return ReplicaStats(
        time_s=now_s,
        num_running=len(engine.running),
        num_waiting=len(state) - len(engine.running),
        num_answering=0,
        num_thinking=0,
        num_kv_blocks=usable,
        num_kv_blocks_used=usable - pool.num_free_blocks,
        block_size=block_size,
        projection=routing.Projection(grid, load, float(usable), ones, ones),
    )


# Meridian's router under each hold setting, by router name.
MERIDIAN_HOLDS = {
    "meridian": Hold.NEVER,
    "meridian-hold": Hold.HEADROOM,
    "meridian-hold-admission": Hold.ADMISSION,
}
# Meridian's router (hold never) with a migration (meridian.sim.migration), by router name.
MERIDIAN_MIGRATIONS = ("meridian-replace", "meridian-move", "meridian-split")
ROUTERS = (
    *MERIDIAN_HOLDS,
    *MERIDIAN_MIGRATIONS,
    "clairvoyant",
    "pow2",
    "round-robin",
    "vllm-dp",
    "pascal-like",
)


def make_router(
    name: str,
    num_replicas: int,
    *,
    seed: int = 0,
    stats_period_s: float | None = None,
    config: RoutingConfig | None = None,
) -> ClusterRouter:
    """A fresh router ``name`` (one of :data:`ROUTERS`) for ``num_replicas`` replicas;
    ``stats_period_s`` overrides its stats period (``None``: its system's own)."""
    if num_replicas < 1:
        raise MeridianError(f"--replicas must be >= 1; got {num_replicas}")
    if name in MERIDIAN_HOLDS or name in MERIDIAN_MIGRATIONS:
        period = stats_period_s or RAY_STATS_PERIOD_S
        chosen = replace(config or RoutingConfig(), hold=MERIDIAN_HOLDS.get(name, Hold.NEVER))
        split = name == "meridian-split"
        moves = MigrationConfig(answer_share=DEFAULT_ANSWER_SHARE) if split else None
        return MeridianClusterRouter(num_replicas, chosen, period, name, moves)
    if name == "clairvoyant":
        return ClairvoyantRouter(num_replicas)
    if name == "pow2":
        return PowerOfTwoRouter(num_replicas, seed)
    if name == "round-robin":
        return RoundRobinRouter(num_replicas, seed)
    if name == "vllm-dp":
        return VllmDpRouter(num_replicas, stats_period_s or VLLM_DP_STATS_PERIOD_S)
    if name == "pascal-like":
        return PascalLikeRouter(num_replicas, stats_period_s or RAY_STATS_PERIOD_S)
    raise MeridianError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")


def parse_routers(text: str) -> list[str]:
    """``all`` or a comma list of router names, in order, without repeats."""
    names: Sequence[str] = ROUTERS if text.strip() == "all" else text.split(",")
    chosen: list[str] = []
    for raw in names:
        name = raw.strip()
        if name and name not in chosen:
            if name not in ROUTERS:
                raise MeridianError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
            chosen.append(name)
    if not chosen:
        raise MeridianError("--router: no router named; use 'all' or a comma list")
    return chosen
