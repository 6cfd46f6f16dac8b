"""The dual queue (ADR-0002): a pure ordering of the running requests' ``RequestState`` s (their
phase is read there, live), two queues each in arrival order. Answer streams and prefills are
served first, up to ``capacity``; thinking requests fill the think limit,
``min(floor(think_batch_multiplier * output_budget), capacity - num_output_served)``; a thinking
request deferred ``think_starvation_steps`` steps in a row is served the next step whatever the
limit says.

NOTE: PREFILL requests are in the output queue: until the first token is out nobody knows whether
the request will think at all, and its user is waiting for that first token.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView
from dataclasses import dataclass

from meridian.config.schema import SchedulerConfig
from meridian.core.state import RequestState
from meridian.core.types import COMPLETE, THINK, floor_fraction

__all__ = ["DualQueue", "QueuePlan"]


@dataclass(slots=True)
class QueuePlan:
    """What to serve in one step, by request id.

    Invariants: ``served`` lists every served output-queue request (FCFS) before any think-queue
    request; its think part lists the starving requests (oldest first) before the rest (FCFS).
    ``served`` and ``deferred`` are disjoint and together hold every queued request. ``deferred``
    holds think requests and, only when the output queue alone exceeds ``capacity``, the
    output-queue requests that did not fit (output-queue ones first, each part FCFS).
    """

    served: list[str]
    deferred: list[str]


@dataclass(slots=True, eq=False)
class _Entry:
    """One queued request: its state, its arrival number, its consecutive deferrals, and which
    queue it is counted in (the queue's own bookkeeping, moved by :meth:`DualQueue.moved`)."""

    state: RequestState
    seq: int
    thinking: bool
    num_deferred: int = 0


class DualQueue:
    """Orders the running requests of each step: output queue first, think queue second.

    Contract:

    - ``add_many`` registers requests; arrival order is the order of the calls (a request that
      is removed and added again counts as a new arrival).
    - ``moved`` is told when a queued request's phase changed: it then counts in its new queue,
      in its arrival position (not at the tail); its consecutive-deferral count carries over,
      capped at ``think_starvation_steps`` when it enters the think queue (a request that
      already waited that long is starving at once, and the think bound stays an invariant).
    - ``schedule`` serves every output-queue request that fits in ``capacity``, then think
      requests up to the think limit, plus every starving think request beyond it: a think
      request is never deferred more than ``think_starvation_steps`` consecutive steps. One
      ``schedule`` is a single O(n) pass; nothing is sorted.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._think_batch_multiplier = float(config.think_batch_multiplier)
        self._think_starvation_steps = int(config.think_starvation_steps)
        # Insertion-ordered, so iterating it is iterating in arrival order: FCFS within each
        # queue falls out of one pass, and a phase change needs no re-insertion.
        self._entries: dict[str, _Entry] = {}
        self._next_seq = 0
        self._num_think_queued = 0
        # Requests served by the last step, (output queue, think queue), and whether any
        # deferral count is above 0 (so serve_all has some to reset).
        self._last_sizes = (0, 0)
        self._any_deferred = False

    # -- membership ---------------------------------------------------------------------------

    def add_many(self, states: Iterable[RequestState]) -> None:
        """Queue each of ``states`` (PREFILL, THINK or OUTPUT) as the newest arrival, in order.
        On an error (an id already queued, a finished request), the ones before it are queued."""
        entries = self._entries
        think = THINK
        for st in states:
            rid = st.request_id
            if rid in entries:
                raise ValueError(f"request {rid!r} is already queued; remove() it first")
            if st.phase is COMPLETE:
                raise ValueError(f"request {rid!r} is complete; it cannot be queued")
            thinking = st.phase is think
            entries[rid] = _Entry(st, self._next_seq, thinking)
            self._next_seq += 1
            self._num_think_queued += thinking

    def moved(self, st: RequestState) -> None:
        """A queued request's phase changed (unknown ids are ignored; see the contract)."""
        entry = self._entries.get(st.request_id)
        if entry is None:
            return
        thinking = st.phase is THINK
        if thinking is entry.thinking:
            return
        entry.thinking = thinking
        if thinking:
            self._num_think_queued += 1
            entry.num_deferred = min(entry.num_deferred, self._think_starvation_steps)
        else:
            self._num_think_queued -= 1

    def remove(self, request_id: str) -> None:
        """Stop queueing a request (finished, aborted or preempted). Unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.thinking:
            self._num_think_queued -= 1

    def ids(self) -> KeysView[str]:
        """The queued ids (a live view)."""
        return self._entries.keys()

    # -- scheduling ---------------------------------------------------------------------------

    def schedule(self, capacity: int, output_budget: int | None = None) -> QueuePlan:
        """Decide this step's served requests, in order, and defer the rest.

        ``capacity`` is the most requests served (e.g. vLLM's ``max_num_seqs``);
        ``output_budget`` the rows that fit in one step within the output TPOT budget (the think
        limit is ``think_batch_multiplier`` times it; default ``capacity``). Served requests'
        deferral counts reset to 0, every deferred request's grows by 1.

        NOTE: the starvation guard overrides both the think limit and ``capacity``: a starving
        think request is appended after the output requests even when that makes the step larger
        than asked, so that no think request waits more than ``think_starvation_steps`` steps.
        """
        budget = capacity if output_budget is None else output_budget
        _check_count("capacity", capacity)
        _check_count("output_budget", budget)
        starvation_steps = self._think_starvation_steps
        output: list[_Entry] = []
        starving: list[_Entry] = []
        think: list[_Entry] = []
        for entry in self._entries.values():
            if entry.thinking:
                if entry.num_deferred >= starvation_steps:
                    starving.append(entry)
                else:
                    think.append(entry)
            else:
                output.append(entry)
        num_output = min(len(output), capacity)
        think_budget = floor_fraction(self._think_batch_multiplier, budget)
        think_limit = min(think_budget, capacity - num_output)
        num_fill = max(0, min(len(think), think_limit - len(starving)))
        served: list[str] = []
        for entry in output[:num_output] + starving + think[:num_fill]:
            entry.num_deferred = 0
            served.append(entry.state.request_id)
        deferred: list[str] = []
        for entry in output[num_output:] + think[num_fill:]:
            entry.num_deferred += 1
            deferred.append(entry.state.request_id)
        self._last_sizes = (num_output, len(starving) + num_fill)
        self._any_deferred = bool(deferred)
        return QueuePlan(served, deferred)

    def defers_none(self, num_running: int, capacity: int, output_budget: int | None) -> bool:
        """Whether ``schedule`` would serve every one of ``num_running`` requests: the queued
        ones plus up to ``num_running - len(self)`` not yet added, in any phase. O(1)."""
        budget = capacity if output_budget is None else output_budget
        think_limit = floor_fraction(self._think_batch_multiplier, budget)
        return num_running <= capacity and num_running - self.num_output_queued <= think_limit

    def serve_all(self) -> None:
        """Record a step that served every queued request, without planning it (for a caller
        that knows none can be deferred): what ``schedule`` would do then, at O(1) cost unless
        the last plan deferred some (their counts reset)."""
        if self._any_deferred:
            for entry in self._entries.values():
                entry.num_deferred = 0
            self._any_deferred = False
        self._last_sizes = (self.num_output_queued, self._num_think_queued)

    # -- observation --------------------------------------------------------------------------

    @property
    def num_output_queued(self) -> int:
        """Requests in the output queue (PREFILL and OUTPUT phase)."""
        return len(self._entries) - self._num_think_queued

    @property
    def num_think_queued(self) -> int:
        """Requests in the think queue."""
        return self._num_think_queued

    @property
    def last_served(self) -> tuple[int, int]:
        """Requests served by the last step, ``(output queue, think queue)`` (PREFILL ones
        count in the output queue); ``(0, 0)`` before the first."""
        return self._last_sizes

    def gauges(self) -> tuple[int, int, int, int]:
        """(output, think) queue depths and the last step's (output, think) batch sizes."""
        return self.num_output_queued, self._num_think_queued, *self._last_sizes

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant, if any: entries are
        keyed by their own id, in strictly increasing arrival order, live, counted in the queue
        of their phase; no think request deferred more than ``think_starvation_steps``."""
        num_think = 0
        prev_seq = -1
        for request_id, entry in self._entries.items():
            st = entry.state
            if st.request_id != request_id:
                raise AssertionError(f"entry keyed {request_id!r} holds {st.request_id!r}")
            if not prev_seq < entry.seq < self._next_seq:
                raise AssertionError(
                    f"request {request_id!r}: arrival seq {entry.seq} out of order "
                    f"(previous {prev_seq}, next {self._next_seq})"
                )
            prev_seq = entry.seq
            if st.phase is COMPLETE:
                raise AssertionError(f"request {request_id!r} is queued but complete")
            if entry.thinking is not (st.phase is THINK):
                raise AssertionError(f"request {request_id!r} counted in the wrong queue")
            if entry.num_deferred < 0:
                raise AssertionError(f"request {request_id!r}: negative deferral count")
            if entry.thinking:
                num_think += 1
                if entry.num_deferred > self._think_starvation_steps:
                    raise AssertionError(
                        f"think request {request_id!r} deferred {entry.num_deferred} steps, "
                        f"more than think_starvation_steps={self._think_starvation_steps}"
                    )
        if num_think != self._num_think_queued:
            raise AssertionError(
                f"think counter {self._num_think_queued} != {num_think} think entries"
            )


def _check_count(name: str, value: int) -> None:
    """Reject anything but a non-negative int, naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
