"""What a run attained, in the report's terms: SLO attainment over the scales and goodput for both
user models (:class:`Attainment`, from :class:`~meridian.bench.slo.NeededScales`), and whether the
run had anything to schedule at all (:class:`Contention`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from meridian.bench.rounding import Sig6
from meridian.bench.slo import SCALES, IdleLatency, NeededScales, UserModel, Window
from meridian.sim.records import RequestRecord, SimResult

__all__ = ["QUEUED_S", "Attainment", "Contention", "SloMisses", "attainment", "contention"]

NS_PER_S = 1_000_000_000
# A first token this much later than on an idle engine is queueing (Contention).
QUEUED_S = 1.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloMisses(_Model):
    """Why measured requests missed the SLO at one scale (a request can miss on several counts,
    except the last three, which no scale helps)."""

    late_first_visible: int = Field(description="First visible token later than scale x idle.")
    slow_stream: int = Field(description="Mean gap between visible tokens over scale x idle.")
    stall: int = Field(description="A gap a reader sees over the stall bound.")
    wrong_answer: int
    unfinished: int


class Attainment(_Model):
    """SLO attainment (%) of the measured requests at each scale (x the idle latency), for the
    reasoning hidden and shown, the goodput at ``goodput_scale`` for each, and why requests
    missed at that scale."""

    scales: list[Sig6]
    hidden_pct: list[Sig6]
    shown_pct: list[Sig6]
    goodput_scale: Sig6
    goodput_hidden_req_s: Sig6
    goodput_shown_req_s: Sig6
    missed_hidden: SloMisses
    missed_shown: SloMisses

    def pct_at(self, user: UserModel, scale: float) -> float | None:
        """Attainment at ``scale`` (one of ``scales``), ``None`` if it is not one."""
        values = self.hidden_pct if user is UserModel.HIDDEN else self.shown_pct
        for s, v in zip(self.scales, values, strict=True):
            if abs(s - scale) < 1e-9:
                return v
        return None


class Contention(_Model):
    """Whether the run had anything to schedule: measured requests preempted at least once, and
    those that *queued*, whose first token came more than :data:`QUEUED_S` after it would on an
    idle engine (a hold, a full cache, a full batch; a step shared with other prompts is not
    that long); and, from the warm-up's end on, the fullest the KV cache got and the longest
    waiting queue after a step (which a burst of prompts fills for a step at any load). Nothing
    preempted and nothing queued is no contention: every scheduler must tie there."""

    kv_used_peak: Sig6 = Field(description="Largest share of the KV blocks in use.")
    max_waiting: int = Field(description="Longest waiting queue after a step.")
    num_preempted_requests: int
    num_queued_requests: int | None = Field(
        default=None, description="First token over 1 s later than idle (null: no idle model)."
    )

    @property
    def contended(self) -> bool:
        return self.num_preempted_requests > 0 or bool(self.num_queued_requests)


def _misses(needed: NeededScales, user: UserModel, scale: float) -> SloMisses:
    visible, stream = needed.ratios(user)
    hopeless = needed.hopeless[user]
    return SloMisses(
        late_first_visible=int(np.count_nonzero(visible > scale)),
        slow_stream=int(np.count_nonzero(stream > scale)),
        stall=hopeless.get("stall", 0),
        wrong_answer=hopeless.get("wrong answer", 0),
        unfinished=hopeless.get("unfinished", 0),
    )


def attainment(needed: NeededScales, window: Window, scale: float) -> Attainment:
    """The attainment curves of the needed scales, and goodput at ``scale``."""
    length = window.length_s
    return Attainment(
        scales=list(SCALES),
        hidden_pct=needed.attainment_pct(UserModel.HIDDEN, SCALES),
        shown_pct=needed.attainment_pct(UserModel.SHOWN, SCALES),
        goodput_scale=scale,
        goodput_hidden_req_s=needed.num_met(UserModel.HIDDEN, scale) / length,
        goodput_shown_req_s=needed.num_met(UserModel.SHOWN, scale) / length,
        missed_hidden=_misses(needed, UserModel.HIDDEN, scale),
        missed_shown=_misses(needed, UserModel.SHOWN, scale),
    )


def contention(
    result: SimResult,
    measured: Sequence[RequestRecord],
    window: Window,
    idle: IdleLatency | None = None,
) -> Contention:
    """The run's contention (:class:`Contention`); queued requests need ``idle``."""
    after = [x for x in result.samples if x.time_ns >= window.start_ns]
    capacity = max(result.num_kv_blocks, 1)
    queued = None
    if idle is not None:
        slack = round(QUEUED_S * NS_PER_S)
        queued = sum(
            1
            for r in measured
            if r.first_token_ns is None
            or r.first_token_ns - r.arrival_ns > idle.of_record(r).ttft_ns + slack
        )
    return Contention(
        kv_used_peak=max((x.num_kv_blocks_used for x in after), default=0) / capacity,
        max_waiting=max((x.num_waiting for x in after), default=0),
        num_preempted_requests=sum(1 for r in measured if r.preemptions_by_phase),
        num_queued_requests=queued,
    )
