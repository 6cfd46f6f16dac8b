# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
"""``MeridianLLMServer``: Ray Serve LLM's ``LLMServer`` with Meridian's stats and metrics.

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
  metrics through Ray's stat logger (``RayPrometheusStatLogger``), which does not see the
  scheduler's ``meridian_*`` metrics; in prometheus_client's multiprocess mode the spawned
  engine core writes them to this directory, and the replica serves them at
  ``http://HOST:PORT/metrics`` (``$MERIDIAN_METRICS_HOST``, default 127.0.0.1;
  ``$MERIDIAN_METRICS_PORT`` plus the replica's rank, or a free port when it is 0). The address
  is in the routing stats (``"meridian_metrics_url"``) and in the replica's directory.

Every replica's files live in ``$MERIDIAN_CLUSTER_DIR/replica-RANK`` (a temporary directory when
the variable is unset): ``metrics_url``, ``state.json`` and ``prom/``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector
from ray import serve
from ray.serve.llm import LLMServer

from meridian.ray.router import STATS_KEY
from meridian.vllm.replica_state import ENV_REPLICA_STATE, read_replica_state

__all__ = [
    "ENV_CLUSTER_DIR",
    "ENV_METRICS_HOST",
    "ENV_METRICS_PORT",
    "METRICS_URL_KEY",
    "MeridianLLMServer",
    "ReplicaChannel",
]

logger = logging.getLogger(__name__)

ENV_CLUSTER_DIR = "MERIDIAN_CLUSTER_DIR"
ENV_METRICS_HOST = "MERIDIAN_METRICS_HOST"
ENV_METRICS_PORT = "MERIDIAN_METRICS_PORT"
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The key of the replica's metrics address in its ``routing_stats``.
METRICS_URL_KEY = "meridian_metrics_url"


def _replica_rank() -> int:
    """This replica's rank in its deployment (0 outside a Serve replica)."""
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # not inside a replica (a unit test)
        return 0
    return int(getattr(rank, "rank", rank) or 0)


class ReplicaChannel:
    """One replica's side of the channel (module docstring): directories and environment for
    the engine it is about to start, the metrics endpoint, and the stats to report."""

    def __init__(self, root: Path, rank: int, host: str, base_port: int) -> None:
        self.directory = root / f"replica-{rank}"
        self.state_path = self.directory / "state.json"
        self.prometheus_dir = self.directory / "prom"
        # Fresh every start: stale files would be counted into this engine's metrics.
        shutil.rmtree(self.prometheus_dir, ignore_errors=True)
        self.prometheus_dir.mkdir(parents=True)
        self.state_path.unlink(missing_ok=True)
        os.environ[ENV_REPLICA_STATE] = str(self.state_path)
        os.environ[PROMETHEUS_DIR_ENV] = str(self.prometheus_dir)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.prometheus_dir))  # type: ignore[no-untyped-call]
        port = base_port + rank if base_port else 0
        self._http, _ = start_http_server(port, addr=host, registry=registry)
        self.metrics_url = f"http://{host}:{self._http.server_port}/metrics"
        (self.directory / "metrics_url").write_text(self.metrics_url, encoding="utf-8")
        self._last_arrival = 0.0

    @classmethod
    def from_env(cls) -> ReplicaChannel:
        root = os.environ.get(ENV_CLUSTER_DIR) or tempfile.mkdtemp(prefix="meridian-replica-")
        host = os.environ.get(ENV_METRICS_HOST) or "127.0.0.1"
        port = int(os.environ.get(ENV_METRICS_PORT) or 0)
        return cls(Path(root), _replica_rank(), host, port)

    def arrived(self) -> None:
        """A request reached this replica."""
        self._last_arrival = time.time()

    def routing_stats(self) -> dict[str, Any]:
        """What the replica adds to ``record_routing_stats()`` (module docstring)."""
        out: dict[str, Any] = {METRICS_URL_KEY: self.metrics_url}
        stats = read_replica_state(self.state_path)
        if stats is not None:
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if idle and self._last_arrival < stats.time_s:
                stats = dataclasses.replace(stats, time_s=time.time())
            out[STATS_KEY] = stats.to_wire()
        return out

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


class MeridianLLMServer(LLMServer):
    """``LLMServer`` whose replica reports Meridian's stats and serves its metrics."""

    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:
        # Before the engine starts: its spawned engine core inherits the environment.
        self.meridian_channel = ReplicaChannel.from_env()
        logger.info("Meridian replica: metrics at %s", self.meridian_channel.metrics_url)
        await super().__init__(llm_config, **kwargs)

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats() or {})
        stats.update(self.meridian_channel.routing_stats())
        return stats

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        self.meridian_channel.arrived()
        return await super().chat(request, raw_request_info)

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        self.meridian_channel.arrived()
        return await super().completions(request, raw_request_info)
