"""A standalone ``/metrics`` endpoint for processes that are not a vLLM server.

A replayed simulator run and tests serve :class:`MeridianMetrics` with
``prometheus_client``'s own WSGI server on a daemon thread. Inside vLLM there is no need for
it: the metrics live on the global registry and vLLM's ``/metrics`` serves them.

Loopback only by default: metrics reveal load and request counts, so exposing them on other
interfaces is an explicit choice (``host="0.0.0.0"``).

Example::

    server, port = serve_metrics(metrics)  # http://127.0.0.1:<port>/metrics
    ...
    stop_metrics_server(server)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from meridian.errors import MeridianError
from meridian.telemetry.metrics import MeridianMetrics

_log = logging.getLogger(__name__)

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class ExporterError(MeridianError):
    """The metrics endpoint could not be started (bad port, address in use, ...)."""


def serve_metrics(
    metrics: MeridianMetrics, host: str = "127.0.0.1", port: int = 0
) -> tuple[WSGIServer, int]:
    """Serve ``metrics.registry`` over HTTP at ``http://host:port/metrics``.

    Args:
        metrics: the catalogue to serve.
        host: the address to bind; loopback unless you choose otherwise.
        port: the TCP port; 0 picks a free one.

    Returns:
        ``(server, port)``: the running server (its thread is a daemon) and the bound port.
        Stop it with :func:`stop_metrics_server`.

    Raises:
        ExporterError: the port is out of range or the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ExporterError(f"metrics port must be in [0, 65535]; got {port}")
    if host not in _LOOPBACK:
        _log.warning("serving Meridian metrics on %s:%d, beyond loopback", host, port)
    try:
        server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise ExporterError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    bound_port = int(server.server_address[1])
    _log.info("Meridian metrics on http://%s:%d/metrics", host, bound_port)
    return server, bound_port


def stop_metrics_server(server: WSGIServer) -> None:
    """Stop a server from :func:`serve_metrics` and release its socket (idempotent)."""
    server.shutdown()
    server.server_close()


@contextmanager
def metrics_server(
    metrics: MeridianMetrics, host: str = "127.0.0.1", port: int = 0
) -> Iterator[int]:
    """:func:`serve_metrics` for the duration of a ``with`` block; yields the bound port."""
    server, bound_port = serve_metrics(metrics, host, port)
    try:
        yield bound_port
    finally:
        stop_metrics_server(server)
