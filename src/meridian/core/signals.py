"""Entropy signals of the think phase, fed one token's entropy at a time: EAT (convergence) and
RPDI (overthinking), and :class:`EntropyProbe`, which feeds both for one request.

EAT is the stopping rule of arXiv:2509.26522 over Meridian's stream proxy (ADR-0007): every
``eat_probe_interval_tokens`` think tokens, one sample is the interval's mean per-token entropy.

NOTE: the paper samples the entropy *after appending* ``</think>``, which needs an extra forward
pass per sample; only the accuracy harness measures that signal
(:mod:`meridian.bench.eat_probe`, through :meth:`EatTracker.add_sample`). The interval mean, not
the last token's entropy, is the sample because single-token entropy is dominated by word choice.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from meridian.config.schema import EntropyConfig

__all__ = ["EatTracker", "EntropyProbe", "RpdiTracker"]

# Per-token entropies slightly below 0 come from device rounding; anything lower is a bug.
ENTROPY_SLACK = 1.0e-3


def _require(condition: bool, message: str) -> None:
    """``check_integrity`` helper: unlike ``assert`` it also runs under ``python -O``."""
    if not condition:
        raise AssertionError(message)


@dataclass(slots=True)
class EatTracker:
    """The EAT stopping rule over a sampled entropy signal ``x[0], x[1], ...``.

    Recursion (arXiv:2509.26522): ``M[0] = x[0]``, ``V[0] = 0``;
    ``M[n] = a*x[n] + (1-a)*M[n-1]``; ``V[n] = a*(x[n] - M[n])**2 + (1-a)*V[n-1]``.
    Converged at the first sample index ``n >= min_distance`` (``n`` counts from 0, so at the
    earliest on the ``min_distance + 1``-th sample) with ``V[n] < variance_threshold``. The
    ``min_distance`` guard is what stops ``V[0] = 0`` from firing at once.

    Invariant: once converged, the state is latched (further samples are ignored), so
    ``ema``/``variance`` report the values that fired the stop.

    :meth:`observe` is the stream proxy: it averages per-token entropies over ``interval_tokens``
    tokens and feeds each interval mean to :meth:`add_sample`.
    """

    alpha: float
    variance_threshold: float
    min_distance: int
    interval_tokens: int
    ema: float = 0.0
    variance: float = 0.0
    num_samples: int = 0
    converged_at: int | None = None
    _interval_sum: float = field(default=0.0, init=False, repr=False)
    _interval_count: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"EAT alpha must be in (0, 1]; got {self.alpha}")
        if self.min_distance < 1 or self.interval_tokens < 1:
            raise ValueError(
                f"EAT min_distance and interval_tokens must be >= 1; "
                f"got {self.min_distance} and {self.interval_tokens}"
            )

    @classmethod
    def from_config(cls, config: EntropyConfig) -> EatTracker:
        """A tracker with the ``[entropy]`` section's numbers (pydantic stays off the hot path)."""
        return cls(
            alpha=float(config.ema_alpha),
            variance_threshold=float(config.eat_ema_variance_threshold),
            min_distance=config.effective_eat_min_distance,
            interval_tokens=config.eat_probe_interval_tokens,
        )

    @property
    def converged(self) -> bool:
        """True once the stop rule fired."""
        return self.converged_at is not None

    def add_sample(self, x: float) -> bool:
        """Feed one EAT sample ``x[n]`` (nats); returns whether the tracker is converged."""
        if self.converged_at is not None:
            return True
        if not math.isfinite(x):
            raise ValueError(f"EAT sample must be a finite entropy in nats; got {x}")
        n = self.num_samples
        if n == 0:
            self.ema = x
            self.variance = 0.0
        else:
            a = self.alpha
            self.ema = a * x + (1.0 - a) * self.ema
            d = x - self.ema
            self.variance = a * d * d + (1.0 - a) * self.variance
        self.num_samples = n + 1
        if n >= self.min_distance and self.variance < self.variance_threshold:
            self.converged_at = n
            return True
        return False

    def observe(self, entropy: float) -> None:
        """Stream proxy: accumulate one token's entropy; every ``interval_tokens`` tokens the
        interval's mean becomes one EAT sample."""
        if self.converged_at is not None:
            return
        self._interval_sum += entropy
        self._interval_count += 1
        if self._interval_count >= self.interval_tokens:
            mean = self._interval_sum / self._interval_count
            self._interval_sum = 0.0
            self._interval_count = 0
            self.add_sample(mean)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        _require(0.0 < self.alpha <= 1.0, f"alpha {self.alpha} not in (0, 1]")
        _require(self.min_distance >= 1, f"min_distance {self.min_distance} < 1")
        _require(self.variance >= 0.0, f"negative variance {self.variance}")
        _require(
            0 <= self._interval_count < self.interval_tokens,
            f"interval count {self._interval_count} not in [0, {self.interval_tokens})",
        )
        if self.num_samples == 0:
            _require(
                self.ema == 0.0 and self.variance == 0.0 and self.converged_at is None,
                "state without samples",
            )
        if self.converged_at is not None:
            _require(
                self.converged_at == self.num_samples - 1,
                f"converged at sample {self.converged_at} but {self.num_samples} samples taken",
            )
            _require(
                self.converged_at >= self.min_distance,
                f"converged at sample {self.converged_at} < min_distance {self.min_distance}",
            )
            _require(
                self.variance < self.variance_threshold,
                f"converged with variance {self.variance} >= {self.variance_threshold}",
            )


