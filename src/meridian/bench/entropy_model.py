"""A generative model of the per-token think entropy of one reasoning chain.

The simulator needs, for every reasoning request, the entropy (nats) of each think token and the
ground truth of when the answer was settled, so that Meridian's entropy-driven budget forcing can
be run and scored (a force before the settle point is *premature*). No model weights are reachable
here, so the traces come from this documented model; its parameters live in
``bench/data/workloads.toml`` (table ``[entropy_model]``).

The model, for one chain of ``n`` think tokens cut into intervals of ``L = 32`` tokens (interval
``k`` covers tokens ``[kL, (k+1)L)``, centre ``c_k = (k + 1/2) L``):

1. **Settle point.** ``f = f_min + (f_max - f_min) * Beta(a, b)`` (35-90 % of the chain),
   ``s = min(floor(f n), n - 1)``. The answer is settled after think token ``s``.
2. **Exploration intensity** ``e_k``, three stretches before ``s`` and zero after it::

       exploring           fade (fade_tokens)          calm (C tokens)        settled
       e = P          |  cosine from P to e_end  |  e = e_end = 0.1     | s |  e = 0

   with ``C = min(calm_tokens, calm_share_max * s)`` and the peak
   ``P = clip(s / exploration_ref_tokens, e_end, 1)``: the chain explores, calms down while it
   closes in on the answer, then settles; short chains (easy problems) explore less.
3. **Interval level** ``mu_k = max(tau_k + w_k, level_floor)`` with a trend that starts ``P D``
   above the settled level and approaches it exponentially from the start of the chain::

       tau_k = m_post + P * D * exp(-c_k / descent_tokens),
       m_post ~ U(0.35, 0.65),  D ~ U(0.2, 0.5)
       w_k   = phi * w_{k-1} + sqrt(1 - phi^2) * sigma_k * eta_k,   eta_k ~ N(0, 1)
       sigma_k = pre_wander_std * e_k (before s),  post_wander_std (after s)

   ``pre_wander_std = 0.14`` with ``phi = 0`` makes consecutive exploring intervals differ by
   about 0.2 nats (std of the difference); after ``s`` the wander is 0.008 nats.
4. **Transition tokens** (entropy > ``transition_threshold`` = 2.5 nats; "wait", "alternatively"):
   token ``t`` is one with probability ``r_t``: ``transition_rate_pre * e_k`` (4 % while
   exploring) before ``s``, ``transition_rate_post`` (0.05 %) after, and the episode's rate inside
   an overthinking episode. Its entropy is ``threshold + margin + Exp(excess_mean)``, capped.
5. **Plain tokens** carry the rest of the level. Their own level is lowered by the expected
   transition share, ``l_k = (mu_k - r_k T) / (1 - r_k)`` with ``T`` the mean transition entropy,
   so that the *expected* interval mean is ``mu_k`` whatever the rate: exploration fading out
   must not step the mean, because an EMA lags a step ``d`` with a variance of about
   ``d^2 (1 - a)^k``, which would take ~60 intervals to fall under the threshold. The noise is
   centred per interval, spreading entropy over the interval's tokens without moving its mean::

       h_t = l_k * (1 + token_noise_rel * (E_t - mean_{t' in k} E_t')),   E_t ~ Exp(1)

   clipped to ``[0, threshold - 0.05]`` (a plain token is never a transition). Exp(1) makes the
   token distribution right-skewed like real token entropy.
6. **Overthinking episodes.** With probability ``overthinking_fraction`` (0.3) a chain gets 1 to
   ``episodes_max`` disjoint episodes after ``s``, each ``U(200, 450)`` tokens long with a
   transition rate ``U(0.30, 0.50)``, together at most ``episode_max_share`` (15 %) of the chain so
   that an episode's rate stays several times the chain's. Episodes that do not fit are dropped.

Why this shape: the detector in :mod:`meridian.core.entropy` (EAT stream proxy: the mean entropy
of every 32-token interval ``x_n`` into ``M_n = a x_n + (1-a) M_{n-1}``,
``V_n = a (x_n - M_n)^2 + (1-a) V_{n-1}``, ``a = 0.05``, converged at the first ``n >= 40`` with
``V_n < 0.001``; RPDI: transition rate over the last 256 tokens over the whole chain's, > 3.0)
can only work if the settled part is steady: with a post-settle interval std ``sigma`` the
steady state is ``V ~ 0.93 sigma^2``, so ``sigma`` must stay well under 0.03 (it is about 0.014).
``V`` cannot fall faster than ``(1 - a)^k``, so after exploring (``V`` about 0.02-0.03) it needs
60-70 intervals to get under 0.001. The calm stretch spends most of that before ``s`` while its
residual exploration (``e_end``) keeps ``V`` above the threshold until ``s``; the remainder is the
detection delay after ``s``. ``e_end`` and ``calm_tokens`` trade that delay against premature
firing.

Achieved (``tests/test_entropy_model.py``: 300 chains per population, fixed seed, chain lengths
from the ``math500`` and ``aime`` think-token distributions, the detector as above plus the
512-token floor; "fires" means EAT converged or RPDI > 3):

* MATH-500-like lengths (mean about 4.1k think tokens): the detector first fires after the
  settle point on 97 % of chains, a median 474 tokens after it; it fires before the chain's end
  on 68 % (28 % of chains under 2k tokens, 57 % at 2-3k, 86 % at 3-5k, 100 % above 5k: EAT needs
  41 intervals and ~60 intervals of calm, so short chains end first). Forcing at the first fire
  would save 22 % of the think tokens.
* AIME-like lengths (mean about 11.6k, 28 % at the 16k cap): 97 % after the settle point, median
  391 tokens after it, 100 % before the end; forcing would save 33 % of the think tokens. The
  EAT paper reports 13-21 % fewer tokens at equal accuracy, so these traces are on the
  optimistic side, most for AIME.
* Post-settle interval-mean std: median 0.014 nats (90th percentile 0.019); consecutive exploring
  intervals differ by 0.24 nats (std). Transition rate: 3.9 % while exploring, 2.3 % over the
  chain, under 0.1 % once settled.
* Overthinking episodes: every one of 224 episodes pushed RPDI over 3; an episode's transition
  rate is 5-17x its chain's overall rate (median 10x).

This is a model, not a measurement: that the in-stream interval mean is this steady after the
answer settles is exactly the assumption Meridian's stream proxy rests on (real per-token entropy
is noisier; the EAT paper's after-``</think>`` probe is the measured signal). Every parameter is
in the data file, so a pessimistic variant can be run.

Which parameters are assumptions: all of them. None is fitted to a measured trace. The one model
that reasons on this machine, ``models/sum-reasoner`` (722 k parameters, character-level, a
deterministic running-sum task), was recorded for it (``benchmarks/bench_reasoner_traces.py``, 100
chains of 21 to 301 think tokens, exact entropy over its 512-entry vocabulary) and does not fit:

* level (``post_level_*``, ``pre_drop_*``): 0.00065 nats per token (P99 0.0024, max 0.09) against
  the model's 0.52 at the same lengths;
* wander (``pre_wander_std``, ``post_wander_std``, ``token_noise_rel``): consecutive 32-token
  interval means differ by 0.00026 nats (std) against 0.040;
* transitions (``transition_*``): no token of 16,530 above 2.5 nats, against 0.22 % from this
  model at the same lengths;
* settle point (``settle_*``, ``calm_tokens``, ``fade_tokens``, ``exploration_*``): the task's
  answer is the last step's value, so it settles at the end of the chain (fraction 1.0), and the
  after-``</think>`` answer entropy is about 0.001 nats whether the cut answer is right or wrong;
* overthinking episodes (``overthinking_fraction``, ``episode*``): the model never overthinks.

Fitted to that, every simulated chain would be certain, settled only at its end, and stopped by
EAT as soon as ``eat_min_distance`` allows: a toy trained to certainty, not a long-chain LLM. A
model with real hesitation (a distilled reasoner on a GPU, with a labelled set) is what the same
script and ``bench.entropy_traces`` should be run on before any parameter here is fitted.

Length: the model, its fit and its calibration check are one assumption and are read together
(the docstring above says what it is and is not).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from meridian.errors import MeridianError

__all__ = [
    "EntropyModelError",
    "EntropyModelParams",
    "EntropyTrace",
    "EntropyTraceModel",
    "load_data_file",
]

DATA_FILE = "workloads.toml"
ENTROPY_TABLE = "entropy_model"
# Plain tokens stay this far below the transition threshold so they are never counted as one.
_PLAIN_TOKEN_MARGIN = 0.05
# Keys of a parameter table that document it and are not parameters.
_DOC_KEYS = frozenset({"source", "assumption", "note"})


class EntropyModelError(MeridianError, ValueError):
    """The entropy-model parameters are invalid; the message names the parameter."""


class EntropyTrace(NamedTuple):
    """One sampled chain: unpacks as ``(entropy, settle_token, episodes)``.

    ``entropy`` is float32 ``[n]`` in nats (>= 0); ``settle_token`` is in ``[0, n - 1]``;
    ``episodes`` are half-open token ranges ``(start, end)``, sorted, disjoint, all after
    ``settle_token``.
    """

    entropy: npt.NDArray[np.float32]
    settle_token: int
    episodes: list[tuple[int, int]]


@lru_cache(maxsize=1)
def _data_text() -> str:
    return resources.files("meridian.bench").joinpath("data", DATA_FILE).read_text("utf-8")


def load_data_file() -> dict[str, Any]:
    """The bundled ``bench/data/workloads.toml`` as a fresh dict (the caller may change it)."""
    return tomllib.loads(_data_text())


@dataclass(frozen=True, slots=True)
class EntropyModelParams:
    """Parameters of :class:`EntropyTraceModel` (see the module docstring for the equations).

    Build them with :meth:`default` (the data file's ``[entropy_model]`` table) or
    :meth:`from_mapping`; the constructor validates every field and raises
    :class:`EntropyModelError` naming the first bad one.
    """

    interval_tokens: int
    settle_fraction_min: float
    settle_fraction_max: float
    settle_beta_a: float
    settle_beta_b: float
    post_level_min: float
    post_level_max: float
    pre_drop_min: float
    pre_drop_max: float
    calm_tokens: int
    calm_share_max: float
    fade_tokens: int
    descent_tokens: float
    level_floor: float
    pre_wander_std: float
    pre_wander_phi: float
    post_wander_std: float
    exploration_end: float
    exploration_ref_tokens: int
    token_noise_rel: float
    transition_threshold: float
    transition_margin: float
    transition_excess_mean: float
    transition_entropy_max: float
    transition_rate_pre: float
    transition_rate_post: float
    overthinking_fraction: float
    episodes_max: int
    episode_tokens_min: int
    episode_tokens_max: int
    episode_rate_min: float
    episode_rate_max: float
    episode_max_share: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want_int = f.type == "int"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EntropyModelError(f"entropy_model.{f.name} must be a number; got {value!r}")
            if want_int and not isinstance(value, int):
                raise EntropyModelError(f"entropy_model.{f.name} must be an integer; got {value!r}")
            if not math.isfinite(value):
                raise EntropyModelError(f"entropy_model.{f.name} must be finite; got {value}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise EntropyModelError(
                    f"entropy_model.{name} must be {rule}; got {getattr(self, name)}"
                )

        need(self.interval_tokens >= 1, "interval_tokens", ">= 1")
        need(0.0 <= self.settle_fraction_min < 1.0, "settle_fraction_min", "in [0, 1)")
        need(
            self.settle_fraction_min <= self.settle_fraction_max <= 1.0,
            "settle_fraction_max",
            f"in [settle_fraction_min ({self.settle_fraction_min}), 1]",
        )
        need(self.settle_beta_a > 0.0, "settle_beta_a", "> 0")
        need(self.settle_beta_b > 0.0, "settle_beta_b", "> 0")
        need(self.post_level_min >= 0.0, "post_level_min", ">= 0")
        need(
            self.post_level_max >= self.post_level_min,
            "post_level_max",
            f">= post_level_min ({self.post_level_min})",
        )
        need(self.pre_drop_min >= 0.0, "pre_drop_min", ">= 0")
        need(
            self.pre_drop_max >= self.pre_drop_min,
            "pre_drop_max",
            f">= pre_drop_min ({self.pre_drop_min})",
        )
        need(self.calm_tokens >= 0, "calm_tokens", ">= 0")
        need(0.0 <= self.calm_share_max <= 1.0, "calm_share_max", "in [0, 1]")
        need(self.fade_tokens >= 1, "fade_tokens", ">= 1")
        need(self.descent_tokens > 0.0, "descent_tokens", "> 0")
        need(self.level_floor >= 0.0, "level_floor", ">= 0")
        need(self.pre_wander_std >= 0.0, "pre_wander_std", ">= 0")
        need(-1.0 < self.pre_wander_phi < 1.0, "pre_wander_phi", "in (-1, 1)")
        need(self.post_wander_std >= 0.0, "post_wander_std", ">= 0")
        need(0.0 <= self.exploration_end <= 1.0, "exploration_end", "in [0, 1]")
        need(self.exploration_ref_tokens >= 1, "exploration_ref_tokens", ">= 1")
        need(0.0 <= self.token_noise_rel <= 1.0, "token_noise_rel", "in [0, 1]")
        need(self.transition_threshold > _PLAIN_TOKEN_MARGIN, "transition_threshold", "> 0.05")
        need(self.transition_margin >= 0.0, "transition_margin", ">= 0")
        need(self.transition_excess_mean >= 0.0, "transition_excess_mean", ">= 0")
        need(
            self.transition_entropy_max > self.transition_threshold + self.transition_margin,
            "transition_entropy_max",
            "> transition_threshold + transition_margin",
        )
        for name in ("transition_rate_pre", "transition_rate_post", "overthinking_fraction"):
            need(0.0 <= getattr(self, name) <= 1.0, name, "in [0, 1]")
        need(self.episodes_max >= 1, "episodes_max", ">= 1")
        need(self.episode_tokens_min >= 1, "episode_tokens_min", ">= 1")
        need(
            self.episode_tokens_max >= self.episode_tokens_min,
            "episode_tokens_max",
            f">= episode_tokens_min ({self.episode_tokens_min})",
        )
        need(0.0 <= self.episode_rate_min <= 1.0, "episode_rate_min", "in [0, 1]")
        need(
            self.episode_rate_min <= self.episode_rate_max <= 1.0,
            "episode_rate_max",
            f"in [episode_rate_min ({self.episode_rate_min}), 1]",
        )
        need(0.0 <= self.episode_max_share <= 1.0, "episode_max_share", "in [0, 1]")

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> EntropyModelParams:
        """Parameters from a mapping such as a TOML table.

        The documentation keys ``source``, ``assumption`` and ``note`` are ignored; integers are
        accepted for float parameters. Unknown or missing keys raise :class:`EntropyModelError`.
        """
        names = [f.name for f in fields(cls)]
        values = {k: v for k, v in table.items() if k not in _DOC_KEYS}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise EntropyModelError(
                f"unknown entropy_model parameter(s) {', '.join(unknown)}; "
                f"known: {', '.join(names)}"
            )
        missing = [n for n in names if n not in values]
        if missing:
            raise EntropyModelError(f"entropy_model is missing {', '.join(missing)}")
        float_names = {f.name for f in fields(cls) if f.type == "float"}
        coerced: dict[str, Any] = {
            k: float(v) if k in float_names and type(v) is int else v for k, v in values.items()
        }
        return cls(**coerced)

    @classmethod
    def default(cls) -> EntropyModelParams:
        """The calibrated parameters of the bundled data file's ``[entropy_model]`` table."""
        return _default_params()


@lru_cache(maxsize=1)
def _default_params() -> EntropyModelParams:
    data = load_data_file()
    table = data.get(ENTROPY_TABLE)
    if not isinstance(table, dict):
        raise EntropyModelError(f"{DATA_FILE} has no [{ENTROPY_TABLE}] table")
    return EntropyModelParams.from_mapping(table)


class EntropyTraceModel:
    """Samples per-token think entropy traces (see the module docstring).

    Deterministic for a given generator state: every draw comes from the ``rng`` passed to
    :meth:`sample`, in a fixed order.

    >>> model = EntropyTraceModel(EntropyModelParams.default())
    >>> entropy, settle, episodes = model.sample(4096, np.random.default_rng(0))
    >>> entropy.dtype, entropy.shape, 0 <= settle < 4096
    (dtype('float32'), (4096,), True)
    """

    __slots__ = ("params",)

    def __init__(self, params: EntropyModelParams | None = None) -> None:
        self.params = params if params is not None else EntropyModelParams.default()

    def sample(self, num_tokens: int, rng: np.random.Generator) -> EntropyTrace:
        """One chain of ``num_tokens`` (>= 1) think tokens."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
            raise EntropyModelError(f"num_tokens must be an integer; got {num_tokens!r}")
        n = int(num_tokens)
        if n < 1:
            raise EntropyModelError(f"num_tokens must be >= 1; got {n}")
        p = self.params
        settle = self._settle_token(n, rng)
        episodes = self._episodes(n, settle, rng)
        levels, base_rate = self._interval_levels(n, settle, rng)
        # Plain tokens sit below the level by the expected transition share, so that the expected
        # interval mean is the level whatever the transition rate: exploration fading out must
        # not step the mean, or the EMA would lag behind the step for ~60 intervals.
        mean_transition = p.transition_threshold + p.transition_margin + p.transition_excess_mean
        plain = np.maximum(
            (levels - base_rate * mean_transition) / np.maximum(1.0 - base_rate, 1e-9), 0.0
        )
        entropy = self._token_entropies(n, plain, rng)
        self._add_transitions(entropy, base_rate, episodes, rng)
        np.clip(entropy, 0.0, p.transition_entropy_max, out=entropy)
        # A zero level times negative noise gives -0.0, which clip keeps; adding +0.0 makes it +0.0.
        entropy += 0.0
        return EntropyTrace(entropy.astype(np.float32), settle, episodes)

    def _settle_token(self, n: int, rng: np.random.Generator) -> int:
        p = self.params
        fraction = p.settle_fraction_min + (p.settle_fraction_max - p.settle_fraction_min) * float(
            rng.beta(p.settle_beta_a, p.settle_beta_b)
        )
        return min(max(int(fraction * n), 0), n - 1)

    def _episodes(self, n: int, settle: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        """Disjoint overthinking episodes placed uniformly in ``(settle, n)``."""
        p = self.params
        if rng.random() >= p.overthinking_fraction:
            return []
        count = int(rng.integers(1, p.episodes_max + 1))
        lengths = rng.integers(p.episode_tokens_min, p.episode_tokens_max + 1, size=count)
        room = n - (settle + 1)
        # Keep only as many episodes as fit, within the share of the chain that episodes may
        # take (so an episode's rate stays several times the chain's); the leftover room is
        # spread uniformly as gaps.
        lengths = lengths[np.cumsum(lengths) <= min(room, p.episode_max_share * n)]
        if lengths.size == 0:
            return []
        slack = room - int(lengths.sum())
        # Sorted uniform cut points split the slack into count + 1 gaps (stars and bars).
        cuts = np.sort(rng.integers(0, slack + 1, size=lengths.size))
        episodes: list[tuple[int, int]] = []
        start = settle + 1
        previous_cut = 0
        for length, cut in zip(lengths.tolist(), cuts.tolist(), strict=True):
            start += cut - previous_cut
            previous_cut = cut
            episodes.append((start, start + length))
            start += length
        return episodes

    def _interval_levels(
        self, n: int, settle: int, rng: np.random.Generator
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per-interval level ``mu_k`` and base transition rate ``r_k``."""
        p = self.params
        size = p.interval_tokens
        num_intervals = -(-n // size)
        centres = (np.arange(num_intervals, dtype=np.float64) + 0.5) * size
        post_level = rng.uniform(p.post_level_min, p.post_level_max)
        drop = rng.uniform(p.pre_drop_min, p.pre_drop_max)
        before = centres < settle
        # The calm stretch before the settle point: exploration has faded, the answer is close.
        calm = min(float(p.calm_tokens), p.calm_share_max * settle)
        calm_start = settle - calm
        # u: how far before the calm stretch, in fade lengths (0 inside it, 1 at full intensity).
        u = np.clip((calm_start - centres) / p.fade_tokens, 0.0, 1.0)
        fade = 0.5 * (1.0 - np.cos(math.pi * u))
        # Short chains (easy problems) explore less: the peak grows with the settle point.
        peak = max(min(1.0, settle / p.exploration_ref_tokens), p.exploration_end)
        intensity = np.where(before, p.exploration_end + (peak - p.exploration_end) * fade, 0.0)
        # The level approaches m_post exponentially from the start of the chain; like the
        # exploration, the drop is smaller in short chains.
        trend = post_level + drop * peak * np.exp(-centres / p.descent_tokens)
        sigma = np.where(before, p.pre_wander_std * intensity, p.post_wander_std)
        shocks = rng.standard_normal(num_intervals) * sigma
        if p.pre_wander_phi == 0.0:
            wander = shocks
        else:
            # AR(1) before s (stationary std sigma_k), white after s. The recursion is sequential;
            # a chain has at most a few thousand intervals.
            phi = np.where(before, p.pre_wander_phi, 0.0)
            innovations = shocks * np.sqrt(1.0 - phi * phi)
            wander = np.empty(num_intervals)
            w = float(shocks[0])
            wander[0] = w
            for k in range(1, num_intervals):
                w = float(phi[k]) * w + float(innovations[k])
                wander[k] = w
        levels = np.maximum(trend + wander, p.level_floor)
        base_rate = np.where(before, p.transition_rate_pre * intensity, p.transition_rate_post)
        return levels, base_rate

    def _token_entropies(
        self, n: int, levels: npt.NDArray[np.float64], rng: np.random.Generator
    ) -> npt.NDArray[np.float64]:
        """Plain-token entropies: interval level times centred Exp(1) noise."""
        p = self.params
        size = p.interval_tokens
        num_intervals = levels.size
        noise = rng.standard_exponential(num_intervals * size).reshape(num_intervals, size)
        # The last interval may be partial: centre over its real tokens only.
        last = n - (num_intervals - 1) * size
        means = noise.mean(axis=1)
        means[-1] = noise[-1, :last].mean()
        tokens = levels[:, None] * (1.0 + p.token_noise_rel * (noise - means[:, None]))
        flat: npt.NDArray[np.float64] = tokens.reshape(-1)[:n].copy()
        np.clip(flat, 0.0, p.transition_threshold - _PLAIN_TOKEN_MARGIN, out=flat)
        return flat

    def _add_transitions(
        self,
        entropy: npt.NDArray[np.float64],
        base_rate: npt.NDArray[np.float64],
        episodes: list[tuple[int, int]],
        rng: np.random.Generator,
    ) -> None:
        """Overwrite transition tokens (> threshold) in place."""
        p = self.params
        n = entropy.size
        rate = np.repeat(base_rate, p.interval_tokens)[:n]
        for start, end in episodes:
            rate[start:end] = rng.uniform(p.episode_rate_min, p.episode_rate_max)
        is_transition = rng.random(n) < rate
        count = int(is_transition.sum())
        values = (
            p.transition_threshold
            + p.transition_margin
            + rng.standard_exponential(count) * p.transition_excess_mean
        )
        entropy[is_transition] = values
