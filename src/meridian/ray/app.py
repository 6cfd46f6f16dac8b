# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
"""The Ray Serve LLM application ``meridian serve-cluster`` starts: N replicas of one model with
Meridian's scheduler and logits processor inside each and Meridian's router in front.

The same from Python (a recipe; ``serve.run`` it on a Ray cluster)::

    from meridian.ray.app import cluster_app
    app = cluster_app("Qwen/Qwen3-8B", num_replicas=4, engine_kwargs={"max_model_len": 32768})

It is Ray Serve LLM's own ``build_openai_app`` over an ``LLMConfig`` whose ``server_cls`` is
:class:`~meridian.ray.server.MeridianLLMServer` and whose deployment routes with
:class:`~meridian.ray.router.MeridianRouter`, polling replicas every ``stats_period_s``
(Serve's default is 10 s; ADR-0016 uses 1 s). The engine arguments get what ``meridian serve``
adds (:mod:`meridian.vllm.serve`): the scheduler class and logits processor of vLLM's own
resolution of them (asynchronous scheduling or not, V1 or V2 runner) and the family's
reasoning parser; the family and config file reach the engines through ``runtime_env``. One
ingress replica: one router sees every request (ADR-0016 says what several would miss).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meridian.config import load_config
from meridian.core.routing import RoutingConfig
from meridian.errors import ConfigError
from meridian.ray import ROUTER_CLS, SERVER_CLS
from meridian.ray.server import ENV_CLUSTER_DIR, ENV_METRICS_HOST, ENV_METRICS_PORT
from meridian.vllm.resolve import resolve_engine
from meridian.vllm.runtime import ENV_CONFIG, ENV_MODEL, GENERIC_NAME
from meridian.vllm.serve import resolve_family

__all__ = ["DEFAULT_STATS_PERIOD_S", "cluster_app", "engine_flags", "start_serve"]

#: Ray Serve's poll of each replica's routing stats (its default is 10 s).
DEFAULT_STATS_PERIOD_S = 1.0
# Engine arguments Meridian sets itself.
_OWN_KWARGS = ("scheduler_cls", "scheduling_policy")


def engine_flags(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """``engine_kwargs`` as vLLM's command-line flags (for vLLM's own resolution of them).

    >>> engine_flags({"max_model_len": 1024, "enforce_eager": True})
    ['--max-model-len', '1024', '--enforce-eager']
    """
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def cluster_app(
    model: str,
    *,
    num_replicas: int,
    model_family: str | None = None,
    config: str | Path | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    cluster_dir: str | Path | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int = 0,
    stats_period_s: float = DEFAULT_STATS_PERIOD_S,
    routing: RoutingConfig | None = None,
    model_id: str | None = None,
    cpu: bool | None = None,
) -> Any:
    """The Serve application (module docstring). ``cluster_dir``: where each replica keeps its
    stats, metrics files and metrics address (``MERIDIAN_CLUSTER_DIR``); ``metrics_port``: the
    first replica's metrics port (replica ``r`` uses ``metrics_port + r``; 0: free ports);
    ``cpu``: run the engines on CPUs (``None``: when vLLM is its CPU build)."""
    from ray.serve.llm import LLMConfig, build_openai_app

    if num_replicas < 1:
        raise ConfigError(f"--replicas must be >= 1; got {num_replicas}")
    if not stats_period_s > 0:
        raise ConfigError(f"--stats-period-s must be > 0; got {stats_period_s}")
    kwargs = dict(engine_kwargs or {})
    clash = [k for k in _OWN_KWARGS if k in kwargs]
    if clash:
        raise ConfigError(f"engine argument {clash[0]} is Meridian's to set; remove it")
    loaded = load_config(config)
    family, definition = resolve_family(model, model_family, loaded.config)
    engine = resolve_engine(model, engine_flags(kwargs))
    kwargs["scheduler_cls"] = engine.scheduler_cls()
    if engine.logits_processor is not None and "logits_processors" not in kwargs:
        kwargs["logits_processors"] = [engine.logits_processor]
    kwargs.setdefault("reasoning_parser", definition.reasoning_parser)
    # The engine core in its own process (vLLM's default, forced here): the scheduler's stats
    # and metrics reach the replica through the environment of that spawned process.
    env = {
        ENV_METRICS_HOST: metrics_host,
        ENV_METRICS_PORT: str(metrics_port),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    if cluster_dir is not None:
        env[ENV_CLUSTER_DIR] = str(Path(cluster_dir).resolve())
    if family != GENERIC_NAME:
        env[ENV_MODEL] = family
    if loaded.source is not None:
        env[ENV_CONFIG] = str(loaded.source.resolve())
    routing = routing or RoutingConfig()
    router_kwargs = {
        "model_family": family,
        "config": None if loaded.source is None else str(loaded.source.resolve()),
        "stats_max_age_s": routing.stats_max_age_s,
        "max_hold_s": routing.max_hold_s,
    }
    on_cpu = engine.install.cpu_build if cpu is None else cpu
    llm_config = LLMConfig(
        model_loading_config={"model_id": model_id or model, "model_source": model},
        engine_kwargs=kwargs,
        server_cls=SERVER_CLS,
        accelerator_config={"kind": "cpu"} if on_cpu else None,
        runtime_env={"env_vars": env},
        deployment_config={
            "num_replicas": num_replicas,
            "request_router_config": {
                "request_router_class": ROUTER_CLS,
                "request_router_kwargs": router_kwargs,
                "request_routing_stats_period_s": stats_period_s,
            },
        },
    )
    return build_openai_app(
        {"llm_configs": [llm_config], "ingress_deployment_config": {"num_replicas": 1}}
    )


def start_serve(
    host: str, port: int, *, address: str | None = None, num_cpus: int | None = None
) -> Any:
    """Ray (a local instance, or the cluster at ``address``) and Serve's HTTP proxy on
    ``host``:``port``; returns ``ray.serve`` (to ``run`` the application and ``shutdown``)."""
    import ray
    from ray import serve

    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    return serve
