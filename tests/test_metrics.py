"""Simulator metrics: every figure of a hand-made run against hand-computed numbers."""

from __future__ import annotations

import json
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.slo import ExplicitSlo, SloSpec, Window, meets_explicit
from meridian.bench.summary import (
    MAX_SERIES_POINTS,
    PolicySummary,
    downsample,
    round_sig,
    summarize,
)
from meridian.core.types import ForceReason, Phase
from meridian.errors import ConfigError
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestKind, RequestSpec
from meridian.sim.streams import Stream

REASONING = RequestKind.REASONING
CHAT = RequestKind.CHAT


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


def explicit(**bounds: float) -> SloSpec:
    """The explicit (fixed) SLO the hand-made figures below are worked out against."""
    return SloSpec(explicit=ExplicitSlo(**bounds))


EXPLICIT = explicit()


def record(
    rid: str,
    kind: RequestKind,
    arrival: float,
    *,
    think_requested: int = 0,
    think: int = 0,
    settle: int | None = None,
    first_token: float | None = None,
    think_end: float | None = None,
    answers: tuple[float, ...] = (),
    steps: tuple[int, ...] = (),
    forced: ForceReason | None = None,
    correct: bool | None = None,
    finished: bool = True,
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        kind=kind,
        arrival_ns=ns(arrival),
        num_prompt_tokens=10,
        num_think_tokens_requested=think_requested,
        num_answer_tokens_requested=max(len(answers), 1),
        settle_token=settle,
        first_token_ns=None if first_token is None else ns(first_token),
        think_end_ns=None if think_end is None else ns(think_end),
        first_answer_ns=ns(answers[0]) if answers else None,
        finish_ns=ns(answers[-1]) if answers and finished else None,
        num_think_tokens=think,
        num_answer_tokens=len(answers),
        forced_reason=forced,
        answer_correct=correct,
        answer_token_ns=[ns(a) for a in answers],
        answer_token_step=list(steps),
    )


def hand_made_run() -> SimResult:
    """Five requests whose every metric is worked out in the tests below.

    A: reasoning, forced (converged) at 50 of 100 think tokens, before its settle point 60, so
       its answer is wrong; ITL gaps 40, 60, 30 ms (P95 58 ms: misses the 50 ms ITL SLO); answer
       steps 10, 11, 14, 15; preempted twice while thinking, 50 tokens recomputed.
    B: reasoning, 200 think tokens unforced (correct); gaps 20, 20 ms: meets both SLOs; preempted
       once thinking and once answering, 27 tokens recomputed.
    C: chat (no verdict); TTFVT 2.5 s > the 2 s base: misses the TTFVT SLO; steps 20, 22.
    D: reasoning, forced (hard cap) at 250 of 300, after its settle point 100 (correct); meets
       both SLOs.
    E: reasoning, still thinking at the end (120 think tokens generated, not finished; its
       verdict, decided before the run, is correct).
    """
    records = [
        record(
            "A", REASONING, 0.0, think_requested=100, think=50, settle=60, first_token=0.5,
            think_end=3.0, answers=(3.2, 3.24, 3.30, 3.33), steps=(10, 11, 14, 15),
            forced=ForceReason.CONVERGED, correct=False,
        ),
        record(
            "B", REASONING, 1.0, think_requested=200, think=200, settle=150, first_token=1.2,
            think_end=4.0, answers=(4.5, 4.52, 4.54), steps=(20, 21, 22), correct=True,
        ),
        record("C", CHAT, 2.0, first_token=4.5, answers=(4.5, 4.53), steps=(20, 22)),
        record(
            "D", REASONING, 2.5, think_requested=300, think=250, settle=100, first_token=2.6,
            think_end=5.0, answers=(5.1, 5.12), steps=(30, 31), forced=ForceReason.HARD_CAP,
            correct=True,
        ),
        record(
            "E", REASONING, 3.0, think_requested=400, think=120, first_token=3.5,
            correct=True, finished=False,
        ),
    ]  # fmt: skip
    records[0].preemptions_by_phase = {Phase.THINK: 2}
    records[0].num_recomputed_tokens = 50
    records[1].preemptions_by_phase = {Phase.THINK: 1, Phase.OUTPUT: 1}
    records[1].num_recomputed_tokens = 27
    counters = RunCounters(
        num_steps=40,
        num_scheduled_rows=90,
        num_scheduled_tokens=1234,
        preemptions_by_phase={Phase.THINK: 3, Phase.OUTPUT: 1},
        num_recomputed_tokens=77,
    )
    samples = [TimeSample(ns(0.1 * i), 10 * i, 5 * i, i, 1, i % 3, 2) for i in range(1, 11)]
    return SimResult("meridian", "model", 100, records, samples, counters, end_ns=ns(6.0))


