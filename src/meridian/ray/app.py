# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
"""The Ray Serve LLM application ``meridian serve-cluster`` starts: N replicas of one model with
Meridian's scheduler and logits processor inside each, Meridian's router in front of them and
Meridian's front door (:mod:`meridian.ray.ingress`) as the ingress.

The same from Python (a recipe; ``serve.run`` it on a Ray cluster)::

    from meridian.ray.app import cluster_app
    app = cluster_app("Qwen/Qwen3-8B", num_replicas=4, engine_kwargs={"max_model_len": 32768})

It is Ray Serve LLM's own deployment of an ``LLMConfig`` (``build_llm_deployment``) whose
``server_cls`` is :class:`~meridian.ray.server.MeridianLLMServer` and whose deployment routes
with :class:`~meridian.ray.router.MeridianRouter` (or Ray Serve's default router, ``router=
"pow2"``, for comparisons), polling replicas every ``stats_period_s`` (Serve's default is 10 s;
ADR-0016 uses 1 s), behind one :class:`~meridian.ray.ingress.MeridianIngress` replica: one
router sees every request (ADR-0016 says what several would miss). The engine arguments get what
``meridian serve`` adds (:mod:`meridian.vllm.serve`): the scheduler class and logits processor
of vLLM's own resolution of them (asynchronous scheduling or not, V1 or V2 runner) and the
family's reasoning parser; the family and config file reach the engines through
``runtime_env``.

:func:`start_ray` starts the Ray this runs on: a local instance with every socket on loopback,
or the cluster at ``--address``.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meridian.config import load_config
from meridian.core.routing import RoutingConfig
from meridian.errors import ConfigError
from meridian.ray import ROUTER_CLS, SERVER_CLS

__all__ = [
    "APP_NAME",
    "DEFAULT_STATS_PERIOD_S",
    "LOOPBACK_ENV",
    "ROUTERS",
    "cluster_app",
    "deploy",
    "engine_flags",
    "start_http",
    "start_ray",
    "starting_deployments",
    "stop",
]

#: The Serve application's name (what ``--address`` deployments add to a cluster).
APP_NAME = "meridian"

#: Ray Serve's poll of each replica's routing stats (its default is 10 s).
DEFAULT_STATS_PERIOD_S = 1.0
#: The routers ``cluster_app`` can put in front: Meridian's, or Ray Serve's default (power of
#: two choices), for comparisons.
ROUTERS = ("meridian", "pow2")
#: Ray's setting that makes a local instance's node address loopback (its single-machine mode,
#: the default on macOS and Windows): every Ray socket (GCS, raylet, workers, agents, their
#: metrics) then listens on 127.0.0.1 only. Read when Ray is imported.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
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
    stats_period_s: float = DEFAULT_STATS_PERIOD_S,
    routing: RoutingConfig | None = None,
    model_id: str | None = None,
    cpu: bool | None = None,
    router: str = "meridian",
) -> Any:
    """The Serve application (module docstring); Ray must be up (:func:`start_ray`).
    ``cluster_dir``: where each replica keeps its stats and metrics files
    (``MERIDIAN_CLUSTER_DIR``); ``cpu``: run the engines on CPUs (``None``: when vLLM is its CPU
    build)."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.serve.llm import LLMConfig, build_llm_deployment
    from ray.serve.llm.ingress import make_fastapi_ingress

    from meridian.ray.ingress import ENDPOINTS, MeridianIngress, front_door_app
    from meridian.ray.server import ENV_CLUSTER_DIR
    from meridian.vllm.resolve import resolve_engine
    from meridian.vllm.runtime import ENV_CONFIG, ENV_MODEL, GENERIC_NAME
    from meridian.vllm.serve import resolve_family

    if num_replicas < 1:
        raise ConfigError(f"--replicas must be >= 1; got {num_replicas}")
    if not stats_period_s > 0:
        raise ConfigError(f"--stats-period-s must be > 0; got {stats_period_s}")
    if router not in ROUTERS:
        raise ConfigError(f"router must be one of {', '.join(ROUTERS)}; got {router!r}")
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
    forcing_off = None if "logits_processors" in kwargs else engine.forcing_off_reason
    kwargs.setdefault("reasoning_parser", definition.reasoning_parser)
    # The engine core in its own process (vLLM's default, forced here): the scheduler's stats
    # and metrics reach the replica through the environment of that spawned process.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if cluster_dir is not None:
        env[ENV_CLUSTER_DIR] = str(Path(cluster_dir).resolve())
    if family != GENERIC_NAME:
        env[ENV_MODEL] = family
    if loaded.source is not None:
        env[ENV_CONFIG] = str(loaded.source.resolve())
    routing = routing or RoutingConfig()
    deployment_config: dict[str, Any] = {"num_replicas": num_replicas}
    if router == "meridian":
        deployment_config["request_router_config"] = {
            "request_router_class": ROUTER_CLS,
            "request_router_kwargs": {
                "model_family": family,
                "config": None if loaded.source is None else str(loaded.source.resolve()),
                "stats_max_age_s": routing.stats_max_age_s,
                "max_hold_s": routing.max_hold_s,
                "hold": routing.hold.value,
            },
            "request_routing_stats_period_s": stats_period_s,
        }
    on_cpu = engine.install.cpu_build if cpu is None else cpu
    llm_config = LLMConfig(
        model_loading_config={"model_id": model_id or model, "model_source": model},
        engine_kwargs=kwargs,
        server_cls=SERVER_CLS,
        accelerator_config={"kind": "cpu"} if on_cpu else None,
        runtime_env={"env_vars": env},
        deployment_config=deployment_config,
    )
    served = llm_config.model_id
    ingress = make_fastapi_ingress(
        MeridianIngress, endpoint_map=ENDPOINTS, app=front_door_app(forcing_off)
    )
    options = {**MeridianIngress.get_deployment_options([llm_config]), "num_replicas": 1}
    options.pop("autoscaling_config", None)  # one ingress replica: one router sees every request
    # No CPU of its own, as Ray Serve LLM's own router deployment: it schedules beside the proxy.
    options["ray_actor_options"] = {"num_cpus": 0}
    return serve.deployment(ingress, **options).bind(
        llm_deployments={served: build_llm_deployment(llm_config)},
        model_cards={served: to_model_metadata(served, llm_config)},
    )


