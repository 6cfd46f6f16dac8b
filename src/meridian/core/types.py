"""Shared vocabulary of the policy core: phases, KV tiers, force reasons and phase events.

Everything here is plain Python so that ``meridian.core`` runs anywhere (no torch, no vllm).
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass
from typing import TypeAlias

# Absorbs binary rounding in floor(fraction * count): 0.29 * 100 is 28.999999999999996.
_FLOOR_EPSILON = 1e-9


def floor_fraction(fraction: float, count: int) -> int:
    """``floor(fraction * count)`` as a person means it: 0.29 of 100 is 29, not 28; a product
    too large for any count (e.g. ``think_batch_multiplier = 1e308``) is ``sys.maxsize``."""
    product = fraction * count + _FLOOR_EPSILON
    return math.floor(product) if product < sys.maxsize else sys.maxsize


class Phase(enum.IntEnum):
    """Where a request is in its life. Phases only move forward (the int order is the order)."""

    PREFILL = 0
    THINK = 1
    OUTPUT = 2
    COMPLETE = 3


# The phases as module constants, for the per-step paths. In Python 3.11 a member read off its
# enum class (``Phase.THINK``) goes through the enum metaclass's ``__getattr__`` hook, several
# times the cost of a module global, and more in the caches a forward pass leaves cold. The same
# objects: ``st.phase is THINK`` is ``st.phase is Phase.THINK``.
PREFILL, THINK, OUTPUT, COMPLETE = Phase.PREFILL, Phase.THINK, Phase.OUTPUT, Phase.COMPLETE


class Tier(enum.IntEnum):
    """What a request's KV holds, as the metrics label it: a thinking (or prefilling) request's
    (``THINK_ACTIVE``), an answer stream's prompt, reasoning and answer (``OUTPUT_CRITICAL``).
    The order of preemption is :class:`~meridian.core.victims.VictimClass`'s, not this.

    The values are those of the deleted MRDN v1 library's wire codes (ADR-0015), whose
    ``THINK_COMPLETE = 0`` nothing inside vLLM could report.
    """

    THINK_ACTIVE = 1
    OUTPUT_CRITICAL = 2


class ForceReason(enum.Enum):
    """Why the budget policy forced ``</think>``."""

    CONVERGED = "converged"
    OVERTHINKING = "overthinking"
    HARD_CAP = "hard_cap"

    # Members are singletons: hash by identity, in C, instead of Enum's Python-level
    # hash(name) (counters keyed by reason are updated on the per-request hot path).
    __hash__ = object.__hash__


# A module constant for the per-request paths, as the phases above.
HARD_CAP = ForceReason.HARD_CAP


@dataclass(frozen=True, slots=True)
class EnterThink:
    """The request entered its think phase (from the prompt tail or a generated ``<think>``)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ExitThink:
    """``</think>`` was seen; ``forced`` is true when the budget policy injected it."""

    request_id: str
    think_tokens: int
    forced: bool


@dataclass(frozen=True, slots=True)
class ForceBudget:
    """The budget policy decided to end the think phase."""

    request_id: str
    reason: ForceReason


PhaseEvent: TypeAlias = EnterThink | ExitThink | ForceBudget
