"""Admission by projected KV headroom: start a waiting request only while the KV the running
requests are expected to hold over the coming steps, with it, still fits the cache.

vLLM admits a waiting request as soon as its prompt fits in the free blocks, whatever the
running requests will need as they keep generating. Under load the cache fills, a request that
needs a new block preempts another (by recompute), and the preempted request is re-admitted as
soon as blocks free up, to be preempted again: churn that recomputes reasoning and, with the
recompute's prefill chunks, slows every step. Projecting each request's growth lets admission
stop while the running set is expected to need the room.

The projection. Each running request gains a token per step until it ends, then frees its
blocks. Its remaining length is unknown; the requests that finished tell its distribution
(:class:`LengthModel`): a request that has thought ``t`` tokens is like the finished ones that
thought longer than ``t`` (it has ``T - t`` think tokens left, then the ``R`` tokens after
them); one that has answered ``a`` tokens, like the finished ones whose answer ran past ``a``.
The expected KV at ``s`` steps from now is then

    E[tokens(s)] = sum_i (c_i + s) * P(request i is still running at s)

(``c_i`` its tokens now), and admission keeps ``max_s E[blocks(s)]`` within the cache. The
expectation sums over many requests, so it is what the cache will hold up to fluctuations of the
order of one request's length; it is not the deterministic "everyone runs to their mean" path,
which overstates the peak (every request is counted whole until its mean end).

The arithmetic is vectorised: requests fall into progress buckets (quantiles of the finished
lengths), each bucket has one survival curve over a grid of future steps, and a projection is
one small matrix product whatever the number of requests.

Until enough requests have finished there is no projection, and in a cache that holds few
requests (:data:`MIN_REQUESTS_IN_CACHE`) it is too noisy to use. There each request's own limit
bounds it: its prompt plus ``max_tokens`` (:func:`bounded_admissible`). Projecting every
request to run to its bound before it frees its blocks is the worst case, so nothing admitted
by it is ever short of KV; it is used while the bounds are tight enough not to starve the
engine (:data:`MIN_BOUNDED_IN_CACHE`, :data:`MAX_BOUND_SLACK`); otherwise admission is vLLM's
own.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "GRID_POINTS",
    "MAX_BOUND_SLACK",
    "MIN_BOUNDED_IN_CACHE",
    "MIN_REQUESTS_IN_CACHE",
    "MIN_SAMPLES",
    "Kind",
    "LengthModel",
    "admissible",
    "bounded_admissible",
    "bounded_peak",
    "bounds_usable",
    "overflows",
    "worth_admitting",
]

# Finished requests the model needs before it projects anything.
MIN_SAMPLES = 32
# Admission is held only in a cache that holds at least this many requests of the mean finished
# size. The projection is an expectation over the running set; with few requests in the cache
# one request's length swings the real peak by several percent, holds cost more queueing than
# the preemptions they avoid, and vLLM's own admission does better (ADR-0013: Qwen3-32B on an
# H100 holds about 40 of the synthetic workload's requests, and headroom loses there; Qwen3-8B
# about 300, and it wins. Two points: the threshold lies between them). Once in use, the projection
# stands aside only where the cache holds half as many (Admission.projects): ServeGen's R1 traffic
# holds about 120, near the threshold, and a projection switched on and off by the drifting mean
# let vLLM's admission overcommit in between (ADR-0013).
MIN_REQUESTS_IN_CACHE = 128
# Admission by each request's bound (prompt plus max_tokens) starts only in a cache that holds
# at least this many of the requests' mean bound (looser bounds, such as a client that leaves
# max_tokens at the model's length, would leave most of the cache idle) and, once requests have
# finished, while the mean bound is at most MAX_BOUND_SLACK times their mean size. Once in use it
# stops only at half the count or twice the slack: a mix of lengths near the threshold would
# otherwise switch it on and off, and vLLM's admission in between overcommits what the bounds
# had kept safe.
MIN_BOUNDED_IN_CACHE = 16
MAX_BOUND_SLACK = 2.0
# The model keeps the most recent lengths (the mix of traffic drifts) ...
MAX_SAMPLES = 1024
# ... and rebuilds its curves after this many new ones.
REBUILD_EVERY = 32
# Future steps the projection looks at (a uniform grid up to the longest finished request) and
# progress buckets per kind of request.
GRID_POINTS = 48
NUM_BUCKETS = 24

FloatArray = npt.NDArray[np.float64]


Tokens = TypeVar("Tokens", float, FloatArray)


def kv_blocks(num_tokens: Tokens, block_size: int) -> Tokens:
    """The KV blocks ``num_tokens`` tokens hold, as the headroom model counts them (the one
    formula admission, replica stats and the router share): the tokens over the block size, plus
    half a block (the partly filled last one)."""
    blocks: Tokens = num_tokens / block_size + 0.5
    return blocks


IntArray = npt.NDArray[np.int64]


class Kind(enum.IntEnum):
    """Which finished requests a running one is like."""

    THINKING = 0  # reasoning, still thinking (or not started: PREFILL); progress = think tokens
    ANSWERING = 1  # reasoning, answering; progress = tokens since its think phase
    CHAT = 2  # never thought; progress = answer tokens


# Progress keys: kind * _KIND_STRIDE + progress, so one sorted array holds every kind's edges.
_KIND_STRIDE = 1 << 40


def _survival(remaining: IntArray, grid: FloatArray) -> FloatArray:
    """P(remaining > g) for each ``g`` of ``grid``, over the samples ``remaining``."""
    ordered = np.sort(remaining)
    at_most: IntArray = np.searchsorted(ordered, grid, side="right")
    result: FloatArray = 1.0 - at_most / len(ordered)
    return result


class _Curves:
    """Survival curves of one kind: ``surv[b, k]`` = P(still running ``grid[k]`` steps from now)
    for a request whose progress falls in bucket ``b`` (``edges[b] <= progress``); ``empty[b]``:
    no sample got past ``edges[b]`` (such a request is projected with the last row)."""

    __slots__ = ("edges", "empty", "surv")

    def __init__(self, progress: IntArray, remaining_after: IntArray, grid: FloatArray) -> None:
        # A request at progress e is like the samples with progress-length > e; its remaining
        # length is (length - e) + remaining_after. Edges: 0 and quantiles of the lengths (the
        # sample at or below each), without repeats. (Not np.quantile or np.unique: their first
        # call imports numpy modules on the scheduler's thread: benchmarks/bench_headroom.py.)
        ordered = np.sort(progress)
        at = (np.arange(NUM_BUCKETS) * (len(ordered) - 1)) // NUM_BUCKETS
        edges = np.concatenate(([0], ordered[at]))
        edges = edges[np.concatenate(([True], edges[1:] != edges[:-1]))]
        # Row b: 1 - #{i: progress_i > e_b, total_i - e_b <= g} / #{i: progress_i > e_b}, with
        # total = progress + remaining_after. Counted for every edge at once: the samples in
        # order of total, a running count per edge of those past it, read at each threshold
        # e_b + floor(g) (integers: exact, as comparing total - e_b with g is).
        total = progress + remaining_after
        by_total = np.argsort(total, kind="stable")
        totals = total[by_total]
        past = progress[by_total][None, :] > edges[:, None]  # (edges, samples)
        counts = np.zeros((len(edges), len(totals) + 1), dtype=np.int64)
        np.cumsum(past, axis=1, out=counts[:, 1:])
        thresholds = edges[:, None] + np.floor(grid).astype(np.int64)[None, :]
        at_most = np.take_along_axis(counts, np.searchsorted(totals, thresholds, "right"), axis=1)
        beyond = counts[:, -1:]
        surv = np.zeros((len(edges) + 1, len(grid)))
        np.divide(at_most, beyond, out=surv[:-1], where=beyond > 0)
        np.subtract(1.0, surv[:-1], out=surv[:-1], where=beyond > 0)
        # Past every sample: nothing is known but that it runs now; assume the shortest tail,
        # remaining_after alone (for answers that is 0: it ends at once).
        surv[-1] = _survival(remaining_after, grid)
        surv[-1, 0] = 1.0
        self.edges = np.append(edges, _KIND_STRIDE - 1)
        self.surv = surv
        self.empty = surv[:, 0] == 0.0


class _Table:
    """Every kind's curves in one array, so projecting a mixed set of requests is one
    ``searchsorted`` and one gather: ``surv[row[searchsorted(keys, kind * stride + progress)
    - 1]]``, where ``row`` sends a bucket no sample got past to its kind's last row."""

    __slots__ = ("keys", "row", "surv")

    def __init__(self, curves: dict[Kind, _Curves]) -> None:
        keys: list[IntArray] = []
        rows: list[IntArray] = []
        survs: list[FloatArray] = []
        offset = 0
        for kind in Kind:
            curve = curves[kind]
            n = len(curve.edges)
            keys.append(curve.edges + kind * _KIND_STRIDE)
            local = np.arange(n)
            local[curve.empty] = n - 1
            rows.append(local + offset)
            survs.append(curve.surv)
            offset += n
        self.keys = np.concatenate(keys)
        self.row = np.concatenate(rows)
        self.surv = np.concatenate(survs)


