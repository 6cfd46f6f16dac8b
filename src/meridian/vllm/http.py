"""An ASGI middleware for vLLM's OpenAI server: Meridian's request knobs checked as sent.

vLLM's request models type ``vllm_xargs`` values as ``str | int | float``, so pydantic turns a
JSON ``true`` into ``1`` before Meridian sees it: ``"meridian_max_think_tokens": true`` would
become a cap of 1 think token. This middleware reads the JSON body of completion requests
(only those that mention ``meridian_``), and answers HTTP 400 with a one-line error for a
boolean where a number is expected; everything else passes through untouched (the body is
replayed to vLLM as received). ``meridian serve`` installs it with vLLM's ``--middleware``.
(``meridian_forcing`` takes a bool as documented: it arrives as 0/1, which the logits
processor reads as off/on.)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from meridian.vllm.runtime import KNOB_MAX_THINK_TOKENS

__all__ = ["MIDDLEWARE", "KnobCheck", "knob_error"]

MIDDLEWARE = "meridian.vllm.http.KnobCheck"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CHECKED_PATHS = ("/completions", "/chat/completions")


def knob_error(body: bytes) -> str | None:
    """The error of a request body's Meridian knobs that vLLM's typing would hide, if any.

    >>> knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": true}}')
    'vllm_xargs.meridian_max_think_tokens must be a positive integer; got true'
    >>> knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": 64}}') is None
    True
    """
    if b"meridian_" not in body:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None  # vLLM reports malformed JSON itself
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    if not isinstance(xargs, dict):
        return None
    cap = xargs.get(KNOB_MAX_THINK_TOKENS)
    if isinstance(cap, bool):
        return (
            f"vllm_xargs.{KNOB_MAX_THINK_TOKENS} must be a positive integer; got {json.dumps(cap)}"
        )
    return None


class KnobCheck:
    """The middleware (a plain ASGI wrapper, as vLLM's own are)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not str(scope.get("path", "")).endswith(_CHECKED_PATHS)
        ):
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
        error = knob_error(b"".join(chunks))
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
