"""Who loses KV under pressure: victim ranking, and the answer hold (ADR-0008).

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
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from meridian.core.interface import R
from meridian.core.state import RequestState
from meridian.core.types import Phase

__all__ = ["VICTIM_CLASS", "Candidate", "VictimClass", "hold_answers", "rank_victims"]


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


def hold_answers(
    order: Sequence[R], states: Mapping[str, RequestState], num_free_blocks: int, block_size: int
) -> list[R]:
    """Answer streams of ``order`` to skip this step because they need a KV block nobody can
    give.

    When no thinking request holds KV, the engine could make room for an answer stream only by
    preempting another one, by recompute: that one stalls until re-admitted and then recomputes
    its prompt, reasoning and answer so far. Holding the streams that need a fresh block for one
    step instead (the newest first) costs the same wait without the recompute, and each keeps
    its KV. Never all of them: if every running request were held, nothing could finish and free
    blocks, so the engine preempts as usual.
    NOTE: Meridian's addition on top of ADR-0008's last resort.
    """
    if num_free_blocks >= len(order):
        return []  # even if every request needed a block, there is one for each
    needy: list[R] = []
    output = Phase.OUTPUT
    for request in order:
        computed = request.num_computed_tokens
        if states[request.request_id].phase is not output:
            if computed > 0:
                return []  # a thinking request holds KV: it is preempted, as planned
            continue
        # A decode step writes position `computed`; at a block boundary it opens a block.
        if request.num_tokens - computed == 1 and computed % block_size == 0:
            needy.append(request)
    surplus = len(needy) - num_free_blocks
    if surplus <= 0 or surplus >= len(order):
        return []
    return needy[-surplus:]
