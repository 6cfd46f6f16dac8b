"""What each simulated request generates: its token stream, with forcing applied up front.

A reasoning request generates ``think`` tokens, ``</think>``, then its answer; a chat request
only its answer; the last answer token is the end-of-sequence token. Forcing (``</think>``
injected early) is decided per request by the same core objects the vLLM logits processor runs
(:class:`~meridian.core.budget.BudgetPolicy` over an :class:`~meridian.core.entropy.
EntropyProbe` fed with the request's entropy trace), before any engine runs: a request's stream
depends only on its trace and the forcing, never on how it was scheduled. So every engine
(vLLM's scheduler, the fast engine model) and every policy with the same forcing replays exactly
the same streams: forcing is held equal by construction.

Convention (as in the logits processor): before the think token with index ``k`` is sampled,
the probe sees that token's entropy, then the policy decides with ``k`` think tokens generated;
a force there makes the think length ``k``.

Accuracy, as the entropy *model* defines it: a reasoning request's answer is correct unless it
was forced to stop before its ``settle_token`` (the point after which its answer is settled).
This is a property of the workload's entropy model, not a measured accuracy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from meridian.config.schema import MeridianConfig
from meridian.core.budget import BudgetPolicy
from meridian.core.forcing import ThinkForcer
from meridian.core.format import ReasoningFormat
from meridian.core.types import ForceReason
from meridian.sim.request import RequestSpec

# Token ids of the simulated streams (vLLM's scheduler sees exactly these). Prompt filler
# tokens are >= FILLER_BASE, so they never spell a boundary.
THINK_START_ID = 1
THINK_END_ID = 2
NO_THINK_ID = 3
THINK_TOKEN_ID = 10
ANSWER_TOKEN_ID = 11
EOS_ID = 12
FILLER_BASE = 100

SIM_FORMAT = ReasoningFormat(
    think_start=(THINK_START_ID,), think_end=(THINK_END_ID,), no_think=(NO_THINK_ID,)
)


class ForcingKind(enum.Enum):
    """How a policy ends reasoning early."""

    OFF = "off"  # never: every chain runs to its own end
    MERIDIAN = "meridian"  # Meridian's budget policy: EAT, RPDI, hard cap, floor ([entropy])
    STATIC = "static"  # vLLM's thinking_token_budget: a fixed cap


@dataclass(frozen=True, slots=True)
class Forcing:
    """One forcing setting; ``cap`` is the static cap (``STATIC`` only)."""

    kind: ForcingKind
    cap: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is ForcingKind.STATIC) != (self.cap is not None):
            raise ValueError("a static forcing needs a cap, and only a static forcing has one")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"a static think cap must be >= 1; got {self.cap}")

    @property
    def label(self) -> str:
        """``off``, ``meridian`` or ``static:CAP``."""
        return f"static:{self.cap}" if self.cap is not None else self.kind.value

    def budget_policy(self, config: MeridianConfig) -> BudgetPolicy | None:
        """The budget policy this forcing runs (``None``: no forcing at all)."""
        if self.kind is ForcingKind.OFF:
            return None
        if self.kind is ForcingKind.STATIC:
            assert self.cap is not None
            return BudgetPolicy.static(self.cap)
        return BudgetPolicy(config.scheduler, config.entropy)


FORCING_OFF = Forcing(ForcingKind.OFF)
FORCING_MERIDIAN = Forcing(ForcingKind.MERIDIAN)


# The max_tokens a simulated client sends: Qwen3's recommended output length for reasoning.
CLIENT_MAX_TOKENS = 32768


@dataclass(frozen=True, slots=True)
class Stream:
    """The tokens one request generates, after forcing.

    ``num_think`` counts generated think tokens (``0`` for chat); ``forced`` says why they were
    cut short (``None``: the chain ended by itself). ``correct`` is the entropy model's verdict
    (``None`` for chat, which has no settle point). ``num_output_tokens`` counts every generated
    token: think tokens, ``</think>`` and the answer, whose last token is EOS. ``max_tokens`` is
    the request's limit as a client sets it (:data:`CLIENT_MAX_TOKENS`), never below what it
    generates: the engine cannot know the length from it.
    """

    spec: RequestSpec
    num_think: int
    forced: ForceReason | None
    correct: bool | None
    # Derived once (engines read them for every token): see the properties' docs.
    request_id: str = field(init=False)
    is_reasoning: bool = field(init=False)
    num_output_tokens: int = field(init=False)
    max_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        marker = 1 if spec.is_reasoning else 0
        object.__setattr__(self, "request_id", spec.request_id)
        object.__setattr__(self, "is_reasoning", spec.is_reasoning)
        # Every generated token: think tokens, </think>, answer (its last one is EOS).
        object.__setattr__(
            self, "num_output_tokens", self.num_think + marker + spec.num_answer_tokens
        )
        object.__setattr__(self, "max_tokens", max(CLIENT_MAX_TOKENS, self.num_output_tokens + 1))

    def token_at(self, index: int) -> int:
        """The ``index``-th generated token (0-based)."""
        if self.is_reasoning:
            if index < self.num_think:
                return THINK_TOKEN_ID
            if index == self.num_think:
                return THINK_END_ID
        return EOS_ID if index == self.num_output_tokens - 1 else ANSWER_TOKEN_ID

    def prompt_tail(self) -> tuple[int, ...]:
        """The end of the prompt, which decides the initial phase (``<think>`` or /no_think)."""
        return (THINK_START_ID,) if self.spec.is_reasoning else (NO_THINK_ID,)

    def prompt_token_ids(self, salt: int) -> list[int]:
        """A full prompt of ``num_prompt_tokens`` ids, unique per ``salt`` (no shared prefix
        between requests, as in the fast engine's prefix cache), ending with the tail."""
        tail = self.prompt_tail()
        n = self.spec.num_prompt_tokens - len(tail)
        first = FILLER_BASE + salt % 100_000
        return [first] + [FILLER_BASE + (salt * 31 + j) % 1000 for j in range(1, n)] + list(tail)


def forced_think_length(spec: RequestSpec, policy: BudgetPolicy) -> tuple[int, ForceReason | None]:
    """The think length of ``spec`` under ``policy``, and the force reason if it was forced:
    what the logits processor's :class:`~meridian.core.forcing.ThinkForcer` decides over the
    request's entropy trace (:meth:`~meridian.core.forcing.ThinkForcer.replay`); a chain
    without a trace only meets the hard cap."""
    return _replay(ThinkForcer(SIM_FORMAT, policy), spec)


def _replay(forcer: ThinkForcer, spec: RequestSpec) -> tuple[int, ForceReason | None]:
    trace = spec.think_entropy
    return forcer.replay(None if trace is None else trace.tolist(), spec.num_think_tokens)


def build_streams(
    specs: Sequence[RequestSpec], forcing: Forcing, config: MeridianConfig
) -> list[Stream]:
    """Every request's stream under ``forcing`` (same order as ``specs``)."""
    policy = forcing.budget_policy(config)
    forcer = None if policy is None else ThinkForcer(SIM_FORMAT, policy)
    streams: list[Stream] = []
    for spec in specs:
        if not spec.is_reasoning:
            streams.append(Stream(spec, 0, None, None))
            continue
        if forcer is None:
            num_think, reason = spec.num_think_tokens, None
        else:
            num_think, reason = _replay(forcer, spec)
        settle = spec.settle_token
        correct = settle is None or reason is None or num_think >= settle
        streams.append(Stream(spec, num_think, reason, correct))
    return streams


def matched_static_cap(specs: Sequence[RequestSpec], target_think_tokens: int) -> int:
    """The largest static cap whose chains sum to at most ``target_think_tokens`` think tokens:
    a cap with (at least) the saving of the forcing that produced that total.

    >>> from meridian.sim.request import RequestKind
    >>> specs = [RequestSpec(f"r{i}", 0, 8, n, 8, RequestKind.REASONING) for i, n in
    ...          enumerate((100, 300, 500))]
    >>> matched_static_cap(specs, 600)   # 100 + 250 + 250
    250
    """
    lengths = sorted(s.num_think_tokens for s in specs if s.is_reasoning)
    if not lengths:
        raise ValueError("no reasoning requests: a think cap saves nothing")
    lo, hi = 1, lengths[-1]
    while lo < hi:  # the largest cap whose total stays within the target
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= target_think_tokens:
            lo = mid
        else:
            hi = mid - 1
    return lo
