"""Service-level objectives as users feel them, and the window a run is measured over.

**The SLO of a request** is a multiple (the *scale*) of its own latency on an idle engine of the
run's shape, as DistServe and its successors define SLO attainment: a long request may take
longer. The idle latency comes from the step-time model the run itself uses
(:class:`IdleLatency`): the prompt's prefill in chunks of ``max_num_batched_tokens``, then one
decode step per generated token, each at batch size 1 over the request's own context. The
workload's lengths define it (think tokens *requested*, before any forcing), so the SLO of a
request is the same under every policy of a comparison. The answer stream also has a bound no
scale relaxes: no gap between two tokens a user reads over :data:`STALL_S` (a stall a reader
notices).

**Two user models** (:class:`UserModel`):

- *reasoning hidden* (the UI shows only the answer): time to first visible token = TTFVT (first
  answer token) <= scale x idle TTFVT; the answer's mean inter-token time (first to last answer
  token) <= scale x its idle value; no answer gap over the stall bound;
- *reasoning shown* (the UI streams the thinking live): time to first visible token = TTFT
  (first think token) <= scale x idle TTFT; the whole stream's mean inter-token time (first
  token to last, thinking included) <= scale x its idle value; no gap over the stall bound
  anywhere in the stream (think gaps, the ``</think>`` turn and answer gaps).

A request meets an SLO only when it finished and its answer is not wrong (a premature forced stop
in the workload's entropy model). The smallest scale at which a request meets its SLO is its
*needed scale* (infinite when no scale helps: a stall, an unfinished request, a wrong answer);
**attainment** at scale ``s`` is the share of measured requests whose needed scale is at most
``s``, reported over :data:`SCALES`. **Goodput** counts the requests meeting the SLO at
:data:`GOODPUT_SCALE` per second of the *arrival window* (not the makespan, which a single
straggler moves).

**The window** (:class:`Window`): the requests that arrive in ``[start, end)`` are measured,
``start`` being the warm-up (the first seconds of arrivals find an empty engine). Every per-request
statistic of a report uses only them; engine-wide figures (peak KV use, the waiting queue) are
taken from the warm-up's end on.

An *explicit* SLO (:class:`ExplicitSlo`: TTFVT <= base + seconds per requested think token,
answer-gap P95 <= a bound) replaces the scaled one for goodput when a user asks for it, and is
what a live server's run (no step-time model) uses.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from meridian.errors import ConfigError, MeridianError
from meridian.sim.records import RequestRecord
from meridian.sim.request import RequestKind
from meridian.sim.steptime import BatchShape, StepTimeModel

__all__ = [
    "GOODPUT_SCALE",
    "SCALES",
    "STALL_S",
    "ExplicitSlo",
    "IdleLatency",
    "IdleTimes",
    "NeededScales",
    "SloSpec",
    "UserModel",
    "Window",
    "answer_gaps_ns",
    "meets_explicit",
    "needed_scale",
    "slo_ratios",
]

NS_PER_S = 1_000_000_000
# Attainment is reported at these scales (x the idle latency): 1.5, 2, 2.5, ..., 10.
SCALES: tuple[float, ...] = tuple(x / 2 for x in range(3, 21))
GOODPUT_SCALE = 3.0
# No gap a reader sees may exceed this (the answer stream's absolute bound, unscaled).
STALL_S = 0.250


class UserModel(enum.StrEnum):
    """What the user sees of a reasoning request (module docstring)."""

    HIDDEN = "hidden"
    SHOWN = "shown"


@dataclass(frozen=True, slots=True)
class ExplicitSlo:
    """A fixed SLO: TTFVT <= ``ttfvt_base_s`` + ``think_tpot_s`` x think tokens requested, and
    the P95 of the request's answer gaps <= ``output_itl_s``."""

    ttfvt_base_s: float = 2.0
    think_tpot_s: float = 0.080
    output_itl_s: float = 0.050

    def __post_init__(self) -> None:
        for name in ("ttfvt_base_s", "think_tpot_s", "output_itl_s"):
            _positive(f"slo.{name}", getattr(self, name))


