"""The dual-queue scheduling policy: answer streams first, thinking fills what is left.

A pure policy (no engine, no clock). The caller tells it which requests are running and in which
phase; each step :meth:`DualQueueScheduler.schedule` says which of them to serve and in what order.

Two queues, each in arrival order (FCFS)::

    output queue   PREFILL and OUTPUT requests    served first, up to `capacity`
    think queue    THINK requests                 fill up to the think limit; the rest wait

PREFILL requests sit in the output queue on purpose: until the first token is out we do not know
whether the request will think at all, and its user is waiting for that first token, so a request
of unknown phase is never deferred to make room for thinking.

The think limit of a step is ``min(floor(think_batch_multiplier * output_budget),
capacity - num_output_served)``. A think request deferred ``think_starvation_steps`` consecutive
steps is *starving* and is served the next step whatever the limit says (the starvation guard).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meridian.config.schema import SchedulerConfig
from meridian.core.types import Phase, floor_fraction


@dataclass(slots=True)
class SchedulePlan:
    """What to serve in one step.

    Invariants: ``served`` lists every served output-queue request (FCFS) before any think-queue
    request; its think part lists the starving requests (oldest first) before the rest (FCFS).
    ``served`` and ``deferred`` are disjoint and together hold every queued request. ``deferred``
    holds think requests and, only when the output queue alone exceeds ``capacity``, the
    output-queue requests that did not fit (output-queue ones first, each part FCFS).
    ``num_starving_served`` counts every think request served because it was starving, including
    those that would have fitted within the think limit anyway.
    """

    served: list[str]
    deferred: list[str]
    num_output: int
    num_think: int
    num_starving_served: int


@dataclass(slots=True)
class _Entry:
    """One tracked request; ``seq`` is its arrival number (strictly increasing in dict order)."""

    request_id: str
    seq: int
    phase: Phase
    num_deferred: int = 0


_QUEUED_PHASES = (Phase.PREFILL, Phase.THINK, Phase.OUTPUT)


class DualQueueScheduler:
    """Orders the running requests of each step: output queue first, think queue second.

    Contract:
    - ``add`` registers a request; arrival order is the order of ``add`` calls (a request that is
      removed and added again counts as a new arrival).
    - ``set_phase`` moves a request between queues; the move takes effect at the next
      ``schedule()`` (a plan already returned never changes). Phases only move forward;
      ``Phase.COMPLETE`` removes the request.
    - ``schedule`` serves every output-queue request that fits in ``capacity``, then think
      requests up to the think limit, plus every starving think request beyond it. A think
      request is therefore never deferred more than ``think_starvation_steps`` consecutive steps.
    - One ``schedule`` is a single O(n) pass over the tracked requests; nothing is sorted.

    >>> s = DualQueueScheduler(SchedulerConfig(think_batch_multiplier=1.0))
    >>> s.add("a", Phase.THINK); s.add("b", Phase.THINK); s.add("c", Phase.OUTPUT)
    >>> plan = s.schedule(capacity=8, output_budget=1)
    >>> plan.served, plan.deferred
    (['c', 'a'], ['b'])
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self._think_batch_multiplier = float(config.think_batch_multiplier)
        self._think_starvation_steps = int(config.think_starvation_steps)
        # Insertion-ordered, so iterating it is iterating in arrival order: FCFS within each
        # queue falls out of one pass, and a phase change needs no re-insertion.
        self._entries: dict[str, _Entry] = {}
        self._next_seq = 0
        self._num_think_queued = 0
        self._last_plan: SchedulePlan | None = None
        # Requests served by the last step, (output queue, think queue), and whether any
        # deferral count is above 0 (so serve_all has some to reset).
        self._last_sizes = (0, 0)
        self._any_deferred = False

    # -- tracking -------------------------------------------------------------------------

    def add(self, request_id: str, phase: Phase) -> None:
        """Track a new request in ``phase`` (PREFILL, THINK or OUTPUT) as the newest arrival.

        Raises ``ValueError`` if the id is already tracked or the phase is ``COMPLETE``.
        """
        self.add_many(((request_id, phase),))

    def add_many(self, arrivals: Iterable[tuple[str, Phase]]) -> None:
        """:meth:`add` each ``(request id, phase)`` of ``arrivals``, in order (a burst of
        arrivals in one pass). On an error, the arrivals before it are added."""
        entries, think = self._entries, Phase.THINK
        for request_id, phase in arrivals:
            if request_id in entries:
                raise ValueError(
                    f"request {request_id!r} is already scheduled; remove() it before adding it "
                    "again"
                )
            if phase not in _QUEUED_PHASES:
                raise ValueError(
                    f"request {request_id!r}: cannot add a request in phase {phase.name}; "
                    "expected PREFILL, THINK or OUTPUT"
                )
            entries[request_id] = _Entry(request_id, self._next_seq, phase)
            self._next_seq += 1
            if phase is think:
                self._num_think_queued += 1

    def set_phase(self, request_id: str, phase: Phase) -> None:
        """Move a request to the queue of ``phase``; ``Phase.COMPLETE`` removes it.

        The request keeps its arrival position, so it lands in the new queue where FCFS puts
        it, not at the tail. Its consecutive-deferral count carries over, capped at
        ``think_starvation_steps`` when it enters the think queue: a request that already
        waited that long is starving at once, and the think bound stays an invariant.

        Raises ``KeyError`` for an unknown id and ``ValueError`` for a backward move.
        """
        entry = self._entry(request_id)
        if phase is Phase.COMPLETE:
            self.remove(request_id)
            return
        if phase < entry.phase:
            raise ValueError(
                f"request {request_id!r}: phases only move forward; got {entry.phase.name} -> "
                f"{phase.name}"
            )
        if phase is entry.phase:
            return
        if phase is Phase.THINK:
            self._num_think_queued += 1
            entry.num_deferred = min(entry.num_deferred, self._think_starvation_steps)
        elif entry.phase is Phase.THINK:
            self._num_think_queued -= 1
        entry.phase = phase

    def remove(self, request_id: str) -> None:
        """Stop tracking a request (finished, aborted or preempted). Unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.phase is Phase.THINK:
            self._num_think_queued -= 1

    # -- scheduling -----------------------------------------------------------------------

    def schedule(self, capacity: int, output_budget: int | None = None) -> SchedulePlan:
        """Decide this step's served requests, in order, and defer the rest.

        Args:
            capacity: the most requests served this step (e.g. vLLM's ``max_num_seqs``).
            output_budget: rows that fit in one step within the output TPOT budget, computed by
                the caller; the think limit is ``think_batch_multiplier`` times it. Defaults to
                ``capacity``.

        Returns:
            The plan; also kept as :attr:`last_plan`. Served requests' deferral counts reset to
            0, every deferred request's count grows by 1.

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
            if entry.phase is Phase.THINK:
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

        served_entries = output[:num_output] + starving + think[:num_fill]
        deferred_entries = output[num_output:] + think[num_fill:]
        served: list[str] = []
        for entry in served_entries:
            entry.num_deferred = 0
            served.append(entry.request_id)
        deferred: list[str] = []
        for entry in deferred_entries:
            entry.num_deferred += 1
            deferred.append(entry.request_id)

        self._last_sizes = (num_output, len(starving) + num_fill)
        self._any_deferred = bool(deferred)
        plan = SchedulePlan(
            served=served,
            deferred=deferred,
            num_output=num_output,
            num_think=len(starving) + num_fill,
            num_starving_served=len(starving),
        )
        self._last_plan = plan
        return plan

    def defers_none(self, num_running: int, capacity: int, output_budget: int | None) -> bool:
        """Whether ``schedule`` would serve every one of ``num_running`` requests: the queued
        ones plus up to ``num_running - len(self)`` not yet added, in any phase. O(1)."""
        budget = capacity if output_budget is None else output_budget
        think_limit = floor_fraction(self._think_batch_multiplier, budget)
        return num_running <= capacity and num_running - self.num_output_queued <= think_limit

    def serve_all(self) -> None:
        """Record a step that served every queued request, without planning it.

        For a caller that knows no request can be deferred (the running set fits both
        ``capacity`` and the think limit): what ``schedule`` would do then at O(1) cost, unless
        the last plan deferred some (their counts reset). :attr:`last_plan` stays the last
        ``schedule`` result.
        """
        if self._any_deferred:
            for entry in self._entries.values():
                entry.num_deferred = 0
            self._any_deferred = False
        self._last_sizes = (self.num_output_queued, self._num_think_queued)

    # -- observation ----------------------------------------------------------------------

    @property
    def num_output_queued(self) -> int:
        """Requests in the output queue (PREFILL and OUTPUT phase)."""
        return len(self._entries) - self._num_think_queued

    @property
    def num_think_queued(self) -> int:
        """Requests in the think queue."""
        return self._num_think_queued

    def queue_depths(self) -> dict[Phase, int]:
        """``{Phase.OUTPUT: output-queue depth, Phase.THINK: think-queue depth}``."""
        return {Phase.OUTPUT: self.num_output_queued, Phase.THINK: self._num_think_queued}

    @property
    def last_plan(self) -> SchedulePlan | None:
        """The plan of the last ``schedule()`` call, or ``None`` before the first."""
        return self._last_plan

    @property
    def last_served(self) -> tuple[int, int]:
        """``last_batch_sizes`` as ``(output queue, think queue)``, without building a dict."""
        return self._last_sizes

    @property
    def last_batch_sizes(self) -> dict[Phase, int]:
        """Requests served in the last step by queue: ``{Phase.OUTPUT: n, Phase.THINK: m}``.

        PREFILL requests count under ``Phase.OUTPUT`` (their queue). All zero before the first
        step.
        """
        num_output, num_think = self._last_sizes
        return {Phase.OUTPUT: num_output, Phase.THINK: num_think}

    def deferred_steps(self, request_id: str) -> int:
        """Consecutive steps the request has been deferred so far (0 after it is served)."""
        return self._entry(request_id).num_deferred

    def phase_of(self, request_id: str) -> Phase:
        """The phase the request is tracked in."""
        return self._entry(request_id).phase

    def _entry(self, request_id: str) -> _Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} is not scheduled; add() it first")
        return entry

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` describing the first broken invariant, if any.

        Invariants: entries are keyed by their own id, in strictly increasing arrival order,
        in a queued phase; the think counter matches the entries; no think request has been
        deferred more than ``think_starvation_steps`` consecutive steps; deferral counts are
        non-negative.
        """
        num_think = 0
        prev_seq = -1
        for request_id, entry in self._entries.items():
            if entry.request_id != request_id:
                raise AssertionError(f"entry keyed {request_id!r} holds {entry.request_id!r}")
            if entry.seq <= prev_seq or entry.seq >= self._next_seq:
                raise AssertionError(
                    f"request {request_id!r}: arrival seq {entry.seq} out of order "
                    f"(previous {prev_seq}, next {self._next_seq})"
                )
            prev_seq = entry.seq
            if entry.phase not in _QUEUED_PHASES:
                raise AssertionError(f"request {request_id!r} tracked in phase {entry.phase!r}")
            if entry.num_deferred < 0:
                raise AssertionError(
                    f"request {request_id!r}: negative deferral count {entry.num_deferred}"
                )
            if entry.phase is Phase.THINK:
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
