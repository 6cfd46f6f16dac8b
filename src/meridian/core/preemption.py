"""Preemption-victim ranking under KV pressure (ADR-0008).

Stock vLLM preempts ``running[-1]`` whatever its phase, and reclaims the victim's KV by
recompute. Meridian ranks the running requests into :class:`VictimClass` es: thinking (and
prefilling) requests first, answer streams only as a last resort, and within each class a
request re-admitted moments ago after a preemption only after the others (the re-admission
guard, so a request is not thrashed in and out). Within a class the request with the least
computed KV goes first: it is the cheapest to recompute, and vLLM re-admits it at the head of
its waiting queue, where a small request blocks the queue for the shortest time.

>>> ranked = rank_victims(
...     [Candidate("a", VictimClass.ANSWERING, 90), Candidate("t", VictimClass.THINKING, 500)],
...     max_victims=2,
... )
>>> [c.request_id for c in ranked]
['t', 'a']
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from meridian.core.types import Phase


class VictimClass(enum.IntEnum):
    """Preemption order of running requests: lower classes are preempted first.

    A PREFILL request ranks as thinking: nothing has been streamed to its user yet, so
    preempting it delays the first visible token exactly as preempting a thinking request does,
    and never stalls a visible stream.
    """

    THINKING = 0
    THINKING_GUARDED = 1
    ANSWERING = 2
    ANSWERING_GUARDED = 3

    @classmethod
    def of(cls, phase: Phase, *, guarded: bool) -> VictimClass:
        """The class of a running request in ``phase``.

        >>> VictimClass.of(Phase.OUTPUT, guarded=False)
        <VictimClass.ANSWERING: 2>
        """
        try:
            return VICTIM_CLASS[phase, guarded]
        except KeyError:
            raise ValueError(
                f"a {phase.name} request is not running and cannot be a victim"
            ) from None


# The class of a running request by (phase, guarded): the lookup re-plans make per request.
VICTIM_CLASS: dict[tuple[Phase, bool], VictimClass] = {
    (phase, guarded): VictimClass(2 * (phase is Phase.OUTPUT) + guarded)
    for phase in (Phase.PREFILL, Phase.THINK, Phase.OUTPUT)
    for guarded in (False, True)
}


class Candidate(NamedTuple):
    """One running request as victim ranking sees it (a tuple: built per re-plan)."""

    request_id: str
    victim_class: VictimClass
    num_computed_tokens: int


def _work(candidate: Candidate) -> int:
    return candidate.num_computed_tokens


def rank_victims(candidates: Sequence[Candidate], *, max_victims: int) -> list[Candidate]:
    """The first ``max_victims`` victims, first choice first.

    Order: by class; within a class by the fewest computed tokens; ties go to the later entry of
    ``candidates`` (as vLLM's ``running[-1]``). Requests with no computed KV are never ranked:
    preempting them frees nothing.

    Cost: one pass into four buckets, then a C-level sort of only the buckets consumed.
    """
    if max_victims < 0:
        raise ValueError(f"max_victims must be >= 0; got {max_victims}")
    buckets: tuple[list[Candidate], ...] = ([], [], [], [])
    # Reversed, so that the stable sort below breaks ties toward later entries.
    for candidate in reversed(candidates):
        if candidate.num_computed_tokens > 0:
            buckets[candidate.victim_class].append(candidate)
    ranked: list[Candidate] = []
    for bucket in buckets:
        if len(ranked) >= max_victims:
            break
        bucket.sort(key=_work)
        ranked.extend(bucket[: max_victims - len(ranked)])
    return ranked
