# mypy: disable-error-code="import-not-found,import-untyped,no-any-unimported,misc"
# mypy: disable-error-code="untyped-decorator"
"""The cluster's front door: Ray Serve LLM's ``OpenAiIngress`` with Meridian's checks, failure
handling and one scrape target.

- **Knobs and errors** (:class:`~meridian.vllm.http.FrontDoor`, the middleware ``meridian
  serve`` installs too): per-request knobs checked as sent, one validator for every front door;
  every error body a short OpenAI-shaped JSON, the details only in the server log.
- **A replica that fails** (its engine dead, or Ray unable to reach it): the router is told at
  once (:meth:`~meridian.ray.router.MeridianRouter.replica_failed`), and a request of which
  nothing reached the client yet is placed again, on another replica (at most ``max_attempts``
  placements in all). A stream that had started ends with an explicit error event, so a client
  never mistakes it for a complete answer.
- **``/metrics``**: every replica's ``meridian_*`` series with a ``replica`` label (asked of each
  replica over Ray, :meth:`~meridian.ray.server.MeridianLLMServer.meridian_metrics`), and the
  front door's own counters (:data:`~meridian.telemetry.catalogue.CLUSTER_CATALOGUE`).

It has no CORS middleware (Ray Serve LLM's allows every origin): a browser page from elsewhere
cannot drive a front door bound to loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from ray.llm._internal.serve.utils.broadcast import broadcast
from ray.serve.llm.ingress import OpenAiIngress
from starlette.exceptions import HTTPException
from starlette.responses import Response

from meridian.ray.failure import is_connection_failure, replica_failure
from meridian.telemetry.catalogue import REPLICA_FAILURES, REQUESTS_REPLACED, STREAMS_BROKEN
from meridian.telemetry.metrics import ClusterMetrics
from meridian.vllm.http import FrontDoor, error_body, internal_error_message

__all__ = ["DEFAULT_MAX_ATTEMPTS", "ENDPOINTS", "MeridianIngress", "front_door_app"]

logger = logging.getLogger(__name__)

#: Placements of one request in all (the first and the ones after failures).
DEFAULT_MAX_ATTEMPTS = 3
#: Ray Serve LLM's routes, and the cluster's ``/metrics``.
ENDPOINTS: dict[str, Callable[[FastAPI], Callable[..., Any]]] = {
    **DEFAULT_ENDPOINTS,
    "metrics": lambda app: app.get("/metrics"),
}
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _json(status: int, message: str, error_type: str | None = None) -> Response:
    return Response(
        error_body(status, message, error_type), status_code=status, media_type="application/json"
    )


def front_door_app(forcing_off: str | None = None) -> FastAPI:
    """The ingress's FastAPI app: Meridian's front door and error handlers (module docstring).
    ``forcing_off``: why this cluster cannot force (``None``: it can)."""
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return _json(400, f"invalid request: {where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _json(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:
        if isinstance(exc, _UnavailableError):
            return _json(503, exc.message, exc.type)
        status = getattr(exc, "status_code", None)
        message = getattr(exc, "message", None)
        if isinstance(status, int) and 400 <= status < 500 and isinstance(message, str):
            return _json(status, message, getattr(exc, "type", None))  # the OpenAI errors
        request_id = _request_id(request)
        logger.error("request %s failed", request_id, exc_info=exc)
        return _json(500, internal_error_message(request_id))

    app.add_middleware(FrontDoor, forcing_off=forcing_off)
    return app


def _error_event(message: str) -> str:
    error = json.loads(error_body(503, message, "ServiceUnavailableError"))
    return f"data: {json.dumps(error)}\n\n"


class MeridianIngress(OpenAiIngress):
    """Ray Serve LLM's ingress with Meridian's failure handling and ``/metrics`` (module
    docstring)."""

    def __init__(
        self,
        llm_deployments: dict[str, Any],
        model_cards: dict[str, Any],
        *,
        lora_paths: dict[str, str] | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths)
        self.max_attempts = max(1, max_attempts)
        self.cluster_metrics = ClusterMetrics()

    async def _get_response(self, **kwargs: Any) -> AsyncIterator[Any]:
        """The replica's stream, placed again while nothing of it has been yielded and its
        replica failed (module docstring)."""
        for attempt in range(1, self.max_attempts + 1):
            started = False
            try:
                async for response in super()._get_response(**kwargs):
                    started = True
                    yield response
                return
            except Exception as exc:
                failure = replica_failure(exc)
                if failure is None and not is_connection_failure(exc):
                    if not started:
                        raise
                    logger.error("a stream failed", exc_info=exc)
                    yield _error_event("this request failed mid-answer; see the server log")
                    return
                self.cluster_metrics.count(REPLICA_FAILURES)
                if failure is not None:
                    self._report(failure.replica)
                if started:
                    self.cluster_metrics.count(STREAMS_BROKEN)
                    logger.warning("a stream broke: %s", failure or type(exc).__name__)
                    yield _error_event("the replica serving this request failed mid-answer")
                    return
                if attempt == self.max_attempts:
                    raise _UnavailableError(attempt) from exc
                self.cluster_metrics.count(REQUESTS_REPLACED)
                logger.warning(
                    "placing a request again (attempt %d): %s",
                    attempt + 1,
                    failure or type(exc).__name__,
                )

    def _report(self, replica: str) -> None:
        """Tell the router of every handle this ingress uses that ``replica`` failed (the
        router runs in this process, inside the handle: Ray Serve's own ``broadcast`` reaches
        the replicas through the same attributes)."""
        for handle in self._configured_serve_handles.values():
            router = getattr(handle, "_router", None)
            inner = getattr(router, "_asyncio_router", router)
            request_router = getattr(inner, "request_router", None)
            report = getattr(request_router, "replica_failed", None)
            if report is not None:
                report(replica)

    async def metrics(self) -> Response:
        """Every replica's ``meridian_*`` metrics, labelled by replica, and the front door's."""
        handle = self._get_configured_serve_handle(next(iter(self._model_cards)))
        try:
            answers = await asyncio.to_thread(broadcast, handle, "meridian_metrics")
        except Exception as exc:  # a replica starting or gone: the front door's own still count
            logger.warning("could not read every replica's metrics: %r", exc)
            answers = []
        text = generate_latest(self.cluster_metrics.registry).decode()
        return Response(text + merge_replica_metrics(answers), media_type=_PROMETHEUS_TEXT)


class _UnavailableError(Exception):
    """No placement of a request reached a replica that could serve it (HTTP 503)."""

    status_code = 503
    type = "ServiceUnavailableError"

    def __init__(self, attempts: int) -> None:
        super().__init__(attempts)
        self.message = f"no replica could serve this request ({attempts} attempts); retry later"


def merge_replica_metrics(answers: Iterable[tuple[str, str]]) -> str:
    """Replicas' metrics (``(replica, Prometheus text)`` each) as one exposition, every sample
    labelled ``replica``; a family's help and type are written once.

    >>> text = "# TYPE meridian_x_total counter\\nmeridian_x_total 2.0\\n"
    >>> print(merge_replica_metrics([("r1", text)]).strip().splitlines()[-1])
    meridian_x_total{replica="r1"} 2.0
    """
    families: dict[str, Metric] = {}
    for replica, text in sorted(answers):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type
                )
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    return generate_latest(_Merged()).decode()
