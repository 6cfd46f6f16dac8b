"""The side channel from Meridian's scheduler to its Ray Serve replica: routing stats in a file.

Under Ray Serve LLM the scheduler runs in vLLM's engine-core process, spawned by the replica's
actor; the replica answers the controller's ``record_routing_stats()`` polls
(:mod:`meridian.ray.server`). The replica names a file in ``$MERIDIAN_REPLICA_STATE`` before the
engine starts (the spawned process inherits it); the scheduler writes its
:class:`~meridian.core.routing.ReplicaStats` there, as JSON, whenever it publishes its metrics
(at most every ``PUBLISH_INTERVAL_S`` while it runs, and when it idles), with a rename so a
reader never sees half a file. Without the variable nothing is written.

The stats carry wall time (``time.time()``): the router compares them with its own clock, in
another process.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from meridian.core.replica_stats import ReplicaStatsRecorder
from meridian.core.routing import ReplicaStats, StatsError
from meridian.vllm.publishing import Publisher

__all__ = ["ENV_REPLICA_STATE", "ReplicaStateWriter", "read_replica_state"]

ENV_REPLICA_STATE = "MERIDIAN_REPLICA_STATE"


class ReplicaStateWriter:
    """Writes a scheduler's routing stats to ``path`` (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._scratch = path.with_name(path.name + ".tmp")
        self._recorder = ReplicaStatsRecorder()

    @classmethod
    def from_env(cls) -> ReplicaStateWriter | None:
        """The writer ``$MERIDIAN_REPLICA_STATE`` asks for (``None``: not asked)."""
        raw = os.environ.get(ENV_REPLICA_STATE, "").strip()
        return cls(Path(raw)) if raw else None

    @classmethod
    def attach(cls, scheduler: Any, publisher: Publisher) -> ReplicaStateWriter | None:
        """The writer ``$MERIDIAN_REPLICA_STATE`` asks for, writing ``scheduler``'s stats after
        each of ``publisher``'s publishes (``None``: not asked, nothing attached)."""
        writer = cls.from_env()
        if writer is not None:
            publisher.on_publish = functools.partial(writer.write, scheduler)
        return writer

    def write(self, scheduler: Any) -> None:
        """The stats of ``scheduler`` (a :class:`~meridian.vllm.scheduler.MeridianScheduler`)
        now: its policy, running and waiting requests, and its KV cache as its admission sees
        it (every block but vLLM's null block)."""
        pool = scheduler.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1
        stats = self._recorder.record(
            scheduler.meridian_policy,
            scheduler.running,
            list(scheduler.waiting),
            num_kv_blocks=usable,
            num_kv_blocks_used=usable - pool.get_num_free_blocks(),
            num_steps=scheduler.current_step,
            now=time.time(),
        )
        self._scratch.write_text(json.dumps(stats.to_wire()), encoding="utf-8")
        os.replace(self._scratch, self.path)


def read_replica_state(path: Path) -> ReplicaStats | None:
    """The stats last written to ``path``; ``None`` while there are none or they cannot be
    read (a reader must not fail the replica's poll)."""
    try:
        return ReplicaStats.from_wire(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, StatsError):
        return None
