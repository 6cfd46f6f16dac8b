"""Simulator workloads: seeded request streams built from the bundled data files.

A table workload (:data:`TABLE_WORKLOADS`) is a Poisson arrival process (exponential
inter-arrival times at ``arrival_rate`` over ``[0, duration_s)``) and, per request, a kind (chat
or reasoning, Bernoulli with ``reasoning_ratio``) and token lengths drawn from the workload's
distributions in ``bench/data/workloads.toml``. Every distribution there names its source; see
that file for what is published and what is assumed. Reasoning requests also get a per-token
think-entropy trace and a settle point from
:class:`~meridian.bench.entropy_model.EntropyTraceModel`.

Determinism: one ``numpy.random.default_rng(seed)`` feeds every draw, in this order: the
arrivals, the kinds, the chat lengths (prompt, output), the reasoning lengths (prompt, think,
answer), then one entropy trace per reasoning request in arrival order. The same name and
parameters give identical requests. ``servegen-r1`` is generated from production traffic
instead (clients with bursty arrivals and their own length tables): :mod:`meridian.bench.servegen`.

>>> specs = generate_workload("sharegpt", WorkloadParams(arrival_rate=5.0, duration_s=2.0, seed=1))
>>> [s.request_id for s in specs][:2], specs == sorted(specs, key=lambda s: s.arrival_ns)
(['r000000', 'r000001'], True)

Length: one table of named workloads and the generator they share (lengths, kinds, arrivals,
traces); each workload is data, not code.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from meridian.bench.entropy_model import (
    DATA_FILE,
    EntropyModelParams,
    EntropyTraceModel,
    load_data_file,
)
from meridian.errors import MeridianError
from meridian.sim.request import RequestKind, RequestSpec

__all__ = [
    "DEFAULT_DURATION_S",
    "MAX_DURATION_S",
    "MAX_EXPECTED_REQUESTS",
    "SERVEGEN",
    "SERVEGEN_DURATION_S",
    "TABLE_WORKLOADS",
    "WORKLOADS",
    "DistKind",
    "LengthDist",
    "WorkloadDef",
    "WorkloadError",
    "WorkloadParams",
    "build_specs",
    "clipped_lognormal_mean",
    "default_duration_s",
    "generate_workload",
    "is_bundled",
    "parse_workload_table",
    "poisson_arrivals_ns",
    "workload_definition",
]

# Workloads defined by a [workloads.NAME] table of workloads.toml (Poisson arrivals).
TABLE_WORKLOADS: tuple[str, ...] = ("synthetic", "math500", "aime", "sharegpt")
# Production traffic from its own data file (meridian.bench.servegen); ``servegen-r1@HH:MM``
# starts at that time of the source's day instead of its default.
SERVEGEN = "servegen-r1"
# Every bundled workload.
WORKLOADS: tuple[str, ...] = (*TABLE_WORKLOADS, SERVEGEN)
DEFAULT_DURATION_S = 30.0
# servegen-r1's rates and burstiness are per 10-minute window: by default a run is one window.
SERVEGEN_DURATION_S = 600.0
# A guard against a typo such as a rate of 1e6 exhausting memory: rate * duration above this.
MAX_EXPECTED_REQUESTS = 1_000_000
# The longest run: a week of arrivals (servegen-r1 walks its source's day window by window, so its
# work grows with the duration at any rate; arrival times stay far inside int64 nanoseconds).
MAX_DURATION_S = 7 * 24 * 3600.0
NS_PER_S = 1_000_000_000

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


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """What a run asks of a workload.

    ``arrival_rate`` (requests/s, > 0) and ``duration_s`` (> 0) set the Poisson process; ``seed``
    (>= 0) seeds the one generator. ``reasoning_ratio`` overrides the data file's mix (``None``:
    the workload's own); ``entropy_params`` overrides the entropy model (``None``: the data
    file's calibrated parameters). Invalid values raise :class:`WorkloadError`.
    """

    arrival_rate: float
    duration_s: float
    seed: int
    reasoning_ratio: float | None = None
    entropy_params: EntropyModelParams | None = None

    def __post_init__(self) -> None:
        for name in ("arrival_rate", "duration_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise WorkloadError(f"{name} must be a number; got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise WorkloadError(f"{name} must be a finite number > 0; got {value}")
        if self.duration_s > MAX_DURATION_S:
            raise WorkloadError(
                f"duration_s must be at most {MAX_DURATION_S:g} (a week); got {self.duration_s:g}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise WorkloadError(f"seed must be an integer >= 0; got {self.seed!r}")
        expected = self.arrival_rate * self.duration_s
        if expected > MAX_EXPECTED_REQUESTS:
            raise WorkloadError(
                f"arrival_rate * duration_s = {expected:g} expected requests; at most "
                f"{MAX_EXPECTED_REQUESTS:,} are supported: lower the rate or the duration"
            )
        ratio = self.reasoning_ratio
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0
        ):
            raise WorkloadError(f"reasoning_ratio must be in [0, 1] or None; got {ratio!r}")
        if self.entropy_params is not None and not isinstance(
            self.entropy_params, EntropyModelParams
        ):
            raise WorkloadError(
                f"entropy_params must be EntropyModelParams or None; got {self.entropy_params!r}"
            )


def poisson_arrivals_ns(rate: float, duration_s: float, rng: np.random.Generator) -> IntArray:
    """Arrival times (integer ns, non-decreasing, all in ``[0, duration_s)``) of a Poisson
    process of ``rate`` per second: cumulative sums of exponential gaps."""
    expected = rate * duration_s
    # Draw in chunks big enough to finish in one go almost always; the draw order stays fixed.
    chunk = int(expected + 6.0 * math.sqrt(expected) + 16)
    parts: list[npt.NDArray[np.float64]] = []
    t = 0.0
    while True:
        times = t + np.cumsum(rng.exponential(1.0 / rate, size=chunk))
        inside = times[times < duration_s]
        parts.append(inside)
        if inside.size < times.size:
            break
        t = float(times[-1])
    seconds = np.concatenate(parts)
    arrivals = np.floor(seconds * NS_PER_S).astype(np.int64)
    # Flooring keeps every arrival below duration_s; the clip only guards float rounding.
    return np.minimum(arrivals, math.ceil(duration_s * NS_PER_S) - 1)


def generate_workload(name: str, params: WorkloadParams) -> list[RequestSpec]:
    """The requests of workload ``name`` (one of :data:`WORKLOADS`), sorted by arrival.

    Ids are ``"r000000"``, ``"r000001"``, ... in arrival order. Chat requests have no think
    tokens and no entropy; every reasoning request has ``think_entropy`` (float32, one value per
    think token) and ``settle_token`` from the entropy model. Raises :class:`WorkloadError` for
    an unknown name, or a ``reasoning_ratio`` the workload cannot serve (a ratio above 0 needs
    reasoning distributions, below 1 chat ones).
    """
    if not is_bundled(name):
        raise WorkloadError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    if _is_servegen(name):
        # Imported here: meridian.bench.servegen builds on this module's parameters and specs.
        from meridian.bench.servegen import generate_servegen, start_of

        return generate_servegen(params, start_s=start_of(name))
    workload = workload_definition(name)
    ratio = workload.reasoning_ratio if params.reasoning_ratio is None else params.reasoning_ratio
    if ratio > 0.0 and not workload.has_reasoning:
        raise WorkloadError(
            f"workload {name!r} is chat-only; reasoning_ratio must be 0 for it; got {ratio}"
        )
    if ratio < 1.0 and not workload.has_chat:
        raise WorkloadError(
            f"workload {name!r} is reasoning-only; reasoning_ratio must be 1 for it; got {ratio}"
        )
    rng = np.random.default_rng(params.seed)
    arrivals = poisson_arrivals_ns(params.arrival_rate, params.duration_s, rng)
    num_requests = int(arrivals.size)
    is_reasoning = rng.random(num_requests) < ratio
    num_reasoning = int(is_reasoning.sum())
    num_chat = num_requests - num_reasoning
    chat_prompt = chat_output = np.zeros(0, dtype=np.int64)
    if workload.chat_prompt is not None and workload.chat_output is not None:
        chat_prompt = workload.chat_prompt.sample(rng, num_chat)
        chat_output = workload.chat_output.sample(rng, num_chat)
    r_prompt = r_think = r_answer = np.zeros(0, dtype=np.int64)
    if (
        workload.reasoning_prompt is not None
        and workload.think is not None
        and workload.answer is not None
    ):
        r_prompt = workload.reasoning_prompt.sample(rng, num_reasoning)
        r_think = workload.think.sample(rng, num_reasoning)
        r_answer = workload.answer.sample(rng, num_reasoning)
    # Merge the two kinds back into arrival order; entropy traces are drawn in that order.
    prompt = np.zeros(num_requests, dtype=np.int64)
    think = np.zeros(num_requests, dtype=np.int64)
    answer = np.zeros(num_requests, dtype=np.int64)
    prompt[~is_reasoning], answer[~is_reasoning] = chat_prompt, chat_output
    prompt[is_reasoning], think[is_reasoning], answer[is_reasoning] = r_prompt, r_think, r_answer
    return build_specs(arrivals, prompt, think, answer, rng, params.entropy_params)


def build_specs(
    arrival_ns: IntArray,
    prompt: IntArray,
    think: IntArray,
    answer: IntArray,
    rng: np.random.Generator,
    entropy_params: EntropyModelParams | None,
) -> list[RequestSpec]:
    """Request specs from columns already in arrival order: ids ``r000000``, ... in that order;
    a request with think tokens is a reasoning request and gets an entropy trace and a settle
    point from ``rng`` (one trace per reasoning request, in order), one without is a chat
    request."""
    model = EntropyTraceModel(entropy_params)
    specs: list[RequestSpec] = []
    columns = zip(
        arrival_ns.tolist(), prompt.tolist(), think.tolist(), answer.tolist(), strict=True
    )
    for index, (arrival, num_prompt, num_think, num_answer) in enumerate(columns):
        trace = model.sample(num_think, rng) if num_think > 0 else None
        specs.append(
            RequestSpec(
                request_id=f"r{index:06d}",
                arrival_ns=arrival,
                num_prompt_tokens=num_prompt,
                num_think_tokens=num_think,
                num_answer_tokens=num_answer,
                kind=RequestKind.CHAT if trace is None else RequestKind.REASONING,
                think_entropy=None if trace is None else trace.entropy,
                settle_token=None if trace is None else trace.settle_token,
            )
        )
    return specs


def _is_servegen(name: str) -> bool:
    return name == SERVEGEN or name.startswith(f"{SERVEGEN}@")


def is_bundled(name: str) -> bool:
    """True when ``name`` names a bundled workload (not a trace file)."""
    return name in WORKLOADS or _is_servegen(name)


def default_duration_s(name: str) -> float:
    """Seconds of arrivals of workload ``name`` (or a trace) when the user gives none."""
    return SERVEGEN_DURATION_S if _is_servegen(name) else DEFAULT_DURATION_S


def workload_definition(name: str) -> WorkloadDef:
    """The bundled definition of table workload ``name`` (one of :data:`TABLE_WORKLOADS`);
    :class:`WorkloadError` lists the known ones."""
    definitions = _bundled_definitions()
    if name not in definitions:
        known = ", ".join(TABLE_WORKLOADS)
        raise WorkloadError(f"unknown workload {name!r}; workloads defined by a table: {known}")
    return definitions[name]


@lru_cache(maxsize=1)
def _bundled_definitions() -> dict[str, WorkloadDef]:
    return parse_workload_table(load_data_file(), source=DATA_FILE)


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
