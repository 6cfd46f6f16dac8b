"""``meridian serve-cluster MODEL --replicas N``: several vLLM replicas with Meridian inside each,
Meridian's router in front, behind Meridian's front door (:mod:`meridian.ray.app`).

Starts Ray once (a local instance with every socket on 127.0.0.1; or, with ``--address``, none:
the application goes onto the Ray cluster given), runs the application with Ray Serve's HTTP
proxy on ``--host``/``--port`` (127.0.0.1:8000 unless told otherwise), prints the OpenAI base URL
and the one metrics address, and serves until interrupted (Ctrl-C or SIGTERM), then stops what it
started: the whole local Ray, or only its application on a cluster it joined.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from meridian.core.routing import (
    DEFAULT_MAX_HOLD_S,
    DEFAULT_STATS_MAX_AGE_S,
    HOLDS,
    Hold,
    RoutingConfig,
)
from meridian.errors import MeridianError
from meridian.vllm.preflight import Status, check_model

#: Ray's logical CPUs one vLLM replica takes (its actor and its engine's bundle, as Ray Serve
#: LLM places them): a local Ray gets at least this many per replica.
CPUS_PER_REPLICA = 2
MAX_REPLICAS = 1024


def register(commands: Any) -> None:
    """Add ``serve-cluster`` to the top-level subparsers."""
    parser = commands.add_parser(
        "serve-cluster",
        help="N vLLM replicas with Meridian, Meridian's router in front (Ray Serve LLM)",
        description=(
            "Start MODEL on N replicas under Ray Serve LLM: Meridian's scheduler and logits "
            "processor in each (as meridian serve sets them up) and Meridian's request router "
            "in front (docs/cluster.md). Needs ray[serve] in the vLLM environment "
            "(make vllm-venv)."
        ),
    )
    parser.add_argument("model", help="model name or local directory")
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas (2)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (8000)")
    parser.add_argument("--config", type=Path, help="meridian.toml (default: the usual search)")
    parser.add_argument("--model-family", help="reasoning-model family (default: guessed)")
    parser.add_argument("--model-id", help="the model name clients send (default: MODEL)")
    parser.add_argument(
        "--engine-kwargs",
        default="{}",
        help="vLLM engine arguments as JSON, e.g. '{\"max_model_len\": 32768}'",
    )
    parser.add_argument(
        "--stats-period-s",
        type=float,
        default=1.0,
        help="Ray Serve's poll of each replica's routing stats, seconds (1; Serve's default 10)",
    )
    parser.add_argument(
        "--stats-max-age-s",
        type=float,
        default=DEFAULT_STATS_MAX_AGE_S,
        help="older stats never hold a request (10)",
    )
    parser.add_argument(
        "--max-hold-s",
        type=float,
        default=DEFAULT_MAX_HOLD_S,
        help="a request held this long at the router is placed anyway (30)",
    )
    parser.add_argument(
        "--hold",
        choices=HOLDS,
        default=Hold.NEVER.value,
        help="when the router holds a request: never (the default), admission (no replica's vLLM "
        "admission could take it), headroom (no replica's projected KV fits it); docs/cluster.md",
    )
    parser.add_argument(
        "--address",
        help="an existing Ray cluster to deploy onto, e.g. 10.0.0.1:6379 (default: start a "
        "local one on 127.0.0.1)",
    )
    parser.add_argument(
        "--num-cpus",
        type=int,
        help="logical CPUs of the local Ray instance (Ray's bookkeeping, not cores; default: the "
        f"machine's, and at least {CPUS_PER_REPLICA} a replica)",
    )
    parser.add_argument(
        "--router",
        choices=("meridian", "pow2"),
        default="meridian",
        help="the request router: Meridian's, or Ray Serve's default (for comparisons; meridian)",
    )
    parser.add_argument(
        "--cluster-dir", type=Path, help="where replicas keep their stats and metrics files"
    )
    parser.set_defaults(handler=run_serve_cluster)


def run_serve_cluster(args: argparse.Namespace) -> int:
    """Start the cluster and serve until interrupted (module docstring)."""
    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise MeridianError(f"--replicas must be in [1, {MAX_REPLICAS}]; got {args.replicas}")
    if not args.host.strip():
        raise MeridianError("--host is empty; leave it out for 127.0.0.1")
    if not 0 < args.port < 65536:
        raise MeridianError(f"--port must be in 1..65535; got {args.port}")
    if args.num_cpus is not None and args.num_cpus < 1:
        raise MeridianError(f"--num-cpus must be >= 1; got {args.num_cpus}")
    if args.address is not None and args.num_cpus is not None:
        raise MeridianError("--num-cpus sizes a local Ray instance; with --address, leave it out")
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        raise MeridianError(f"--engine-kwargs is not JSON: {exc}") from None
    if not isinstance(engine_kwargs, dict):
        raise MeridianError("--engine-kwargs must be a JSON object")
    routing = RoutingConfig(args.stats_max_age_s, args.max_hold_s, Hold(args.hold))
    from meridian.ray import app as ray_app

    # What would fail in every replica a minute after Ray's start is said now.
    model = check_model(args.model, ray_app.engine_flags(engine_kwargs))
    if model.status is Status.FAIL:
        raise MeridianError(f"{model.detail}; {model.fix}" if model.fix else model.detail)
    where = f"the Ray cluster at {args.address}" if args.address else "a local Ray (127.0.0.1)"
    print(f"meridian serve-cluster: starting {where}", flush=True)
    num_cpus = args.num_cpus
    if args.address is None and num_cpus is None:
        num_cpus = max(os.cpu_count() or 1, CPUS_PER_REPLICA * args.replicas)
    try:
        ray_app.start_ray(address=args.address, num_cpus=num_cpus)
    except ImportError:
        raise MeridianError(
            "serve-cluster needs Ray Serve in this environment: run `make vllm-venv` (it "
            "installs ray[serve] as requirements-vllm.lock pins it), then use .venv-vllm/bin/"
            "meridian serve-cluster"
        ) from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise MeridianError(f"cannot start or reach Ray ({where}): {exc}") from None
    # After Ray's start, which installs its own handler: SIGTERM stops as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ray_app.start_http(args.host, args.port)
        cluster_dir = args.cluster_dir or Path(tempfile.mkdtemp(prefix="meridian-cluster-"))
        app = ray_app.cluster_app(
            args.model,
            num_replicas=args.replicas,
            model_family=args.model_family,
            config=args.config,
            engine_kwargs=engine_kwargs,
            cluster_dir=cluster_dir,
            stats_period_s=args.stats_period_s,
            routing=routing,
            model_id=args.model_id,
            router=args.router,
        )
        print(
            f"meridian serve-cluster: starting {args.replicas} replicas of {args.model} "
            f"(files in {cluster_dir}); each loads its engine, a minute or more on CPUs",
            flush=True,
        )
        reporter = threading.Thread(target=_report_progress, args=(ray_app,), daemon=True)
        reporter.start()
        ray_app.deploy(app)
        base = f"http://{args.host}:{args.port}"
        print(f"meridian serve-cluster: OpenAI API at {base}/v1", flush=True)
        print(f"meridian serve-cluster: metrics of every replica at {base}/metrics", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("meridian serve-cluster: stopping", flush=True)
        ray_app.stop(joined=args.address is not None)
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _report_progress(ray_app: Any, period_s: float = 15.0) -> None:
    """While the application starts, print what Ray Serve says of each deployment that is not
    running yet, when it changes (a replica waiting for resources says which)."""
    said: dict[str, str] = {}
    while True:
        time.sleep(period_s)
        try:
            lines = ray_app.starting_deployments()
        except Exception:  # Serve shutting down
            return
        if lines is None:
            return
        for name, line in lines.items():
            if said.get(name) != line:
                said[name] = line
                print(f"meridian serve-cluster: {name}: {line}", flush=True)
