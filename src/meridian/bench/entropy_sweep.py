"""A sweep of the ``[entropy]`` thresholds on a served model, with the accuracy harness.

The ``[entropy]`` numbers are server-wide (no request knob carries them), so each
:class:`SweepSetting` is one ``meridian serve`` of the model with that section (started and
stopped as ``meridian bench ab-real`` does, :func:`meridian.bench.abreal.serving`). On each
server the accuracy harness (:mod:`meridian.bench.accuracy`) runs the setting's entropy policies
(``eat``, ``rpdi``, ``meridian``: the per-request ``meridian_signals``) on the same items; the
first server also runs ``none`` (forcing off: the same on every server) and Meridian's hard caps
(``hard-cap:N``, signals off), the reference an entropy signal must beat at equal think tokens.
Every run is labelled ``POLICY@SETTING``, so one summary, one table and one Pareto front cover
the whole sweep. After each policy the server's ``meridian_budget_forces_total`` is scraped:
the forces it caused, by reason.

:func:`predicted_think_tokens` replays a recorded entropy trace through the core budget policy
(:func:`meridian.sim.streams.forced_think_length`, the logits processor's decision sequence),
to tell from a model's traces where a setting fires without serving it.

``benchmarks/bench_entropy_sweep.py`` runs it on ``models/sum-reasoner``;
``tests/vllm_e2e/test_entropy_sweep.py`` runs a slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import numpy.typing as npt
from prometheus_client.parser import text_string_to_metric_families

from meridian.bench.abreal import CANDIDATE, AbRealSpec, serving
from meridian.bench.accuracy import (
    AccuracyRun,
    ForcingSummary,
    Item,
    Outcome,
    pareto_front,
    parse_forcing_policies,
    run_accuracy,
)
from meridian.config.loading import parse_config_text
from meridian.config.schema import MeridianConfig
from meridian.core.budget import BudgetPolicy
from meridian.core.types import ForceReason
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.streams import forced_think_length

__all__ = [
    "FULL_GRID",
    "HARD_CAPS",
    "QUICK_GRID",
    "SweepResult",
    "SweepSetting",
    "forces_by_reason",
    "matched_hard_caps",
    "predicted_think_tokens",
    "run_sweep",
    "settings_markdown",
]

ENTROPY_POLICIES = ("eat", "rpdi", "meridian")


@dataclass(frozen=True, slots=True)
class SweepSetting:
    """One server's ``[entropy]`` section (only the fields it changes) and the entropy policies
    run against it.

    >>> s = SweepSetting("eat-L8-d5", {"eat_probe_interval_tokens": 8, "eat_min_distance": 5})
    >>> s.config().entropy.eat_probe_interval_tokens, s.eat_fire_tokens()
    (8, 47)
    """

    name: str
    entropy: Mapping[str, float | int] = field(default_factory=dict)
    policies: tuple[str, ...] = ENTROPY_POLICIES
    min_think_tokens: int = 16
    max_think_tokens: int = 1000

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in ENTROPY_POLICIES]
        if unknown or not self.policies:
            raise ValueError(
                f"setting {self.name}: policies must be among {', '.join(ENTROPY_POLICIES)}; "
                f"got {', '.join(self.policies) or 'none'}"
            )
        self.config()  # a bad value fails here, naming the setting and the field

    def config_text(self) -> str:
        """The ``meridian.toml`` of the setting's server."""
        lines = [
            "[scheduler]",
            f"min_think_tokens = {self.min_think_tokens}",
            f"max_think_tokens = {self.max_think_tokens}",
            "",
            "[entropy]",
        ]
        lines += [f"{key} = {value!r}" for key, value in self.entropy.items()]
        return "\n".join(lines) + "\n"

    def config(self) -> MeridianConfig:
        """The validated config (a :class:`~meridian.errors.ConfigError` names a bad field)."""
        return parse_config_text(self.config_text(), source=f"sweep setting {self.name}")

    def eat_fire_tokens(self) -> int:
        """The fewest think tokens an EAT stop can leave: the rule may fire on the
        ``min_distance + 1``-th interval sample, i.e. on observing think token ``(d + 1) L``,
        whose place ``</think>`` takes; never below the floor. On a chain whose interval means
        barely move (a model certain of every token) it fires exactly there, like a hard cap."""
        entropy = self.config().entropy
        samples = (entropy.effective_eat_min_distance + 1) * entropy.eat_probe_interval_tokens
        return max(samples - 1, self.min_think_tokens)

    def label(self) -> str:
        """The setting's ``[entropy]`` changes as ``key=value`` pairs (``defaults`` if none)."""
        return ", ".join(f"{k}={v:g}" for k, v in self.entropy.items()) or "defaults"