class LengthModel:
    """What finished requests generated, and the expected KV of requests like them.

    ``finished(think, rest)``: a request that completed having thought ``think`` tokens (``None``
    if it never thought) and generated ``rest`` tokens after them (the think end and its answer).
    """

    def __init__(self) -> None:
        self._think: deque[int] = deque(maxlen=MAX_SAMPLES)
        self._after_think: deque[int] = deque(maxlen=MAX_SAMPLES)
        self._chat: deque[int] = deque(maxlen=MAX_SAMPLES)
        # Whole requests: prompt and everything generated.
        self._sizes: deque[int] = deque(maxlen=MAX_SAMPLES)
        self._since_build = 0
        self._table: _Table | None = None
        self.grid: FloatArray = np.zeros(GRID_POINTS)

    @property
    def ready(self) -> bool:
        """True once every kind of request seen so far has enough finished samples."""
        reasoning, chat = len(self._think), len(self._chat)
        return (
            reasoning + chat > 0
            and (reasoning >= MIN_SAMPLES or reasoning == 0)
            and (chat >= MIN_SAMPLES or chat == 0)
        )

    @property
    def num_samples(self) -> int:
        """Finished requests the model has learnt from (the most recent ``MAX_SAMPLES``)."""
        return len(self._sizes)

    @property
    def mean_request_tokens(self) -> float:
        """The mean size (prompt and output tokens) of the recent finished requests."""
        return sum(self._sizes) / len(self._sizes) if self._sizes else 0.0

    def finished(
        self, num_think_tokens: int | None, num_rest_tokens: int, num_prompt_tokens: int = 0
    ) -> None:
        """A request completed (see the class docstring)."""
        self._sizes.append(num_prompt_tokens + (num_think_tokens or 0) + num_rest_tokens)
        if num_think_tokens is None:
            self._chat.append(num_rest_tokens)
        else:
            self._think.append(num_think_tokens)
            self._after_think.append(num_rest_tokens)
        self._since_build += 1
        if self._since_build >= REBUILD_EVERY:
            self._table = None

    def _built(self) -> _Table:
        if self._table is None:
            think = np.array(self._think, dtype=np.int64)
            after = np.array(self._after_think, dtype=np.int64)
            chat = np.array(self._chat, dtype=np.int64)
            longest = max(
                int((think + after).max()) if len(think) else 0,
                int(chat.max()) if len(chat) else 0,
                1,
            )
            grid = np.linspace(0.0, float(longest), GRID_POINTS)
            # With no samples of a kind, its requests are projected like those of the other.
            thinking = answering = chat_curves = None
            if len(think):
                thinking = _Curves(think, after, grid)
                answering = _Curves(after, np.zeros_like(after), grid)
            if len(chat):
                chat_curves = _Curves(chat, np.zeros_like(chat), grid)
            curves = {
                Kind.THINKING: thinking or chat_curves,
                Kind.ANSWERING: answering or chat_curves,
                Kind.CHAT: chat_curves or answering,
            }
            complete = {kind: c for kind, c in curves.items() if c is not None}
            assert len(complete) == len(Kind), "built only once some request finished"
            self._table, self.grid, self._since_build = _Table(complete), grid, 0
        return self._table

    def survival(self, kinds: Sequence[int], progress: Sequence[int]) -> FloatArray:
        """Per request of ``kinds`` at ``progress``, the probability that it still runs at each
        grid step from now (``len(kinds) x GRID_POINTS``)."""
        table = self._built()
        keys = np.asarray(kinds, dtype=np.int64) * _KIND_STRIDE + np.asarray(
            progress, dtype=np.int64
        )
        rows = table.row[np.searchsorted(table.keys, keys, side="right") - 1]
        surv: FloatArray = table.surv[rows]
        return surv

    def expected_blocks(
        self, kinds: Sequence[int], progress: Sequence[int], tokens: Sequence[int], block_size: int
    ) -> FloatArray:
        """Per request, the expected KV blocks it holds at each grid step from now
        (``len(kinds) x GRID_POINTS``): :func:`kv_blocks` of its tokens by then, times the
        chance it still runs."""
        c = np.asarray(tokens, dtype=np.float64)
        survival = self.survival(kinds, progress)
        blocks: FloatArray = kv_blocks(c[:, None] + self.grid[None, :], block_size) * survival
        return blocks


