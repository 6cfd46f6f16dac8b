"""Routing across replicas: which replica a new request should go to, or whether it should wait.

One policy, two drivers (ADR-0016): :class:`RoutingPolicy` is what Meridian's Ray Serve request
router (:mod:`meridian.ray.router`) runs and what the cluster simulator
(:mod:`meridian.sim.cluster`) measures. It sees what a router sees: each replica's
:class:`ReplicaStats` as the replica last reported them (polled, so late), and its own
in-flight requests (those it placed and that have not completed).

What it optimises. A replica running Meridian's scheduler admits a waiting request only while
the KV its running requests are expected to grow into leaves room for it
(:mod:`meridian.core.headroom`); a request sent to a replica without that headroom waits in that
replica's queue, bound to it, while another replica may free room first. So:

1. **Headroom first.** A replica *fits* a request when its projected KV peak, with the request
   added, stays within its admission budget. The projection is the replica's own (its length
   model's expected KV of every running and waiting request, on its grid of future steps),
   aged by the steps run since it was measured, plus the requests this router sent it that
   the stats do not count (sent since then, or, if more, those beyond the replica's running and
   waiting requests: still on their way), each projected as a fresh request of its kind.
2. **Among the rest, the shortest queue**: the replica with the fewest of this router's requests
   in flight (join the shortest queue; ties to the replica sent fewest requests). A replica
   that fits and one whose stats cannot say (below) rank alike. Ranking those that fit by the
   KV the request would share its steps with (the projected load averaged over its expected
   life) lost to this: one replica whose projection appeared first drew the traffic of the
   others (ADR-0016 has the runs).
3. **Hold, if configured** (:attr:`RoutingConfig.hold`, a :class:`Hold`): the request waits at
   the router (Ray Serve retries it) and goes to the first replica that frees room, instead of
   queueing behind one replica. ``never`` (the default) places every request at once, on the
   replica it overflows least when none fits; ``admission`` holds only when no replica's vLLM
   admission could take it now (free KV blocks for its prompt, after the prompts of the requests
   sent there that the stats do not count, and nothing waiting); ``headroom`` holds when no
   replica fits its projection. Measured (4 x H100 / Qwen3-8B, ServeGen R1, 130 %, 300 s), the
   headroom hold cost 12 s of TTFT P95 and bought no TTFVT (issue 45): hence off by default. A
   request held :attr:`RoutingConfig.max_hold_s` is placed anyway (a starvation bound), on the
   replica it overflows least.

Stale statistics. Stats without a projection (a replica whose length model has not seen enough
finished requests, or whose admission does not use it), missing stats and stats older than
:attr:`RoutingConfig.stats_max_age_s` say nothing the router can hold on: such a replica ranks
with those that fit, by this router's requests in flight on it, and never holds a request (the
``admission`` hold reads only the counts, so fresh stats without a projection can say there).
Holding on information that cannot be trusted could hold forever.

Failed replicas. A driver that sees a replica fail a request (its engine dead, a connection lost,
a server error) reports it (:meth:`RoutingPolicy.failed`): from then on the replica gets no new
request until the driver reports that it answers again (:meth:`RoutingPolicy.answered`, with a
time after the failure). A replica that fails fast looks the least loaded to every rule above,
so without this it would draw the traffic. When every replica has failed, a request is held as
when none fits, whatever :attr:`RoutingConfig.hold` says (up to ``max_hold_s``).

A new request's kind comes from its prompt's tail, as the replica's admission decides it
(:func:`~meridian.core.format.expects_reasoning`, over
:meth:`~meridian.core.format.ReasoningFormat.initial_phase`).

Length: the stats a replica reports (:class:`ReplicaStats`, read and checked from JSON) and the
policy that reads them change together; apart, every new field would touch two modules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from meridian.core.format import expects_reasoning
from meridian.core.headroom import kv_blocks
from meridian.core.types import Phase
from meridian.errors import ConfigError, MeridianError

__all__ = [
    "DEFAULT_MAX_HOLD_S",
    "DEFAULT_STATS_MAX_AGE_S",
    "HOLDS",
    "WIRE_VERSION",
    "Hold",
    "NewRequest",
    "Projection",
    "ReplicaStats",
    "RoutingConfig",
    "RoutingPolicy",
    "StatsError",
]

FloatArray = npt.NDArray[np.float64]

# The version of ReplicaStats.to_wire's dict; a router ignores stats of another version.
WIRE_VERSION = 1
# RoutingConfig's defaults: stats older than this never hold a request (ten polls at the
# 1 s Meridian's deployment uses), and a request is held at most this long (as long as a
# replica's admission_order_max_wait_s).
DEFAULT_STATS_MAX_AGE_S = 10.0
DEFAULT_MAX_HOLD_S = 30.0


class StatsError(MeridianError, ValueError):
    """A replica's reported stats cannot be read (wrong version, a missing or bad field)."""


