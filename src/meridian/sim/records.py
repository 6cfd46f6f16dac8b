"""What one simulator run produces: a record per request, samples over time, and counters.

The engine fills these; ``meridian.bench`` turns them into metrics, reports and plots. Times are
integer nanoseconds of simulated time since the start of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meridian.core.types import ForceReason, Phase
from meridian.sim.request import RequestKind, RequestSpec


@dataclass(slots=True)
class RequestRecord:
    """The life of one request in a run.

    ``answer_token_ns`` holds the completion time of every answer token in order, so output ITLs
    are its differences. ``num_think_tokens`` is what was generated (after any forced stop);
    ``num_think_tokens_requested`` is what the workload asked for.
    """

    request_id: str
    kind: RequestKind
    arrival_ns: int
    num_prompt_tokens: int
    num_think_tokens_requested: int
    num_answer_tokens_requested: int
    settle_token: int | None = None
    first_token_ns: int | None = None
    think_end_ns: int | None = None
    first_answer_ns: int | None = None
    finish_ns: int | None = None
    num_think_tokens: int = 0
    num_answer_tokens: int = 0
    forced_reason: ForceReason | None = None
    answer_token_ns: list[int] = field(default_factory=list)
    answer_token_step: list[int] = field(default_factory=list)
    preemptions_by_phase: dict[Phase, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0

    @classmethod
    def for_spec(cls, spec: RequestSpec, *, settle_token: bool = True) -> RequestRecord:
        """An empty record for ``spec`` (``settle_token=False``: the model's settle point does
        not apply, e.g. a real server's run)."""
        return cls(
            request_id=spec.request_id,
            kind=spec.kind,
            arrival_ns=spec.arrival_ns,
            num_prompt_tokens=spec.num_prompt_tokens,
            num_think_tokens_requested=spec.num_think_tokens,
            num_answer_tokens_requested=spec.num_answer_tokens,
            settle_token=spec.settle_token if settle_token else None,
        )

    @property
    def finished(self) -> bool:
        """True once the last answer token was produced."""
        return self.finish_ns is not None

    @property
    def premature_force(self) -> bool | None:
        """Forced before the entropy model's settle point (``None``: not forced or unknown)."""
        if self.forced_reason is None or self.settle_token is None:
            return None
        return self.num_think_tokens < self.settle_token


@dataclass(frozen=True, slots=True)
class TimeSample:
    """Engine state after one step (the report down-samples these)."""

    time_ns: int
    num_kv_blocks_used: int
    num_kv_blocks_think: int
    num_running: int
    num_waiting: int
    queue_output: int
    queue_think: int
    batch_output: int
    batch_think: int


@dataclass(slots=True)
class RunCounters:
    """Run-wide counters."""

    num_steps: int = 0
    num_scheduled_rows: int = 0
    num_output_critical_evictions: int = 0
    preemptions_by_phase: dict[Phase, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0
    num_offloaded_blocks: int = 0
    num_ingested_blocks: int = 0


@dataclass(slots=True)
class SimResult:
    """Everything one policy's run produced."""

    policy: str
    num_kv_blocks: int
    records: list[RequestRecord]
    samples: list[TimeSample]
    counters: RunCounters
    end_ns: int