@pytest.fixture(scope="module")
def summary() -> PolicySummary:
    return summarize(hand_made_run(), EXPLICIT)


approx = pytest.approx


def test_counts(summary: PolicySummary) -> None:
    assert (summary.num_requests, summary.num_finished) == (5, 4)
    assert (summary.num_reasoning, summary.num_chat) == (4, 1)
    assert summary.sim_duration_s == 6.0
    assert summary.makespan_s == approx(5.12)


def test_ttft(summary: PolicySummary) -> None:
    # [0.5, 0.2, 2.5, 0.1, 0.5] -> sorted [0.1, 0.2, 0.5, 0.5, 2.5]
    t = summary.ttft_s
    assert t.count == 5
    assert t.mean == approx(0.76)
    assert t.p50 == approx(0.5)
    assert t.p95 == approx(0.5 + 0.8 * 2.0)
    assert t.p99 == approx(0.5 + 0.96 * 2.0)


def test_ttfvt(summary: PolicySummary) -> None:
    # A 3.2, B 3.5, C 2.5, D 2.6; E has no answer yet.
    t = summary.ttfvt_s
    assert t.count == 4
    assert t.mean == approx(2.95)
    assert t.p50 == approx(2.9)
    assert t.p95 == approx(3.2 + 0.85 * 0.3)
    assert t.max == approx(3.5)


def test_ttot_is_reasoning_only(summary: PolicySummary) -> None:
    # A 0.2, B 0.5, D 0.1; the chat request has no </think>.
    t = summary.ttot_s
    assert t.count == 3
    assert t.p50 == approx(0.2)
    assert t.p95 == approx(0.2 + 0.9 * 0.3)
    assert t.p99 == approx(0.2 + 0.98 * 0.3)


def test_output_itl_pools_all_gaps(summary: PolicySummary) -> None:
    # Gaps (ms): A 40, 60, 30; B 20, 20; C 30; D 20 -> sorted 20 20 20 30 30 40 60.
    t = summary.output_itl_s
    assert t.count == 7
    assert t.mean == approx(0.22 / 7, rel=1e-5)
    assert t.p50 == approx(0.030)
    assert t.p95 == approx(0.040 + 0.7 * 0.020)
    assert t.p99 == approx(0.040 + 0.94 * 0.020)
    assert t.max == approx(0.060)


def test_token_counts_over_finished_requests(summary: PolicySummary) -> None:
    # Think: A 50, B 200, D 250 (E unfinished); answers: A 4, B 3, C 2, D 2.
    assert summary.think_tokens.count == 3
    assert summary.think_tokens.mean == approx(500 / 3, rel=1e-5)
    assert summary.think_tokens.p50 == 200
    assert summary.think_tokens.p95 == approx(245.0)
    assert summary.answer_tokens.mean == approx(2.75)


def test_forced_by_reason_and_premature_rate(summary: PolicySummary) -> None:
    assert summary.num_forced == 2
    # Over the 4 reasoning requests.
    assert summary.forced_pct.converged == 25.0
    assert summary.forced_pct.hard_cap == 25.0
    assert summary.forced_pct.overthinking == 0.0
    # A stopped at 50 < settle 60 (premature), D at 250 >= settle 100 (not).
    assert summary.premature_force_pct == 50.0


def test_think_tokens_saved_ignores_unfinished_think(summary: PolicySummary) -> None:
    # A, B, D passed </think>: requested 600, generated 500. E is still thinking.
    assert summary.think_tokens_saved == 100
    assert summary.think_tokens_saved_pct == approx(100 / 6, rel=1e-5)


def test_counters_and_worst_gap(summary: PolicySummary) -> None:
    # Preemptions and recomputed tokens are the measured requests' own (here: every request).
    assert summary.preemptions.model_dump() == {"prefill": 0, "think": 3, "output": 1}
    assert summary.num_recomputed_tokens == 77
    # The engine's work is the run-wide counter, not anything derived from the records.
    assert summary.num_scheduled_tokens == 1234
    assert summary.worst_answer_gap_steps == 3  # A: step 11 -> 14


