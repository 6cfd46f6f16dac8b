"""The ``[workloads.*]`` tables of ``bench/data/workloads.toml``: token-length distributions and
workload definitions, parsed and checked (an error names the file and the dotted key).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from meridian.errors import MeridianError

__all__ = [
    "TABLE_WORKLOADS",
    "DistKind",
    "IntArray",
    "LengthDist",
    "WorkloadDef",
    "WorkloadError",
    "clipped_lognormal_mean",
    "parse_workload_table",
]

# Workloads defined by a [workloads.NAME] table of workloads.toml (Poisson arrivals).
TABLE_WORKLOADS: tuple[str, ...] = ("synthetic", "math500", "aime", "sharegpt")

IntArray = npt.NDArray[np.int64]


class WorkloadError(MeridianError, ValueError):
    """An unknown workload, bad workload parameters, or an invalid workload data file."""


class DistKind(enum.Enum):
    """Shape of a token-length distribution."""

    LOGNORMAL = "lognormal"
    UNIFORM = "uniform"


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """``E[clip(X, lo, hi)]`` for ``X ~ LogNormal(mu, sigma)``, in closed form.

    ``lo * P(X < lo) + E[X; lo <= X <= hi] + hi * P(X > hi)``, where the partial expectation is
    ``exp(mu + sigma^2 / 2) * (Phi(z_hi - sigma) - Phi(z_lo - sigma))`` with
    ``z = (ln(bound) - mu) / sigma``.
    """
    z_lo = (math.log(lo) - mu) / sigma
    z_hi = (math.log(hi) - mu) / sigma
    body = math.exp(mu + 0.5 * sigma * sigma) * (
        _normal_cdf(z_hi - sigma) - _normal_cdf(z_lo - sigma)
    )
    return lo * _normal_cdf(z_lo) + body + hi * (1.0 - _normal_cdf(z_hi))


def _solve_lognormal_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The log-mean whose clipped mean is ``mean`` (bisection; the clipped mean rises with mu)."""
    low, high = math.log(lo) - 10.0 * sigma, math.log(hi) + 10.0 * sigma
    for _ in range(200):
        mid = 0.5 * (low + high)
        if clipped_lognormal_mean(mid, sigma, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """An integer token-length distribution on ``[min_tokens, max_tokens]``.

    ``LOGNORMAL``: ``clip(LogNormal(mu, sigma), min, max)`` rounded, with ``mu`` solved at
    construction so that the clipped mean is ``mean``. ``UNIFORM``: integers in ``[min, max]``.
    ``mean`` is the distribution's expected value either way.
    """

    kind: DistKind
    min_tokens: int
    max_tokens: int
    mean: float
    sigma: float
    source: str
    mu: float = 0.0

    def sample(self, rng: np.random.Generator, size: int) -> IntArray:
        """``size`` lengths as int64."""
        if self.kind is DistKind.UNIFORM:
            return rng.integers(self.min_tokens, self.max_tokens + 1, size=size, dtype=np.int64)
        x = rng.lognormal(self.mu, self.sigma, size=size)
        return np.rint(np.clip(x, self.min_tokens, self.max_tokens)).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadDef:
    """One workload of the data file: the mix, its length distributions and published targets.

    ``chat_*`` are ``None`` when the workload has no chat requests, ``reasoning_*`` when it has
    no reasoning requests. ``published_total_range`` is the published band of the mean generated
    tokens (think + answer) per reasoning request, when the workload is calibrated to one.
    """

    name: str
    description: str
    reasoning_ratio: float
    chat_prompt: LengthDist | None
    chat_output: LengthDist | None
    reasoning_prompt: LengthDist | None
    think: LengthDist | None
    answer: LengthDist | None
    total_tokens_cap: int | None
    published_total_range: tuple[int, int] | None

    @property
    def has_chat(self) -> bool:
        """True when the workload defines chat requests."""
        return self.chat_prompt is not None

    @property
    def has_reasoning(self) -> bool:
        """True when the workload defines reasoning requests."""
        return self.think is not None


def parse_workload_table(data: Mapping[str, Any], *, source: str) -> dict[str, WorkloadDef]:
    """Validate a parsed data file's ``[workloads.*]`` tables into :class:`WorkloadDef` s.

    Every workload of :data:`TABLE_WORKLOADS` must be present. Errors name ``source`` and the dotted
    key, e.g. ``workloads.toml: workloads.aime.reasoning.think_tokens.sigma must be > 0``.
    """
    table = data.get("workloads")
    if not isinstance(table, Mapping):
        raise WorkloadError(f"{source}: no [workloads] table")
    missing = [name for name in TABLE_WORKLOADS if name not in table]
    if missing:
        raise WorkloadError(f"{source}: workloads {', '.join(missing)} are not defined")
    return {name: _parse_workload(name, table[name], source) for name in table}


def _fail(source: str, key: str, rule: str, value: object) -> WorkloadError:
    return WorkloadError(f"{source}: {key} must be {rule}; got {value!r}")


def _number(section: Mapping[str, Any], key: str, where: str, source: str) -> float:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(source, f"{where}.{key}", "a finite number", value)
    return float(value)


def _integer(section: Mapping[str, Any], key: str, where: str, source: str) -> int:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(source, f"{where}.{key}", "an integer", value)
    return value


def _parse_dist(section: object, where: str, source: str) -> LengthDist:
    if not isinstance(section, Mapping):
        raise _fail(source, where, "a table", section)
    text = section.get("source")
    if not isinstance(text, str) or not text.strip():
        raise _fail(source, f"{where}.source", "a non-empty string naming the source", text)
    kinds = ", ".join(k.value for k in DistKind)
    try:
        kind = DistKind(section.get("dist"))
    except ValueError:
        raise _fail(source, f"{where}.dist", f"one of {kinds}", section.get("dist")) from None
    lo = _integer(section, "min", where, source)
    hi = _integer(section, "max", where, source)
    if lo < 1:
        raise _fail(source, f"{where}.min", ">= 1", lo)
    if hi < lo:
        raise _fail(source, f"{where}.max", f">= min ({lo})", hi)
    if kind is DistKind.UNIFORM:
        return LengthDist(kind, lo, hi, mean=(lo + hi) / 2.0, sigma=0.0, source=text)
    mean = _number(section, "mean", where, source)
    sigma = _number(section, "sigma", where, source)
    if sigma <= 0:
        raise _fail(source, f"{where}.sigma", "> 0", sigma)
    if not lo < mean < hi:
        raise _fail(source, f"{where}.mean", f"strictly between min ({lo}) and max ({hi})", mean)
    mu = _solve_lognormal_mu(mean, sigma, lo, hi)
    return LengthDist(kind, lo, hi, mean=mean, sigma=sigma, source=text, mu=mu)


def _parse_workload(name: str, section: object, source: str) -> WorkloadDef:
    where = f"workloads.{name}"
    if not isinstance(section, Mapping):
        raise _fail(source, where, "a table", section)
    description = section.get("description")
    if not isinstance(description, str) or not description:
        raise _fail(source, f"{where}.description", "a non-empty string", description)
    ratio = _number(section, "reasoning_ratio", where, source)
    if not 0.0 <= ratio <= 1.0:
        raise _fail(source, f"{where}.reasoning_ratio", "in [0, 1]", ratio)

    chat_prompt = chat_output = None
    chat = section.get("chat")
    if chat is not None:
        if not isinstance(chat, Mapping):
            raise _fail(source, f"{where}.chat", "a table", chat)
        chat_prompt = _parse_dist(chat.get("prompt_tokens"), f"{where}.chat.prompt_tokens", source)
        chat_output = _parse_dist(chat.get("output_tokens"), f"{where}.chat.output_tokens", source)

    reasoning_prompt = think = answer = None
    cap: int | None = None
    reasoning = section.get("reasoning")
    if reasoning is not None:
        rw = f"{where}.reasoning"
        if not isinstance(reasoning, Mapping):
            raise _fail(source, rw, "a table", reasoning)
        reasoning_prompt = _parse_dist(
            reasoning.get("prompt_tokens"), f"{rw}.prompt_tokens", source
        )
        think = _parse_dist(reasoning.get("think_tokens"), f"{rw}.think_tokens", source)
        answer = _parse_dist(reasoning.get("answer_tokens"), f"{rw}.answer_tokens", source)
        if "total_tokens_cap" in reasoning:
            cap = _integer(reasoning, "total_tokens_cap", rw, source)
            if think.max_tokens + answer.max_tokens > cap:
                raise _fail(
                    source,
                    f"{rw}.think_tokens.max + answer_tokens.max",
                    f"<= total_tokens_cap ({cap})",
                    think.max_tokens + answer.max_tokens,
                )

    if ratio > 0.0 and think is None:
        raise _fail(source, f"{where}.reasoning", "defined when reasoning_ratio > 0", None)
    if ratio < 1.0 and chat_prompt is None:
        raise _fail(source, f"{where}.chat", "defined when reasoning_ratio < 1", None)

    published: tuple[int, int] | None = None
    pub = section.get("published")
    if pub is not None:
        pw = f"{where}.published"
        if not isinstance(pub, Mapping):
            raise _fail(source, pw, "a table", pub)
        lo = _integer(pub, "total_tokens_mean_min", pw, source)
        hi = _integer(pub, "total_tokens_mean_max", pw, source)
        if not 0 < lo <= hi:
            raise _fail(source, f"{pw}.total_tokens_mean_max", f">= min ({lo}) > 0", hi)
        published = (lo, hi)

    return WorkloadDef(
        name=name,
        description=description,
        reasoning_ratio=ratio,
        chat_prompt=chat_prompt,
        chat_output=chat_output,
        reasoning_prompt=reasoning_prompt,
        think=think,
        answer=answer,
        total_tokens_cap=cap,
        published_total_range=published,
    )
