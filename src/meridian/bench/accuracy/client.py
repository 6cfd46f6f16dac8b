"""The client of ``meridian bench accuracy``: every item under every forcing policy against an
OpenAI-compatible server (async httpx), and the think tokens of each reply."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from meridian.bench.accuracy.dataset import Item, grade
from meridian.bench.accuracy.policies import ForcingPolicy
from meridian.bench.eat_probe import (
    DEFAULT_SUFFIX,
    ProbeSettings,
    ProbeStats,
    ReplyError,
    reason_with_probe,
)
from meridian.bench.realmode import KEEPALIVE_S, MAX_RETRIES, RETRYABLE, require_server
from meridian.config.schema import EntropyConfig
from meridian.core.signals import EatTracker
from meridian.errors import MeridianError

__all__ = ["AccuracyRun", "Outcome", "count_think_tokens", "run_accuracy"]


@dataclass(slots=True)
class Outcome:
    """One item under one policy."""

    policy: str
    item: str
    correct: bool
    think_tokens: int | None
    answer_tokens: int | None
    seconds: float
    answer: str = ""
    error: str | None = None
    probe: ProbeStats | None = None  # eat-probe policies only


@dataclass(frozen=True, slots=True)
class AccuracyRun:
    """Where to send the requests and how."""

    url: str
    model: str
    max_tokens: int = 2048
    temperature: float = 0.0
    concurrency: int = 8
    seed: int = 0
    request_timeout_s: float = 600.0
    think_end: str = "</think>"
    # eat-probe: the top-K log-probabilities of a probe, the text it appends, the tracker's numbers.
    probe_logprobs: int = 20
    probe_suffix: str = DEFAULT_SUFFIX
    entropy: EntropyConfig = field(default_factory=EntropyConfig)


def count_think_tokens(
    reported: object, reasoning: str, content: str, token_ids: object, end_ids: Sequence[int]
) -> int | None:
    """The think tokens of one reply (see the module docstring); ``None`` if unknown.

    >>> count_think_tokens(0, "hmm", "4", [5, 6, 7, 9, 4], [7, 9])
    2
    >>> count_think_tokens(0, "hmm", "", [5, 6], [7, 9]), count_think_tokens(3, "h", "4", None, [])
    (2, 3)
    """
    if isinstance(reported, int) and (reported > 0 or not reasoning):
        return reported
    if not isinstance(token_ids, list) or not end_ids:
        return None
    n = len(end_ids)
    for i in range(len(token_ids) - n + 1):
        if token_ids[i : i + n] == list(end_ids):
            return i
    return None if content else len(token_ids)


@dataclass(frozen=True, slots=True)
class _Ids:
    """Token ids of the run's markers (empty where the server cannot tokenize)."""

    think_end: tuple[int, ...]
    suffix: tuple[int, ...]


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST ``body``; the reply's JSON. A connection reset before any response is retried as in
    real mode; anything else that is not a 200 with JSON raises :class:`ReplyError`."""
    for attempt in range(MAX_RETRIES + 1):
        try:
            resp = await client.post(url, json=body, timeout=timeout)
            break
        except httpx.HTTPError as exc:
            if attempt < MAX_RETRIES and isinstance(exc, RETRYABLE):
                continue
            raise ReplyError(f"{type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ReplyError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        return resp.json()
    except ValueError:
        raise ReplyError(f"not JSON: {resp.text[:200]!r}") from None


async def _ask(
    client: httpx.AsyncClient, run: AccuracyRun, policy: ForcingPolicy, item: Item, ids: _Ids
) -> Outcome:
    """One item under one policy: a chat completion, or the EAT probe's requests."""
    start = time.perf_counter()
    try:
        if policy.probe_interval is not None:
            return await _ask_probed(client, run, policy, item, ids, start)
        return await _ask_chat(client, run, policy, item, ids.think_end, start)
    except ReplyError as exc:
        return Outcome(policy.name, item.id, False, None, None, time.perf_counter() - start,
                       error=str(exc))  # fmt: skip


def _messages(item: Item) -> list[dict[str, str]]:
    return [{"role": "user", "content": item.prompt}]


def _sampling(run: AccuracyRun, policy: ForcingPolicy) -> dict[str, Any]:
    """The fields every request of a policy carries, chat or completion."""
    return {"model": run.model, "temperature": run.temperature, "seed": run.seed, **policy.fields}


async def _ask_chat(
    client: httpx.AsyncClient,
    run: AccuracyRun,
    policy: ForcingPolicy,
    item: Item,
    end_ids: Sequence[int],
    start: float,
) -> Outcome:
    body = {**_sampling(run, policy), "messages": _messages(item), "max_tokens": run.max_tokens}
    if end_ids:
        body["return_token_ids"] = True
    data = await _post(client, "/chat/completions", body, run.request_timeout_s)
    seconds = time.perf_counter() - start
    try:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
        usage = data.get("usage") or {}
        completion = usage.get("completion_tokens")
        reported = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        think = count_think_tokens(reported, reasoning, content, choice.get("token_ids"), end_ids)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ReplyError(f"not an OpenAI chat completion: {str(data)[:200]!r}") from None
    answer_tokens = (
        completion - think if isinstance(completion, int) and think is not None else None
    )
    return Outcome(policy.name, item.id, grade(item, content), think, answer_tokens, seconds,
                   answer=content[:500])  # fmt: skip