def test_throughput_and_goodput(summary: PolicySummary) -> None:
    # Generated: A 54, B 203, C 2, D 252, E 120 = 631 tokens over 0 s -> 5.12 s.
    assert summary.throughput_tok_s == approx(631 / 5.12, rel=1e-5)
    # Only B and D meet both SLOs (A misses ITL and is wrong, C misses TTFVT, E unfinished).
    assert summary.num_slo_met == 2
    # Per second of the arrival window (first arrival 0 s to just after the last, 3 s), not of
    # the makespan: a straggler does not move it.
    assert summary.window_s == approx(3.0)
    assert summary.goodput_req_s == approx(2 / 3.0, rel=1e-5)
    assert summary.slo_met_pct == 40.0
    # No step-time model, no idle latency: no attainment curves, no queued count.
    assert summary.attainment is None
    assert summary.contention is not None and summary.contention.num_queued_requests is None


def test_goodput_follows_the_slo() -> None:
    run = hand_made_run()
    # A 60 ms ITL SLO admits A's latencies (P95 58 ms) but A's answer is wrong; a 2.5 s base
    # admits C (TTFVT 2.5 s, at the edge).
    loose_slo = explicit(ttfvt_base_s=2.5, output_itl_s=0.060)
    assert summarize(run, loose_slo).num_slo_met == 3
    run.records[0].answer_correct = None  # no verdict: only the latencies count
    assert summarize(run, loose_slo).num_slo_met == 4
    run = hand_made_run()
    # A TTFVT allowance of 0.01 s per think token: B needs 3.5 <= 2 + 2.0, D 2.6 <= 2 + 3.0.
    tight = summarize(run, explicit(think_tpot_s=0.01))
    assert tight.num_slo_met == 2
    tighter = summarize(run, explicit(think_tpot_s=0.005))  # B: 3.5 > 3.0 now
    assert tighter.num_slo_met == 1


def test_slo_edges_are_inclusive() -> None:
    r = record("X", CHAT, 0.0, first_token=2.0, answers=(2.0, 2.05, 2.10), steps=(1, 2, 3))
    assert meets_explicit(r, ExplicitSlo())  # TTFVT exactly 2 s, every gap exactly 50 ms
    assert not meets_explicit(r, ExplicitSlo(output_itl_s=0.049))
    assert not meets_explicit(r, ExplicitSlo(ttfvt_base_s=1.999))
    one_token = record("Y", CHAT, 0.0, first_token=1.0, answers=(1.0,), steps=(1,))
    assert meets_explicit(one_token, ExplicitSlo())  # no gap, nothing to violate


def test_hand_made_answer_accuracy(summary: PolicySummary) -> None:
    # Finished with a verdict: A wrong, B and D correct; C (chat) has none, E is unfinished.
    assert summary.answer_accuracy_pct == approx(200 / 3, rel=1e-5)


def two_request_run(correct: bool | None) -> SimResult:
    """X: a reasoning request meeting both SLOs by its latencies (TTFVT 1 s, gaps 20 ms),
    with verdict ``correct``; Y: a chat request meeting both (TTFVT 1.96 s, one 40 ms gap).
    Makespan 2 s (the window, :data:`TWO_S`); generated tokens 40 + 3 + 2 = 45."""
    x = record(
        "X", REASONING, 0.0, think_requested=100, think=40, settle=60, first_token=0.3,
        think_end=0.99, answers=(1.0, 1.02, 1.04), steps=(5, 6, 7),
        forced=ForceReason.CONVERGED, correct=correct,
    )  # fmt: skip
    y = record("Y", CHAT, 0.0, first_token=1.96, answers=(1.96, 2.0), steps=(8, 9))
    return SimResult("meridian", "model", 16, [x, y], [], RunCounters(), end_ns=ns(2.0))


TWO_S = Window(0, ns(2.0))


@pytest.mark.parametrize("correct", [True, None])
def test_goodput_counts_a_request_whose_answer_is_not_wrong(correct: bool | None) -> None:
    run = two_request_run(correct)
    assert meets_explicit(run.records[0], ExplicitSlo())
    s = summarize(run, EXPLICIT, window=TWO_S)
    assert s.num_slo_met == 2
    assert s.goodput_req_s == approx(1.0)
    assert s.slo_met_pct == 100.0


