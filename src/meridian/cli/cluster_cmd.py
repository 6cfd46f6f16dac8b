"""``meridian serve-cluster MODEL --replicas N``: several vLLM replicas with Meridian inside each
and Meridian's router in front, on Ray Serve LLM (:mod:`meridian.ray.app`).

Starts a local Ray instance (or joins ``--address``), runs the application with Ray Serve's HTTP
proxy on ``--host``/``--port`` (127.0.0.1:8000 unless told otherwise), prints the OpenAI base URL
and each replica's ``meridian_*`` metrics address as they come up, and serves until interrupted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from meridian.core.routing import DEFAULT_MAX_HOLD_S, DEFAULT_STATS_MAX_AGE_S, RoutingConfig
from meridian.errors import MeridianError

# How long to wait for every replica's metrics address before saying where to look.
_STARTUP_REPORT_S = 900.0


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
        "--metrics-port",
        type=int,
        default=0,
        help="replica r serves its meridian_* metrics on this port + r (0: free ports; 0)",
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
    parser.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    parser.add_argument(
        "--num-cpus", type=int, help="logical CPUs of a local Ray instance (default: Ray's)"
    )
    parser.add_argument(
        "--cluster-dir", type=Path, help="where replicas keep their stats and metrics files"
    )
    parser.set_defaults(handler=run_serve_cluster)


def run_serve_cluster(args: argparse.Namespace) -> int:
    """Start the cluster and serve until interrupted."""
    if args.replicas < 1:
        raise MeridianError(f"--replicas must be >= 1; got {args.replicas}")
    if not args.host.strip():
        raise MeridianError("--host is empty; leave it out for 127.0.0.1")
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        raise MeridianError(f"--engine-kwargs is not JSON: {exc}") from None
    if not isinstance(engine_kwargs, dict):
        raise MeridianError("--engine-kwargs must be a JSON object")
    routing = RoutingConfig(args.stats_max_age_s, args.max_hold_s)
    try:
        from meridian.ray.app import cluster_app, start_serve
    except ImportError:
        raise MeridianError(
            "serve-cluster needs Ray Serve in this environment: run `make vllm-venv` (it "
            "installs ray[serve] as requirements-vllm.lock pins it), then use .venv-vllm/bin/"
            "meridian serve-cluster"
        ) from None

    cluster_dir = args.cluster_dir or Path(tempfile.mkdtemp(prefix="meridian-cluster-"))
    app = cluster_app(
        args.model,
        num_replicas=args.replicas,
        model_family=args.model_family,
        config=args.config,
        engine_kwargs=engine_kwargs,
        cluster_dir=cluster_dir,
        metrics_host=args.host,
        metrics_port=args.metrics_port,
        stats_period_s=args.stats_period_s,
        routing=routing,
        model_id=args.model_id,
    )
    serve = start_serve(args.host, args.port, address=args.address, num_cpus=args.num_cpus)
    print(f"meridian serve-cluster: starting {args.replicas} replicas (files in {cluster_dir})")
    serve.run(app, blocking=False)
    print(f"meridian serve-cluster: OpenAI API at http://{args.host}:{args.port}/v1", flush=True)
    _report_metrics(cluster_dir, args.replicas)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _report_metrics(cluster_dir: Path, replicas: int) -> None:
    """Print each replica's metrics address once it is written."""
    shown: set[Path] = set()
    deadline = time.monotonic() + _STARTUP_REPORT_S
    while len(shown) < replicas and time.monotonic() < deadline:
        for path in sorted(cluster_dir.glob("replica-*/metrics_url")):
            if path not in shown:
                shown.add(path)
                url = path.read_text(encoding="utf-8")
                print(f"meridian serve-cluster: {path.parent.name} metrics at {url}", flush=True)
        time.sleep(1.0)
