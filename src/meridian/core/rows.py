"""Thinking rows counted in bulk while an engine's batch stays the same.

Through most of a reasoning batch's life the same requests each get one token per step, and no
thinking request's token ends its think phase: all a step changes is one more think token for
each thinking row. :class:`SteadyRows` holds such a batch (*armed* by the policy once the same
requests got tokens two steps running) and counts its thinking rows lazily: a step that lists
the same requests, one token each, with no ``think_end`` among them, is one increment of
``pending``; the rows' own counts are brought up to date (:meth:`SteadyRows.settle`) before
anyone reads them. Rows that need the per-request path (a think phase ending, a first answer
token, a prompt still deciding its phase) are *special*: the policy handles them one by one each
step and reclassifies them (:meth:`SteadyRows.reclassify`).

Invariant: a lazy row's state is in THINK past its first token and has received exactly
``pending - base[i]`` tokens not yet counted (one per bulk step since ``base[i]``). Settling a
row counts them (:func:`~meridian.core.state.count_think`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meridian.core.state import RequestState, count_think
from meridian.core.types import THINK

__all__ = ["SteadyRows"]


@dataclass(slots=True, eq=False)
class SteadyRows:
    """An armed batch: the engine's request ids in its order and each row's kind.

    ``states[i]`` is the state of a lazily counted thinking row (``None``: an answer stream, or
    a special row, listed in ``special``); ``base[i]`` the value of ``pending`` when row ``i``
    was last brought up to date.
    """

    ids: list[str]
    states: list[RequestState | None]
    base: list[int]
    special: list[int]
    pending: int = 0

    @classmethod
    def arm(
        cls,
        ids: list[str],
        thinking: Sequence[RequestState | None],
        answering: Sequence[bool],
    ) -> SteadyRows:
        """Rows ``ids``: ``thinking[i]``, the state of a request in THINK past its first token
        (``None`` otherwise), ``answering[i]``, an answer stream served in the last step; the
        rest are special."""
        states: list[RequestState | None] = list(thinking)
        special = [
            i
            for i, (st, served) in enumerate(zip(states, answering, strict=True))
            if st is None and not served
        ]
        return cls(ids, states, [0] * len(ids), special)

    def single_tokens(self, tokens: Sequence[Sequence[int]]) -> list[int] | None:
        """The step's tokens, one per row, if every row got exactly one (else ``None``)."""
        try:
            return [token for (token,) in tokens]
        except ValueError:  # a row with none, or with several
            return None

    def ending(self, flat: list[int], think_end: int) -> list[int]:
        """Indices of the lazy rows whose token is ``think_end`` (C-level scans of ``flat``, as
        many as it holds: no scan ends in an exception)."""
        found: list[int] = []
        i = -1
        states = self.states
        for _ in range(flat.count(think_end)):
            i = flat.index(think_end, i + 1)
            if states[i] is not None:
                found.append(i)
        return found

    def settle_row(self, i: int) -> None:
        """Bring lazy row ``i``'s counts up to date."""
        st = self.states[i]
        if st is not None:
            count_think(st, self.pending - self.base[i])
            self.base[i] = self.pending

    def settle(self) -> None:
        """Bring every lazy row's counts up to date (before anyone reads them)."""
        pending, base = self.pending, self.base
        if not pending:
            return
        for i, st in enumerate(self.states):
            if st is not None:
                count_think(st, pending - base[i])
        self.pending = 0
        self.base = [0] * len(self.ids)

    def reclassify(self, i: int, st: RequestState | None, answering: bool) -> bool:
        """Row ``i`` after the per-request path handled this step's token: lazy from the next
        step if it is thinking past its first token, not special if it answers; returns
        whether it stays special. Call before :meth:`step_done`."""
        if st is not None and st.phase is THINK and st.num_generated_tokens:
            self.states[i] = st
            self.base[i] = self.pending + 1  # this step's token is counted already
            return False
        self.states[i] = None
        return not answering

    def step_done(self) -> None:
        """A bulk step is accounted: every lazy row got one more token."""
        self.pending += 1