def test_goodput_excludes_a_wrong_answer_that_meets_the_slos() -> None:
    run = two_request_run(False)
    assert not meets_explicit(run.records[0], ExplicitSlo())
    assert meets_explicit(run.records[1], ExplicitSlo())
    s = summarize(run, EXPLICIT, window=TWO_S)
    assert s.num_slo_met == 1
    assert s.goodput_req_s == approx(0.5)
    assert s.slo_met_pct == 50.0
    # A wrong answer still took the engine's time and produced its tokens.
    assert s.num_finished == 2
    assert s.throughput_tok_s == approx(22.5)
    assert s.answer_accuracy_pct == 0.0


def test_answer_accuracy_counts_finished_requests_with_a_verdict() -> None:
    def reasoning(rid: str, correct: bool, *, finished: bool = True) -> RequestRecord:
        return record(
            rid, REASONING, 0.0, think_requested=50, think=50, first_token=0.1, think_end=0.5,
            answers=(0.6, 0.61), steps=(1, 2), correct=correct, finished=finished,
        )  # fmt: skip

    records = [
        reasoning("R1", True),
        reasoning("R2", True),
        reasoning("R3", False),
        reasoning("R4", True),
        record("C", CHAT, 0.0, first_token=0.2, answers=(0.2, 0.21), steps=(1, 2)),
        reasoning("U", False, finished=False),  # no answer yet: not counted
    ]
    assert records[4].answer_correct is None
    run = SimResult("meridian", "model", 16, records, [], RunCounters(), end_ns=ns(1.0))
    s = summarize(run, EXPLICIT)
    assert s.answer_accuracy_pct == 75.0  # 3 of the 4 finished reasoning requests
    # Without any verdict (e.g. a real server's run) there is no accuracy, not 0 % or 100 %.
    for r in records:
        r.answer_correct = None
    assert summarize(run, EXPLICIT).answer_accuracy_pct is None


def test_pace_delivery_spaces_answer_tokens() -> None:
    r = record("P", CHAT, 0.0, first_token=1.0, answers=(1.0,), steps=(1,))
    r.answer_token_ns = [1000, 1010, 1130, 1135, 1150]
    r.answer_token_step = [1, 2, 5, 6, 7]
    r.first_answer_ns, r.finish_ns = 1000, 1150
    r.pace_delivery(50)
    # 1010 waits for its slot 1050; 1130 was generated after its slot 1100, so it goes out when
    # generated; 1135 and 1150 are held behind it, one pace apart.
    assert r.answer_token_ns == [1000, 1050, 1130, 1180, 1230]
    assert all(b - a >= 50 for a, b in pairwise(r.answer_token_ns))
    assert r.first_answer_ns == 1000  # the first answer token is not held
    assert r.finish_ns == 1150  # the engine's finish, not the last delivery
    assert r.answer_token_step == [1, 2, 5, 6, 7]
    r.pace_delivery(50)  # already paced: nothing moves
    assert r.answer_token_ns == [1000, 1050, 1130, 1180, 1230]


def test_pace_delivery_leaves_slow_streams_alone() -> None:
    r = record("Q", CHAT, 0.0, first_token=1.0, answers=(1.0, 1.2, 1.5), steps=(1, 2, 3))
    r.pace_delivery(ns(0.05))
    assert r.answer_token_ns == [ns(1.0), ns(1.2), ns(1.5)]
    one = record("O", CHAT, 0.0, first_token=1.0, answers=(1.0,), steps=(1,))
    one.pace_delivery(ns(0.05))
    assert one.answer_token_ns == [ns(1.0)]


def test_paced_delivery_is_what_the_itl_measures() -> None:
    # Gaps of 10, 10 and 80 ms, paced at 30 ms: delivered 0, 30, 60 ms after the first, then the
    # last at 100 ms, when it was generated (its slot was 90 ms).
    answers = (0.5, 0.51, 0.52, 0.6)
    r = record("Z", CHAT, 0.0, first_token=0.5, answers=answers, steps=(1, 2, 3, 4))
    r.pace_delivery(ns(0.03))
    assert r.answer_token_ns == [ns(0.5), ns(0.53), ns(0.56), ns(0.6)]
    run = SimResult("pascal", "model", 16, [r], [], RunCounters(), end_ns=ns(0.6))
    s = summarize(run, EXPLICIT)
    assert s.output_itl_s.count == 3
    assert s.output_itl_s.p50 == approx(0.03)
    assert s.output_itl_s.max == approx(0.04)
    assert s.ttfvt_s.max == approx(0.5)  # the first answer token is not held
    assert s.makespan_s == approx(0.6)  # the finish is the engine's


