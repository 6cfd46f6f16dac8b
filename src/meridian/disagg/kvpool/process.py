"""Running a pool: :func:`run_kvpool` (embeddable), and the ``meridian kvpool`` /
``python -m meridian.disagg.kvpool`` command line (:func:`main`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Final

from meridian.core.types import Tier
from meridian.disagg.fabric import POOL_FABRICS, FabricUnavailable
from meridian.disagg.kvpool.protocol import (
    DEFAULT_LISTEN,
    FAULTS_ENV,
    parse_address,
    parse_size,
)
from meridian.disagg.kvpool.server import KvPoolServer, PoolEndpoint, make_pool_endpoint
from meridian.disagg.kvpool.store import DEFAULT_QUARANTINE_S, PoolStore
from meridian.errors import ConfigError, MeridianError

_log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BYTES: Final = 1 << 30


def faults_from_env() -> bool:
    """True when ``MERIDIAN_KVPOOL_FAULTS`` asks for fault injection."""
    return os.environ.get(FAULTS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def run_kvpool(
    fabric: str,
    listen: str = DEFAULT_LISTEN,
    *,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    quarantine_s: float = DEFAULT_QUARANTINE_S,
    fault_injection: bool = False,
    stop: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    metrics_port: int | None = None,
) -> int:
    """Serve a KV pool until ``stop`` is set or SIGTERM/SIGINT arrives; returns 0.

    Logs one line when serving, with the control address (the real port when ``listen`` asks
    for port 0), and calls ``on_ready(address)``. With ``metrics_port`` the pool reports frames
    stored and read, and its used and total bytes, through Meridian's metric catalogue on
    ``http://HOST:PORT/metrics`` (the same host as ``listen``). Raises ConfigError for bad
    arguments and FabricUnavailable when the fabric's library is missing.
    """
    if fabric not in POOL_FABRICS:
        raise ConfigError(
            f"kvpool --fabric must be one of {', '.join(POOL_FABRICS)}; got {fabric!r}"
        )
    host, port = parse_address(listen)
    metrics = metrics_server = None
    if metrics_port is not None:
        from meridian.telemetry.exporter import serve_metrics
        from meridian.telemetry.metrics import MeridianMetrics

        metrics = MeridianMetrics()
        metrics.set_kv_capacity_bytes(capacity_bytes)
        metrics_server, bound = serve_metrics(metrics, host=host, port=metrics_port)
        _log.info("meridian kvpool: metrics on http://%s:%d/metrics", host, bound)
    store = PoolStore(capacity_bytes, label=fabric, quarantine_s=quarantine_s, metrics=metrics)
    endpoint: PoolEndpoint = make_pool_endpoint(fabric, store.slab, host=host, epoch=store.epoch)
    stop = stop or threading.Event()
    try:
        server = KvPoolServer((host, port), store, endpoint, fault_injection=fault_injection)
    except OSError as exc:
        endpoint.close()
        raise FabricUnavailable(f"kvpool cannot listen on {listen}: {exc.strerror or exc}") from exc
    restore = _install_stop_signals(stop)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="kvpool-control")
    thread.start()
    address = f"{host}:{server.server_address[1]}"
    try:
        _log.info(
            "meridian kvpool: fabric %s listening on %s (capacity %d bytes, epoch %s%s)",
            fabric,
            address,
            capacity_bytes,
            store.epoch,
            ", fault injection ON" if fault_injection else "",
        )
        if on_ready is not None:
            on_ready(address)
        while not stop.wait(endpoint.progress_interval_s):
            endpoint.progress()
            store.reclaim()
            if metrics is not None:
                metrics.set_kv_used_bytes(Tier.THINK_COMPLETE, store.stats().stored_bytes)
    finally:
        if metrics_server is not None:
            from meridian.telemetry.exporter import stop_metrics_server

            stop_metrics_server(metrics_server)
        server.shutdown()
        server.server_close()
        thread.join()
        stats = store.stats()
        endpoint.close()
        restore()
        _log.info(
            "meridian kvpool: stopped; dropped %d frames (%d bytes)",
            stats.num_frames,
            stats.stored_bytes,
        )
    return 0


def _install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Make SIGTERM and SIGINT set ``stop`` (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _log.info("meridian kvpool: %s received, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def build_parser() -> argparse.ArgumentParser:
    """The ``meridian kvpool`` / ``python -m meridian.disagg.kvpool`` arguments."""
    parser = argparse.ArgumentParser(
        prog="meridian kvpool",
        description="Hold offloaded KV blocks (MRDN frames) for Meridian producers.",
    )
    parser.add_argument("--fabric", required=True, choices=POOL_FABRICS, help="data plane")
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"control address, loopback (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--capacity", default="1GiB", help="slab size, e.g. 512MiB or 4GiB (default 1GiB)"
    )
    parser.add_argument(
        "--quarantine-s",
        type=float,
        default=DEFAULT_QUARANTINE_S,
        help="seconds an abandoned slot waits before reuse (late writes may still land)",
    )
    parser.add_argument(
        "--fault-injection",
        action="store_true",
        default=None,
        help=f"accept test-only fault ops (also {FAULTS_ENV}=1)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port of the --listen host (0: any free port)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        return run_kvpool(
            args.fabric,
            args.listen,
            capacity_bytes=parse_size(args.capacity),
            quarantine_s=args.quarantine_s,
            fault_injection=faults_from_env() if args.fault_injection is None else True,
            metrics_port=args.metrics_port,
        )
    except MeridianError as exc:
        print(f"meridian kvpool: error: {exc}", file=sys.stderr)
        return 2
