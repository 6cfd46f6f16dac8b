# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
"""``MeridianLLMServer``: Ray Serve LLM's ``LLMServer`` with Meridian's stats, metrics and
failure reports.

Each replica runs vLLM's ``AsyncLLM``, whose engine core (and Meridian's scheduler in it) is a
process vLLM spawns from the replica (vLLM forces ``spawn`` inside a Ray actor), so the
scheduler's state reaches the replica through its environment, set before the engine starts
(:class:`ReplicaChannel`):

- ``$MERIDIAN_REPLICA_STATE``: the file the scheduler writes its routing stats to
  (:mod:`meridian.vllm.replica_state`); ``record_routing_stats()``, which Ray Serve's controller
  polls, returns them under ``"meridian"`` (with ``LLMServer``'s own stats). A replica whose
  last stats show it idle and that has received no request since is reported idle *now*: an
  idle scheduler writes nothing more, and an idle replica should not look stale to the router.
- ``$PROMETHEUS_MULTIPROC_DIR``: a fresh directory per replica. Ray Serve LLM exports vLLM's own
  metrics through Ray's stat logger, which does not see the scheduler's ``meridian_*`` metrics;
  in prometheus_client's multiprocess mode the spawned engine core writes them to this
  directory, and :meth:`MeridianLLMServer.meridian_metrics` reads them for the cluster's front
  door (``/metrics`` of :mod:`meridian.ray.ingress`), over Ray's own (authenticated) channel:
  a replica opens no port of its own.

Health. The routing stats also say whether the engine answers (``meridian_health``: vLLM's own
health check at the poll). A request that fails on a replica whose engine no longer answers
raises :class:`~meridian.ray.failure.ReplicaFailedError`, which tells the ingress to take the
replica out of rotation and to place the request elsewhere if nothing of it reached the client;
a request that fails while the engine answers is that request's own error.

Every replica's files live in ``$MERIDIAN_CLUSTER_DIR/replica-RANK`` (a temporary directory when
the variable is unset): ``state.json`` and ``prom/``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from ray import serve
from ray.serve.llm import LLMServer

from meridian.ray.failure import ReplicaFailedError
from meridian.ray.router import HEALTH_KEY, STATS_KEY
from meridian.vllm.replica_state import ENV_REPLICA_STATE, read_replica_state

__all__ = ["ENV_CLUSTER_DIR", "MeridianLLMServer", "ReplicaChannel"]

logger = logging.getLogger(__name__)

ENV_CLUSTER_DIR = "MERIDIAN_CLUSTER_DIR"
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _replica_identity() -> tuple[int, str]:
    """This replica's rank in its deployment and its unique id (the router's name for it);
    ``(0, "local")`` outside a Serve replica (a unit test)."""
    try:
        context = serve.get_replica_context()
    except Exception:
        return 0, "local"
    rank = getattr(context.rank, "rank", context.rank)
    return int(rank or 0), str(context.replica_id.unique_id)


class ReplicaChannel:
    """One replica's side of the channel (module docstring): directories and environment for
    the engine it is about to start, its metrics, and the stats to report."""

    def __init__(self, root: Path, rank: int) -> None:
        self.directory = root / f"replica-{rank}"
        self.state_path = self.directory / "state.json"
        self.prometheus_dir = self.directory / "prom"
        # Fresh every start: stale files would be counted into this engine's metrics.
        shutil.rmtree(self.prometheus_dir, ignore_errors=True)
        self.prometheus_dir.mkdir(parents=True)
        self.state_path.unlink(missing_ok=True)
        os.environ[ENV_REPLICA_STATE] = str(self.state_path)
        os.environ[PROMETHEUS_DIR_ENV] = str(self.prometheus_dir)
        self._registry = CollectorRegistry()
        MultiProcessCollector(self._registry, path=str(self.prometheus_dir))  # type: ignore[no-untyped-call]
        self._last_arrival = 0.0

    @classmethod
    def from_env(cls, rank: int) -> ReplicaChannel:
        root = os.environ.get(ENV_CLUSTER_DIR) or tempfile.mkdtemp(prefix="meridian-replica-")
        return cls(Path(root), rank)

    def arrived(self) -> None:
        """A request reached this replica."""
        self._last_arrival = time.time()

    def routing_stats(self) -> dict[str, Any]:
        """Meridian's stats for ``record_routing_stats()`` (module docstring)."""
        stats = read_replica_state(self.state_path)
        if stats is None:
            return {}
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and self._last_arrival < stats.time_s:
            stats = dataclasses.replace(stats, time_s=time.time())
        return {STATS_KEY: stats.to_wire()}

    def metrics_text(self) -> str:
        """The engine's ``meridian_*`` metrics, in Prometheus' text format."""
        return generate_latest(self._registry).decode()


class MeridianLLMServer(LLMServer):
    """``LLMServer`` whose replica reports Meridian's stats, its engine's health and metrics,
    and its failures (module docstring)."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:
        # Before the engine starts: its spawned engine core inherits the environment.
        rank, self.meridian_replica = _replica_identity()
        self.meridian_channel = ReplicaChannel.from_env(rank)
        await super().__init__(llm_config, **kwargs)

    async def _engine_answers(self) -> bool:
        try:
            await self.check_health()
        except Exception:
            return False
        return True

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        stats.update(self.meridian_channel.routing_stats())
        stats[HEALTH_KEY] = {"ok": await self._engine_answers(), "time_s": time.time()}
        return stats

    async def meridian_metrics(self) -> tuple[str, str]:
        """This replica's name (as the router knows it) and its ``meridian_*`` metrics."""
        return self.meridian_replica, self.meridian_channel.metrics_text()

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        return await self._serve(super().chat, request, raw_request_info)

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        return await self._serve(super().completions, request, raw_request_info)

    async def _serve(
        self, method: Callable[..., Awaitable[Any]], request: Any, raw_request_info: Any
    ) -> AsyncIterator[Any]:
        self.meridian_channel.arrived()
        try:
            stream = await method(request, raw_request_info)
        except Exception as exc:
            await self._raise_failure(exc)
            raise
        return self._watch(stream)

    async def _watch(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``stream``, with a failure of this replica's engine raised as a
        :class:`ReplicaFailedError` (module docstring)."""
        first = True
        try:
            async for item in stream:
                if first and _server_error(item) is not None:
                    await self._raise_failure(RuntimeError(_server_error(item)))
                first = False
                yield item
        except ReplicaFailedError:
            raise
        except Exception as exc:
            await self._raise_failure(exc)
            raise

    async def _raise_failure(self, exc: Exception) -> None:
        """Raise :class:`ReplicaFailedError` for ``exc`` if this replica's engine no longer
        answers; return if it does (``exc`` is then the request's own)."""
        if await self._engine_answers():
            return
        logger.error("Meridian replica %s: engine failed: %r", self.meridian_replica, exc)
        raise ReplicaFailedError(self.meridian_replica, type(exc).__name__) from exc


def _server_error(item: Any) -> str | None:
    """The message of an item that is a server-side error response (5xx), else ``None``."""
    first = item[0] if isinstance(item, list) and item else item
    error = getattr(first, "error", None)
    code = getattr(error, "code", None)
    if isinstance(code, int) and code >= 500:
        return str(getattr(error, "message", "server error"))
    return None