def test_record_for_stream_and_on_token() -> None:
    spec = RequestSpec("s1", ns(1.0), 8, 5, 3, REASONING, settle_token=4)
    stream = Stream(spec, num_think=2, forced=ForceReason.CONVERGED, correct=False)
    r = RequestRecord.for_stream(stream)
    assert (r.forced_reason, r.answer_correct, r.settle_token) == (
        ForceReason.CONVERGED,
        False,
        4,
    )
    assert r.premature_force is True  # 2 think tokens < settle 4
    tokens = [stream.token_at(i) for i in range(stream.num_output_tokens)]
    for i, token in enumerate(tokens):
        r.on_token(token, ns(2.0) + i * 1000, 10 + i)
    # 2 think tokens, </think> at index 2, then 3 answer tokens (the last one EOS).
    assert r.first_token_ns == ns(2.0)
    assert r.num_think_tokens == 2
    assert r.think_end_ns == ns(2.0) + 2000
    assert r.num_answer_tokens == 3
    assert r.first_answer_ns == ns(2.0) + 3000
    assert r.answer_token_ns == [ns(2.0) + 3000, ns(2.0) + 4000, ns(2.0) + 5000]
    assert r.answer_token_step == [13, 14, 15]
    assert r.finish_ns is None  # the engine sets it
    r.on_preempt(Phase.THINK)
    r.on_preempt(Phase.THINK)
    r.on_preempt(Phase.OUTPUT)
    assert r.preemptions_by_phase == {Phase.THINK: 2, Phase.OUTPUT: 1}
    counters = RunCounters()
    counters.on_preempt(Phase.PREFILL)
    assert counters.preemptions_by_phase == {Phase.PREFILL: 1}


def test_empty_run_gives_nulls_not_errors() -> None:
    s = summarize(SimResult("vllm-fcfs", "model", 10, [], [], RunCounters(), end_ns=0), SloSpec())
    assert s.num_requests == 0
    assert s.answer_accuracy_pct is None and s.num_scheduled_tokens == 0
    assert s.ttft_s.count == 0 and s.ttft_s.p50 is None and s.output_itl_s.p99 is None
    assert s.throughput_tok_s is None and s.goodput_req_s == 0.0
    assert s.premature_force_pct is None and s.worst_answer_gap_steps is None
    assert s.distributions.output_itl_s.quantiles == []
    assert s.series.time_s == []
    json.dumps(s.model_dump(mode="json"))  # serialisable, nulls included


def test_cdf_sketch_holds_101_quantiles(summary: PolicySummary) -> None:
    q = summary.distributions.ttfvt_s.quantiles
    assert len(q) == 101
    assert q[0] == approx(2.5) and q[50] == approx(2.9) and q[100] == approx(3.5)
    assert q == sorted(q)


def test_time_series_fractions_of_capacity(summary: PolicySummary) -> None:
    series = summary.series
    assert len(series.time_s) == 10  # short runs keep every sample
    assert series.kv_used_fraction[-1] == 1.0  # 100 of 100 blocks
    assert series.kv_think_fraction[3] == 0.2
    assert series.queue_output[:3] == [1, 2, 0]


def test_downsample_keeps_spikes_and_is_deterministic() -> None:
    samples = [TimeSample(i * 1000, 1, 0, 1, 0, 0, 0) for i in range(5003)]
    samples[1234] = TimeSample(1234 * 1000, 99, 0, 1, 0, 77, 0)
    a = downsample(samples, 100)
    assert len(a.time_s) == MAX_SERIES_POINTS
    assert max(a.queue_output) == 77
    assert max(a.kv_used_fraction) == 0.99
    assert a.time_s[-1] == approx(5002 * 1000 / 1e9)
    assert a.time_s == sorted(a.time_s)
    assert downsample(samples, 100) == a


def test_floats_are_rounded_to_six_significant_digits() -> None:
    run = hand_made_run()
    run.records[0].answer_token_ns[1] += 1  # a gap of 40.000001 ms
    s = summarize(run, EXPLICIT)

    def floats(value: object) -> list[float]:
        if isinstance(value, float):
            return [value]
        if isinstance(value, dict):
            return [f for v in value.values() for f in floats(v)]
        if isinstance(value, list):
            return [f for v in value for f in floats(v)]
        return []

    values = floats(s.model_dump())
    assert values
    assert all(v == float(f"{v:.6g}") for v in values)
    # The reloaded summary is the same object (rounding is idempotent).
    assert PolicySummary.model_validate_json(s.model_dump_json()) == s


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300))
@settings(max_examples=200, deadline=None)
def test_round_sig_is_idempotent_and_close(x: float) -> None:
    r = round_sig(x)
    assert round_sig(r) == r
    assert r == approx(x, rel=1e-5, abs=1e-300)


