"""Real mode: replay a workload against a live OpenAI-compatible server and measure it.

Each request of the workload becomes one streaming ``/chat/completions`` call, started at its
arrival time (relative to the start of the run). Think tokens arrive as ``reasoning`` deltas
(vLLM 0.32; ``reasoning_content`` in earlier releases and SGLang) when the server runs a
reasoning parser, answer tokens as ``content`` deltas; from their arrival times we measure
TTFT, TTFVT, TTOT and output ITL exactly as the simulator defines them, and write the same
report schema and plots.

With ``replay_think_lengths`` each request carries vLLM's ``thinking_token_budget`` set to its
think length, so the server's think phases have the workload's lengths (for test models that
never close ``</think>`` themselves).

NOTE: a streamed delta may carry several tokens (vLLM's ``stream_interval``); each content delta
counts as one answer-token arrival, so ITL is per delta. Token counts come from the final usage
chunk when the server sends one (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from meridian.errors import MeridianError
from meridian.sim.records import RequestRecord, RunCounters, SimResult
from meridian.sim.request import RequestSpec

# Seconds an idle client connection is kept for reuse (below any server's keep-alive timeout).
KEEPALIVE_S = 1.0
# A request whose connection fails before any response (a reset under load: vLLM's API server
# sometimes closes a connection before the headers) is sent again, at most this many times.
MAX_RETRIES = 2
# Such failures: nothing of the response was seen, so the server did not serve the request.
RETRYABLE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

_WORDS = tuple(
    [
        "consider",
        "the",
        "following",
        "problem",
        "carefully",
        "and",
        "explain",
        "each",
        "step",
        "of",
        "the",
        "reasoning",
        "before",
        "giving",
        "a",
        "short",
        "final",
        "answer",
        "about",
        "numbers",
        "shapes",
        "time",
        "distance",
        "and",
        "probability",
    ]
)


class RealModeError(MeridianError):
    """The server could not be reached or answered something that is not an OpenAI stream."""


@dataclass(frozen=True, slots=True)
class RealRunSpec:
    """Where to send the workload and how long to wait."""

    url: str
    model: str
    request_timeout_s: float = 600.0
    think_suffix: str = ""
    chat_suffix: str = " /no_think"
    temperature: float = 0.0
    max_concurrency: int = 512
    replay_think_lengths: bool = False


def prompt_for(spec: RequestSpec, suffix: str) -> str:
    """A deterministic prompt of roughly ``num_prompt_tokens`` words."""
    words = [
        _WORDS[(i * 7 + len(spec.request_id)) % len(_WORDS)] for i in range(spec.num_prompt_tokens)
    ]
    return " ".join(words) + suffix


def max_tokens_for(spec: RequestSpec) -> int:
    """Room for the think phase, ``</think>`` and the answer."""
    return spec.num_think_tokens + spec.num_answer_tokens + (1 if spec.num_think_tokens else 0)


async def _one(
    client: httpx.AsyncClient,
    run: RealRunSpec,
    spec: RequestSpec,
    t0: float,
    sem: asyncio.Semaphore,
    errors: list[str],
    retried: list[str],
) -> RequestRecord:
    rec = RequestRecord.for_spec(spec, settle_token=False)
    delay = t0 + spec.arrival_ns / 1e9 - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    suffix = run.think_suffix if spec.is_reasoning else run.chat_suffix
    body: dict[str, object] = {
        "model": run.model,
        "messages": [{"role": "user", "content": prompt_for(spec, suffix)}],
        "max_tokens": max_tokens_for(spec),
        "temperature": run.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if run.replay_think_lengths:
        # vLLM's own static budget ends each think phase at the workload's length, so a model
        # that never closes </think> by itself (a random test model) still answers on time.
        body["thinking_token_budget"] = spec.num_think_tokens

    def now_ns() -> int:
        return int((time.perf_counter() - t0) * 1e9)

    async with sem:
        for attempt in range(MAX_RETRIES + 1):
            answered = False
            try:
                async with client.stream(
                    "POST", "/chat/completions", json=body, timeout=run.request_timeout_s
                ) as resp:
                    answered = True
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")[:300]
                        errors.append(f"{spec.request_id}: HTTP {resp.status_code}: {text}")
                        return rec
                    async for line in resp.aiter_lines():
                        _consume(line, rec, now_ns())
                break
            except (httpx.HTTPError, RealModeError) as exc:
                if not answered and attempt < MAX_RETRIES and isinstance(exc, RETRYABLE):
                    retried.append(f"{spec.request_id}: {type(exc).__name__} before a response")
                    continue
                errors.append(
                    f"{spec.request_id}: {type(exc).__name__}: {exc} (after "
                    f"{rec.num_think_tokens} reasoning and {rec.num_answer_tokens} answer deltas)"
                )
                return rec
    if rec.first_token_ns is not None:
        rec.finish_ns = rec.answer_token_ns[-1] if rec.answer_token_ns else now_ns()
    return rec


def _consume(line: str, rec: RequestRecord, now: int) -> None:
    """Apply one SSE line of a chat-completions stream to ``rec``."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise RealModeError(
            f"{rec.request_id}: the server sent a non-JSON event: {data[:120]!r}"
        ) from None
    usage = chunk.get("usage")
    if usage:
        details = usage.get("completion_tokens_details") or {}
        reasoning = details.get("reasoning_tokens")
        if isinstance(reasoning, int) and reasoning >= rec.num_think_tokens:
            rec.num_think_tokens = reasoning
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
        if thought:
            if rec.first_token_ns is None:
                rec.first_token_ns = now
            rec.num_think_tokens += 1
            rec.think_end_ns = now  # the last think delta so far; TTOT runs from here
        if content:
            if rec.first_token_ns is None:
                rec.first_token_ns = now
            if rec.first_answer_ns is None:
                rec.first_answer_ns = now
            rec.answer_token_ns.append(now)
            rec.num_answer_tokens += 1


