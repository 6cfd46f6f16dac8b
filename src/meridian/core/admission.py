"""Admission: which waiting requests start first, and how many may start (ADR-0013).

Two levers, both consulted by the engine adapter before each step:

- **The waiting order** (``scheduler.admission_order``): chat requests first (``chat-first``,
  the default), reasoning ones first, or the engine's own order. Preempted requests, and those
  that have waited ``admission_order_max_wait_s`` (the starvation bound), go before both. The
  adapter applies the order to its own waiting queue (core never touches an engine's queue).
- **How many start** (``scheduler.admission = "headroom"``): only as many as keep the running
  set's projected KV peak within the cache (:mod:`meridian.core.headroom`), once the length model
  has seen enough finished requests and the cache holds enough of them; before that, and in
  smaller caches, as many as keep every request's bound (prompt plus ``max_tokens``) within the
  cache, while the bounds are tight. First of all, and cheaply: all of them, when the running and
  waiting requests fit the cache together at their bounds.
- **Cost-based admission** (``scheduler.admission_wait_weight`` > 0), on top of the projection:
  a new request it holds starts anyway, in head order, once the cost of its waiting (its time
  in the queue, weighted) is at least the expected cost of the preemptions starting it risks
  (:func:`~meridian.core.headroom.worth_admitting`): its projected overflow recomputed at the
  engine's prefill rate, plus the victim's wait to restart, the projected time the load stays
  over the cache (what the projection already knows, where a measured mean of past restarts
  lags the load it would be applied to). Rate and step time: :class:`EngineRates`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import numpy as np

from meridian.config.schema import SchedulerConfig
from meridian.core.format import expects_reasoning
from meridian.core.headroom import (
    MIN_REQUESTS_IN_CACHE,
    FloatArray,
    IntArray,
    Kind,
    LengthModel,
    admissible,
    bounded_admissible,
    bounds_usable,
    overflows,
    worth_admitting,
)
from meridian.core.interface import EngineRequest, PolicyStats, R
from meridian.core.pacing import StepClock
from meridian.core.routing import Projection
from meridian.core.state import RequestState, reasoned

__all__ = ["ADMISSION_CANDIDATES", "Admission", "EngineRates"]

# Waiting requests admission looks at: the head of the engine's waiting queue (both adapters
# pass this many).
ADMISSION_CANDIDATES = 64


# The priors of EngineRates until the engine's steps say otherwise: conservative (a slow
# prefill, a long step make preemptions look dear, so admission holds, as the projection does).
PRIOR_PREFILL_TOKENS_PER_S = 1000.0
PRIOR_STEP_S = 0.1
# The weight of each new step in EngineRates' running means.
RATE_ALPHA = 0.05


class EngineRates:
    """The engine's step time and prefill rate, learnt online from its own steps.

    ``scheduled(num_rows, num_tokens, took)`` each step, ``took`` the previous step's time
    (:attr:`~meridian.core.pacing.StepClock.took`; ``None`` after an idle spell). Steps whose
    prefill tokens (those beyond one a row) are at least their rows time the rate at which the
    engine computes prompt and recompute tokens (as it does them: in mixed steps, beside decode
    rows).

    >>> rates = EngineRates()
    >>> rates.scheduled(4, 4, None); rates.scheduled(2, 1002, 0.02); rates.scheduled(2, 2, 0.5)
    >>> round(rates.step_s, 4), round(rates.prefill_tokens_per_s, 1)
    (0.1162, 1050.2)
    """

    __slots__ = ("_last", "prefill_tokens_per_s", "step_s")

    def __init__(self) -> None:
        self.step_s = PRIOR_STEP_S
        self.prefill_tokens_per_s = PRIOR_PREFILL_TOKENS_PER_S
        # (rows, tokens) of the last step scheduled.
        self._last: tuple[int, int] | None = None

    def scheduled(self, num_rows: int, num_tokens: int, took: float | None) -> None:
        """The engine scheduled a step of ``num_rows`` rows, ``num_tokens`` tokens; the one
        before it took ``took`` seconds."""
        last, self._last = self._last, (num_rows, num_tokens)
        if last is None or took is None or took <= 0.0:
            return
        rows, tokens = last
        self.step_s += RATE_ALPHA * (took - self.step_s)
        if tokens - rows >= rows:
            rate = tokens / took
            self.prefill_tokens_per_s += RATE_ALPHA * (rate - self.prefill_tokens_per_s)


def _bounds(requests: Sequence[EngineRequest]) -> tuple[IntArray, IntArray]:
    """Each request's tokens now and its bound: its prompt plus ``max_tokens``."""
    tokens = np.fromiter((r.num_tokens for r in requests), np.int64, len(requests))
    bounds = np.fromiter(
        (r.num_prompt_tokens + r.max_tokens for r in requests), np.int64, len(requests)
    )
    return tokens, bounds


