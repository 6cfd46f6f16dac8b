"""``meridian bench accuracy``: what forcing costs in answer quality, on a labelled set, against
any OpenAI-compatible server (vLLM with or without Meridian, SGLang).

Each forcing policy is a set of request fields, so one server serves every policy:

=================  ==================================================================  =========
policy             request fields                                                      needs
=================  ==================================================================  =========
``none``           ``meridian_forcing: "off"``: the model reasons as long as it wants  Meridian
``cap:N``          vLLM's static ``thinking_token_budget: N``, Meridian's forcing off  vLLM
``hard-cap:N``     ``meridian_max_think_tokens: N``, ``meridian_signals: "none"``      Meridian
``meridian``       nothing: the server's ``[entropy]`` signals and its hard cap        Meridian
``eat``            ``meridian_signals: "eat"``: the EAT stream proxy (ADR-0007)        Meridian
``rpdi``           ``meridian_signals: "rpdi"``                                        Meridian
``eat-probe:N``    the paper's EAT, measured by the harness every N reasoning tokens   vLLM
                   (:mod:`meridian.bench.eat_probe`); ``meridian_forcing: "off"``
=================  ==================================================================  =========

``cap:N`` takes a comma list in one policy argument's place: ``cap:64,128,256`` is a sweep.
``eat-probe`` without N probes every ``[entropy].eat_probe_interval_tokens`` tokens (32), the
stream proxy's interval, so ``eat`` and ``eat-probe`` differ in their signal only; its tracker
takes the ``[entropy]`` section's ``ema_alpha``, ``eat_ema_variance_threshold`` and
``eat_min_distance``.
Stock vLLM passes ``vllm_xargs`` on to ``extra_args``, which nothing reads there: against a
server without Meridian only ``none`` and ``cap:N`` mean what they say (SGLang names its own
budget differently; ``cap:N`` is vLLM's field).

The dataset is JSON Lines, one item per line::

    {"prompt": "...", "answer": "42", "checker": "numeric", "tolerance": 0.5}

``checker`` (default ``exact``): ``exact`` (the answer text equals ``answer`` up to case, spaces
and a final full stop), ``numeric`` (the last number in the answer is within ``tolerance`` of
``answer``; commas in numbers are ignored), ``regex`` (``pattern``, else ``answer``, is found in
the answer text), ``choice`` (the last standalone capital letter of the answer text, among the
first ``len(choices)`` letters when ``choices`` is given, is ``answer``). Only the answer
(``content``) is graded; the reasoning never is.

Think tokens are the server's ``usage.completion_tokens_details.reasoning_tokens`` where it
counts them. vLLM 0.32's parsers count only tokens between a generated start and end marker, so
for models whose chat template puts ``<think>`` in the prompt (DeepSeek-R1's, the tiny test
model's) it reports 0 with reasoning text present; then the harness counts the output's token
ids (vLLM's ``return_token_ids``) before the first ``think_end`` (its ids from the server's
``/tokenize``), or all of them when the answer never started. Answer tokens are
``completion_tokens`` less the think tokens (the end marker included). Accuracy comes with a
95 % Wilson interval.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from meridian.bench.eat_probe import (
    DEFAULT_SUFFIX,
    ProbeSettings,
    ProbeStats,
    ProbeSummary,
    ReplyError,
    reason_with_probe,
    summarize_probes,
)
from meridian.bench.metrics import percentiles
from meridian.bench.realmode import KEEPALIVE_S, MAX_RETRIES, RETRYABLE, require_server
from meridian.config.schema import EntropyConfig
from meridian.core.signals import EatTracker
from meridian.errors import MeridianError

__all__ = [
    "CHECKERS",
    "COLUMNS",
    "AccuracyRun",
    "ForcingPolicy",
    "Item",
    "Outcome",
    "PolicySummary",
    "cells",
    "count_think_tokens",
    "grade",
    "load_dataset",
    "pareto_front",
    "parse_policies",
    "run_accuracy",
    "summarize",
    "wilson_interval",
    "write_accuracy_report",
]

CHECKERS = ("exact", "numeric", "regex", "choice")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")
_LETTER = re.compile(r"\b([A-Z])\b")
Z95 = 1.959963984540054


class DatasetError(MeridianError):
    """A dataset line that is not a valid item (the message names file, line and field)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One labelled question."""

    id: str
    prompt: str
    answer: str
    checker: str = "exact"
    tolerance: float = 0.0
    pattern: str | None = None
    choices: tuple[str, ...] = ()


def load_dataset(path: Path) -> list[Item]:
    """The items of a JSONL file; a bad line raises :class:`DatasetError` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc}") from None
    items: list[Item] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: an item must be a JSON object")
        items.append(_item(raw, where, len(items)))
    if not items:
        raise DatasetError(f"{path}: no items")
    return items