def start_ray(*, address: str | None = None, num_cpus: int | None = None) -> None:
    """Ray for the application: the cluster at ``address`` (Meridian starts none of its own), or
    a local instance whose every socket listens on loopback (:data:`LOOPBACK_ENV`: in the
    environment of the processes Ray starts, and in this one's Ray if it was imported before).
    A cluster at a loopback address is one started in that mode (``ray start --head
    --node-ip-address 127.0.0.1`` with :data:`LOOPBACK_ENV`): this driver joins it in the same
    mode, or it would look for its node at the machine's own address and wait forever."""
    import ray
    import ray.serve  # an ImportError here: no Ray Serve in this environment

    if address is None or _is_loopback(address):
        from ray._private import ray_constants

        os.environ.update(LOOPBACK_ENV)
        ray_constants.ENABLE_RAY_CLUSTER = False  # what the variable sets, read at Ray's import
    if address:
        # A token this user holds is sent (RAY_AUTH_MODE unset), as Ray does for a cluster it
        # finds itself: ray.init with an explicit address sends none, and a cluster started
        # with token authentication (Ray's default) refuses such a driver.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (``HOST:PORT``, or ``auto``) names this machine's loopback.

    >>> [_is_loopback(a) for a in ("127.0.0.1:6379", "localhost:6379", "10.0.0.1:6379")]
    [True, True, False]
    """
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_http(host: str, port: int) -> None:
    """Ray Serve, its HTTP proxy on ``host``:``port``."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})


def deploy(app: Any) -> None:
    """Run ``app`` as :data:`APP_NAME`; returns once it is running."""
    from ray import serve

    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def starting_deployments() -> dict[str, str] | None:
    """What Ray Serve says of each deployment of :data:`APP_NAME` that is not healthy yet
    (``{}``: not deployed yet; ``None``: the application is running)."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return {}
    if str(app.status).endswith("RUNNING"):
        return None
    out = {}
    for name, deployment in app.deployments.items():
        status = str(deployment.status).rsplit(".", 1)[-1]
        if status != "HEALTHY":
            out[name] = f"{status}: {deployment.message}" if deployment.message else status
    return out


def stop(*, joined: bool) -> None:
    """Stop what was started: the application on a cluster joined, else Serve and the local
    Ray instance."""
    import ray
    from ray import serve

    try:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