def _bounds_fit(requests: Iterable[EngineRequest], num_blocks: int, block_size: int) -> bool:
    """Whether ``requests`` fit in ``num_blocks`` together, each at its bound (prompt plus
    ``max_tokens``): then admitting them can never leave one short of KV. The plain sum, not
    :func:`~meridian.core.headroom.bounded_peak` (tighter, but a pass over every request each
    step): it stops at the first request past the cache (under load, with loose bounds, after a
    few)."""
    left = num_blocks
    for request in requests:
        left -= -(-(request.num_prompt_tokens + request.max_tokens) // block_size)
        if left < 0:
            return False
    return True


class Admission:
    """The waiting order and the admission count (module docstring).

    ``states`` is the policy's table of tracked requests (read only; ``settle`` brings their
    counts up to date before a projection reads them); ``stats`` counts the steps on which a
    request was held back.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        states: Mapping[str, RequestState],
        settle: Callable[[], None],
        stats: PolicyStats,
        *,
        block_size: int,
        mode: Literal["headroom", "vllm"],
        step_clock: StepClock,
    ) -> None:
        self.states = states
        self.step_clock = step_clock
        self.settle = settle
        self.stats = stats
        self.block_size = block_size
        self.mode = mode
        self.reserve = float(config.admission_reserve)
        # Which new requests start first: reasoning ones (True), chat ones (False), or None: the
        # engine's order.
        self.reasoning_first: bool | None = {"reasoning-first": True, "chat-first": False}.get(
            config.admission_order
        )
        self.max_wait_s = float(config.admission_order_max_wait_s)
        self.wait_weight = float(config.admission_wait_weight)
        self.rates = EngineRates()
        self.lengths = LengthModel()
        # Whether admission went by the requests' bounds last time (headroom.bounds_usable),
        # and by the projection (projects).
        self._bounded = False
        self._projected = False

    def wait_start(self, tracked_at: float | None, clock: Callable[[], float]) -> float:
        """When a new request's wait for admission starts (``tracked_at``; ``None``: now): 0.0
        when admission goes in the engine's order and weighs no wait, so never reads it (no clock
        read)."""
        if self.reasoning_first is None and not self.wait_weight:
            return 0.0
        return clock() if tracked_at is None else tracked_at

    def scheduled(self, num_rows: int, num_tokens: int) -> None:
        """The engine scheduled a step (the policy's ``on_step``): cost-based admission learns
        the engine's rates from it."""
        if self.wait_weight:
            self.rates.scheduled(num_rows, num_tokens, self.step_clock.took)

    def finished(self, st: RequestState, num_output_tokens: int) -> None:
        """A request ran to its end after ``num_output_tokens``: its lengths teach the model."""
        think = st.num_think_tokens if reasoned(st) else None
        rest = max(0, st.num_after_think(num_output_tokens))
        self.lengths.finished(think, rest, st.num_prompt_tokens)

    def waiting_order(self, waiting: Sequence[R], now: float) -> list[R] | None:
        """The head of the waiting queue in the order it should start, or ``None`` to keep the
        engine's: preempted and starving requests first, then new requests of the preferred
        kind (reasoning: thinking from their prompt on; chat: the others), then the rest, each
        group in the engine's order."""
        reasoning_first = self.reasoning_first
        if reasoning_first is None or len(waiting) < 2:
            return None
        states = self.states
        starved = now - self.max_wait_s
        ranks = []
        for request in waiting:
            st = states.get(request.request_id)
            if st is None or st.preempted or st.tracked_at <= starved:
                ranks.append(0)
            else:
                ranks.append(1 if expects_reasoning(st.phase) is reasoning_first else 2)
        if all(a <= b for a, b in itertools.pairwise(ranks)):
            return None
        order = sorted(range(len(waiting)), key=ranks.__getitem__)
        return [waiting[i] for i in order]

    def admissions(self, running: Sequence[R], waiting: Sequence[R], num_blocks: int) -> int | None:
        """How many of ``waiting`` (from the head, in the engine's order) may start this step;
        ``None``: no limit from Meridian (the engine's own rules decide). ``num_blocks`` is the
        cache's size in blocks."""
        if self.mode != "headroom" or not waiting:
            return None
        lengths, bs = self.lengths, self.block_size
        if _bounds_fit(itertools.chain(running, waiting), num_blocks, bs):
            return len(waiting)  # all of them at their bounds fit: nothing to hold back
        count: int | None
        mean_size = lengths.mean_request_tokens
        self._projected = self.projects(num_blocks)
        if self._projected:
            blocks = lengths.expected_blocks(*self.progress([*running, *waiting]), bs)
            grown, candidates = blocks[: len(running)], blocks[len(running) :]
            limit = self.peak_limit(num_blocks)
            count = admissible(grown, candidates, limit)
            if count < len(waiting) and self.wait_weight:
                admitted = np.concatenate((grown, candidates[:count])).sum(axis=0)
                count += self.worth_the_wait(waiting[count:], admitted, candidates[count:], limit)
        else:
            run, wait = _bounds(running), _bounds(waiting)
            mean_bound = float(run[1].sum() + wait[1].sum()) / (len(running) + len(waiting))
            self._bounded = bounds_usable(num_blocks * bs, mean_bound, mean_size, self._bounded)
            if not self._bounded:
                return None
            count = bounded_admissible(run, wait, num_blocks, bs)
            if count < len(waiting):
                self.stats.num_bounded_holds += 1
        if count < len(waiting):
            self.stats.num_admissions_held += 1
        return count

    def worth_the_wait(
        self, held: Sequence[R], admitted: FloatArray, blocks: FloatArray, limit: float
    ) -> int:
        """How many of ``held`` (from the head; the projection would hold them all) start anyway
        on cost (module docstring): ``admitted`` is the expected blocks of the running and
        admitted requests together, ``blocks`` the held ones' (rows), ``limit`` the peak limit."""
        rates, states = self.rates, self.states
        excess, steps = overflows(admitted[None, :], blocks, limit, self.lengths.grid)
        now = self.step_clock.now()
        for i, request in enumerate(held):
            st = states.get(request.request_id)
            # NOTE: a preempted request restarts when the projection says (its wait since
            # arrival would start it at once, to be preempted again: churn); nor does a newer
            # request start past it on cost.
            if st is None or st.preempted:
                return i
            wait_s = now - st.tracked_at
            if not worth_admitting(
                wait_s,
                self.wait_weight,
                float(excess[i]) * self.block_size,
                rates.prefill_tokens_per_s,
                float(steps[i]) * rates.step_s,
            ):
                return i
        return len(held)

    def peak_limit(self, num_blocks: int) -> float:
        """The blocks admission keeps the projected peak within, in a cache of ``num_blocks``:
        the cache less the reserve."""
        return num_blocks * (1.0 - self.reserve)

    def projection(self, requests: Sequence[EngineRequest], num_blocks: int) -> Projection | None:
        """The projection admission goes by for ``requests`` (running and waiting) in a cache of
        ``num_blocks``, as a router reads it (``None`` where admission would not project): their
        expected load, the peak limit, and how long a request just admitted, of each kind, is
        expected to run."""
        if self.mode != "headroom" or not self.projects(num_blocks):
            return None
        lengths = self.lengths
        load = lengths.expected_blocks(*self.progress(requests), self.block_size).sum(axis=0)
        fresh = lengths.survival([Kind.THINKING, Kind.CHAT], [0, 0])
        return Projection(
            grid=lengths.grid.copy(),
            load=np.asarray(load, dtype=np.float64),
            budget=self.peak_limit(num_blocks),
            survival_reasoning=fresh[0],
            survival_chat=fresh[1],
        )

    def projects(self, num_blocks: int) -> bool:
        """Whether admission goes by the projection in a cache of ``num_blocks``: once enough
        requests have finished, in a cache that holds :data:`MIN_REQUESTS_IN_CACHE` requests of
        their mean size; once in use, until it holds half as many (the recent mean drifts, and a
        mix near the threshold would otherwise switch the projection on and off: vLLM's
        admission in between overcommits what the projection had kept, and the backlog the
        projection held starts at once, as the bounds' rule says of its own threshold).
        Read-only: :meth:`admissions` records the answer."""
        lengths = self.lengths
        count = MIN_REQUESTS_IN_CACHE // 2 if self._projected else MIN_REQUESTS_IN_CACHE
        return lengths.ready and num_blocks * self.block_size >= count * lengths.mean_request_tokens

    def progress(self, requests: Sequence[EngineRequest]) -> tuple[list[int], list[int], list[int]]:
        """Each request's :class:`~meridian.core.headroom.Kind`, progress and tokens now (also
        what a replica's routing stats project from, :mod:`meridian.core.replica_stats`)."""
        self.settle()
        kinds: list[int] = []
        progress: list[int] = []
        tokens: list[int] = []
        states = self.states
        for request in requests:
            num_tokens = request.num_tokens
            tokens.append(num_tokens)
            st = states.get(request.request_id)
            if st is None:
                kinds.append(Kind.THINKING)
                progress.append(0)
                continue
            if expects_reasoning(st.phase):
                kinds.append(Kind.THINKING)
                progress.append(st.num_think_tokens)
            else:
                kinds.append(Kind.ANSWERING if reasoned(st) else Kind.CHAT)
                progress.append(st.num_after_think(num_tokens - st.num_prompt_tokens))
        return kinds, progress, tokens