def _item(raw: dict[str, Any], where: str, index: int) -> Item:
    def text(key: str, required: bool = True) -> str | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if key == "answer" and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or (required and not value):
            raise DatasetError(f"{where}: {key} must be a non-empty string; got {value!r}")
        return value

    unknown = sorted(set(raw) - {"id", "prompt", "answer", "checker", "tolerance", "pattern",
                                 "choices"})  # fmt: skip
    if unknown:
        raise DatasetError(f"{where}: unknown field {unknown[0]!r}")
    checker = raw.get("checker", "exact")
    if checker not in CHECKERS:
        raise DatasetError(
            f"{where}: checker must be one of {', '.join(CHECKERS)}; got {checker!r}"
        )
    tolerance = raw.get("tolerance", 0.0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise DatasetError(f"{where}: tolerance must be a number; got {tolerance!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise DatasetError(f"{where}: tolerance must be a finite number >= 0; got {tolerance!r}")
    answer = text("answer")
    assert answer is not None
    if checker == "numeric" and _last_number(answer) is None:
        raise DatasetError(f"{where}: answer must be a number for the numeric checker")
    pattern = text("pattern", required=False)
    if checker == "regex":
        try:
            re.compile(pattern or answer)
        except re.error as exc:
            raise DatasetError(f"{where}: pattern is not a regular expression ({exc})") from None
    choices = raw.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DatasetError(f"{where}: choices must be a list of strings")
    if checker == "choice" and not re.fullmatch(r"[A-Z]", answer.strip()):
        raise DatasetError(f"{where}: answer must be one capital letter for the choice checker")
    item_id = raw.get("id", f"item-{index}")
    prompt = text("prompt")
    assert prompt is not None
    return Item(str(item_id), prompt, answer, checker, float(tolerance), pattern, tuple(choices))


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold().rstrip(".")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def grade(item: Item, content: str) -> bool:
    """Whether the answer text ``content`` is right for ``item`` (see the module docstring).

    >>> grade(Item("a", "?", "42", "numeric", 0.5), "so the total is 42.3.")
    True
    >>> grade(Item("b", "?", "C", "choice", choices=("x", "y", "z")), "I pick C")
    True
    """
    if item.checker == "exact":
        return _normal(content) == _normal(item.answer)
    if item.checker == "numeric":
        got, want = _last_number(content), _last_number(item.answer)
        return got is not None and want is not None and abs(got - want) <= item.tolerance
    if item.checker == "regex":
        return re.search(item.pattern or item.answer, content) is not None
    letters = _LETTER.findall(content)
    if item.choices:
        letters = [x for x in letters if ord(x) - ord("A") < len(item.choices)]
    return bool(letters) and letters[-1] == item.answer.strip()


@dataclass(frozen=True, slots=True)
class ForcingPolicy:
    """One way to stop reasoning, as the request fields that select it; ``probe_interval``: the
    harness's EAT probe decides instead, every that many reasoning tokens."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    probe_interval: int | None = None


_XARGS = {
    "meridian": {},
    "eat": {"meridian_signals": "eat"},
    "rpdi": {"meridian_signals": "rpdi"},
    "none": {"meridian_forcing": "off"},
}


def parse_policies(text: str, probe_interval: int = 32) -> list[ForcingPolicy]:
    """``none,cap:64,128,hard-cap:256,meridian,eat-probe:8`` -> policies, in order (see the
    module table); ``eat-probe`` alone probes every ``probe_interval`` tokens."""
    policies: list[ForcingPolicy] = []
    kind = ""
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, value = part.partition(":")
        if name in _XARGS and not value:
            kind = ""
            policies.append(ForcingPolicy(name, {"vllm_xargs": dict(_XARGS[name])}))
            continue
        if name in ("cap", "hard-cap", "eat-probe"):
            kind = name
            value = value or (str(probe_interval) if name == "eat-probe" else "")
        elif kind in ("cap", "hard-cap") and not value and part.isdigit():
            value = part  # the next number of a sweep: cap:64,128
        else:
            raise MeridianError(
                f"--policies: unknown policy {part!r}; known: none, cap:N, hard-cap:N, meridian, "
                "eat, rpdi, eat-probe[:N]"
            )
        if not value.isdigit() or int(value) < 1:
            raise MeridianError(f"--policies: {kind} needs a positive token count; got {part!r}")
        count = int(value)
        fields: dict[str, Any] = {"vllm_xargs": dict(_XARGS["none"])}  # Meridian's forcing off
        if kind == "cap":
            fields["thinking_token_budget"] = count
        elif kind == "hard-cap":
            xargs = {"meridian_max_think_tokens": count, "meridian_signals": "none"}
            fields = {"vllm_xargs": xargs}
        probe_every = count if kind == "eat-probe" else None  # only the probe forces
        policies.append(ForcingPolicy(f"{kind}:{count}", fields, probe_every))
    names = [p.name for p in policies]
    if not names:
        raise MeridianError("--policies: no policy given")
    if len(set(names)) != len(names):
        raise MeridianError(f"--policies: a policy is listed twice: {', '.join(names)}")
    return policies


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


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default).

    >>> [round(x, 3) for x in wilson_interval(5, 10)]
    [0.237, 0.763]
    """
    if total <= 0:
        return (0.0, 1.0)
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    # At 0 or all correct the bound is exactly 0 or 1 (the formula rounds to 1 - 1e-16).
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == total else min(1.0, centre + half)
    return (low, high)


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One policy's row of the report."""

    policy: str
    items: int
    correct: int
    failed: int
    accuracy: float
    accuracy_low: float
    accuracy_high: float
    think_tokens_mean: float
    think_tokens_p50: float
    think_tokens_p95: float
    answer_tokens_mean: float
    think_tokens_saved: float  # against `none`, as a fraction of its mean think tokens
    wall_s: float
    probe: ProbeSummary | None = None  # eat-probe policies only


def summarize(outcomes: Sequence[Outcome], walls: dict[str, float]) -> list[PolicySummary]:
    """A row per policy, in the order they ran. Failed requests count as wrong."""
    think = {
        policy: percentiles(np.array([o.think_tokens for o in outcomes if o.policy == policy
                                      and o.think_tokens is not None], dtype=np.float64))
        for policy in walls
    }  # fmt: skip
    base = think["none"].mean if "none" in think else None
    rows: list[PolicySummary] = []
    for policy, wall in walls.items():
        mine = [o for o in outcomes if o.policy == policy]
        probes = [o.probe for o in mine if o.probe is not None]
        correct = sum(o.correct for o in mine)
        answers = [o.answer_tokens for o in mine if o.answer_tokens is not None]
        low, high = wilson_interval(correct, len(mine))
        mean = think[policy].mean
        rows.append(
            PolicySummary(
                policy=policy,
                items=len(mine),
                correct=correct,
                failed=sum(o.error is not None for o in mine),
                accuracy=correct / len(mine) if mine else math.nan,
                accuracy_low=low,
                accuracy_high=high,
                think_tokens_mean=math.nan if mean is None else mean,
                think_tokens_p50=_or_nan(think[policy].p50),
                think_tokens_p95=_or_nan(think[policy].p95),
                answer_tokens_mean=sum(answers) / len(answers) if answers else math.nan,
                think_tokens_saved=(1 - mean / base if mean is not None and base else math.nan),
                wall_s=wall,
                probe=summarize_probes(probes) if probes else None,
            )
        )
    return rows


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def pareto_front(rows: Sequence[PolicySummary]) -> list[PolicySummary]:
    """The policies no other beats on both counts (fewer mean think tokens and higher
    accuracy; ties kept), by mean think tokens."""
    usable = [r for r in rows if not math.isnan(r.think_tokens_mean)]
    front = [
        r
        for r in usable
        if not any(
            o.think_tokens_mean <= r.think_tokens_mean
            and o.accuracy >= r.accuracy
            and (o.think_tokens_mean < r.think_tokens_mean or o.accuracy > r.accuracy)
            for o in usable
        )
    ]
    return sorted(front, key=lambda r: r.think_tokens_mean)


def _fmt(x: float, spec: str = ".1f") -> str:
    return "n/a" if math.isnan(x) else format(x, spec)


COLUMNS = (
    "policy", "accuracy", "95 % Wilson", "think tokens mean / P50 / P95", "answer tokens mean",
    "think tokens saved vs none", "EAT probe: fired / probes / probe tokens", "failed", "wall s",
    "Pareto",
)  # fmt: skip


def _probe_cell(probe: ProbeSummary | None) -> str:
    """``fired/requests / probes per request / probe tokens per request`` ("≥": the floor, the
    server did not report its cached tokens); "—" for the other policies."""
    if probe is None:
        return "—"
    floor = "" if probe.measured else "≥"
    return (f"{probe.fired}/{probe.requests} / {_fmt(probe.probes_mean)} / "
            f"{floor}{_fmt(probe.probe_tokens_mean, ',.0f')}")  # fmt: skip


def cells(row: PolicySummary, on_front: bool) -> list[str]:
    """One row of the report table, a string per :data:`COLUMNS` entry (Markdown and console)."""
    r = row
    return [
        r.policy,
        f"{r.correct}/{r.items} ({_fmt(100 * r.accuracy)} %)",
        f"{100 * r.accuracy_low:.1f}–{100 * r.accuracy_high:.1f} %",
        f"{_fmt(r.think_tokens_mean)} / {_fmt(r.think_tokens_p50, '.0f')} / "
        f"{_fmt(r.think_tokens_p95, '.0f')}",
        _fmt(r.answer_tokens_mean),
        "n/a" if math.isnan(r.think_tokens_saved) else f"{100 * r.think_tokens_saved:.1f} %",
        _probe_cell(r.probe),
        str(r.failed),
        f"{r.wall_s:.1f}",
        "yes" if on_front else "",
    ]


def markdown(rows: Sequence[PolicySummary], title: str) -> str:
    """The report table (Markdown)."""
    front = {r.policy for r in pareto_front(rows)}
    lines = [
        f"# {title}",
        "",
        f"| {' | '.join(COLUMNS)} |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        policy, *rest = cells(r, r.policy in front)
        lines.append(f"| `{policy}` | {' | '.join(rest)} |")
    return "\n".join(lines) + "\n"


def write_accuracy_report(
    out_dir: Path,
    rows: Sequence[PolicySummary],
    outcomes: Sequence[Outcome],
    meta: dict[str, Any],
    plot: bool = True,
) -> list[Path]:
    """``accuracy.json`` (summary, every outcome, the run's settings), ``accuracy.md`` and, with
    ``plot``, ``accuracy.png`` (accuracy against mean think tokens, the Pareto front drawn)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "summary": [asdict(r) for r in rows],
        "pareto_front": [r.policy for r in pareto_front(rows)],
        "outcomes": [asdict(o) for o in outcomes],
    }
    paths = [out_dir / "accuracy.json", out_dir / "accuracy.md"]
    paths[0].write_text(json.dumps(data, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(rows, f"Accuracy of forcing policies: {meta.get('dataset')}"))
    if plot:
        paths.append(_plot(out_dir / "accuracy.png", rows))
    return paths


def _plot(path: Path, rows: Sequence[PolicySummary]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    usable = [r for r in rows if not math.isnan(r.think_tokens_mean)]
    for r in usable:
        err = [
            [max(0.0, 100 * (r.accuracy - r.accuracy_low))],
            [max(0.0, 100 * (r.accuracy_high - r.accuracy))],
        ]
        ax.errorbar(r.think_tokens_mean, 100 * r.accuracy, yerr=err, fmt="o", capsize=3)
        ax.annotate(r.policy, (r.think_tokens_mean, 100 * r.accuracy), xytext=(4, 4),
                    textcoords="offset points", fontsize=8)  # fmt: skip
    front = pareto_front(usable)
    if len(front) > 1:
        ax.step([r.think_tokens_mean for r in front], [100 * r.accuracy for r in front],
                where="post", color="grey", linestyle="--", label="Pareto front")  # fmt: skip
        ax.legend(loc="lower right")
    ax.set_xlabel("think tokens per item (mean)")
    ax.set_ylabel("accuracy % (95 % Wilson interval)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