def admissible(running: FloatArray, waiting: FloatArray, num_blocks: float) -> int:
    """How many of the waiting requests (rows of ``waiting``, in order) may start so that the
    expected peak of ``running`` plus them stays within ``num_blocks`` (the cache less the
    reserve).

    The rows are :meth:`LengthModel.expected_blocks` curves. At least one when nothing runs
    (something must make progress).

    >>> r = np.array([[4.0, 5.0, 0.0]]); w = np.array([[2.0, 3.0, 0.0], [2.0, 3.0, 0.0]])
    >>> admissible(r, w, 8), admissible(r, w, 11), admissible(np.zeros((0, 3)), w, 1)
    (1, 2, 1)
    """
    base = running.sum(axis=0)
    totals = base[None, :] + np.cumsum(waiting, axis=0)
    fits = totals.max(axis=1) <= num_blocks
    count = int(np.argmin(fits)) if not fits.all() else len(fits)
    if count == 0 and len(running) == 0 and len(waiting):
        return 1
    return count


def overflows(
    running: FloatArray, waiting: FloatArray, num_blocks: float, grid: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """What admitting the first ``k + 1`` of ``waiting`` risks, for each ``k`` (rows as in
    :func:`admissible`, columns on ``grid``, in steps from now): the expected blocks above
    ``num_blocks`` at the projected peak (0 where it fits), and how many steps the projected load
    stays above ``num_blocks`` (from its first step over to the first after the peak back within,
    or the grid's end): how long a request preempted for the overflow waits for room again.

    >>> r = np.array([[4.0, 5.0, 0.0]]); w = np.array([[2.0, 3.0, 0.0], [2.0, 3.0, 0.0]])
    >>> excess, steps = overflows(r, w, 9.0, np.array([0.0, 10.0, 20.0]))
    >>> excess.tolist(), steps.tolist()
    ([0.0, 2.0], [0.0, 10.0])
    """
    totals = running.sum(axis=0)[None, :] + np.cumsum(waiting, axis=0)
    over = totals > num_blocks
    excess: FloatArray = np.maximum(totals.max(axis=1) - num_blocks, 0.0)
    first = over.argmax(axis=1)
    peak = totals.argmax(axis=1)
    after = np.arange(len(grid))[None, :] > peak[:, None]
    back_within = after & ~over
    back = np.where(back_within.any(axis=1), back_within.argmax(axis=1), len(grid) - 1)
    steps: FloatArray = np.where(over.any(axis=1), grid[back] - grid[first], 0.0)
    return excess, steps


def worth_admitting(
    wait_s: float,
    wait_weight: float,
    overflow_tokens: float,
    prefill_tokens_per_s: float,
    requeue_s: float,
) -> bool:
    """Whether a held request should start: the cost of its waiting (``wait_s`` so far, times
    ``wait_weight``, the user model's) is at least the expected cost of the preemptions starting
    it risks (recomputing ``overflow_tokens`` at ``prefill_tokens_per_s``, plus ``requeue_s``,
    the victim's wait to restart). Both sides in seconds.

    >>> worth_admitting(10.0, 1.0, 8000.0, 1000.0, 2.0), worth_admitting(9.9, 1.0, 8000, 1000, 2)
    (True, False)
    """
    return wait_s * wait_weight >= overflow_tokens / prefill_tokens_per_s + requeue_s


def bounded_peak(tokens: IntArray, bounds: IntArray, block_size: int) -> float:
    """The most KV blocks requests holding ``tokens`` now can ever hold together, if each gains
    a token a step and runs to its ``bounds`` (prompt plus ``max_tokens``) before it frees its
    blocks: a request that ends sooner only frees them sooner. (Counted with one partly filled
    block per request.)

    The sum grows between two ends, so its peak is just before one: at ``s = bound_k -
    tokens_k`` the requests still running are those with at least ``s`` to go.

    >>> bounded_peak(np.array([0, 0]), np.array([8, 16]), 4)  # at 8 tokens each, + 2 partial
    6.0
    """
    if not len(tokens):
        return 0.0
    remaining = np.maximum(bounds - tokens, 0)
    order = np.argsort(remaining, kind="stable")
    ends, held = remaining[order], tokens[order]
    # Requests still running at ends[k]: k and after (ties: the first of them counts them all).
    running_tokens = np.cumsum(held[::-1])[::-1]
    count = len(ends) - np.arange(len(ends))
    peaks = (running_tokens + count * ends) / block_size + count
    return float(peaks.max())


def bounds_usable(cache_tokens: int, mean_bound: float, mean_size: float, in_use: bool) -> bool:
    """Whether requests whose mean bound is ``mean_bound`` tokens are admitted by their bounds in
    a cache of ``cache_tokens`` (``mean_size``: the finished requests' mean size, 0 if none;
    ``in_use``: whether they were last time): see :data:`MIN_BOUNDED_IN_CACHE`.

    >>> bounds_usable(1600, 100, 0, False), bounds_usable(1500, 100, 0, False)
    (True, False)
    >>> bounds_usable(1500, 100, 0, True), bounds_usable(1500, 100, 60, True)
    (True, True)
    >>> bounds_usable(700, 100, 0, True), bounds_usable(1600, 100, 20, True)
    (False, False)
    """
    slack = 2.0 if in_use else 1.0
    return cache_tokens * slack >= MIN_BOUNDED_IN_CACHE * mean_bound and (
        mean_size <= 0 or mean_bound <= slack * MAX_BOUND_SLACK * mean_size
    )


def bounded_admissible(
    running: tuple[IntArray, IntArray],
    waiting: tuple[IntArray, IntArray],
    num_blocks: int,
    block_size: int,
) -> int:
    """How many of the waiting requests (``(tokens now, bounds)``, in order) may start so that
    the running ones and they can never outgrow ``num_blocks`` (:func:`bounded_peak`). At least
    one when nothing runs.

    >>> t, b = np.full(40, 10), np.full(40, 40)  # 10 tokens now, at most 40: 11 blocks of 4
    >>> bounded_admissible((t[:0], b[:0]), (t, b), 200, 4)
    18
    >>> bounded_admissible((t[:5], b[:5]), (t, b), 200, 4)
    13
    """
    (run_tokens, run_bounds), (wait_tokens, wait_bounds) = running, waiting

    def fits(k: int) -> bool:
        tokens = np.concatenate((run_tokens, wait_tokens[:k]))
        bounds = np.concatenate((run_bounds, wait_bounds[:k]))
        return bounded_peak(tokens, bounds, block_size) <= num_blocks

    low, high = 0, len(wait_tokens)  # fits(low); the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    if low == 0 and not len(run_tokens):
        return 1
    return low
