"""Simulator workloads: seeded request streams built from the bundled data files.

A table workload (:data:`TABLE_WORKLOADS`) is a Poisson arrival process (exponential
inter-arrival times at ``arrival_rate`` over ``[0, duration_s)``) and, per request, a kind (chat
or reasoning, Bernoulli with ``reasoning_ratio``) and token lengths drawn from the workload's
distributions in ``bench/data/workloads.toml`` (parsed by :mod:`meridian.bench.workload_table`).
Every distribution there names its source; see that file for what is published and what is
assumed. Reasoning requests also get a per-token think-entropy trace and a settle point from
:class:`~meridian.bench.entropy_model.EntropyTraceModel`.

Determinism: one ``numpy.random.default_rng(seed)`` feeds every draw, in this order: the
arrivals, the kinds, the chat lengths (prompt, output), the reasoning lengths (prompt, think,
answer), then one entropy trace per reasoning request in arrival order. The same name and
parameters give identical requests. ``servegen-r1`` is generated from production traffic
instead (clients with bursty arrivals and their own length tables): :mod:`meridian.bench.servegen`.

>>> specs = generate_workload("sharegpt", WorkloadParams(arrival_rate=5.0, duration_s=2.0, seed=1))
>>> [s.request_id for s in specs][:2], specs == sorted(specs, key=lambda s: s.arrival_ns)
(['r000000', 'r000001'], True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from meridian.bench.entropy_model import (
    DATA_FILE,
    EntropyModelParams,
    EntropyTraceModel,
    load_data_file,
)
from meridian.bench.workload_table import (
    TABLE_WORKLOADS,
    IntArray,
    WorkloadDef,
    WorkloadError,
    parse_workload_table,
)
from meridian.sim.request import RequestKind, RequestSpec

__all__ = [
    "DEFAULT_DURATION_S",
    "MAX_DURATION_S",
    "MAX_EXPECTED_REQUESTS",
    "SERVEGEN",
    "SERVEGEN_DURATION_S",
    "TABLE_WORKLOADS",
    "WORKLOADS",
    "IntArray",
    "WorkloadError",
    "WorkloadParams",
    "build_specs",
    "default_duration_s",
    "generate_workload",
    "is_bundled",
    "poisson_arrivals_ns",
    "workload_definition",
]

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