async def require_server(client: httpx.AsyncClient) -> None:
    """Raise :class:`RealModeError` (one line) unless the client's base URL answers
    ``/models``: before any request of a run is sent."""
    try:
        await client.get("/models", timeout=10.0)
    except httpx.HTTPError as exc:
        url = str(client.base_url).rstrip("/")
        raise RealModeError(
            f"cannot reach {url}/models ({type(exc).__name__}); is the server up?"
        ) from None


async def _run_all(
    run: RealRunSpec,
    specs: Sequence[RequestSpec],
    on_done: Callable[[int], None] | None,
) -> tuple[list[RequestRecord], list[str], list[str], int]:
    errors: list[str] = []
    retried: list[str] = []
    sem = asyncio.Semaphore(run.max_concurrency)
    # Idle connections are dropped well before servers close them (uvicorn's keep-alive
    # timeout, vLLM's default 5 s): reusing one the server is closing fails with ReadError.
    limits = httpx.Limits(max_connections=run.max_concurrency, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=run.url.rstrip("/"), limits=limits) as client:
        await require_server(client)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, run, s, t0, sem, errors, retried)) for s in specs]
        for done, fut in enumerate(asyncio.as_completed(tasks), start=1):
            await fut
            if on_done is not None:
                on_done(done)
        end_ns = int((time.perf_counter() - t0) * 1e9)
        return [t.result() for t in tasks], errors, retried, end_ns


def run_real(
    run: RealRunSpec,
    specs: Sequence[RequestSpec],
    label: str = "server",
    on_done: Callable[[int], None] | None = None,
) -> tuple[SimResult, list[str], list[str]]:
    """Replay ``specs`` against the server: a :class:`SimResult` (for the same reports), the
    per-request errors (requests that failed are reported as unfinished, never dropped) and
    the requests sent again after their connection failed before any response."""
    records, errors, retried, end_ns = asyncio.run(_run_all(run, specs, on_done))
    result = SimResult(
        policy=label,
        engine="real",
        num_kv_blocks=0,
        records=records,
        samples=[],
        counters=RunCounters(),
        end_ns=end_ns,
    )
    return result, errors, retried