@dataclass(frozen=True, slots=True)
class SloSpec:
    """What counts toward goodput: the unloaded-latency SLO of ``user`` at ``scale`` (stall
    bound ``stall_s``), or ``explicit`` when given."""

    scale: float = GOODPUT_SCALE
    stall_s: float = STALL_S
    user: UserModel = UserModel.HIDDEN
    explicit: ExplicitSlo | None = None

    def __post_init__(self) -> None:
        _positive("slo.scale", self.scale)
        _positive("slo.stall_s", self.stall_s)

    @property
    def stall_ns(self) -> int:
        return round(self.stall_s * NS_PER_S)

    def describe(self) -> str:
        """One sentence for reports."""
        if self.explicit is not None:
            e = self.explicit
            return (
                f"explicit SLO: TTFVT ≤ {e.ttfvt_base_s:g} s + {e.think_tpot_s * 1000:g} ms × "
                f"think tokens requested, answer-gap P95 ≤ {e.output_itl_s * 1000:g} ms"
            )
        return (
            f"each request's SLO is {self.scale:g} × its latency on an idle engine of the same "
            f"shape (reasoning {self.user.value}), with no gap a reader sees over "
            f"{self.stall_s * 1000:g} ms"
        )


def _positive(where: str, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value)):
        raise ConfigError(f"{where} must be a positive number; got {value!r}")
    if value <= 0:
        raise ConfigError(f"{where} must be a positive number; got {value}")