@dataclass(slots=True)
class RpdiTracker:
    """Transition-token density ratio (RPDI), O(1) per token.

    A token is a *transition* when its entropy exceeds ``transition_threshold`` (nats).
    ``rpdi = (transitions in the last window_tokens tokens / window_tokens)
    / (transitions in the whole chain / num_tokens)``. It is 0.0 until the chain holds at least
    two windows of tokens (a ratio of a window to itself says nothing), and 0.0 when the chain has
    no transition. The window is part of the chain, so ``rpdi <= num_tokens / window_tokens``:
    a threshold ``r`` can fire at the earliest after ``r * window_tokens`` tokens.

    Invariants: ``ring`` holds the last ``window_tokens`` transition flags (zeros before the
    window first fills); ``num_window_transitions == sum(ring)``;
    ``num_window_transitions <= num_transitions <= num_tokens``.
    """

    transition_threshold: float
    window_tokens: int
    rpdi_threshold: float
    num_tokens: int = 0
    num_transitions: int = 0
    num_window_transitions: int = 0
    _pos: int = field(default=0, init=False, repr=False)
    ring: bytearray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.window_tokens < 1:
            raise ValueError(f"RPDI window must be at least 1 token; got {self.window_tokens}")
        self.ring = bytearray(self.window_tokens)

    @classmethod
    def from_config(cls, config: EntropyConfig) -> RpdiTracker:
        """A tracker with the ``[entropy]`` section's numbers."""
        return cls(
            transition_threshold=float(config.transition_entropy_threshold),
            window_tokens=config.rpdi_window_tokens,
            rpdi_threshold=float(config.rpdi_threshold),
        )

    def observe(self, entropy: float) -> None:
        """Account one token's entropy."""
        flag = 1 if entropy > self.transition_threshold else 0
        pos = self._pos
        self.num_window_transitions += flag - self.ring[pos]
        self.ring[pos] = flag
        pos += 1
        self._pos = 0 if pos == self.window_tokens else pos
        self.num_transitions += flag
        self.num_tokens += 1

    @property
    def rpdi(self) -> float:
        """Recent/whole-chain transition-rate ratio (0.0 while undefined)."""
        if self.num_tokens < 2 * self.window_tokens or self.num_transitions == 0:
            return 0.0
        return (self.num_window_transitions * self.num_tokens) / (
            self.window_tokens * self.num_transitions
        )

    @property
    def overthinking(self) -> bool:
        """``rpdi > rpdi_threshold`` now (not latched: it follows the stream)."""
        return self.rpdi > self.rpdi_threshold

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant, if any."""
        _require(len(self.ring) == self.window_tokens, "ring size differs from the window")
        _require(
            self._pos == self.num_tokens % self.window_tokens,
            f"ring position {self._pos} after {self.num_tokens} tokens",
        )
        _require(
            sum(self.ring) == self.num_window_transitions,
            f"window count {self.num_window_transitions} != {sum(self.ring)} flags in the ring",
        )
        _require(
            0 <= self.num_window_transitions <= self.num_transitions <= self.num_tokens,
            f"counts out of order: window {self.num_window_transitions}, "
            f"chain {self.num_transitions}, tokens {self.num_tokens}",
        )


class EntropyProbe:
    """One request's entropy signals: feed it every think token's entropy with :meth:`observe`;
    the budget policy (:mod:`meridian.core.budget`) reads ``converged`` and ``overthinking``.

    The ``[entropy]`` section's numbers are copied into plain slots at construction (no pydantic
    on the hot path). ``enabled`` is not read here: whether the signals may force is the budget
    policy's decision.

    >>> probe = EntropyProbe(EntropyConfig(ema_alpha=0.5, eat_min_distance=2,
    ...                                    eat_probe_interval_tokens=1))
    >>> for h in (1.0, 1.0, 1.0):
    ...     probe.observe(h)
    >>> probe.converged, probe.num_eat_samples, probe.num_tokens
    (True, 3, 3)
    """

    __slots__ = ("_eat", "_rpdi")

    def __init__(self, config: EntropyConfig) -> None:
        self._eat = EatTracker.from_config(config)
        self._rpdi = RpdiTracker.from_config(config)

    def observe(self, entropy: float) -> None:
        """Account one think token's entropy (nats, finite, >= 0)."""
        if not -ENTROPY_SLACK <= entropy < math.inf:
            raise ValueError(f"token entropy must be a finite number of nats >= 0; got {entropy}")
        self._rpdi.observe(entropy)
        self._eat.observe(entropy)

    @property
    def eat_ema(self) -> float:
        """EMA ``M[n]`` of the EAT samples (0.0 before the first sample)."""
        return self._eat.ema

    @property
    def eat_variance(self) -> float:
        """EMA variance ``V[n]`` of the EAT samples (0.0 before the second sample)."""
        return self._eat.variance

    @property
    def num_eat_samples(self) -> int:
        """EAT samples taken so far (frozen once converged)."""
        return self._eat.num_samples

    @property
    def eat_variance_threshold(self) -> float:
        """``delta``: converged when the variance falls below this."""
        return self._eat.variance_threshold

    @property
    def rpdi(self) -> float:
        """Recent/whole-chain transition-rate ratio (0.0 before two windows of tokens)."""
        return self._rpdi.rpdi

    @property
    def rpdi_threshold(self) -> float:
        """Overthinking when ``rpdi`` exceeds this."""
        return self._rpdi.rpdi_threshold

    @property
    def rpdi_window_tokens(self) -> int:
        """Tokens of the RPDI recent window."""
        return self._rpdi.window_tokens

    @property
    def num_tokens(self) -> int:
        """Think tokens observed."""
        return self._rpdi.num_tokens

    @property
    def converged(self) -> bool:
        """EAT stop rule fired (latched)."""
        return self._eat.converged

    @property
    def overthinking(self) -> bool:
        """``rpdi > rpdi_threshold`` now."""
        return self._rpdi.overthinking

    def copy(self) -> EntropyProbe:
        """An independent probe in this one's state: observations that may not count (a
        speculative decoding step's draft rows, :meth:`meridian.core.forcing.ThinkForcer.
        speculate`) go to the copy, and this probe is left as it is."""
        clone = copy.copy(self)
        clone._eat = copy.copy(self._eat)  # plain numbers only
        clone._rpdi = copy.copy(self._rpdi)
        clone._rpdi.ring = bytearray(self._rpdi.ring)
        return clone

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of either tracker."""
        self._eat.check_integrity()
        self._rpdi.check_integrity()
        if not self._eat.converged:
            expected = self._rpdi.num_tokens // self._eat.interval_tokens
            _require(
                self._eat.num_samples >= expected,
                f"{self._eat.num_samples} EAT samples after {self._rpdi.num_tokens} tokens",
            )