async def _ask_probed(
    client: httpx.AsyncClient,
    run: AccuracyRun,
    policy: ForcingPolicy,
    item: Item,
    ids: _Ids,
    start: float,
) -> Outcome:
    """The item under an ``eat-probe`` policy (:func:`.eat_probe.reason_with_probe`)."""
    assert policy.probe_interval is not None
    prompt_ids = await _tokenize(client, run, {"messages": _messages(item),
                                               "add_generation_prompt": True})  # fmt: skip
    settings = ProbeSettings(
        interval_tokens=policy.probe_interval,
        num_logprobs=run.probe_logprobs,
        max_tokens=run.max_tokens,
        think_end_ids=ids.think_end,
        suffix_ids=ids.suffix,
        fields=_sampling(run, policy),
    )

    async def post(path: str, body: dict[str, Any]) -> Any:
        return await _post(client, path, body, run.request_timeout_s)

    tracker = EatTracker.from_config(run.entropy)
    reply = await reason_with_probe(post, prompt_ids, tracker, settings)
    return Outcome(policy.name, item.id, grade(item, reply.answer), reply.think_tokens,
                   reply.answer_tokens, time.perf_counter() - start, answer=reply.answer[:500],
                   probe=reply.stats)  # fmt: skip


async def _tokenize(
    client: httpx.AsyncClient, run: AccuracyRun, request: dict[str, Any]
) -> list[int]:
    """Token ids from vLLM's ``/tokenize`` (at the server's root): ``request`` is a ``prompt``
    or ``messages``; :class:`ReplyError` where the server has no such endpoint."""
    root = run.url.rstrip("/").removesuffix("/v1")
    data = await _post(client, f"{root}/tokenize", {"model": run.model, **request}, 30.0)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ReplyError(f"/tokenize gave no token ids: {str(data)[:200]!r}")
    return tokens


async def _marker_ids(
    client: httpx.AsyncClient, run: AccuracyRun, policies: Sequence[ForcingPolicy]
) -> _Ids:
    """``think_end``'s ids, and the probe suffix's when a policy probes. Without ``/tokenize``
    chat policies count think tokens from usage only; a probe cannot run at all."""
    probing = [p.name for p in policies if p.probe_interval is not None]

    async def ids(text: str) -> tuple[int, ...]:
        try:
            return tuple(
                await _tokenize(client, run, {"prompt": text, "add_special_tokens": False})
            )
        except ReplyError as exc:
            if probing:
                raise MeridianError(
                    f"{probing[0]} needs the server's /tokenize (vLLM's): {exc}"
                ) from None
            return ()

    return _Ids(await ids(run.think_end), await ids(run.probe_suffix) if probing else ())


async def _run_all(
    run: AccuracyRun,
    policies: Sequence[ForcingPolicy],
    items: Sequence[Item],
    on_done: Callable[[str, int], None] | None,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[list[Outcome], dict[str, float]]:
    order = list(items)
    random.Random(run.seed).shuffle(order)
    limits = httpx.Limits(max_connections=run.concurrency, keepalive_expiry=KEEPALIVE_S)
    outcomes: list[Outcome] = []
    walls: dict[str, float] = {}
    client_at = httpx.AsyncClient(base_url=run.url.rstrip("/"), limits=limits, transport=transport)
    async with client_at as client:
        await require_server(client)
        ids = await _marker_ids(client, run, policies)
        sem = asyncio.Semaphore(run.concurrency)

        async def one(policy: ForcingPolicy, item: Item) -> Outcome:
            async with sem:
                return await _ask(client, run, policy, item, ids)

        for policy in policies:  # one policy at a time: its wall time is its own
            if on_done is not None:
                on_done(policy.name, 0)
            start = time.perf_counter()
            tasks = [asyncio.create_task(one(policy, item)) for item in order]
            for done, fut in enumerate(asyncio.as_completed(tasks), start=1):
                await fut
                if on_done is not None:
                    on_done(policy.name, done)
            walls[policy.name] = time.perf_counter() - start
            outcomes += [t.result() for t in tasks]
    return outcomes, walls


def run_accuracy(
    run: AccuracyRun,
    policies: Sequence[ForcingPolicy],
    items: Sequence[Item],
    on_done: Callable[[str, int], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[Outcome], dict[str, float]]:
    """Every item under every policy (items in the seed's order, the same for each policy):
    the outcomes, in that order, and each policy's wall time in seconds. ``transport``: an
    httpx transport instead of the network (tests)."""
    return asyncio.run(_run_all(run, policies, items, on_done, transport))
