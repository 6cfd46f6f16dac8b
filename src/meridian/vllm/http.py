"""An ASGI middleware for vLLM's OpenAI server: Meridian's request knobs checked as sent.

vLLM's request models type ``vllm_xargs`` values as ``str | int | float``, so pydantic turns a
JSON ``true`` into ``1`` before Meridian sees it: ``"meridian_max_think_tokens": true`` would
become a cap of 1 think token. This middleware answers HTTP 400 with a one-line error for a
boolean where that number is expected; everything else passes through untouched (the body is
replayed to vLLM as received). ``meridian serve`` installs it with vLLM's ``--middleware``.
(``meridian_forcing`` takes a bool as documented: it arrives as 0/1, which the logits
processor reads as off/on.)

Which requests: every POST whose body mentions ``meridian_``, whatever its path. Every vLLM
route that takes ``vllm_xargs`` has it at the top level of its body (chat and text completions
with their ``/batch`` and ``/render`` forms, Anthropic's ``/v1/messages``, ``/v1/responses``,
SageMaker's ``/invocations``, which takes a chat or completion body; vLLM 0.32 and 0.33): a JSON
object, or for the audio routes (``/v1/audio/transcriptions``, ``/translations``) a form field
holding JSON. ``/inference/v1/generate`` takes ``SamplingParams`` whole, whose ``extra_args``
keep a JSON bool, which the logits processor's ``validate_params`` rejects.

A body this check cannot read (not JSON, nested deeper than Python's recursion limit, a
malformed form) goes to vLLM untouched, which answers it as it answers any bad body (HTTP 400).
"""

from __future__ import annotations

import email.errors
import email.parser
import email.policy
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from meridian.vllm.runtime import KNOB_MAX_THINK_TOKENS

__all__ = ["MIDDLEWARE", "KnobCheck", "knob_error"]

MIDDLEWARE = "meridian.vllm.http.KnobCheck"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_XARGS = "vllm_xargs"


def knob_error(body: bytes, content_type: str = "application/json") -> str | None:
    """The error of a request body's Meridian knobs that vLLM's typing would hide, if any.

    ``content_type`` is the request's header: a form (``multipart/form-data``,
    ``application/x-www-form-urlencoded``) carries ``vllm_xargs`` as a JSON string; anything
    else is read as JSON.

    >>> knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": true}}')
    'vllm_xargs.meridian_max_think_tokens must be a positive integer; got true'
    >>> knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": 64}}') is None
    True
    """
    if b"meridian_" not in body:
        return None
    xargs = _vllm_xargs(body, content_type)
    if not isinstance(xargs, dict):
        return None
    cap = xargs.get(KNOB_MAX_THINK_TOKENS)
    if isinstance(cap, bool):
        return f"{_XARGS}.{KNOB_MAX_THINK_TOKENS} must be a positive integer; got {json.dumps(cap)}"
    return None


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


class KnobCheck:
    """The middleware (a plain ASGI wrapper, as vLLM's own are)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
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
        content_type = next(
            (
                v.decode("latin-1")
                for k, v in scope.get("headers", ())
                if k.lower() == b"content-type"
            ),
            "application/json",
        )
        error = knob_error(b"".join(chunks), content_type)
        if error is not None:
            payload = json.dumps(
                {"error": {"message": error, "type": "BadRequestError", "param": None, "code": 400}}
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
