"""The per-request knobs every front door must judge alike (``meridian serve``, with and without
speculative decoding, and ``meridian serve-cluster``'s ingress): the same 400, the same message.

``BAD``: knobs no server accepts. ``UNHONOURABLE``: valid knobs a server whose forcing is off
(speculative decoding under vLLM's V1 runner) must refuse rather than ignore; a server that
forces serves them.
"""

from __future__ import annotations

from typing import Any

import httpx

BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"meridian_max_think_tokens": True},
        "vllm_xargs.meridian_max_think_tokens must be a positive integer; got true",
    ),
    (
        {"meridian_max_think_tokens": "lots"},
        "vllm_xargs.meridian_max_think_tokens must be a positive integer; got 'lots'",
    ),
    (
        {"meridian_max_think_tokens": 0},
        "vllm_xargs.meridian_max_think_tokens must be a positive integer; got 0",
    ),
    (
        {"meridian_forcing": "maybe"},
        'vllm_xargs.meridian_forcing must be "on", "off" or a bool; got \'maybe\'',
    ),
    (
        {"meridian_signals": "eats"},
        'vllm_xargs.meridian_signals must be one of "all", "eat", "rpdi", "none"; got \'eats\'',
    ),
    (
        {"meridian_max_thinking": 8},
        "vllm_xargs: unknown Meridian key 'meridian_max_thinking'; known keys: "
        "meridian_max_think_tokens, meridian_forcing, meridian_signals",
    ),
]

UNHONOURABLE: list[dict[str, Any]] = [
    {"meridian_max_think_tokens": 8},
    {"meridian_forcing": "on"},
    {"meridian_signals": "eat"},
]


def post_knobs(url: str, model: str, xargs: dict[str, Any]) -> httpx.Response:
    """A short chat with ``xargs`` as its ``vllm_xargs``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "b=3 x=2 n=3"}],
        "max_tokens": 4,
        "vllm_xargs": xargs,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def check_front_door(url: str, model: str, *, forcing: bool) -> None:
    """Every row of the table at the front door at ``url``: ``BAD`` ones are a 400 with the
    table's message; ``UNHONOURABLE`` ones are served where ``forcing``, else a 400 that says
    forcing is off."""
    for xargs, message in BAD:
        resp = post_knobs(url, model, xargs)
        assert resp.status_code == 400, (xargs, resp.text)
        assert resp.json()["error"]["message"] == message, (xargs, resp.text)
    for xargs in UNHONOURABLE:
        resp = post_knobs(url, model, xargs)
        if forcing:
            assert resp.status_code == 200, (xargs, resp.text)
        else:
            assert resp.status_code == 400, (xargs, resp.text)
            error = resp.json()["error"]["message"]
            assert error.startswith(f"vllm_xargs.{next(iter(xargs))} cannot be honoured"), error