def test_round_sig_rejects_non_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        round_sig(float("nan"))


def test_slo_spec_validation() -> None:
    with pytest.raises(ConfigError, match=r"slo\.output_itl_s must be a positive"):
        ExplicitSlo(output_itl_s=0.0)
    with pytest.raises(ConfigError, match=r"slo\.ttfvt_base_s"):
        ExplicitSlo(ttfvt_base_s=float("nan"))
    with pytest.raises(ConfigError, match=r"slo\.scale"):
        SloSpec(scale=-1.0)
    assert "3 × its latency on an idle engine" in SloSpec().describe()
    assert "explicit SLO" in EXPLICIT.describe()


@st.composite
def random_runs(draw: st.DrawFn) -> SimResult:
    records: list[RequestRecord] = []
    for i in range(draw(st.integers(0, 12))):
        reasoning = draw(st.booleans())
        arrival = draw(st.integers(0, 10_000))
        t = arrival + draw(st.integers(1, 5_000))
        think_requested = draw(st.integers(1, 500)) if reasoning else 0
        think = draw(st.integers(0, think_requested))
        forced = draw(st.sampled_from([None, *ForceReason])) if reasoning else None
        correct = draw(st.sampled_from([None, True, False])) if reasoning else None
        gaps = draw(st.lists(st.integers(1, 3_000), max_size=6))
        answers = [t + (draw(st.integers(1, 5_000)) if reasoning else 0)]
        for g in gaps:
            answers.append(answers[-1] + g)
        finished = draw(st.booleans())
        records.append(
            RequestRecord(
                request_id=f"r{i}",
                kind=REASONING if reasoning else CHAT,
                arrival_ns=arrival * 1_000_000,
                num_prompt_tokens=5,
                num_think_tokens_requested=think_requested,
                num_answer_tokens_requested=len(answers),
                settle_token=draw(st.none() | st.integers(0, 500)) if reasoning else None,
                first_token_ns=t * 1_000_000,
                think_end_ns=(answers[0] - 1) * 1_000_000 if reasoning else None,
                first_answer_ns=answers[0] * 1_000_000,
                finish_ns=answers[-1] * 1_000_000 if finished else None,
                num_think_tokens=think,
                num_answer_tokens=len(answers),
                forced_reason=forced,
                answer_correct=correct,
                answer_token_ns=[a * 1_000_000 for a in answers],
                answer_token_step=list(range(len(answers))),
            )
        )
    end = max((r.answer_token_ns[-1] for r in records), default=0)
    return SimResult("p", "model", 64, records, [], RunCounters(), end_ns=end)


@given(random_runs())
@settings(max_examples=60, deadline=None)
def test_summary_invariants(run: SimResult) -> None:
    s = summarize(run, EXPLICIT)
    for p in (s.ttft_s, s.ttfvt_s, s.ttot_s, s.output_itl_s, s.think_tokens):
        if p.count:
            assert p.p50 is not None and p.p95 is not None and p.p99 is not None
            assert p.max is not None
            assert p.p50 <= p.p95 <= p.p99 <= p.max
        else:
            assert p.p50 is None and p.mean is None
    assert s.num_slo_met <= s.num_finished <= s.num_requests
    finished = [r for r in run.records if r.finished]
    assert s.num_slo_met <= sum(r.answer_correct is not False for r in finished)
    verdicts = [r.answer_correct for r in finished if r.answer_correct is not None]
    if verdicts:
        assert s.answer_accuracy_pct == approx(100 * sum(verdicts) / len(verdicts), rel=1e-5)
    else:
        assert s.answer_accuracy_pct is None
    forced = s.forced_pct
    # Each share is rounded to 6 significant digits (Sig6): up to 5e-5 off apiece below 100.
    assert forced.converged + forced.overthinking + forced.hard_cap <= 100.0 + 1e-3
    assert s.think_tokens_saved >= 0
    if s.window_s:
        assert s.goodput_req_s == approx(s.num_slo_met / s.window_s, rel=1e-5)
    assert summarize(run, EXPLICIT) == s  # deterministic
    assert np.isfinite([v for v in s.distributions.output_itl_s.quantiles]).all()
