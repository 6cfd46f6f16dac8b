"""A replica's routing stats, measured from its Meridian policy and its engine's queues.

Both drivers of the routing policy (:mod:`meridian.core.routing`) build a replica's
:class:`~meridian.core.routing.ReplicaStats` here: Meridian's vLLM scheduler writes them for its
Ray Serve replica to report (:mod:`meridian.vllm.replica_state`), and the cluster simulator takes
them from each simulated replica when the router's view of it refreshes. The projection is the
replica's own headroom model (:class:`~meridian.core.headroom.LengthModel`), under the same
conditions as its admission uses it (:meth:`~meridian.core.policy.MeridianPolicy.admissions`),
so a router holds a request exactly where the replica's admission would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from meridian.core.interface import EngineRequest
from meridian.core.policy import MeridianPolicy
from meridian.core.routing import ReplicaStats
from meridian.core.types import Phase

__all__ = ["ReplicaStatsRecorder"]


class ReplicaStatsRecorder:
    """Measures one replica's stats, call after call; between two calls, its step rate."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None
        # NOTE: not a step's time (the planner's, plan to plan, busy steps only) but seconds per
        # step over the reporter's clock, idle spells included: the router ages stats by the
        # steps run since, and an idle replica runs none (ReplicaStats.step_time_s).
        self.seconds_per_step = 0.0

    def record(
        self,
        policy: MeridianPolicy,
        running: Sequence[EngineRequest],
        waiting: Sequence[EngineRequest],
        *,
        num_kv_blocks: int,
        num_kv_blocks_used: int,
        num_steps: int,
        now: float,
    ) -> ReplicaStats:
        """The stats at ``now`` (the policy's clock): ``num_kv_blocks`` is the cache the
        admission projects into (as the engine passes it to ``admissions``), ``num_steps`` the
        engine's step count so far."""
        last = self._last
        if last is not None and num_steps > last[1] and now > last[0]:
            self.seconds_per_step = (now - last[0]) / (num_steps - last[1])
        self._last = (now, num_steps)
        answering = 0
        for request in running:
            # A request not tracked yet has not started answering.
            with contextlib.suppress(KeyError):
                answering += policy.phase(request.request_id) is Phase.OUTPUT
        return ReplicaStats(
            time_s=now,
            num_running=len(running),
            num_waiting=len(waiting),
            num_answering=answering,
            num_thinking=len(running) - answering,
            num_kv_blocks=num_kv_blocks,
            num_kv_blocks_used=num_kv_blocks_used,
            block_size=policy.block_size,
            step_time_s=self.seconds_per_step,
            projection=policy.admission.projection([*running, *waiting], num_kv_blocks),
        )
