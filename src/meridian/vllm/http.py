"""Meridian's front door: an ASGI middleware for vLLM's OpenAI server and for the cluster's
ingress. It checks Meridian's request knobs as sent and keeps internals out of error bodies.

Knobs. vLLM's request models type ``vllm_xargs`` values as ``str | int | float``, so pydantic
turns a JSON ``true`` into ``1`` before Meridian sees it: ``"meridian_max_think_tokens": true``
would become a cap of 1 think token. :func:`check_knobs` is the one validator of a request's
``meridian_*`` knobs as the client sent them (:func:`~meridian.vllm.runtime.parse_request_budget`
plus that JSON-type rule), and the refusal of a knob the running server cannot honour (forcing
off for every request, e.g. no logits processor under speculative decoding: the reason is in
``$MERIDIAN_FORCING_OFF``). Every front door calls it: ``meridian serve`` installs this
middleware with vLLM's ``--middleware``, ``meridian serve-cluster``'s ingress adds it to its app.
(``meridian_forcing`` takes a bool as documented: it arrives as 0/1, which the logits processor
reads as off/on.)

Which requests: every POST whose body mentions ``meridian_``, whatever its path. Every vLLM
route that takes ``vllm_xargs`` has it at the top level of its body (chat and text completions
with their ``/batch`` and ``/render`` forms, Anthropic's ``/v1/messages``, ``/v1/responses``,
SageMaker's ``/invocations``, which takes a chat or completion body; vLLM 0.32 and 0.33): a JSON
object, or for the audio routes (``/v1/audio/transcriptions``, ``/translations``) a form field
holding JSON. ``/inference/v1/generate`` takes ``SamplingParams`` whole, whose ``extra_args``
keep a JSON bool, which the logits processor's ``validate_params`` rejects. A body this check
cannot read (not JSON, nested deeper than Python's recursion limit, a malformed form) goes on
untouched, and is answered as any bad body is (HTTP 400).

Errors. A response with a 5xx status gets a short OpenAI-shaped body (:func:`error_body`) in
place of whatever the server wrote (which may hold a traceback, file paths, addresses); what it
wrote is logged server-side under the request's id, which the client's body names.
"""

from __future__ import annotations

import email.errors
import email.parser
import email.policy
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from meridian.vllm.runtime import (
    KNOB_FORCING,
    KNOB_MAX_THINK_TOKENS,
    KNOB_SIGNALS,
    RequestArgsError,
    parse_request_budget,
)

__all__ = [
    "ENV_FORCING_OFF",
    "MIDDLEWARE",
    "FrontDoor",
    "check_knobs",
    "error_body",
    "knob_error",
]

logger = logging.getLogger(__name__)

MIDDLEWARE = "meridian.vllm.http.FrontDoor"
#: Why forcing is off for every request of this server (unset: forcing works).
ENV_FORCING_OFF = "MERIDIAN_FORCING_OFF"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_XARGS = "vllm_xargs"


def check_knobs(xargs: Mapping[str, Any], forcing_off: str | None = None) -> str | None:
    """The error of a request's ``vllm_xargs`` as the client sent them (JSON types intact), if
    any: the knobs' own rules, a JSON bool where a number is expected, and a knob that asks for
    forcing where ``forcing_off`` (the reason) says this server cannot force.

    >>> check_knobs({"meridian_max_think_tokens": True})
    'vllm_xargs.meridian_max_think_tokens must be a positive integer; got true'
    >>> check_knobs({"meridian_max_think_tokens": 64}) is None
    True
    >>> print(check_knobs({"meridian_max_think_tokens": 64}, forcing_off="speculative decoding"))
    vllm_xargs.meridian_max_think_tokens cannot be honoured: forcing is off in this server \
(speculative decoding)
    """
    cap = xargs.get(KNOB_MAX_THINK_TOKENS)
    if isinstance(cap, bool):
        return f"{_XARGS}.{KNOB_MAX_THINK_TOKENS} must be a positive integer; got {json.dumps(cap)}"
    try:
        budget = parse_request_budget(xargs, field=_XARGS)
    except RequestArgsError as exc:
        return str(exc)
    if budget is None or not forcing_off:
        return None
    wants = [
        key
        for key, asks in (
            (KNOB_MAX_THINK_TOKENS, cap is not None),
            (KNOB_FORCING, KNOB_FORCING in xargs and budget.forcing),
            (KNOB_SIGNALS, xargs.get(KNOB_SIGNALS, "none") != "none"),
        )
        if asks
    ]
    if not wants:
        return None
    return f"{_XARGS}.{wants[0]} cannot be honoured: forcing is off in this server ({forcing_off})"


