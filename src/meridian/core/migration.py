"""Moving a request between replicas after its placement: when, where to, and at what cost.

One policy, two drivers: the cluster simulator (:mod:`meridian.sim.migration`) measures these
decisions; a Ray Serve driver would make the same calls with the same router state. Three
mechanisms (issue 45), each an upper bound on what moving can buy before a driver is built:

- **Re-placement by recompute** (:attr:`Reason.PREEMPTED`, :attr:`Reason.WAITED`): a request
  preempted on a replica, or waiting there longer than :attr:`MigrationConfig.max_wait_s`, is
  taken off it and placed on the replica with the most room for it, whose prefill recomputes its
  prompt and the tokens it has generated (the cost its local preemption pays anyway, without the
  local queue).
- **Answer streams moved at ``</think>``** (:attr:`Reason.ANSWER`): a request that starts
  answering on a replica under pressure moves to one with room, its KV sent over a link
  (:attr:`MigrationConfig.link_bytes_per_s`) or recomputed there, whichever is cheaper.
- **A split after Pascal** (arXiv:2602.11530), when :attr:`MigrationConfig.answer_share` is
  set: that share of the replicas, the last ones, answer first. A request that starts thinking
  is placed on the others, one that answers from its start on them
  (:meth:`MigrationPolicy.placement`), and every request that closes its ``</think>`` on a
  thinking replica moves to the answer-first one with the most room
  (:meth:`MigrationPolicy.move_answer`), paying the link or recompute as an answer stream moved
  under pressure does.

Room, as the router sees it (:class:`~meridian.core.routing.RoutingPolicy`'s stats and its own
in-flight requests): a replica whose stats carry a fresh projection has room for a request when
it fits (:meth:`~meridian.core.routing.RoutingPolicy.margin`: the share of its budget left at its
projected peak with the request added); one without a projection has room when nothing waits
there and its free KV blocks, less those of the requests sent since its stats, hold the
request's tokens (the share of its blocks left). Stale or missing stats: no room (a request is
never moved to a replica the router cannot see).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from meridian.core.routing import NewRequest, RoutingPolicy
from meridian.errors import ConfigError

__all__ = [
    "DEFAULT_ANSWER_SHARE",
    "DEFAULT_LINK_BYTES_PER_S",
    "DEFAULT_MAX_WAIT_S",
    "MigrationConfig",
    "MigrationPolicy",
    "Reason",
    "Transfer",
]

# A PCIe Gen4 x16 link's usable bandwidth, about 25 GB/s each way (NVLink is 10-36x that): the
# default KV link between two replicas, a conservative one.
DEFAULT_LINK_BYTES_PER_S = 25e9
# A request waiting on one replica this long is re-placed (Meridian's admission bounds a
# request's wait at 30 s; a third of it leaves time to be served elsewhere).
DEFAULT_MAX_WAIT_S = 10.0
# The split's answer-first share of the replicas: the answer phase's share of the KV a request
# holds over its decode steps, 11-13 % on both bundled workloads (docs/cluster.md).
DEFAULT_ANSWER_SHARE = 0.125


class Reason(Enum):
    """Why a request moved (the label of ``meridian_migrations_total{reason}``)."""

    PREEMPTED = "preempted"
    WAITED = "waited"
    ANSWER = "answer"


class Transfer(Enum):
    """How a moved request's KV reaches its new replica."""

    RECOMPUTE = "recompute"
    LINK = "link"


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """The knobs (module docstring): the wait that re-places a request, the link's bandwidth,
    how often one request may move (a bound on ping-pong) and the split's answer-first share
    (``None``: no split; :data:`DEFAULT_ANSWER_SHARE` is the one measured)."""

    max_wait_s: float = DEFAULT_MAX_WAIT_S
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    max_moves: int = 2
    answer_share: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_wait_s", "link_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"migration.{name} must be a positive number; got {value}")
        if self.max_moves < 1:
            raise ConfigError(f"migration.max_moves must be >= 1; got {self.max_moves}")
        share = self.answer_share
        if share is not None and not (isinstance(share, int | float) and 0.0 < share < 1.0):
            raise ConfigError(f"migration.answer_share must be between 0 and 1; got {share!r}")


