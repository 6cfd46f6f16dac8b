"""The paper's EAT signal, client-side: the ``eat-probe`` policy of ``meridian bench accuracy``.

EAT (arXiv:2509.26522) is the entropy of the next-token distribution *after appending the end of
thinking* to the reasoning so far. Meridian's server computes a proxy of it from the live stream
(ADR-0007); this module measures the real thing against any vLLM server, with side requests:

1. the reasoning is generated in chunks of ``interval_tokens`` tokens with ``/v1/completions``
   (the prompt is token ids, so every chunk continues exactly where the last one stopped; the
   server's forcing is off for every request, so only the probe decides);
2. after each chunk a probe, ``prompt + reasoning + suffix`` with ``max_tokens=1`` and
   ``logprobs=K``, returns the top-K log-probabilities of the token after the suffix; their
   entropy is one sample for :class:`~meridian.core.signals.EatTracker` (``add_sample``; the
   report names this source ``after_think``);
3. when the tracker converges the harness forces: ``prompt + reasoning + suffix``, and the answer
   is generated from there; when the model writes ``think_end`` itself first, the answer is
   generated after its own marker. Think tokens are the reasoning tokens before either.

The suffix is the paper's code's (``"\\n</think>\\n\\n"``, github.com/xidulu/EAT): the entropy is
that of the answer's first token. With ``</think>`` alone a model whose template puts a newline
after it measures the entropy of that newline.

Tail mass. A server returns the top K log-probabilities only (vLLM caps K with
``--max-logprobs``, 20 by default); the rest of the vocabulary holds ``r = 1 - sum(p_topK)`` in an
unknown shape. :func:`entropy_from_top_logprobs` lumps it into one outcome, ``-r ln r``: a lower
bound (merging outcomes never raises entropy). The upper bound spreads ``r`` evenly over the other
``V - K`` tokens, ``H_lump + r ln(V - K)``; the harness records the largest ``r`` a request saw, so
the gap is known. With ``K >= V`` (all of the vocabulary) the entropy is exact, up to the
server's rounding of the log-probabilities.

Cost. Each probe makes the server compute the prompt tokens its prefix cache does not hold plus
one generated token. With the prefix cached that is ``len(suffix) + 1``; vLLM caches whole blocks
only, so the reasoning's last partial block is computed again too. Where the server reports
``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``)
that is what is counted; otherwise the floor ``len(suffix) + 1`` per probe. The chunked
generation has a cost of its own, which a probe inside the server would not have: each chunk after
the first, and the answer, recomputes the uncached part of its prompt (``resume_tokens``, known
only where the server reports cached tokens).

With ``temperature > 0`` a chunked generation does not draw the same tokens as one request (each
chunk reseeds the sampler); at 0 (greedy) it does.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meridian.core.signals import EatTracker

__all__ = [
    "DEFAULT_SUFFIX",
    "ProbeSettings",
    "ProbeStats",
    "ProbeSummary",
    "ProbedReply",
    "ReplyError",
    "entropy_from_top_logprobs",
    "reason_with_probe",
    "summarize_probes",
]

DEFAULT_SUFFIX = "\n</think>\n\n"

# POST a JSON body to a path of the server; the reply's JSON, or ReplyError.
Post = Callable[[str, dict[str, Any]], Awaitable[Any]]


class ReplyError(Exception):
    """A request that got no usable reply; the message says why (it becomes the outcome's
    error)."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How one request is probed. ``fields`` are the sampling fields every request carries
    (model, temperature, seed, the per-request knobs that turn the server's forcing off)."""

    interval_tokens: int
    num_logprobs: int
    max_tokens: int
    think_end_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ProbeStats:
    """What the probe saw on one request and what it cost the server."""

    fired: bool = False
    num_probes: int = 0
    probe_tokens: int = 0
    measured: bool = True  # probe_tokens from the server's cached_tokens, else the floor
    resume_tokens: int | None = 0  # None: the server does not report cached tokens
    tail_mass_max: float = 0.0
    entropies: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ProbedReply:
    """One request's result: think tokens (before the force or the model's own marker), the
    answer text and its tokens (the appended marker or suffix included, as a chat reply counts
    its end marker), and the probe's statistics."""

    think_tokens: int
    answer: str
    answer_tokens: int
    stats: ProbeStats


def entropy_from_top_logprobs(logprobs: Iterable[float]) -> tuple[float, float]:
    """The entropy (nats) of a next-token distribution known by its top-K log-probabilities,
    the tail lumped into one outcome (a lower bound; exact when K covers the vocabulary), and
    the tail mass.

    >>> h, tail = entropy_from_top_logprobs([math.log(0.5), math.log(0.25)])
    >>> round(h, 4), tail  # 0.5 ln 2 + 0.25 ln 4 + 0.25 ln 4 (the tail: one outcome of 0.25)
    (1.0397, 0.25)
    """
    probs = [math.exp(x) for x in logprobs]
    h = -sum(p * math.log(p) for p in probs if p > 0.0)
    tail = max(0.0, 1.0 - sum(probs))
    if tail > 0.0:
        h -= tail * math.log(tail)
    return h, tail


def _computed(usage: dict[str, Any]) -> int | None:
    """Prompt tokens the server computed (not found in its prefix cache), if it says."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = usage.get("prompt_tokens")
    if isinstance(cached, int) and isinstance(prompt, int):
        return prompt - cached
    return None


def _find(ids: Sequence[int], marker: Sequence[int]) -> int | None:
    n = len(marker)
    for i in range(len(ids) - n + 1):
        if list(ids[i : i + n]) == list(marker):
            return i
    return None


def _ends_in_part_of(ids: Sequence[int], marker: Sequence[int]) -> bool:
    """Whether ``ids`` end with a proper prefix of ``marker``."""
    return any(list(ids[-k:]) == list(marker[:k]) for k in range(1, min(len(marker), len(ids) + 1)))


class _Prober:
    """The requests of one probed reply; counts their cost into ``stats``."""

    def __init__(self, post: Post, settings: ProbeSettings) -> None:
        self.post = post
        self.settings = settings
        self.stats = ProbeStats()

    async def complete(
        self, prompt: list[int], max_tokens: int, **extra: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """POST one completion; its first choice and its usage."""
        body = {**self.settings.fields, "prompt": prompt, "max_tokens": max_tokens, **extra}
        data = await self.post("/completions", body)
        choices = data.get("choices") if isinstance(data, dict) else None
        usage = (data.get("usage") or {}) if isinstance(data, dict) else None
        if not (choices and isinstance(choices, list) and isinstance(choices[0], dict)
                and isinstance(usage, dict)):  # fmt: skip
            raise ReplyError(f"not an OpenAI completion: {str(data)[:200]!r}")
        return choices[0], usage

    async def resume(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """A continuation (a chunk after the first, or the answer): its uncached prompt tokens
        are the chunked generation's own cost."""
        choice, usage = await self.complete(prompt, max_tokens, return_token_ids=True)
        computed = _computed(usage)
        if computed is None or self.stats.resume_tokens is None:
            self.stats.resume_tokens = None
        else:
            self.stats.resume_tokens += computed
        return choice

    async def probe(self, prefix: list[int]) -> float:
        """One EAT sample: the entropy after ``prefix + suffix``."""
        settings = self.settings
        choice, usage = await self.complete([*prefix, *settings.suffix_ids], 1, temperature=0.0,
                                            logprobs=settings.num_logprobs,
                                            return_tokens_as_token_ids=True)  # fmt: skip
        try:
            top = choice["logprobs"]["top_logprobs"][0]
            values = [float(v) for v in top.values()]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise ReplyError(f"a probe without top_logprobs: {str(choice)[:200]!r}") from None
        h, tail = entropy_from_top_logprobs(values)
        computed = _computed(usage)
        stats = self.stats
        stats.num_probes += 1
        if computed is None:
            stats.measured = False
            stats.probe_tokens += len(settings.suffix_ids) + 1
        else:
            stats.probe_tokens += computed + 1  # and the one generated token
        stats.tail_mass_max = max(stats.tail_mass_max, tail)
        stats.entropies.append(h)
        return h


def _token_ids(choice: dict[str, Any]) -> list[int]:
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ReplyError("a completion without token_ids (the server needs return_token_ids)")
    return ids


async def reason_with_probe(
    post: Post, prompt_ids: Sequence[int], tracker: EatTracker, settings: ProbeSettings
) -> ProbedReply:
    """Reason in chunks, probe after each, force when ``tracker`` converges (module docstring).

    At most ``settings.max_tokens`` tokens are generated in all (reasoning and answer), as one
    request's ``max_tokens`` bounds them; a reasoning that reaches it, or ends the sequence
    without ``think_end``, has no answer.
    """
    prober = _Prober(post, settings)
    prompt = list(prompt_ids)
    reasoning: list[int] = []
    end = settings.think_end_ids
    while True:
        budget = settings.max_tokens - len(reasoning)
        if budget <= 0:
            return ProbedReply(len(reasoning), "", 0, prober.stats)
        chunk_size = min(settings.interval_tokens, budget)
        if reasoning:
            choice = await prober.resume([*prompt, *reasoning], chunk_size)
        else:
            choice, _ = await prober.complete(prompt, chunk_size, return_token_ids=True)
        reasoning += _token_ids(choice)
        # The marker may straddle two chunks: look for it in the whole reasoning.
        at = _find(reasoning, end) if end else None
        if at is not None:
            appended = list(end)
            del reasoning[at:]
            break
        if choice.get("finish_reason") == "stop":  # ended without think_end
            return ProbedReply(len(reasoning), "", 0, prober.stats)
        if _ends_in_part_of(reasoning, end):
            continue  # the model is writing its marker: no probe, the next chunk ends it
        if tracker.add_sample(await prober.probe([*prompt, *reasoning])):
            prober.stats.fired = True
            appended = list(settings.suffix_ids)
            break
    budget = settings.max_tokens - len(reasoning) - len(appended)
    if budget <= 0:
        return ProbedReply(len(reasoning), "", len(appended), prober.stats)
    choice = await prober.resume([*prompt, *reasoning, *appended], budget)
    text = choice.get("text") or ""
    generated = len(_token_ids(choice))
    return ProbedReply(len(reasoning), text, len(appended) + generated, prober.stats)


@dataclass(frozen=True, slots=True)
class ProbeSummary:
    """A probe policy's figures over its requests (failed requests left out)."""

    requests: int
    fired: int
    probes_mean: float
    probe_tokens_mean: float
    measured: bool  # every request's probe tokens from the server's cached_tokens
    resume_tokens_mean: float  # NaN where the server did not report cached tokens
    tail_mass_max: float


def summarize_probes(stats: Sequence[ProbeStats]) -> ProbeSummary:
    """:class:`ProbeSummary` of one policy's requests."""
    n = len(stats)

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    resumes = [s.resume_tokens for s in stats]
    return ProbeSummary(
        requests=n,
        fired=sum(s.fired for s in stats),
        probes_mean=mean([s.num_probes for s in stats]),
        probe_tokens_mean=mean([s.probe_tokens for s in stats]),
        measured=all(s.measured for s in stats),
        resume_tokens_mean=(
            math.nan if any(r is None for r in resumes) else mean([r or 0 for r in resumes])
        ),
        tail_mass_max=max((s.tail_mass_max for s in stats), default=0.0),
    )
