"""Reports of simulator runs: JSON for machines, Markdown for people.

Three reports, each a pydantic model with ``schema_version: Literal[3]`` (3: goodput over the
arrival window with the unloaded-latency SLO, attainment curves, a warm-up):

- :class:`SimReport`: one arrival rate, one :class:`PolicySummary` per policy
  (``report.json`` / ``report.md``);
- :class:`AbReport`: the candidate (``meridian``) against every baseline on the headline metrics,
  with Δ% and a flag (``ab-report.json`` / ``ab-report.md``; thresholds in
  :mod:`meridian.bench.ab`);
- :class:`SweepReport`: several arrival rates, goodput and output ITL P99 per rate per policy
  (``sweep-report.json`` / ``sweep-report.md``).

The JSON is canonical: sorted keys, indent 2, a trailing newline, floats rounded to 6 significant
digits, and nothing that varies between two runs of the same inputs (no timestamps, no wall time,
no absolute paths), so the same inputs give a byte-identical file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from meridian.bench.ab import (
    BIG_FROM_PCT,
    FLAT_BELOW_PCT,
    AbRow,
    compare,
)
from meridian.bench.effects import same_forcing_baselines
from meridian.bench.offered import OfferedLoad
from meridian.bench.slo import SloSpec
from meridian.bench.summary import PolicySummary, Sig6
from meridian.config.files import MIB, read_user_file
from meridian.errors import MeridianError

CANDIDATE = "meridian"
PREMATURE_NOTE = (
    "Answer accuracy and premature force rate are a *model*: a forced `</think>` before the "
    "request's settle point in the workload's entropy model makes its answer wrong (and it does "
    "not count toward goodput). The entropy model's parameters are assumptions, not fitted to a "
    "real model's traces; forcing's real accuracy cost is measured with a model that reasons."
)

M = TypeVar("M", bound=BaseModel)


class _RunParameters(BaseModel):
    """What every report states about the run(s) behind it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[3] = 3
    workload: str
    seed: int
    duration_s: Sig6
    warmup_s: Sig6 = Field(default=0.0, description="Arrivals before this are in no statistic.")
    hardware: str
    model: str
    slo: SloSpec
    policies: list[str]
    engine: str = Field(
        default="model",
        description="vllm (vLLM's scheduler on virtual time), model (the fast engine) or real.",
    )
    async_scheduling: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_kv_blocks: int | None = None

    @field_validator("workload")
    @classmethod
    def _no_absolute_path(cls, value: str) -> str:
        # An absolute path would make two identical runs on two machines differ byte for byte.
        if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute():
            raise ValueError(
                f"workload must be a name (e.g. the trace file's name), not an absolute path; "
                f"got {value!r}"
            )
        return value