@dataclass(frozen=True, slots=True)
class NewRequest:
    """What the router knows of a request it has not placed yet: its initial phase (from the
    prompt's tail), its prompt length and its own bound on generated tokens (``None``: none)."""

    phase: Phase
    num_prompt_tokens: int
    max_tokens: int | None = None

    @property
    def reasoning(self) -> bool:
        """Whether it is expected to think (it does not start answering)."""
        return expects_reasoning(self.phase)


@dataclass(frozen=True, slots=True, eq=False)
class Projection:
    """A replica's headroom model when its stats were taken.

    ``load[k]``: expected KV blocks of its running and waiting requests ``grid[k]`` steps
    later; ``budget``: the blocks its admission keeps that peak within; ``survival_reasoning``
    / ``survival_chat``: the probability that a request of that kind, just admitted, still runs
    ``grid[k]`` steps later (from the same length model). All arrays have the grid's length.
    """

    grid: FloatArray
    load: FloatArray
    budget: float
    survival_reasoning: FloatArray
    survival_chat: FloatArray

    def request_blocks(self, request: NewRequest, block_size: int) -> FloatArray:
        """The expected KV blocks ``request`` holds at each grid step once admitted: its prompt
        and the tokens it has generated by then, times the chance it still runs (as
        :meth:`~meridian.core.headroom.LengthModel.expected_blocks` counts a request), never
        past its own bound (``max_tokens``)."""
        survival = self.survival_reasoning if request.reasoning else self.survival_chat
        generated = self.grid
        if request.max_tokens is not None and request.max_tokens < generated[-1]:
            # (A bound past the grid changes nothing; survivals are finite, so the product with
            # the mask is np.where's result, at half its cost on the router's per-decision path.)
            survival = survival * (generated <= request.max_tokens)
            generated = np.minimum(generated, float(request.max_tokens))
        blocks: FloatArray = kv_blocks(request.num_prompt_tokens + generated, block_size) * survival
        return blocks

    def aged(self, steps: float) -> FloatArray:
        """``load`` as it stands ``steps`` steps after it was projected (past the grid: its
        last point), interpolated linearly between grid points. Within the grid's first cell
        (``steps`` under its smallest spacing) that is ``load + steps * slopes()``."""
        if steps <= 0.0:
            return self.load
        shifted: FloatArray = np.interp(self.grid + steps, self.grid, self.load)
        return shifted

    def slopes(self) -> tuple[float, FloatArray | None]:
        """(the grid's smallest spacing, ``load``'s slope over each grid cell, 0 at the last
        point): :meth:`aged` within the first cell as one product. (0, None) for a grid that
        does not increase strictly."""
        grid, load = self.grid, self.load
        spacing = grid[1:] - grid[:-1]  # (slices, not np.diff: a stats refresh per replica)
        cell = float(spacing[spacing.argmin()]) if len(spacing) else 0.0
        if not cell > 0.0:
            return 0.0, None
        slopes: FloatArray = np.zeros(len(grid))
        np.divide(load[1:] - load[:-1], spacing, out=slopes[:-1])
        return cell, slopes


