"""SLOs from unloaded latency (bench.slo): a request's idle latency against a hand computation
from the roofline step-time model, the two user models, attainment and goodput over the arrival
window, and the warm-up kept out of every statistic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meridian.bench.report import SimReport, load_report
from meridian.bench.slo import (
    SCALES,
    IdleLatency,
    NeededScales,
    SloSpec,
    UserModel,
    Window,
    needed_scale,
    slo_ratios,
)
from meridian.bench.summary import summarize
from meridian.cli import main
from meridian.core.types import Phase
from meridian.errors import MeridianError
from meridian.sim.presets import hardware_preset, model_preset
from meridian.sim.records import RequestRecord, RunCounters, SimResult, TimeSample
from meridian.sim.request import RequestKind
from meridian.sim.steptime import RooflineStepTime

MS = 1_000_000
# H100-SXM serving Qwen3-8B (sim/data/presets.toml), written out by hand.
WEIGHT_BYTES = 2 * 8_190_735_360
KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
FLOPS_PER_TOKEN = 2 * 8_190_735_360
ATTN_FLOPS_PER_PAIR = 4 * 36 * 32 * 128
SUSTAINED_FLOPS = 989.4e12 * 0.5
SUSTAINED_BYTES = 3.35e12 * 0.8
OVERHEAD_NS, PER_REQUEST_NS = 1_000_000, 20_000
CHUNK = 8192  # vLLM's max_num_batched_tokens on an H100


def roofline_ns(prefill: int, decode: int, kv_read: int) -> int:
    """One step of one request: max(compute, memory) + overheads (RooflineStepTime's formula)."""
    flops = FLOPS_PER_TOKEN * (prefill + decode)
    flops += ATTN_FLOPS_PER_PAIR * (kv_read + prefill * (prefill - 1) / 2)
    seconds = max(flops / SUSTAINED_FLOPS, (WEIGHT_BYTES + kv_read * KV_BYTES_PER_TOKEN) / 2.68e12)
    assert SUSTAINED_BYTES == 2.68e12
    return round(seconds * 1e9) + OVERHEAD_NS + PER_REQUEST_NS


@pytest.fixture(scope="module")
def idle() -> IdleLatency:
    model = RooflineStepTime(hardware_preset("h100-sxm"), model_preset("qwen3-8b"))
    return IdleLatency(model, CHUNK)


def test_idle_latency_is_the_hand_computation_from_the_step_time_model(idle: IdleLatency) -> None:
    # 10,000 prompt tokens: two chunks (8,192 then 1,808), the first token at the end of the
    # second; then 3 think tokens, </think> and 4 answer tokens, one decode step each, the k-th
    # reading 10,000 + k KV entries.
    ttft = roofline_ns(8192, 0, 8192) + roofline_ns(1808, 0, 10_000)
    decode = {k: roofline_ns(0, 1, 10_000 + k) for k in range(1, 8)}
    ttfvt = ttft + sum(decode[k] for k in range(1, 5))  # tokens 1..4: think 2, 3, </think>, answer
    times = idle.of(10_000, 3, 4, reasoning=True)
    assert times.ttft_ns == ttft
    assert times.ttfvt_ns == ttfvt
    assert times.answer_tpot_ns == pytest.approx(sum(decode[k] for k in (5, 6, 7)) / 3)
    assert times.stream_tpot_ns == pytest.approx(sum(decode.values()) / 7)
    # A decode step at batch size 1 is memory-bound: the weights once plus the context's KV.
    assert decode[1] == round((WEIGHT_BYTES + 10_001 * KV_BYTES_PER_TOKEN) / 2.68e3) + 1_020_000
    # A chat request's first visible token is its first token; one answer token has no gap.
    chat = idle.of(100, 0, 1, reasoning=False)
    assert chat.ttft_ns == chat.ttfvt_ns == roofline_ns(100, 0, 100)
    assert chat.answer_tpot_ns is None and chat.stream_tpot_ns is None


def test_the_decode_table_grows_and_agrees_with_direct_steps(idle: IdleLatency) -> None:
    # Long contexts first, then short ones: the prefix sums extend on demand and stay exact.
    far = idle.of(30_000, 2_000, 50, reasoning=True)
    near = idle.of(10, 5, 2, reasoning=True)
    direct = sum(idle.decode_ns(10 + k) for k in range(1, 7))
    assert near.ttfvt_ns == idle.prefill_ns(10) + direct
    assert far.ttfvt_ns > 2_000 * 7 * MS


def reasoning_record(
    idle: IdleLatency, *, visible: float, stream: float, shown_first: float, think_gap_ms: int
) -> RequestRecord:
    """A finished reasoning request (prompt 1,000, 3 think tokens, 4 answer tokens) whose first
    answer comes ``visible`` x its idle TTFVT after arrival, with answer gaps ``stream`` x the
    idle answer gap, whose first token comes ``shown_first`` x its idle TTFT."""
    times = idle.of(1_000, 3, 4, reasoning=True)
    assert times.answer_tpot_ns is not None
    arrival = 10 * MS
    first_answer = arrival + round(visible * times.ttfvt_ns)
    gap = round(stream * times.answer_tpot_ns)
    answers = [first_answer + i * gap for i in range(4)]
    record = RequestRecord(
        request_id="x",
        kind=RequestKind.REASONING,
        arrival_ns=arrival,
        num_prompt_tokens=1_000,
        num_think_tokens_requested=3,
        num_answer_tokens_requested=4,
        first_token_ns=arrival + round(shown_first * times.ttft_ns),
        think_end_ns=first_answer - 5 * MS,
        first_answer_ns=first_answer,
        finish_ns=answers[-1],
        num_think_tokens=3,
        num_answer_tokens=4,
        answer_correct=True,
        answer_token_ns=answers,
        answer_token_step=[1, 2, 3, 4],
        max_think_gap_ns=think_gap_ms * MS,
    )
    return record


def test_needed_scale_per_user_model(idle: IdleLatency) -> None:
    record = reasoning_record(idle, visible=2.0, stream=1.5, shown_first=4.0, think_gap_ms=40)
    times = idle.of_record(record)
    stall = round(0.25e9)
    # Reasoning hidden: the first answer at 2x, answer gaps at 1.5x: it needs a scale of 2.
    assert needed_scale(record, times, UserModel.HIDDEN, stall) == pytest.approx(2.0, rel=1e-6)
    # Reasoning shown: the first (think) token at 4x its idle TTFT decides.
    visible, stream, why = slo_ratios(record, times, UserModel.SHOWN, stall)
    assert why is None and visible == pytest.approx(4.0, rel=1e-6)
    expected = (record.answer_token_ns[-1] - record.first_token_ns) / 7 / times.stream_tpot_ns
    assert stream == pytest.approx(expected)
    assert needed_scale(record, times, UserModel.SHOWN, stall) == max(visible, stream)
    # A 300 ms gap in the thinking is a stall only for a user who is shown the thinking.
    stalled = reasoning_record(idle, visible=2.0, stream=1.5, shown_first=1.0, think_gap_ms=300)
    assert math.isinf(needed_scale(stalled, times, UserModel.SHOWN, stall))
    assert needed_scale(stalled, times, UserModel.HIDDEN, stall) == pytest.approx(2.0, rel=1e-6)
    assert slo_ratios(stalled, times, UserModel.SHOWN, stall)[2] == "stall"
    # A wrong answer or an unfinished request meets no SLO at any scale.
    record.answer_correct = False
    assert slo_ratios(record, times, UserModel.HIDDEN, stall)[2] == "wrong answer"
    record.answer_correct, record.finish_ns = True, None
    assert slo_ratios(record, times, UserModel.HIDDEN, stall)[2] == "unfinished"


def test_attainment_curves_and_goodput_over_the_arrival_window(idle: IdleLatency) -> None:
    records = [
        reasoning_record(idle, visible=v, stream=1.0, shown_first=f, think_gap_ms=20)
        for v, f in ((1.2, 1.2), (2.6, 1.8), (4.5, 9.0), (12.0, 1.1))
    ]
    for i, r in enumerate(records):
        r.request_id = f"r{i}"
    needed = NeededScales.of(records, idle, round(0.25e9))
    assert needed.attainment_pct(UserModel.HIDDEN, [1.5, 3.0, 5.0, 10.0]) == [25, 50, 75, 75]
    run = SimResult("p", "model", 100, records, [], RunCounters(), end_ns=10**10)
    window = Window(0, 4 * 10**9)
    s = summarize(run, SloSpec(), window=window, idle=idle)
    assert s.attainment is not None and s.attainment.scales == list(SCALES)
    assert s.attainment.pct_at(UserModel.HIDDEN, 3.0) == 50.0
    # Two requests meet 3x with the reasoning hidden: 2 per 4 s of arrivals.
    assert s.goodput_req_s == pytest.approx(0.5) and s.num_slo_met == 2
    assert s.attainment.goodput_hidden_req_s == pytest.approx(0.5)
    assert s.attainment.missed_hidden.late_first_visible == 2
    # Shown: the third request's first token came at 9x its idle TTFT; the fourth's thinking
    # took 12x as long as idle, so its stream's mean gap is over 10x its idle one.
    assert s.attainment.pct_at(UserModel.SHOWN, 3.0) == 50.0
    assert s.attainment.pct_at(UserModel.SHOWN, 9.0) == 75.0
    assert s.attainment.pct_at(UserModel.SHOWN, 10.0) == 75.0
    missed = s.attainment.missed_shown
    assert (missed.late_first_visible, missed.slow_stream) == (1, 1)
    shown = summarize(run, SloSpec(user=UserModel.SHOWN), window=window, idle=idle)
    assert shown.num_slo_met == 2


def test_warmup_requests_are_in_no_statistic(idle: IdleLatency) -> None:
    late = reasoning_record(idle, visible=1.5, stream=1.0, shown_first=1.0, think_gap_ms=10)
    early = reasoning_record(idle, visible=50.0, stream=9.0, shown_first=40.0, think_gap_ms=900)
    early.request_id, early.arrival_ns = "early", 0
    late.request_id = "late"
    shift = 5 * 10**9  # the late request arrives 5 s into the run
    for name in ("arrival_ns", "first_token_ns", "think_end_ns", "first_answer_ns", "finish_ns"):
        setattr(late, name, getattr(late, name) + shift)
    late.answer_token_ns = [t + shift for t in late.answer_token_ns]
    early.preemptions_by_phase = {Phase.THINK: 4}
    early.num_recomputed_tokens = 999
    samples = [TimeSample(10**9, 90, 0, 1, 7, 0, 0), TimeSample(6 * 10**9, 20, 0, 1, 0, 0, 0)]
    both = SimResult("p", "model", 100, [early, late], samples, RunCounters(), end_ns=10**10)
    window = Window.of_run(10.0, warmup_s=2.0)
    s = summarize(both, SloSpec(), window=window, idle=idle)
    alone = summarize(
        SimResult("p", "model", 100, [late], samples[1:], RunCounters(), end_ns=10**10),
        SloSpec(),
        window=window,
        idle=idle,
    )
    assert (s.num_requests, s.num_warmup_requests) == (1, 1)
    assert s.num_recomputed_tokens == 0 and s.preemptions.think == 0
    assert s.contention is not None and s.contention.kv_used_peak == 0.2
    assert s.contention.max_waiting == 0
    # Every figure but the engine's series (the whole run, for the plots) is the late one's.
    skip = {"num_warmup_requests", "series"}
    assert s.model_dump(exclude=skip) == alone.model_dump(exclude=skip)
    assert s.goodput_req_s == pytest.approx(1 / 8.0)  # one request per 8 s of measured arrivals


def test_a_window_must_measure_something() -> None:
    with pytest.raises(MeridianError, match="--warmup-s"):
        Window.of_run(60.0, warmup_s=60.0)
    with pytest.raises(MeridianError, match="--warmup-s"):
        Window.of_run(60.0, warmup_s=-1.0)
    assert Window.spanning([0, 3 * 10**9], warmup_s=1.0).length_s == pytest.approx(2.0)


def test_bench_sim_warmup_and_attainment_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "new" / "folder" / "trace.jsonl"  # a folder that does not exist yet
    args = [
        "bench", "sim", "--duration-s", "6", "--arrival-rate", "4", "--warmup-s", "2",
        "--policies", "meridian,vllm-fcfs+forcing", "--out-dir", str(tmp_path / "out"),
        "--export-trace", str(trace),
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "SLO: each request's SLO is 3 × its latency on an idle engine" in out
    assert "the first 2 s of arrivals are warm-up" in out
    report = load_report(tmp_path / "out" / "report.json", SimReport)
    assert report.warmup_s == 2.0
    exported = trace.read_text().splitlines()
    for summary in report.summaries.values():
        assert summary.num_requests + summary.num_warmup_requests == len(exported)
        assert summary.num_warmup_requests > 0 and summary.window_s == 4.0
        assert summary.attainment is not None
        assert summary.attainment.hidden_pct == sorted(summary.attainment.hidden_pct)
    assert (tmp_path / "out" / "attainment.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## SLO attainment" in md and "the first 2 s of arrivals are warm-up" in md
    arrivals = [json.loads(line)["arrival_s"] for line in exported]
    assert sum(a < 2.0 for a in arrivals) == summary.num_warmup_requests


def test_warmup_past_the_arrivals_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "sim", "--duration-s", "4", "--warmup-s", "4", "--out-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--warmup-s (4) must be below" in err and "Traceback" not in err
