"""What one simulator run produces: a record per request, samples over time, and counters.

Both engines (vLLM's scheduler driven on virtual time, and the fast engine model) fill these
through the same functions; ``meridian.bench`` turns them into metrics, reports and plots.
Times are integer nanoseconds of simulated time since the start of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meridian.core.types import ForceReason, Phase
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.streams import THINK_END_ID, THINK_TOKEN_ID, Stream


@dataclass(slots=True)
class RequestRecord:
    """The life of one request in a run.

    ``answer_token_ns`` holds the time every answer token reached the user, in order (with a
    delivery pacer, the paced times), so output ITLs are its differences; ``answer_token_step``
    the engine step that generated each. ``num_think_tokens`` is what was generated (after any
    forced stop); ``num_think_tokens_requested`` what the workload asked for. ``answer_correct``
    is the entropy model's verdict (``None`` for chat, or a real server's run).
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
    answer_correct: bool | None = None
    answer_token_ns: list[int] = field(default_factory=list)
    answer_token_step: list[int] = field(default_factory=list)
    preemptions_by_phase: dict[Phase, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0
    # The longest gap between two think-phase tokens (think tokens and ``</think>``), which a
    # user who is shown the reasoning reads; the last such token's time.
    max_think_gap_ns: int = 0
    last_think_token_ns: int | None = None

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

    @classmethod
    def for_stream(cls, stream: Stream) -> RequestRecord:
        """An empty record of a simulated request; forcing and correctness come from its
        stream (decided before the run)."""
        record = cls.for_spec(stream.spec)
        record.forced_reason = stream.forced
        record.answer_correct = stream.correct
        return record

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

    def on_token(self, token: int, now_ns: int, step: int) -> None:
        """Account one generated token at ``now_ns`` in engine step ``step``."""
        if self.first_token_ns is None:
            self.first_token_ns = now_ns
        if token in (THINK_TOKEN_ID, THINK_END_ID):
            last = self.last_think_token_ns
            if last is not None and now_ns - last > self.max_think_gap_ns:
                self.max_think_gap_ns = now_ns - last
            self.last_think_token_ns = now_ns
            if token == THINK_TOKEN_ID:
                self.num_think_tokens += 1
            else:
                self.think_end_ns = now_ns
        else:
            self.num_answer_tokens += 1
            if self.first_answer_ns is None:
                self.first_answer_ns = now_ns
            self.answer_token_ns.append(now_ns)
            self.answer_token_step.append(step)

    def on_preempt(self, phase: Phase) -> None:
        """Count one preemption of this request, in ``phase``."""
        self.preemptions_by_phase[phase] = self.preemptions_by_phase.get(phase, 0) + 1

    def pace_delivery(self, pace_ns: int) -> None:
        """Release answer tokens to the user no faster than one per ``pace_ns`` (a token
        pacer's buffer, as in Pascal): each reaches the user at
        ``max(generated, previous delivery + pace)``; the first answer token is not held.
        ``finish_ns`` stays the engine's (the request's KV is freed when it is generated)."""
        times = self.answer_token_ns
        for i in range(1, len(times)):
            times[i] = max(times[i], times[i - 1] + pace_ns)


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


@dataclass(slots=True)
class RunCounters:
    """Run-wide counters. ``num_scheduled_tokens`` is every token computed (the engine's work);
    ``num_recomputed_tokens`` the part of it computed again after preemptions; the offload
    counters are KV blocks copied to and from the host tier (``--kv-offload-gib``)."""

    num_steps: int = 0
    num_scheduled_rows: int = 0
    num_scheduled_tokens: int = 0
    preemptions_by_phase: dict[Phase, int] = field(default_factory=dict)
    num_recomputed_tokens: int = 0
    # The longest gap between two think-phase tokens (think tokens and ``</think>``), which a
    # user who is shown the reasoning reads; the last such token's time.
    max_think_gap_ns: int = 0
    last_think_token_ns: int | None = None
    num_offload_stored_blocks: int = 0
    num_offload_loaded_blocks: int = 0

    def on_preempt(self, phase: Phase) -> None:
        self.preemptions_by_phase[phase] = self.preemptions_by_phase.get(phase, 0) + 1


@dataclass(slots=True)
class SimResult:
    """Everything one policy's run produced; ``engine`` names the engine that ran it."""

    policy: str
    engine: str
    num_kv_blocks: int
    records: list[RequestRecord]
    samples: list[TimeSample]
    counters: RunCounters
    end_ns: int

    @classmethod
    def of_run(
        cls,
        *,
        policy: str,
        engine: str,
        num_kv_blocks: int,
        records: list[RequestRecord],
        samples: list[TimeSample],
        counters: RunCounters,
        now_ns: int,
        delivery_pace_ns: int | None,
    ) -> SimResult:
        """The result of a finished engine run; with ``delivery_pace_ns``, answer tokens reach
        the user through a token pacer (:meth:`RequestRecord.pace_delivery`)."""
        if delivery_pace_ns is not None:
            for record in records:
                record.pace_delivery(delivery_pace_ns)
        return cls(
            policy=policy,
            engine=engine,
            num_kv_blocks=num_kv_blocks,
            records=records,
            samples=samples,
            counters=counters,
            end_ns=max([now_ns, *(r.finish_ns or 0 for r in records)]),
        )