def knob_error(
    body: bytes, content_type: str = "application/json", *, forcing_off: str | None = None
) -> str | None:
    """:func:`check_knobs` of a request body's ``vllm_xargs``, if it has any.

    ``content_type`` is the request's header: a form (``multipart/form-data``,
    ``application/x-www-form-urlencoded``) carries ``vllm_xargs`` as a JSON string; anything
    else is read as JSON.

    >>> knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": "lots"}}')
    "vllm_xargs.meridian_max_think_tokens must be a positive integer; got 'lots'"
    """
    if b"meridian_" not in body:
        return None
    xargs = _vllm_xargs(body, content_type)
    if not isinstance(xargs, dict):
        return None
    return check_knobs(xargs, forcing_off)


# OpenAI's error types by status (its Python client's exception names).
_ERROR_TYPES = {
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, error_type: str | None = None) -> bytes:
    """An OpenAI-shaped error body (as vLLM writes its own).

    >>> error_body(400, "bad knob")
    b'{"error": {"message": "bad knob", "type": "BadRequestError", "param": null, "code": 400}}'
    """
    kind = (
        error_type
        or _ERROR_TYPES.get(status)
        or ("BadRequestError" if status < 500 else "InternalServerError")
    )
    error = {"message": message, "type": kind, "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def internal_error_message(request_id: str) -> str:
    """What a client is told of a server-side failure: nothing but where to look."""
    return f"Internal server error (request id {request_id}; the details are in the server log)"


def _vllm_xargs(body: bytes, content_type: str) -> object:
    """The body's top-level ``vllm_xargs``, decoded; ``None`` where there is none or the body
    cannot be read (vLLM answers such a body itself)."""
    media = content_type.split(";", 1)[0].strip().lower()
    try:
        if media == "multipart/form-data":
            raw = _multipart_field(body, content_type, _XARGS)
        elif media == "application/x-www-form-urlencoded":
            raw = next(iter(parse_qs(body.decode()).get(_XARGS, ())), None)
        else:
            request = json.loads(body)
            return request.get(_XARGS) if isinstance(request, dict) else None
        return None if raw is None else json.loads(raw)
    except (ValueError, RecursionError, email.errors.MessageError):
        # ValueError: malformed JSON or text; MessageError: a malformed form; RecursionError:
        # JSON nested past the interpreter's limit (raised by json.loads' C decoder, nothing
        # of ours is left half done).
        return None


def _multipart_field(body: bytes, content_type: str, name: str) -> str | None:
    """The text of the form field ``name`` of a ``multipart/form-data`` body, if any."""
    header = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + body)
    if not message.is_multipart():
        return None
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == name:
            content = part.get_payload(decode=True)
            return content.decode() if isinstance(content, bytes) else None
    return None


class FrontDoor:
    """The middleware (a plain ASGI wrapper, as vLLM's own are; module docstring).
    ``forcing_off``: why this server cannot force (default: ``$MERIDIAN_FORCING_OFF``)."""

    def __init__(self, app: ASGIApp, forcing_off: str | None = None) -> None:
        self.app = app
        self.forcing_off = forcing_off or os.environ.get(ENV_FORCING_OFF) or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        send = _ErrorGuard(send, request_id)
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        content_type = _header(scope, b"content-type") or "application/json"
        error = knob_error(b"".join(chunks), content_type, forcing_off=self.forcing_off)
        if error is not None:
            await _send_json(send, 400, error_body(400, error))
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _header(scope: Scope, name: bytes) -> str | None:
    return next(
        (v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == name), None
    )


async def _send_json(send: Send, status: int, payload: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class _ErrorGuard:
    """``send`` with every 5xx response's body replaced by :func:`error_body` (module
    docstring); what the server wrote is logged with the request id."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._request_id = request_id
        self._status: int | None = None
        self._held: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._status = int(message["status"])
            if self._status < 500:
                await self._send(message)
            return
        if kind != "http.response.body" or self._status is None or self._status < 500:
            await self._send(message)
            return
        self._held.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        written = b"".join(self._held).decode("utf-8", "replace")
        logger.error(
            "request %s answered HTTP %d; the client got a short error; the server wrote: %s",
            self._request_id,
            self._status,
            written[:4000],
        )
        payload = error_body(self._status, internal_error_message(self._request_id))
        await _send_json(self._send, self._status, payload)