class MigrationPolicy:
    """The decisions (module docstring) over the router's view of the replicas.

    >>> from meridian.core.types import Phase
    >>> policy = MigrationPolicy(RoutingPolicy())
    >>> policy.transfer(kv_bytes=2.5e9, recompute_s=0.5)  # 0.1 s over a 25 GB/s link
    (<Transfer.LINK: 'link'>, 0.1)
    """

    def __init__(self, routing: RoutingPolicy, config: MigrationConfig | None = None) -> None:
        self.routing = routing
        self.config = config or MigrationConfig()

    def room(self, replica: str, request: NewRequest, now: float) -> float | None:
        """The share of ``replica``'s KV left with ``request`` added (below 0: it overflows);
        ``None``: its stats cannot say (module docstring)."""
        margin = self.routing.margin(replica, request, now)
        if margin is not None:
            return margin
        return self.routing.free_share(replica, request, now)

    def under_pressure(self, replica: str, request: NewRequest, now: float) -> bool:
        """Whether ``replica`` cannot take ``request``'s remaining growth beside its load: it
        overflows its room, or requests wait there."""
        stats = self.routing.stats_of(replica, now)
        if stats is None:
            return False
        room = self.room(replica, request, now)
        return stats.num_waiting > 0 or (room is not None and room < 0.0)

    def target(
        self, source: str, candidates: Sequence[str], request: NewRequest, now: float
    ) -> str | None:
        """The replica other than ``source`` with the most room for ``request`` (ties to the
        fewest of this router's requests in flight, then the name); ``None`` where none has
        room or none is in rotation."""
        best: tuple[float, int, str] | None = None
        for name in candidates:
            if name == source or self.routing.is_failed(name):
                continue
            room = self.room(name, request, now)
            if room is None or room < 0.0:
                continue
            key = (-room, self.routing.num_in_flight(name), name)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def replace(
        self,
        source: str,
        candidates: Sequence[str],
        request: NewRequest,
        now: float,
        *,
        preempted: bool,
        waited_s: float,
        num_moves: int,
    ) -> tuple[Reason, str] | None:
        """Where to re-place a request on ``source`` (it was just ``preempted``, or has waited
        there ``waited_s``), and why; ``None``: it stays. ``request`` is what the target must
        take: its prompt and generated tokens as the prompt."""
        if num_moves >= self.config.max_moves:
            return None
        if preempted:
            reason = Reason.PREEMPTED
        elif waited_s > self.config.max_wait_s:
            reason = Reason.WAITED
        else:
            return None
        target = self.target(source, candidates, request, now)
        return None if target is None else (reason, target)

    def answer_pool(self, names: Sequence[str]) -> Sequence[str]:
        """The split's answer-first replicas: the last ``answer_share`` of ``names`` (rounded,
        at least one and at most all but one); none without a split or with fewer than two."""
        n, share = len(names), self.config.answer_share
        if share is None or n < 2:
            return ()
        k = min(n - 1, max(1, round(share * n)))
        return names[n - k :]

    def placement(self, names: Sequence[str], request: NewRequest) -> Sequence[str]:
        """The candidates for a new ``request``: under the split, the thinking replicas if it is
        expected to think, else the answer-first ones; otherwise all of ``names``."""
        pool = self.answer_pool(names)
        if not pool:
            return names
        return names[: len(names) - len(pool)] if request.reasoning else pool

    def move_answer(
        self,
        source: str,
        candidates: Sequence[str],
        request: NewRequest,
        now: float,
        *,
        num_moves: int,
    ) -> str | None:
        """Where a request that just closed its ``</think>`` on ``source`` should answer
        (``None``: it stays): under the split, the answer-first replica with the most room
        unless ``source`` is one; otherwise another replica with room when ``source`` is under
        pressure."""
        if num_moves >= self.config.max_moves:
            return None
        pool = self.answer_pool(candidates)
        if pool:
            return None if source in pool else self.target(source, pool, request, now)
        if not self.under_pressure(source, request, now):
            return None
        return self.target(source, candidates, request, now)

    def transfer(self, kv_bytes: float, recompute_s: float) -> tuple[Transfer, float]:
        """The cheaper way to bring ``kv_bytes`` of KV to the new replica, and its seconds: over
        the link, or recomputed there (``recompute_s``, the driver's estimate of the prefill)."""
        link_s = kv_bytes / self.config.link_bytes_per_s
        if link_s <= recompute_s:
            return Transfer.LINK, link_s
        return Transfer.RECOMPUTE, recompute_s