def _eat(
    name: str, interval: int, distance: int, alpha: float = 0.05, **more: float
) -> SweepSetting:
    values = {
        "eat_probe_interval_tokens": interval,
        "eat_min_distance": distance,
        "ema_alpha": alpha,
    }
    return SweepSetting(name, {**values, **more}, ("eat", "meridian"))


def _rpdi(name: str, window: int, ratio: float, transition: float = 2.5) -> SweepSetting:
    values = {"rpdi_window_tokens": window, "rpdi_threshold": ratio,
              "transition_entropy_threshold": transition}  # fmt: skip
    return SweepSetting(name, values, ("rpdi", "meridian"))


# Every point can fire on chains of 20 to 300 think tokens except `defaults` (EAT needs 41
# samples of 32 tokens, RPDI 2 windows of 256) and the two controls (`eat-strict`: a variance
# threshold below what the model's interval means reach; `rpdi-w32`: the default transition
# threshold, above every token of the model). The `rpdi-*-model` points put the transition
# threshold inside the model's own entropy range (its P99 is about 0.0024 nats).
FULL_GRID: tuple[SweepSetting, ...] = (
    SweepSetting("defaults"),
    _eat("eat-L4-d2", 4, 2, alpha=0.5),
    _eat("eat-L8-d5", 8, 5, alpha=0.2),
    _eat("eat-L16-d5", 16, 5, alpha=0.1),
    _eat("eat-L16-d10", 16, 10),
    _eat("eat-L32-d7", 32, 7),
    _eat("eat-strict", 8, 5, alpha=0.2, eat_ema_variance_threshold=1e-9),
    _rpdi("rpdi-w32", 32, 2.0),
    _rpdi("rpdi-w16-model", 16, 1.5, transition=0.0015),
    _rpdi("rpdi-w32-model", 32, 2.0, transition=0.002),
    _rpdi("rpdi-w64-model", 64, 1.5, transition=0.002),
)
QUICK_GRID: tuple[SweepSetting, ...] = tuple(
    s for s in FULL_GRID if s.name in ("defaults", "eat-L8-d5", "rpdi-w16-model")
)


def matched_hard_caps(settings: Sequence[SweepSetting], longest: int) -> tuple[int, ...]:
    """Meridian's hard caps at the EAT settings' earliest stops below ``longest`` think tokens:
    what an entropy signal must beat at equal think tokens.

    >>> matched_hard_caps(FULL_GRID, 300)
    (16, 47, 95, 175, 255)
    """
    return tuple(sorted({s.eat_fire_tokens() for s in settings if "eat" in s.policies
                         and s.eat_fire_tokens() < longest}))  # fmt: skip


HARD_CAPS = matched_hard_caps(FULL_GRID, 300)