@dataclass(frozen=True, slots=True, eq=False)
class ReplicaStats:
    """What a replica reports to the router (Ray Serve's ``record_routing_stats``).

    ``time_s`` is the replica's clock when they were taken (wall time in Ray, virtual time in
    the simulator); ``block_size`` the tokens of one KV block; ``step_time_s`` the mean engine
    step over the recent past (0: unknown); ``projection`` ``None`` where the replica's admission
    has no projection to use.
    """

    time_s: float
    num_running: int
    num_waiting: int
    num_answering: int
    num_thinking: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    block_size: int = 16
    step_time_s: float = 0.0
    projection: Projection | None = None

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use (vLLM's ``kv_cache_usage``)."""
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0

    def to_wire(self) -> dict[str, Any]:
        """A plain, JSON-compatible dict (what crosses Ray Serve's controller)."""
        wire: dict[str, Any] = {
            "version": WIRE_VERSION,
            "time_s": self.time_s,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_answering": self.num_answering,
            "num_thinking": self.num_thinking,
            "num_kv_blocks": self.num_kv_blocks,
            "num_kv_blocks_used": self.num_kv_blocks_used,
            "block_size": self.block_size,
            "step_time_s": self.step_time_s,
            "projection": None,
        }
        p = self.projection
        if p is not None:
            wire["projection"] = {
                "grid": p.grid.tolist(),
                "load": p.load.tolist(),
                "budget": p.budget,
                "survival_reasoning": p.survival_reasoning.tolist(),
                "survival_chat": p.survival_chat.tolist(),
            }
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ReplicaStats:
        """Read :meth:`to_wire`'s dict back; :class:`StatsError` names what is wrong."""
        if not isinstance(data, Mapping):
            raise StatsError(f"replica stats must be a mapping; got {type(data).__name__}")
        if data.get("version") != WIRE_VERSION:
            raise StatsError(
                f"replica stats version must be {WIRE_VERSION}; got {data.get('version')!r}"
            )
        counts = {
            name: _count(data, name)
            for name in (
                "num_running",
                "num_waiting",
                "num_answering",
                "num_thinking",
                "num_kv_blocks",
                "num_kv_blocks_used",
            )
        }
        raw = data.get("projection")
        projection = None if raw is None else _projection(raw)
        block_size = _count(data, "block_size")
        if block_size < 1:
            raise StatsError("replica stats: block_size must be >= 1")
        return cls(
            block_size=block_size,
            time_s=_number(data, "time_s"),
            step_time_s=_number(data, "step_time_s"),
            projection=projection,
            **counts,
        )


def _number(data: Mapping[str, Any], name: str, *, minimum: float = 0.0) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise StatsError(f"replica stats: {name} must be a finite number; got {value!r}")
    if value < minimum:
        raise StatsError(f"replica stats: {name} must be >= {minimum:g}; got {value!r}")
    return float(value)


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StatsError(f"replica stats: {name} must be an integer >= 0; got {value!r}")
    return value


def _curve(data: Mapping[str, Any], name: str, size: int | None) -> FloatArray:
    values = data.get(name)
    if not isinstance(values, list | tuple) or not values:
        raise StatsError(f"replica stats: projection.{name} must be a non-empty list")
    if size is not None and len(values) != size:
        raise StatsError(
            f"replica stats: projection.{name} has {len(values)} points; the grid has {size}"
        )
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)) or np.any(array < 0.0):
        raise StatsError(f"replica stats: projection.{name} must hold finite numbers >= 0")
    return array


def _projection(raw: Any) -> Projection:
    if not isinstance(raw, Mapping):
        raise StatsError("replica stats: projection must be a mapping or null")
    grid = _curve(raw, "grid", None)
    if np.any(np.diff(grid) <= 0.0):
        raise StatsError("replica stats: projection.grid must increase")
    return Projection(
        grid=grid,
        load=_curve(raw, "load", len(grid)),
        budget=_number(raw, "budget"),
        survival_reasoning=_curve(raw, "survival_reasoning", len(grid)),
        survival_chat=_curve(raw, "survival_chat", len(grid)),
    )


class Hold(Enum):
    """When the router holds a request no replica can take (module docstring)."""

    NEVER = "never"
    ADMISSION = "admission"
    HEADROOM = "headroom"

    @classmethod
    def parse(cls, value: object) -> Hold:
        """``value`` as a :class:`Hold` (one already, or its name); a one-line
        :class:`~meridian.errors.ConfigError` naming ``routing.hold`` otherwise."""
        if isinstance(value, Hold):
            return value
        if value not in HOLDS:
            raise ConfigError(f"routing.hold must be one of {', '.join(HOLDS)}; got {value!r}")
        return cls(value)


