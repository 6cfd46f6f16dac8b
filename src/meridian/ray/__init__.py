"""Meridian on Ray Serve LLM: several vLLM replicas with Meridian inside, Meridian's router in
front (issue 32, ADR-0016).

- :mod:`meridian.ray.router`: ``MeridianRouter``, a Ray Serve ``RequestRouter`` over the one
  routing policy (:class:`~meridian.core.routing.RoutingPolicy`);
- :mod:`meridian.ray.server`: ``MeridianLLMServer``, Ray Serve LLM's ``LLMServer`` reporting the
  replica's Meridian stats in ``record_routing_stats`` and serving its ``meridian_*`` metrics;
- :mod:`meridian.ray.app`: the application (``build_openai_app`` with both), as
  ``meridian serve-cluster`` starts it;
- :mod:`meridian.ray.requests`: what the router reads of an OpenAI request (no Ray needed).

Importing this package imports neither Ray nor vLLM; the modules above import Ray (install
``ray[serve]`` as ``requirements-vllm.lock`` pins it: ``make vllm-venv``). Ray Serve's router
API is alpha, so the version is pinned (:data:`RAY_VERSION`).
"""

from __future__ import annotations

__all__ = ["RAY_VERSION", "ROUTER_CLS", "SERVER_CLS"]

#: The Ray release the router and the server are written against (its router API is alpha).
RAY_VERSION = "2.60.0"
#: ``request_router_class`` of the LLM deployment's ``request_router_config``.
ROUTER_CLS = "meridian.ray.router:MeridianRouter"
#: ``server_cls`` of the ``LLMConfig``.
SERVER_CLS = "meridian.ray.server:MeridianLLMServer"