def forces_by_reason(metrics_text: str) -> dict[str, int]:
    """``meridian_budget_forces_total`` by reason from a ``/metrics`` page (0 where absent).

    >>> forces_by_reason('meridian_budget_forces_total{reason="converged"} 3.0\\n')
    {'converged': 3, 'overthinking': 0, 'hard_cap': 0}
    """
    counts = dict.fromkeys((r.value for r in ForceReason), 0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            reason = sample.labels.get("reason", "")
            if sample.name == "meridian_budget_forces_total" and reason in counts:
                counts[reason] += int(sample.value)
    return counts


@dataclass(slots=True)
class SweepResult:
    """Every outcome (policies labelled ``POLICY@SETTING``), each label's wall time in run
    order (``none`` first), and the forces each label caused, by reason."""

    outcomes: list[Outcome] = field(default_factory=list)
    walls: dict[str, float] = field(default_factory=dict)
    forces: dict[str, dict[str, int]] = field(default_factory=dict)


Progress = Callable[[str, int], None]


def run_sweep(
    model: Path,
    settings: Sequence[SweepSetting],
    items: Sequence[Item],
    work: Path,
    *,
    hard_caps: Sequence[int] = HARD_CAPS,
    vllm_args: Sequence[str] = (),
    max_tokens: int = 400,
    concurrency: int = 8,
    on_done: Progress | None = None,
    on_server: Callable[[str], None] | None = None,
) -> SweepResult:
    """Serve ``model`` once per setting and run its policies on ``items`` (module docstring).

    Server logs and configs go to ``work/SETTING/``. ``on_done(label, n)`` is called as the
    harness's progress callback; ``on_server(setting)`` when a setting's server is healthy.
    """
    result = SweepResult()
    for index, setting in enumerate(settings):
        folder = work / setting.name
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "meridian.toml"
        config_path.write_text(setting.config_text(), encoding="utf-8")
        spec = AbRealSpec(str(model), vllm_args, config_path=config_path, log_dir=folder)
        first = ["none", *(f"hard-cap:{n}" for n in hard_caps)] if index == 0 else []
        with serving(CANDIDATE, spec) as url:
            if on_server is not None:
                on_server(setting.name)
            run = AccuracyRun(
                url=f"{url}/v1", model=str(model), max_tokens=max_tokens, concurrency=concurrency
            )
            for name in [*first, *setting.policies]:
                label = name if name in first else f"{name}@{setting.name}"
                before = forces_by_reason(httpx.get(f"{url}/metrics", timeout=10).text)

                def progress(_: str, done: int, label: str = label) -> None:
                    if on_done is not None:
                        on_done(label, done)

                (policy,) = parse_forcing_policies(name)
                outcomes, walls = run_accuracy(run, [policy], items, on_done=progress)
                after = forces_by_reason(httpx.get(f"{url}/metrics", timeout=10).text)
                result.outcomes += [replace(o, policy=label) for o in outcomes]
                result.walls[label] = walls[name]
                result.forces[label] = {k: after[k] - before[k] for k in after}
    return result


def predicted_think_tokens(
    trace: npt.NDArray[np.float32], setting: SweepSetting, signals: str = "all"
) -> int:
    """The think tokens a chain with this per-token entropy ``trace`` would keep on the
    setting's server (its whole length when nothing fires): the core policy's decisions, token
    by token, as the logits processor takes them. ``signals``: ``all``, ``eat`` or ``rpdi``.

    >>> flat = np.full(100, 0.01, dtype=np.float32)
    >>> predicted_think_tokens(flat, FULL_GRID[2]), predicted_think_tokens(flat, FULL_GRID[0])
    (47, 100)
    """
    config = setting.config()
    entropy = config.entropy
    if signals == "eat":  # RPDI unreachable: a threshold no ratio of rates can exceed
        entropy = entropy.model_copy(update={"rpdi_threshold": math.inf})
    elif signals == "rpdi":
        entropy = entropy.model_copy(update={"eat_ema_variance_threshold": 0.0})
    elif signals != "all":
        raise ValueError(f"signals must be all, eat or rpdi; got {signals!r}")
    spec = RequestSpec("trace", 0, 1, int(trace.size), 1, RequestKind.REASONING, trace)
    num_think, _ = forced_think_length(spec, BudgetPolicy(config.scheduler, entropy))
    return num_think


_REASONS = (ForceReason.CONVERGED, ForceReason.OVERTHINKING, ForceReason.HARD_CAP)


def settings_markdown(
    settings: Sequence[SweepSetting],
    rows: Sequence[ForcingSummary],
    forces: Mapping[str, Mapping[str, int]],
) -> str:
    """The sweep's table: per run, its setting's changes, accuracy, think tokens, forces."""
    front = {r.policy for r in pareto_front(rows)}
    by_name = {s.name: s for s in settings}
    lines = [
        "| run | `[entropy]` changes | accuracy (95 % Wilson) | think tokens mean / P50 | "
        "saved vs none | forced (converged / overthinking / hard cap) | Pareto |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        _, _, name = r.policy.partition("@")
        setting = by_name.get(name)
        f = forces.get(r.policy, {})
        forced = " / ".join(str(f.get(reason.value, 0)) for reason in _REASONS)
        saved = "n/a" if math.isnan(r.think_tokens_saved) else f"{100 * r.think_tokens_saved:.1f} %"
        lines.append(
            f"| `{r.policy}` | {setting.label() if setting else '—'} | "
            f"{r.correct}/{r.items} ({100 * r.accuracy_low:.0f}–{100 * r.accuracy_high:.0f} %) | "
            f"{r.think_tokens_mean:.1f} / {r.think_tokens_p50:.0f} | {saved} | {forced} | "
            f"{'yes' if r.policy in front else ''} |"
        )
    return "\n".join(lines) + "\n"
