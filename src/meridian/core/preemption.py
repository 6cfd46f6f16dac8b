"""Preemption-victim selection under KV pressure (ADR-0008).

Stock vLLM preempts ``running[-1]`` whatever its phase. Meridian picks victims by KV tier:
requests whose KV is all ThinkComplete first, then thinking (and prefilling) requests, and
answer-streaming requests only as a last resort, least recently touched first within a class.
A request re-admitted moments ago is skipped while anything else can be taken, so a preempted
request is not thrashed in and out. See ``docs/adr/0008-preemption-policy.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from meridian.core.types import Phase, Tier, floor_fraction


class ReclaimMode(enum.Enum):
    """How a victim's KV is reclaimed: dropped and recomputed later, or moved over the fabric."""

    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """What victim selection needs to know about one running request.

    ``last_touched`` is a logical step/touch counter (smaller = less recently used).
    ``readmitted_step`` is the step at which the request was last re-admitted after a
    preemption. ``think_done`` marks an OUTPUT-phase request whose think phase has ended but
    which has written no answer KV yet, so all its KV is ThinkComplete; it is only valid with
    ``Phase.OUTPUT``.
    """

    request_id: str
    phase: Phase
    num_blocks: int
    last_touched: int
    readmitted_step: int | None = None
    think_done: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 0:
            raise ValueError(
                f"request {self.request_id}: num_blocks must be >= 0; got {self.num_blocks}"
            )
        # Validates phase/think_done once here so the selection loop needs no checks.
        request_tier(self.phase, think_done=self.think_done)


@dataclass(frozen=True, slots=True)
class Victim:
    """One request to preempt, the tier it was taken from and how to reclaim its blocks."""

    request_id: str
    tier: Tier
    reclaim: ReclaimMode
    num_blocks: int


def request_tier(phase: Phase, *, think_done: bool = False) -> Tier:
    """The tier a running request is preempted as.

    - ``THINK`` -> THINK_ACTIVE.
    - ``PREFILL`` -> THINK_ACTIVE: nothing has been streamed to the user yet, so preempting it
      delays the first visible token exactly as preempting a thinking request does, and never
      stalls a visible stream. (Its prompt *blocks* are OUTPUT_CRITICAL in the block manager,
      ``tier_for_phase``, so that demotion at ``</think>`` never drops the prompt; this function
      ranks the *request*, not its blocks.)
    - ``OUTPUT`` -> OUTPUT_CRITICAL, or THINK_COMPLETE with ``think_done`` (think ended, no
      answer KV written yet).
    - ``COMPLETE`` is not a running phase: ``ValueError``.

    >>> request_tier(Phase.OUTPUT, think_done=True)
    <Tier.THINK_COMPLETE: 0>
    """
    if phase is Phase.COMPLETE:
        raise ValueError("a COMPLETE request is not running and cannot be a preemption candidate")
    if think_done and phase is not Phase.OUTPUT:
        raise ValueError(
            f"think_done is only meaningful in the OUTPUT phase (think ended, no answer KV yet); "
            f"got phase {phase.name}"
        )
    if phase is Phase.OUTPUT:
        return Tier.THINK_COMPLETE if think_done else Tier.OUTPUT_CRITICAL
    return Tier.THINK_ACTIVE


# Candidate classes in preemption order. Output-critical requests come last even after guarded
# think requests: a re-preempted think request wastes throughput, a preempted answer stream is
# a stall the user sees.
_CLASS_TIERS: tuple[Tier, ...] = (
    Tier.THINK_COMPLETE,  # 0
    Tier.THINK_ACTIVE,  # 1
    Tier.THINK_COMPLETE,  # 2: guarded
    Tier.THINK_ACTIVE,  # 3: guarded
    Tier.OUTPUT_CRITICAL,  # 4
    Tier.OUTPUT_CRITICAL,  # 5: guarded
)
_BY_LAST_TOUCHED = attrgetter("last_touched")


def select_preemption_victims(
    needed_blocks: int,
    running: Sequence[RunningRequest],
    *,
    step: int,
    max_fraction: float,
    readmit_guard_steps: int = 1,
    fabric_attached: bool = False,
) -> list[Victim]:
    """Choose whom to preempt to free ``needed_blocks``; victims in the order to preempt them.

    Order: THINK_COMPLETE, THINK_ACTIVE, then requests re-admitted fewer than
    ``readmit_guard_steps`` steps ago (``step - readmitted_step < readmit_guard_steps``, so
    ``readmit_guard_steps = 1`` protects a request during the step it re-entered, ``0`` disables
    the guard) in the same tier order, and OUTPUT_CRITICAL (unguarded, then guarded) only as a
    last resort. Within a class the least recently touched goes first; ties go to the later
    entry of ``running`` (the newest arrival, as vLLM's ``running[-1]``). Requests holding no
    block are never chosen: preempting them frees nothing.

    Victims are taken greedily until their blocks cover ``needed_blocks`` or
    ``max(1, floor(max_fraction * len(running)))`` are chosen, so the result may fall short of
    the need; the caller sums ``num_blocks``. Reclaim is OFFLOAD for THINK_COMPLETE victims when
    ``fabric_attached``, RECOMPUTE otherwise.

    Cost: one pass over ``running`` into six buckets, then a C-level sort of only the buckets
    actually consumed.
    """
    if not 0.0 < max_fraction <= 1.0:
        raise ValueError(f"max_fraction must be in (0, 1]; got {max_fraction}")
    if readmit_guard_steps < 0:
        raise ValueError(f"readmit_guard_steps must be >= 0; got {readmit_guard_steps}")
    if needed_blocks <= 0 or not running:
        return []
    max_victims = max(1, floor_fraction(max_fraction, len(running)))
    buckets: tuple[list[RunningRequest], ...] = ([], [], [], [], [], [])
    output = Phase.OUTPUT
    # Reversed, so that the stable sort below breaks last_touched ties toward later entries.
    for r in reversed(running):
        if r.num_blocks == 0:
            continue
        cls = (0 if r.think_done else 4) if r.phase is output else 1
        readmitted = r.readmitted_step
        if readmitted is not None and step - readmitted < readmit_guard_steps:
            cls += 1 if cls == 4 else 2
        buckets[cls].append(r)

    victims: list[Victim] = []
    covered = 0
    for cls, bucket in enumerate(buckets):
        if not bucket:
            continue
        bucket.sort(key=_BY_LAST_TOUCHED)
        tier = _CLASS_TIERS[cls]
        reclaim = (
            ReclaimMode.OFFLOAD
            if fabric_attached and tier is Tier.THINK_COMPLETE
            else ReclaimMode.RECOMPUTE
        )
        for r in bucket:
            victims.append(Victim(r.request_id, tier, reclaim, r.num_blocks))
            covered += r.num_blocks
            if covered >= needed_blocks or len(victims) == max_victims:
                return victims
    return victims
