# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
"""``MeridianRouter``: Ray Serve's ``RequestRouter`` over Meridian's routing policy (ADR-0016).

Select it in the LLM deployment's config (:func:`meridian.ray.app.cluster_app` does)::

    deployment_config={"request_router_config": {
        "request_router_class": "meridian.ray.router:MeridianRouter",
        "request_router_kwargs": {"model_family": "qwen3"},
        "request_routing_stats_period_s": 1}}

How Ray Serve 2.60 drives it (``ray/serve/_private/request_router/request_router.py``):

- ``choose_replicas(candidates, pending_request)`` returns ranks of replicas, best first; Serve
  sends the request to the replica with the shortest queue below ``max_ongoing_requests``
  within the first rank that has one. One replica per rank keeps Meridian's order. An empty
  answer makes the request wait and be routed again; with
  ``routing_context.should_backoff`` set, after a backoff (25 ms doubling to 500 ms), else at
  once (a busy loop), so it is always set here.
- Each candidate's ``routing_stats`` is what its replica's ``record_routing_stats()`` returned
  at the controller's last poll (every ``request_routing_stats_period_s``): the
  :class:`~meridian.core.routing.ReplicaStats` under ``"meridian"``
  (:class:`~meridian.ray.server.MeridianLLMServer`).
- The request counts as in flight on the first-ranked replica from the decision on (a burst
  is decided before any replica accepts), on the replica that accepted it from
  ``on_request_routed``, until ``on_request_completed``.
- This router does not mix in ``FIFOMixin``: a replica found for one request must go to that
  request (its kind and size chose it), not to the oldest pending one, so Serve's default match
  by request id is kept.

Failures. The ingress in front of the replicas runs in the same process as this router (its
deployment handle holds it) and reports a replica whose engine failed a request with
:meth:`MeridianRouter.replica_failed`: from then on the policy leaves it out
(:meth:`RoutingPolicy.failed`) until its routing stats show its engine answering again
(``meridian_health``, written by the replica at each poll after the failure). Ray itself reports
replicas it cannot reach (``on_replica_actor_unavailable``: out of rotation likewise) and
replicas that died (forgotten).

``initialize_state`` takes ``request_router_kwargs``: ``model_family`` (the reasoning-model
family whose boundaries tell a request's kind; default: the generic ``<think>`` tags),
``config`` (a meridian.toml path for ``[model.NAME]`` families), ``stats_max_age_s``,
``max_hold_s`` and ``hold`` (:class:`~meridian.core.routing.RoutingConfig`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from meridian.config import ModelDefinition, load_config
from meridian.core.routing import (
    DEFAULT_MAX_HOLD_S,
    DEFAULT_STATS_MAX_AGE_S,
    Hold,
    NewRequest,
    ReplicaStats,
    RoutingConfig,
    RoutingPolicy,
    StatsError,
)
from meridian.core.types import Phase
from meridian.ray.requests import describe_request
from meridian.vllm.runtime import GENERIC_NAME, GENERIC_THINK_TAGS

__all__ = ["HEALTH_KEY", "STATS_KEY", "MeridianRouter", "family_definition"]

logger = logging.getLogger(__name__)

#: The key of Meridian's stats in a replica's ``routing_stats``.
STATS_KEY = "meridian"
#: The key of the replica's engine health in its ``routing_stats``: ``{"ok", "time_s"}``.
HEALTH_KEY = "meridian_health"

_UNKNOWN = NewRequest(Phase.PREFILL, 1)
# Requests described but not routed yet (a cancelled one never is): the oldest are dropped
# past this many.
_MAX_DESCRIBED = 4096


def family_definition(model_family: str | None, config: str | None) -> ModelDefinition:
    """The boundaries of ``model_family`` (bundled or a ``[model.NAME]`` table of ``config``);
    the generic ``<think>`` tags when none is named."""
    if not model_family or model_family == GENERIC_NAME:
        return GENERIC_THINK_TAGS
    return load_config(config).config.model_definition(model_family)


class MeridianRouter(RequestRouter):
    """Ranks replicas with :class:`~meridian.core.routing.RoutingPolicy` (module docstring)."""

    def initialize_state(
        self,
        model_family: str | None = None,
        config: str | None = None,
        stats_max_age_s: float = DEFAULT_STATS_MAX_AGE_S,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
        hold: str = Hold.NEVER.value,
        **_: Any,
    ) -> None:
        self.meridian_policy = RoutingPolicy(
            RoutingConfig(stats_max_age_s, max_hold_s, Hold.parse(hold))
        )
        self._definition = family_definition(model_family, config)
        # The routing_stats dict last read per replica (a new poll brings a new dict).
        self._read: dict[str, Any] = {}
        self._requests: dict[str, NewRequest] = {}

    def _ensure_state(self) -> None:
        # Serve calls initialize_state with the deployment's kwargs; a router built without it
        # (Serve's own tests do) runs with the defaults.
        if not hasattr(self, "meridian_policy"):
            self.initialize_state()

    def _refresh(self, replica: RunningReplica) -> str:
        """Give the policy the replica's latest stats and health (read once per poll); its
        name."""
        name = str(replica.replica_id.unique_id)
        polled = replica.routing_stats
        if name not in self._read or polled is not self._read[name]:
            self._read[name] = polled
            polled = polled or {}
            health = polled.get(HEALTH_KEY)
            if isinstance(health, dict) and health.get("ok") is True:
                at = health.get("time_s")
                if isinstance(at, int | float):
                    self.meridian_policy.answered(name, float(at))
            raw = polled.get(STATS_KEY)
            stats: ReplicaStats | None = None
            if raw is not None:
                try:
                    stats = ReplicaStats.from_wire(raw)
                except StatsError as exc:
                    logger.warning("Meridian router: ignoring %s's stats: %s", name, exc)
            self.meridian_policy.observe(name, stats)
        return name

    def _describe(self, pending: PendingRequest | None) -> NewRequest:
        if pending is None or not pending.args:
            return _UNKNOWN
        key = str(pending.metadata.internal_request_id)
        described = self._requests.get(key)
        if described is None:
            described = self._requests[key] = describe_request(pending.args[0], self._definition)
            if len(self._requests) > _MAX_DESCRIBED:
                del self._requests[next(iter(self._requests))]
        return described

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        now = time.time()
        by_name = {self._refresh(r): r for r in candidate_replicas}
        waited = 0.0
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # a hold backs off
            waited = max(0.0, now - pending_request.created_at)
        request = self._describe(pending_request)
        ranked = self.meridian_policy.rank(list(by_name), request, now, waited)
        if ranked and pending_request is not None:
            # Serve sends it to the first rank now; the next decision, which may come before
            # the replica's acceptance (on_request_routed), must count it there already.
            key = str(pending_request.metadata.internal_request_id)
            self.meridian_policy.routed(ranked[0], key, request, now)
        return [[by_name[name]] for name in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._ensure_state()
        key = str(pending_request.metadata.internal_request_id)
        request = self._describe(pending_request)
        self._requests.pop(key, None)
        if self.meridian_policy.placed_on(key) != str(replica_id.unique_id):
            self.meridian_policy.routed(str(replica_id.unique_id), key, request, time.time())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ensure_state()
        self._requests.pop(str(internal_request_id), None)
        self.meridian_policy.completed(str(internal_request_id))

    def replica_failed(self, replica: str) -> None:
        """``replica`` (its unique id) failed a request: out of rotation until its stats show
        its engine answering again (module docstring)."""
        self._ensure_state()
        self.meridian_policy.failed(replica, time.time())

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._ensure_state()
        self.meridian_policy.failed(str(replica_id.unique_id), time.time())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self.meridian_policy.forget(str(replica_id.unique_id))
        self._read.pop(str(replica_id.unique_id), None)