HOLDS = ("never", "admission", "headroom")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The router's knobs (module docstring): how old stats may be before they no longer hold
    a request, how long a request may be held, and when it is held (``hold``: a :class:`Hold`
    or its name).

    >>> RoutingConfig(hold="headroom").hold
    <Hold.HEADROOM: 'headroom'>
    """

    stats_max_age_s: float = DEFAULT_STATS_MAX_AGE_S
    max_hold_s: float = DEFAULT_MAX_HOLD_S
    hold: Hold = Hold.NEVER

    def __post_init__(self) -> None:
        for name in ("stats_max_age_s", "max_hold_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"routing.{name} must be a positive number of seconds; got {value}"
                )
        # A name read from a file or a Ray Serve kwarg is taken as its Hold.
        object.__setattr__(self, "hold", Hold.parse(self.hold))


@dataclass(slots=True)
class _Placed:
    """A request this router placed, until it completes; with its expected KV blocks on the
    last projection it was weighed against (the stats' projection, until they refresh)."""

    request: NewRequest
    routed_at: float
    projection: Projection | None = None
    blocks: FloatArray | None = None
    peak: float = 0.0


@dataclass(slots=True)
class _Unseen:
    """The requests a replica's stats do not count (:func:`_unseen`), for one (stats, in-flight
    version) pair, with their expected KV blocks on the stats' projection grid."""

    stats: ReplicaStats
    version: int
    placed: list[_Placed]
    requests: list[NewRequest]
    # Set by _Replica.unseen_blocks: their expected blocks summed (None: no request), and the
    # sum of each one's largest, at least their summed peak.
    weighed: bool = False
    total: FloatArray | None = None
    peak_bound: float = 0.0
    # Set by _assess: per kind (reasoning, chat), the columns a decision's peak is one product
    # of (_Shape.columns).
    columns: list[FloatArray | None] = field(default_factory=lambda: [None, None])


@dataclass(slots=True)
class _Replica:
    stats: ReplicaStats | None = None
    in_flight: dict[str, _Placed] = field(default_factory=dict)
    # Requests placed on it ever (one moved elsewhere no longer counts): equal costs go to the
    # replica that got fewest (at light load every replica is idle between requests; by name
    # alone, the first got them all).
    num_routed: int = 0
    # When the driver last saw it fail a request (None: it answers).
    failed_at: float | None = None
    # Bumped whenever in_flight changes (the cached unseen requests are for one version), and
    # whether in_flight's send times never decrease in its order (then the requests sent since a
    # time are a suffix of it, counted from its end).
    version: int = 0
    in_order: bool = True
    unseen_cache: _Unseen | None = None
    # What the decision reads of the stats' projection, once per stats.
    shape: _Shape | None = None

    def place(self, request_id: str, placed: _Placed) -> None:
        """Record ``request_id`` in flight here (again: its send time changes in place)."""
        if request_id in self.in_flight:
            self.in_order = self.in_order and len(self.in_flight) == 1
        elif self.in_flight:
            last = next(reversed(self.in_flight.values()))
            self.in_order = self.in_order and placed.routed_at >= last.routed_at
        self.in_flight[request_id] = placed
        self.version += 1

    def remove(self, request_id: str) -> None:
        """``request_id`` is no longer in flight here (unknown ids are ignored)."""
        if self.in_flight.pop(request_id, None) is not None:
            self.version += 1
            if not self.in_flight:
                self.in_order = True

    def unseen(self, stats: ReplicaStats) -> _Unseen:
        """:func:`_unseen` of ``stats``, computed once per stats and in-flight version."""
        cached = self.unseen_cache
        if cached is None or cached.stats is not stats or cached.version != self.version:
            placed = _unseen(self, stats)
            requests = [p.request for p in placed]
            cached = self.unseen_cache = _Unseen(stats, self.version, placed, requests)
        return cached

    def unseen_blocks(self, stats: ReplicaStats, projection: Projection) -> _Unseen:
        """:meth:`unseen` with each request's expected blocks on ``projection`` (``stats``')."""
        cached = self.unseen(stats)
        if not cached.weighed:
            # NOTE: each request's blocks once per projection, not once per in-flight change: a
            # replica's unseen requests change with every request placed on it or completed.
            total: FloatArray | None = None
            bound = 0.0
            for placed in cached.placed:
                if placed.projection is not projection or placed.blocks is None:
                    placed.blocks = projection.request_blocks(placed.request, stats.block_size)
                    placed.peak = float(placed.blocks.max())
                    placed.projection = projection
                total = placed.blocks if total is None else total + placed.blocks
                bound += placed.peak
            cached.weighed = True
            cached.total = total
            cached.peak_bound = bound
        return cached

    def shape_of(self, stats: ReplicaStats, projection: Projection) -> _Shape:
        """:class:`_Shape` of ``stats`` (whose projection is ``projection``), once per stats."""
        shape = self.shape
        if shape is None or shape.stats is not stats:
            shape = self.shape = _Shape.of(stats, projection)
        return shape


@dataclass(slots=True, eq=False)
class _Shape:
    """What every decision reads of one stats and its projection: whether the replica was idle,
    its budget (at least a block), the room its largest load leaves in it (less a margin for
    rounding), its largest survivals (reasoning, chat), the last step of its grid, per kind a
    fresh request's expected blocks with no prompt (:meth:`Projection.request_blocks` without
    ``max_tokens``, less the prompt), and :meth:`Projection.slopes`."""

    stats: ReplicaStats
    idle: bool  # nothing running or waiting
    budget: float
    room: float
    survival_max: tuple[float, float]
    last: float
    survival: tuple[FloatArray, FloatArray]
    grid_blocks: tuple[FloatArray, FloatArray]
    empty_blocks: float
    cell: float
    slopes: FloatArray | None

    @classmethod
    def of(cls, stats: ReplicaStats, projection: Projection) -> _Shape:
        survival = projection.survival_reasoning, projection.survival_chat
        blocks = kv_blocks(projection.grid, stats.block_size)
        budget = max(projection.budget, 1.0)
        cell, slopes = projection.slopes()
        return cls(
            stats=stats,
            idle=stats.num_running == 0 and stats.num_waiting == 0,
            budget=budget,
            room=budget * (1.0 - 1e-9) - float(projection.load.max()),
            survival_max=(float(survival[0].max()), float(survival[1].max())),
            last=float(projection.grid[-1]),
            survival=survival,
            grid_blocks=(blocks * survival[0], blocks * survival[1]),
            empty_blocks=kv_blocks(0.0, stats.block_size),
            cell=cell,
            slopes=slopes,
        )

    def columns(self, projection: Projection, unseen: _Unseen, kind: int) -> FloatArray:
        """Per grid point (rows): the load with the uncounted requests' and a fresh request's
        blocks without its prompt (kind ``kind``), the load's slope, the kind's survival. A
        request's peak ``steps`` into the first cell is the largest of ``columns @ (1, steps,
        its prompt's blocks)``: kv_blocks is affine in tokens, so the prompt adds its own blocks
        less an empty request's at every step."""
        assert self.slopes is not None
        base = projection.load + self.grid_blocks[kind]
        if unseen.total is not None:
            base = base + unseen.total
        columns: FloatArray = np.array((base, self.slopes, self.survival[kind])).T
        return columns


def _unseen(replica: _Replica, stats: ReplicaStats) -> list[_Placed]:
    """The requests this router placed on ``replica`` that its ``stats`` do not count: those
    sent since the stats were measured, or, if more, those beyond the requests the stats count
    (running or waiting), the latest placed first. The second covers requests still on their way
    (in the replica's frontend, not yet in its scheduler) when the stats were measured: in a
    burst they are hundreds, and a replica that reported itself idle would otherwise take them
    all."""
    in_flight = replica.in_flight
    if replica.in_order:  # those sent since are the latest: count from the end
        since = len(in_flight)
        for i, placed in enumerate(reversed(in_flight.values())):
            if placed.routed_at < stats.time_s:
                since = i
                break
    else:
        since = sum(p.routed_at >= stats.time_s for p in in_flight.values())
    beyond = len(in_flight) - stats.num_running - stats.num_waiting
    count = max(since, beyond)
    if count <= 0:
        return []
    latest = list(itertools.islice(reversed(in_flight.values()), count))
    latest.reverse()  # in the order they were placed
    return latest


def _prompt_blocks(request: NewRequest, block_size: int) -> int:
    """The KV blocks vLLM allocates for ``request``'s prompt when it admits it."""
    return -(-request.num_prompt_tokens // block_size)


def _steps(stats: ReplicaStats, now: float) -> float:
    """The engine steps the replica ``stats`` describe has run since they were measured."""
    elapsed = max(0.0, now - stats.time_s)
    return elapsed / stats.step_time_s if stats.step_time_s > 0.0 else 0.0


def _peak(
    stats: ReplicaStats,
    projection: Projection,
    unseen: FloatArray | None,
    request: NewRequest,
    steps: float,
) -> float:
    """The projected KV peak of the replica ``stats`` describe with the ``unseen`` requests'
    expected blocks (summed) and ``request`` added, its load aged by the ``steps`` run since
    ``stats`` (:func:`_steps`)."""
    load = projection.aged(steps)
    if unseen is not None:
        load = load + unseen
    need = projection.request_blocks(request, stats.block_size)
    return float((load + need).max())  # (ndarray.max: half np.max's cost on 48 points)


# Rank tiers: replicas that can take the request (it fits their projection, or their stats cannot
# say: none, stale or without a projection), those without room for it.
_OPEN, _FULL = 0, 1


class RoutingPolicy:
    """Meridian's routing decision (module docstring), the same object in every driver.

    A driver reports each replica's stats (:meth:`observe`), the requests it placed
    (:meth:`routed`) and their completion (:meth:`completed`), and asks :meth:`rank` for every
    new request. Deterministic: the same calls give the same ranks (ties go to the replica this
    router has sent fewest requests, then by name, whatever the candidates' order).

    >>> policy = RoutingPolicy()
    >>> policy.rank(["b", "a"], NewRequest(Phase.THINK, 100), now=0.0)  # no stats: by queue
    ['a', 'b']
    """

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._replicas: dict[str, _Replica] = {}
        self._placed_on: dict[str, str] = {}
        self._failed: set[str] = set()  # the replicas whose failed_at is set

    def _replica(self, name: str) -> _Replica:
        replica = self._replicas.get(name)
        if replica is None:
            replica = self._replicas[name] = _Replica()
        return replica

    # -- what the driver reports ---------------------------------------------------------------

    def observe(self, replica: str, stats: ReplicaStats | None) -> None:
        """``replica``'s latest stats (``None``: it has reported none, or they were unreadable)."""
        self._replica(replica).stats = stats

    def routed(self, replica: str, request_id: str, request: NewRequest, now: float) -> None:
        """The driver sent ``request_id`` to ``replica`` at ``now`` (again: it moved there)."""
        before = self._placed_on.get(request_id)
        if before is not None and before != replica:
            moved_from = self._replicas[before]
            moved_from.remove(request_id)
            moved_from.num_routed -= 1  # it went elsewhere: not one of this replica's
        target = self._replica(replica)
        if request_id not in target.in_flight:
            target.num_routed += 1
        target.place(request_id, _Placed(request, now))
        self._placed_on[request_id] = replica

    def completed(self, request_id: str) -> None:
        """``request_id`` finished (or failed); unknown ids are ignored."""
        replica = self._placed_on.pop(request_id, None)
        if replica is not None:
            self._replicas[replica].remove(request_id)

    def forget(self, replica: str) -> None:
        """``replica`` is gone: its stats and its in-flight requests with it."""
        gone = self._replicas.pop(replica, None)
        self._failed.discard(replica)
        if gone is not None:
            for request_id in gone.in_flight:
                self._placed_on.pop(request_id, None)

    def failed(self, replica: str, now: float) -> None:
        """A request on ``replica`` failed at ``now``: no new request goes there until it
        :meth:`answered` after ``now`` (module docstring)."""
        target = self._replica(replica)
        if target.failed_at is None or now > target.failed_at:
            target.failed_at = now
            self._failed.add(replica)

    def answered(self, replica: str, at: float) -> None:
        """``replica`` was seen working at ``at`` (a health check, a request that succeeded):
        back in rotation if that is after its last failure."""
        target = self._replicas.get(replica)
        if target is not None and target.failed_at is not None and at > target.failed_at:
            target.failed_at = None
            self._failed.discard(replica)

    def is_failed(self, replica: str) -> bool:
        """Whether ``replica`` is out of rotation (it failed and has not answered since)."""
        return replica in self._failed

    def placed_on(self, request_id: str) -> str | None:
        """The replica ``request_id`` was sent to (``None``: none, or it completed)."""
        return self._placed_on.get(request_id)

    def num_in_flight(self, replica: str) -> int:
        """Requests this router placed on ``replica`` that have not completed."""
        found = self._replicas.get(replica)
        return 0 if found is None else len(found.in_flight)

    # -- the decision ----------------------------------------------------------------------------

    def rank(
        self,
        candidates: Sequence[str],
        request: NewRequest,
        now: float,
        waited_s: float = 0.0,
    ) -> list[str]:
        """``candidates`` best first, or ``[]`` to hold ``request`` (:attr:`RoutingConfig.hold`
        holds it and it has waited less than ``max_hold_s``: ``waited_s`` since it reached the
        router). Replicas out of rotation (:meth:`failed`) are left out while any other is a
        candidate; when all are, ``request`` is held as when none fits. Otherwise a permutation
        of ``candidates`` (duplicates are ranked once)."""
        names = set(candidates)
        may_hold = waited_s < self.config.max_hold_s
        working = names - self._failed
        if working:
            names = working
        elif may_hold:
            return []
        kind = 0 if request.reasoning else 1
        keyed: list[tuple[tuple[int, float, int], str]] = []
        find, assess = self._replicas.get, self._assess  # (bound once: 16 replicas a decision)
        for name in names:
            replica = find(name) or _Replica()
            tier, cost = assess(replica, request, kind, now)
            keyed.append(((tier, cost, replica.num_routed), name))
        keyed.sort()
        if keyed and may_hold and self._holds(keyed, request, now):
            return []
        return [name for _, name in keyed]

    def _holds(
        self, keyed: list[tuple[tuple[int, float, int], str]], request: NewRequest, now: float
    ) -> bool:
        """Whether :attr:`RoutingConfig.hold` holds ``request`` over the ranked ``keyed``."""
        hold = self.config.hold
        if hold is Hold.HEADROOM:
            return keyed[0][0][0] == _FULL
        if hold is Hold.ADMISSION:
            return not any(self.admits(name, request, now) is not False for _, name in keyed)
        return False

    def admits(self, replica: str, request: NewRequest, now: float) -> bool | None:
        """Whether ``replica``'s vLLM admission could take ``request`` now: nothing waits there
        and its free KV blocks, less the prompts of the requests sent there that its stats do
        not count, hold the request's prompt (an idle replica always could); ``None`` where its
        stats cannot say (none, or older than ``stats_max_age_s``)."""
        found = self._replicas.get(replica) or _Replica()
        stats = found.stats
        if stats is None or now - stats.time_s > self.config.stats_max_age_s:
            return None
        unseen = found.unseen(stats).requests
        if stats.num_running == 0 and stats.num_waiting == 0 and not unseen:
            return True
        if stats.num_waiting > 0:
            return False
        free = stats.num_kv_blocks - stats.num_kv_blocks_used
        free -= sum(_prompt_blocks(placed, stats.block_size) for placed in unseen)
        return free >= _prompt_blocks(request, stats.block_size)

    def _assess(
        self, replica: _Replica, request: NewRequest, kind: int, now: float
    ) -> tuple[int, float]:
        """(tier, cost) of ``replica`` for ``request`` (of that kind: 0 reasoning, 1 chat): lower
        tiers and costs are better; ``_FULL`` where the request would overflow the replica's
        budget, the cost then how far (a fraction of it), else this router's requests in flight
        on it (module docstring)."""
        stats = replica.stats
        if (
            stats is None
            or stats.projection is None
            or now - stats.time_s > self.config.stats_max_age_s
        ):
            return _OPEN, float(len(replica.in_flight))
        projection = stats.projection
        unseen = replica.unseen_cache  # (unseen_blocks' cache read here: it is the usual case)
        if (
            unseen is None
            or unseen.stats is not stats
            or unseen.version != replica.version
            or not unseen.weighed
        ):
            unseen = replica.unseen_blocks(stats, projection)
        shape = replica.shape_of(stats, projection)
        if shape.idle and not unseen.requests:
            return _OPEN, float(len(replica.in_flight))
        # NOTE: a bound first, the projection only where it cannot decide. Aging only reads
        # later points of the load, so no aged load exceeds its largest point, and no request
        # holds more than its prompt and bound times its kind's largest survival: when those
        # together stay within the budget, so does the peak computed below (a margin for
        # rounding). At 16 replicas with room most decisions end here (issue 45: the cost per
        # decision).
        bound = shape.last if request.max_tokens is None else min(shape.last, request.max_tokens)
        need_max = kv_blocks(request.num_prompt_tokens + bound, stats.block_size)
        need_max *= shape.survival_max[kind]
        if unseen.peak_bound + need_max <= shape.room:
            return _OPEN, float(len(replica.in_flight))
        steps = _steps(stats, now)
        if (request.max_tokens is not None and request.max_tokens < shape.last) or not (
            steps < shape.cell
        ):
            peak = _peak(stats, projection, unseen.total, request, steps)
        else:
            # NOTE: _peak as one product (_Shape.columns), its columns once per in-flight
            # change. Stats a poll old are tens of steps old, within the grid's first cell (a
            # 47th of the longest request); older ones take _peak above.
            columns = unseen.columns[kind]
            if columns is None:
                columns = unseen.columns[kind] = shape.columns(projection, unseen, kind)
            prompt = kv_blocks(request.num_prompt_tokens, stats.block_size) - shape.empty_blocks
            values = columns.dot((1.0, steps, prompt))
            peak = float(values[values.argmax()])  # (argmax and an index: cheaper than .max())
        budget = shape.budget
        if peak > budget:
            return _FULL, (peak - budget) / budget
        return _OPEN, float(len(replica.in_flight))

    # -- what a migration asks (meridian.core.migration) ---------------------------------------

    def stats_of(self, replica: str, now: float) -> ReplicaStats | None:
        """``replica``'s stats if it reported some no older than ``stats_max_age_s``."""
        found = self._replicas.get(replica)
        stats = None if found is None else found.stats
        if stats is None or now - stats.time_s > self.config.stats_max_age_s:
            return None
        return stats

    def margin(self, replica: str, request: NewRequest, now: float) -> float | None:
        """The share of ``replica``'s budget left at its projected peak with ``request`` added
        (below 0: it overflows); ``None`` without a fresh projection."""
        stats = self.stats_of(replica, now)
        if stats is None or stats.projection is None:
            return None
        unseen = self._replicas[replica].unseen_blocks(stats, stats.projection)
        budget = max(stats.projection.budget, 1.0)
        peak = _peak(stats, stats.projection, unseen.total, request, _steps(stats, now))
        return (budget - peak) / budget

    def free_share(self, replica: str, request: NewRequest, now: float) -> float | None:
        """The share of ``replica``'s KV blocks free once the prompts of the requests sent since
        its stats and ``request``'s tokens are in (below 0: they do not fit; -1 while requests
        wait there); ``None`` without fresh stats."""
        stats = self.stats_of(replica, now)
        if stats is None or stats.num_kv_blocks == 0:
            return None
        if stats.num_waiting > 0:
            return -1.0
        unseen = self._replicas[replica].unseen(stats).requests
        free = stats.num_kv_blocks - stats.num_kv_blocks_used
        free -= sum(_prompt_blocks(placed, stats.block_size) for placed in unseen)
        free -= _prompt_blocks(request, stats.block_size)
        return free / stats.num_kv_blocks

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the in-flight tables disagree."""
        count = 0
        for name, replica in self._replicas.items():
            for request_id in replica.in_flight:
                if self._placed_on.get(request_id) != name:
                    raise AssertionError(f"{request_id!r} in flight on {name!r} but not placed")
                count += 1
        if count != len(self._placed_on):
            raise AssertionError(f"{len(self._placed_on)} placed, {count} in flight")