@dataclass(frozen=True, slots=True)
class Window:
    """The requests a run measures: arrivals in ``[start_ns, end_ns)``; ``start_ns`` is the
    warm-up."""

    start_ns: int
    end_ns: int

    def __post_init__(self) -> None:
        if not 0 <= self.start_ns < self.end_ns:
            raise MeridianError(
                f"the warm-up ({self.start_ns / NS_PER_S:g} s) must be below the end of the "
                f"arrivals ({self.end_ns / NS_PER_S:g} s)"
            )

    @classmethod
    def of_run(cls, duration_s: float, warmup_s: float = 0.0) -> Window:
        """Arrivals from ``warmup_s`` to ``duration_s`` (a bundled workload's span)."""
        if not (math.isfinite(warmup_s) and warmup_s >= 0):
            raise MeridianError(f"--warmup-s must be a number >= 0; got {warmup_s}")
        if warmup_s >= duration_s:
            raise MeridianError(
                f"--warmup-s ({warmup_s:g}) must be below the seconds of arrivals "
                f"({duration_s:g}): nothing would be measured"
            )
        return cls(round(warmup_s * NS_PER_S), math.ceil(duration_s * NS_PER_S))

    @classmethod
    def spanning(cls, arrivals_ns: Iterable[int], warmup_s: float = 0.0) -> Window:
        """From ``warmup_s`` to just after the last arrival (a trace's own span)."""
        last = max(arrivals_ns, default=0)
        return cls.of_run((last + 1) / NS_PER_S, warmup_s)

    @property
    def length_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S

    @property
    def warmup_s(self) -> float:
        return self.start_ns / NS_PER_S

    def contains(self, arrival_ns: int) -> bool:
        return self.start_ns <= arrival_ns < self.end_ns

    def measured(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """The records this window measures, in their order."""
        return [r for r in records if self.start_ns <= r.arrival_ns < self.end_ns]


@dataclass(frozen=True, slots=True)
class IdleTimes:
    """One request alone on an idle engine (ns): its first token, its first answer token, and
    the mean gap between its answer tokens and between all its tokens (``None``: one token)."""

    ttft_ns: int
    ttfvt_ns: int
    answer_tpot_ns: float | None
    stream_tpot_ns: float | None


class IdleLatency:
    """The latency of a request alone on an engine of the run's shape, from the run's step-time
    model: prefill in chunks of ``max_num_batched_tokens`` (each a step of that many prompt
    tokens over the context so far), the first token at the end of the last chunk, then one
    decode step per token at batch size 1, the ``k``-th reading ``prompt + k`` KV entries (the
    counting of :func:`meridian.vllm.steplog.step_shape`).

    Decode steps are tabulated once per context length and summed through a prefix sum, so a
    request costs O(chunks), whatever its length.
    """

    def __init__(self, step_model: StepTimeModel, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise MeridianError(
                f"max_num_batched_tokens must be >= 1; got {max_num_batched_tokens}"
            )
        self.step_model = step_model
        self.chunk_tokens = max_num_batched_tokens
        # _decode_prefix[n] = sum of decode(c) for c < n; decode(0) is never used (0 by
        # convention), so the table starts from a context of 1.
        self._decode_prefix: npt.NDArray[np.int64] = np.zeros(1, dtype=np.int64)

    def decode_ns(self, context: int) -> int:
        """One decode step at batch size 1 reading ``context`` KV entries."""
        return self.step_model.step_time_ns(BatchShape.decode_only(1, context))

    def _decode_sum(self, first: int, last: int) -> int:
        """``decode_ns(c)`` summed over contexts ``first..last`` (inclusive; 0 when empty)."""
        if last < first:
            return 0
        table = self._decode_prefix
        if last + 1 >= table.size:
            size = max(last + 2, 2 * table.size)
            steps = [self.decode_ns(c) if c > 0 else 0 for c in range(table.size - 1, size - 1)]
            table = np.concatenate([table, table[-1] + np.cumsum(steps, dtype=np.int64)])
            self._decode_prefix = table
        return int(table[last + 1] - table[first])

    def prefill_ns(self, num_prompt_tokens: int) -> int:
        """The prompt's chunked prefill, through the step that samples the first token."""
        total = done = 0
        while done < num_prompt_tokens:
            chunk = min(self.chunk_tokens, num_prompt_tokens - done)
            done += chunk
            total += self.step_model.step_time_ns(
                BatchShape(
                    num_prefill_tokens=chunk, num_decode_seqs=0, num_kv_tokens_read=done, num_seqs=1
                )
            )
        return total

    def of(self, num_prompt: int, num_think: int, num_answer: int, *, reasoning: bool) -> IdleTimes:
        """A request generating ``num_think`` think tokens, ``</think>`` (when ``reasoning``)
        and ``num_answer`` answer tokens (the last one EOS) after a prompt of ``num_prompt``."""
        first_answer = num_think + 1 if reasoning else 0  # its index among generated tokens
        last = first_answer + num_answer - 1
        ttft = self.prefill_ns(num_prompt)
        # Generated token k >= 1 comes from the decode step reading num_prompt + k entries.
        ttfvt = ttft + self._decode_sum(num_prompt + 1, num_prompt + first_answer)
        answer_gaps = last - first_answer
        answer = self._decode_sum(num_prompt + first_answer + 1, num_prompt + last)
        stream = self._decode_sum(num_prompt + 1, num_prompt + last)
        return IdleTimes(
            ttft_ns=ttft,
            ttfvt_ns=ttfvt,
            answer_tpot_ns=answer / answer_gaps if answer_gaps > 0 else None,
            stream_tpot_ns=stream / last if last > 0 else None,
        )

    def of_record(self, record: RequestRecord) -> IdleTimes:
        """The idle latency of the request a record is of (its workload's lengths)."""
        reasoning = record.kind is RequestKind.REASONING
        return self.of(
            record.num_prompt_tokens,
            record.num_think_tokens_requested if reasoning else 0,
            record.num_answer_tokens_requested,
            reasoning=reasoning,
        )


def answer_gaps_ns(record: RequestRecord) -> npt.NDArray[np.int64]:
    """The gaps between consecutive answer tokens of one request (ns); empty below two tokens."""
    times = np.asarray(record.answer_token_ns, dtype=np.int64)
    return times[1:] - times[:-1]


def _worst_answer_gap_ns(record: RequestRecord) -> int:
    times = record.answer_token_ns
    return int(max((b - a for a, b in pairwise(times)), default=0))


def slo_ratios(
    record: RequestRecord, idle: IdleTimes, user: UserModel, stall_ns: int
) -> tuple[float, float, str | None]:
    """``record`` against its idle self for ``user``: the first visible token's ratio, the
    stream's mean-gap ratio, and why no scale can help (``"unfinished"``, ``"wrong answer"``,
    ``"stall"``; ``None`` when some scale does, and the ratios are 0 when one does not)."""
    if record.finish_ns is None or record.first_token_ns is None or not record.answer_token_ns:
        return 0.0, 0.0, "unfinished"
    if record.answer_correct is False:
        return 0.0, 0.0, "wrong answer"
    answers = record.answer_token_ns
    worst = _worst_answer_gap_ns(record)
    if user is UserModel.HIDDEN:
        visible = (answers[0] - record.arrival_ns) / max(idle.ttfvt_ns, 1)
        gaps, idle_tpot, first = len(answers) - 1, idle.answer_tpot_ns, answers[0]
    else:
        visible = (record.first_token_ns - record.arrival_ns) / max(idle.ttft_ns, 1)
        think_end = record.think_end_ns
        gaps = record.num_think_tokens + int(think_end is not None) + len(answers) - 1
        idle_tpot, first = idle.stream_tpot_ns, record.first_token_ns
        if think_end is not None:
            worst = max(worst, record.max_think_gap_ns, answers[0] - think_end)
    if worst > stall_ns:
        return 0.0, 0.0, "stall"
    stream = 0.0
    if gaps > 0 and idle_tpot:
        stream = (answers[-1] - first) / gaps / idle_tpot
    return visible, stream, None


def needed_scale(record: RequestRecord, idle: IdleTimes, user: UserModel, stall_ns: int) -> float:
    """The smallest scale at which ``record`` meets its SLO for ``user`` (infinite when none
    does): the larger of its two ratios (:func:`slo_ratios`)."""
    visible, stream, why = slo_ratios(record, idle, user, stall_ns)
    return math.inf if why is not None else max(visible, stream)


def meets_explicit(record: RequestRecord, slo: ExplicitSlo) -> bool:
    """True when a finished request meets the explicit SLO's TTFVT and answer-gap P95 bounds and
    its answer is not wrong."""
    if not record.finished or record.first_answer_ns is None or record.answer_correct is False:
        return False
    ttfvt_s = (record.first_answer_ns - record.arrival_ns) / NS_PER_S
    if ttfvt_s > slo.ttfvt_base_s + record.num_think_tokens_requested * slo.think_tpot_s:
        return False
    gaps_s = answer_gaps_ns(record) / NS_PER_S
    # The P95 never exceeds the largest gap: skip the (costly) percentile when that one is fine.
    if gaps_s.size == 0 or gaps_s.max() <= slo.output_itl_s:
        return True
    return float(np.percentile(gaps_s, 95, method="linear")) <= slo.output_itl_s


@dataclass(frozen=True, slots=True)
class NeededScales:
    """Every measured request's ratios to its idle self for each user model (first visible
    token, stream), its needed scale (infinite when no scale helps), and why the hopeless ones
    miss (reason -> count)."""

    visible: dict[UserModel, npt.NDArray[np.float64]]
    stream: dict[UserModel, npt.NDArray[np.float64]]
    needed: dict[UserModel, npt.NDArray[np.float64]]
    hopeless: dict[UserModel, dict[str, int]]

    @classmethod
    def of(cls, records: Sequence[RequestRecord], idle: IdleLatency, stall_ns: int) -> NeededScales:
        rows: dict[UserModel, list[tuple[float, float, float]]] = {u: [] for u in UserModel}
        hopeless: dict[UserModel, dict[str, int]] = {u: {} for u in UserModel}
        for record in records:
            times = idle.of_record(record)
            for user in UserModel:
                visible, stream, why = slo_ratios(record, times, user, stall_ns)
                rows[user].append((visible, stream, math.inf if why else max(visible, stream)))
                if why is not None:
                    hopeless[user][why] = hopeless[user].get(why, 0) + 1
        columns = {u: np.asarray(rows[u], dtype=np.float64).reshape(-1, 3) for u in UserModel}
        return cls(
            visible={u: c[:, 0] for u, c in columns.items()},
            stream={u: c[:, 1] for u, c in columns.items()},
            needed={u: c[:, 2] for u, c in columns.items()},
            hopeless=hopeless,
        )

    def ratios(self, user: UserModel) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Each request's first-visible-token and stream ratios (0 for a hopeless one)."""
        return self.visible[user], self.stream[user]

    def attainment_pct(self, user: UserModel, scales: Sequence[float]) -> list[float]:
        """The share of requests (%) meeting the SLO at each scale."""
        values = self.needed[user]
        if values.size == 0:
            return [0.0 for _ in scales]
        ordered = np.sort(values)
        met = np.searchsorted(ordered, np.asarray(scales, dtype=np.float64), side="right")
        return [100.0 * float(m) / values.size for m in met]

    def num_met(self, user: UserModel, scale: float) -> int:
        """Requests meeting the SLO at ``scale``."""
        return int(np.count_nonzero(self.needed[user] <= scale))
