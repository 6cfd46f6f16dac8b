"""The think-budget policy: when to force ``</think>``.

:meth:`BudgetPolicy.decide` takes a think-phase request's token count and its
:class:`~meridian.core.signals.EntropyProbe` and returns a :class:`ForceDecision` (force now,
why, and the numbers behind it) or ``None`` (keep thinking), by the rules of docs/architecture.md
("Budget forcing"), first that applies, in the order of its code. :meth:`BudgetPolicy.static` is
vLLM's ``thinking_token_budget`` baseline: a hard cap only.

NOTE: a request's ``max_think_tokens`` *replaces* the config's, smaller or larger; one below
``min_think_tokens`` fires below the floor, which only holds back the entropy signals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meridian.config.schema import EntropyConfig, SchedulerConfig
from meridian.core.signals import EntropyProbe
from meridian.core.types import ForceReason
from meridian.errors import ConfigError

__all__ = ["BudgetPolicy", "ForceDecision", "RequestBudget", "Signals", "think_cap"]


def _is_positive_int(value: object) -> bool:
    """True for an ``int`` >= 1 (``bool`` is an ``int`` subclass but not a token count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, slots=True)
class ForceDecision:
    """Force ``</think>`` now: why, at which think-token count, and the numbers behind it."""

    reason: ForceReason
    num_think_tokens: int
    detail: str


class Signals(enum.Enum):
    """Which entropy signals may force a request (the hard cap always may): a per-request knob,
    so one server serves each forcing policy of an accuracy sweep (``meridian bench accuracy``).
    """

    ALL = "all"
    EAT = "eat"
    RPDI = "rpdi"
    NONE = "none"  # the hard cap only

    # Members are singletons: hash by identity, in C, instead of Enum's Python-level
    # hash(name) (each request's budget is looked up by its signals when it is tracked).
    __hash__ = object.__hash__

    @property
    def eat(self) -> bool:
        return self in (Signals.ALL, Signals.EAT)

    @property
    def rpdi(self) -> bool:
        return self in (Signals.ALL, Signals.RPDI)


@dataclass(frozen=True, slots=True)
class RequestBudget:
    """Per-request overrides (from ``SamplingParams.extra_args`` in the vLLM integration).

    ``max_think_tokens`` replaces the config's hard cap for this request; ``forcing=False`` turns
    every force off for it, hard cap included; ``signals`` chooses which entropy signals may
    force it.
    """

    max_think_tokens: int | None = None
    forcing: bool = True
    signals: Signals = Signals.ALL

    def __post_init__(self) -> None:
        cap = self.max_think_tokens
        if cap is not None and not _is_positive_int(cap):
            raise ValueError(f"max_think_tokens must be a positive integer or None; got {cap!r}")


def think_cap(budget: RequestBudget | None, default: int) -> int | None:
    """Where a request's hard-cap force ends (``default``: the config's; ``None``: no forcing).

    >>> think_cap(None, 100), think_cap(RequestBudget(50), 100)
    (100, 50)
    >>> think_cap(RequestBudget(forcing=False), 100) is None
    True
    """
    if budget is None:
        return default
    return (budget.max_think_tokens or default) if budget.forcing else None


class BudgetPolicy:
    """Decides when a think-phase request is forced to emit ``</think>`` (rules: module docs).

    The config's numbers are copied into slots; the policy holds no per-request state, so one
    instance serves every request.

    >>> policy = BudgetPolicy.static(100)
    >>> policy.decide(99, None) is None
    True
    >>> policy.decide(100, None).reason
    <ForceReason.HARD_CAP: 'hard_cap'>
    """

    __slots__ = ("_entropy", "entropy_enabled", "max_think_tokens", "min_think_tokens")

    def __init__(self, scheduler: SchedulerConfig, entropy: EntropyConfig) -> None:
        self.max_think_tokens: int = scheduler.max_think_tokens
        self.min_think_tokens: int = scheduler.min_think_tokens
        self.entropy_enabled: bool = entropy.enabled
        self._entropy = entropy

    @classmethod
    def static(cls, max_think_tokens: int) -> BudgetPolicy:
        """The vLLM ``thinking_token_budget`` baseline: hard cap only, no floor, no entropy."""
        if not _is_positive_int(max_think_tokens):
            raise ConfigError(
                f"static think budget max_think_tokens must be a positive integer; "
                f"got {max_think_tokens!r}"
            )
        return cls(
            SchedulerConfig(max_think_tokens=max_think_tokens, min_think_tokens=0),
            EntropyConfig(enabled=False),
        )

    def new_probe(self) -> EntropyProbe | None:
        """A fresh probe for one request with this policy's ``[entropy]`` numbers, or ``None``
        when entropy forcing is disabled (so callers skip the per-token work)."""
        return EntropyProbe(self._entropy) if self.entropy_enabled else None

    def cap(self, budget: RequestBudget | None = None) -> int | None:
        """The hard cap a request with ``budget`` is forced at: its override, else the config's;
        ``None`` when its forcing is off (nothing forces it). :meth:`decide` fires before it only
        on an entropy signal (the probe's ``converged`` or ``overthinking``)."""
        if budget is None:
            return self.max_think_tokens
        if not budget.forcing:
            return None
        return self.max_think_tokens if budget.max_think_tokens is None else budget.max_think_tokens

    @staticmethod
    def cannot_fire(num_think_tokens: int, cap: float, probe: EntropyProbe | None) -> bool:
        """Whether :meth:`decide` keeps a request thinking whatever its budget's signals: below
        ``cap`` (:meth:`cap`, infinite when its forcing is off) with no entropy signal raised.
        A cheap test for callers that ask every step."""
        return num_think_tokens < cap and (
            probe is None or not (probe.converged or probe.overthinking)
        )

    def decide(
        self,
        num_think_tokens: int,
        probe: EntropyProbe | None,
        budget: RequestBudget | None = None,
    ) -> ForceDecision | None:
        """Force ``</think>`` now (a decision with its reason), or ``None`` to keep thinking.

        ``num_think_tokens`` counts the request's reasoning so far: the think tokens it
        generated and those its prompt already held (``RequestState.num_reasoning_tokens``).
        """
        if num_think_tokens < 0:
            raise ValueError(f"num_think_tokens must be >= 0; got {num_think_tokens}")
        cap = self.cap(budget)
        if cap is None:
            return None
        if num_think_tokens >= cap:
            overridden = budget is not None and budget.max_think_tokens is not None
            source = "request override" if overridden else "config"
            return ForceDecision(
                ForceReason.HARD_CAP,
                num_think_tokens,
                f"num_think_tokens={num_think_tokens} >= max_think_tokens={cap} ({source})",
            )
        if num_think_tokens < self.min_think_tokens or not self.entropy_enabled or probe is None:
            return None
        signals = Signals.ALL if budget is None else budget.signals
        if probe.converged and signals.eat:
            return ForceDecision(
                ForceReason.CONVERGED,
                num_think_tokens,
                f"eat_variance={probe.eat_variance:.4g} < {probe.eat_variance_threshold:g} "
                f"after {probe.num_eat_samples} samples (stream_proxy)",
            )
        if probe.overthinking and signals.rpdi:
            return ForceDecision(
                ForceReason.OVERTHINKING,
                num_think_tokens,
                f"rpdi={probe.rpdi:.3g} > {probe.rpdi_threshold:g} "
                f"(last {probe.rpdi_window_tokens} of {probe.num_tokens} tokens)",
            )
        return None