class ForcingSummary(BaseModel):
    """One forcing on the workload, apart from scheduling (the streams every engine replays)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    forcing: str = Field(description="off, meridian, or static:CAP (vLLM's thinking budget).")
    num_reasoning: int
    think_tokens_avg: Sig6 | None
    think_tokens_saved_pct: Sig6 | None = Field(description="Against forcing off.")
    num_forced: int
    answer_accuracy_pct: Sig6 | None = Field(description="Per the entropy *model*.")


class SimReport(_RunParameters):
    """One simulator run per policy, same workload and seed, at one arrival rate (requests/s).

    ``static_cap`` is the cap ``static-budget`` ran at: the one whose think-token saving matches
    Meridian's forcing on this workload. ``forcing`` compares forcings apart from scheduling.
    """

    arrival_rate: Sig6
    offered: OfferedLoad | None = Field(default=None, description="What the requests were.")
    summaries: dict[str, PolicySummary]
    static_cap: int | None = None
    forcing: list[ForcingSummary] = Field(default_factory=list)

    @model_validator(mode="after")
    def _policies_match(self) -> SimReport:
        if sorted(self.policies) != sorted(self.summaries):
            raise ValueError(
                f"policies {self.policies} and summaries {sorted(self.summaries)} must name the "
                f"same policies"
            )
        for name, summary in self.summaries.items():
            if summary.policy != name:
                raise ValueError(f"summaries[{name!r}] holds policy {summary.policy!r}")
        return self


class AbReport(_RunParameters):
    """The candidate against each baseline on :data:`~meridian.bench.ab.HEADLINE_METRICS`."""

    arrival_rate: Sig6
    offered: OfferedLoad | None = None
    candidate: str
    baselines: list[str]
    flat_below_pct: float = FLAT_BELOW_PCT
    big_from_pct: float = BIG_FROM_PCT
    rows: list[AbRow]


class SweepPoint(BaseModel):
    """All policies at one arrival rate (requests/s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival_rate: Sig6
    offered: OfferedLoad | None = None
    goodput_req_s: dict[str, Sig6 | None]
    output_itl_p99_s: dict[str, Sig6 | None]
    summaries: dict[str, PolicySummary]


class SweepReport(_RunParameters):
    """The same workload and seed at several arrival rates, in increasing rate order."""

    arrival_rates: list[Sig6]
    points: list[SweepPoint]


def build_ab_report(
    report: SimReport, candidate: str = CANDIDATE, baselines: Sequence[str] | None = None
) -> AbReport:
    """Compare ``candidate`` with ``baselines`` (default: every other policy, in run order)."""
    if candidate not in report.summaries:
        raise MeridianError(
            f"A/B needs the candidate policy {candidate!r} in the run; the run has "
            f"{', '.join(report.policies)}"
        )
    chosen = (
        [p for p in report.policies if p != candidate] if baselines is None else list(baselines)
    )
    missing = [b for b in chosen if b not in report.summaries]
    if missing:
        raise MeridianError(
            f"A/B baselines {missing} are not in the run; it has {', '.join(report.policies)}"
        )
    if not chosen:
        raise MeridianError(f"A/B needs at least one baseline besides {candidate!r}")
    return AbReport(
        **_run_parameters(report),
        arrival_rate=report.arrival_rate,
        offered=report.offered,
        candidate=candidate,
        baselines=chosen,
        rows=compare(report.summaries, candidate, chosen),
    )


def ab_baselines(report: _RunParameters, candidate: str = CANDIDATE) -> list[str] | None:
    """The baselines a simulated run's WIN/LOSS is claimed against: the policies with the
    candidate's forcing (against another forcing a WIN would credit forcing to scheduling;
    :mod:`meridian.bench.effects` reports forcing apart). A live A/B (``real``): every side."""
    if report.engine == "real":
        return None
    return same_forcing_baselines(candidate, report.policies)


def build_sweep_report(reports: Sequence[SimReport]) -> SweepReport:
    """Merge one :class:`SimReport` per arrival rate into a sweep (sorted by rate).

    The reports must agree on everything but the arrival rate, and the rates must differ.
    """
    if not reports:
        raise MeridianError("a sweep needs at least one run")
    first = _run_parameters(reports[0])
    for r in reports[1:]:
        other = _run_parameters(r)
        if other != first:
            diff = sorted(k for k in first if first[k] != other[k])
            raise MeridianError(
                f"sweep runs must differ only in arrival rate; they differ in {diff}"
            )
    ordered = sorted(reports, key=lambda r: r.arrival_rate)
    rates = [r.arrival_rate for r in ordered]
    if len(set(rates)) != len(rates):
        raise MeridianError(f"sweep arrival rates must be distinct; got {rates}")
    points = [
        SweepPoint(
            arrival_rate=r.arrival_rate,
            offered=r.offered,
            goodput_req_s={p: s.goodput_req_s for p, s in r.summaries.items()},
            output_itl_p99_s={p: s.output_itl_s.p99 for p, s in r.summaries.items()},
            summaries=r.summaries,
        )
        for r in ordered
    ]
    return SweepReport(**first, arrival_rates=rates, points=points)


def _run_parameters(report: _RunParameters) -> dict[str, object]:
    return {
        "workload": report.workload,
        "seed": report.seed,
        "duration_s": report.duration_s,
        "warmup_s": report.warmup_s,
        "hardware": report.hardware,
        "model": report.model,
        "slo": report.slo,
        "policies": list(report.policies),
        "engine": report.engine,
        "async_scheduling": report.async_scheduling,
        "max_num_seqs": report.max_num_seqs,
        "max_num_batched_tokens": report.max_num_batched_tokens,
        "num_kv_blocks": report.num_kv_blocks,
    }


def to_json(model: BaseModel) -> str:
    """The canonical JSON text: sorted keys, indent 2, trailing newline."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, indent=2) + "\n"


# A report holds summaries, not per-request data: a few hundred KiB for a sweep.
MAX_REPORT_BYTES = 64 * MIB


def load_report(path: Path, kind: type[M]) -> M:
    """Read a report written by ``write_*`` back into its model (schema-checked; read bounded:
    a report is at most :data:`MAX_REPORT_BYTES`)."""
    text = read_user_file(path, what="report", max_bytes=MAX_REPORT_BYTES)
    try:
        return kind.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise MeridianError(
            f"{path} is not a valid {kind.__name__} (schema_version 3): {where}: {first['msg']}"
        ) from exc


__all__ = [
    "CANDIDATE",
    "AbReport",
    "ForcingSummary",
    "SimReport",
    "SweepPoint",
    "SweepReport",
    "ab_baselines",
    "build_ab_report",
    "build_sweep_report",
    "load_report",
    "to_json",
]
