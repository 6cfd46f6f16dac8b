"""Meridian inside vLLM: a scheduler subclass, logits processors, a tiny test model.

Importing this package does not import vllm or torch; the modules that need them
(:mod:`meridian.vllm.scheduler`, :mod:`meridian.vllm.logits`, :mod:`meridian.vllm.tiny_model`)
are imported by vLLM itself from the dotted paths below, in whichever process needs them.

Use with vLLM (offline ``LLM(...)`` keywords, or the same flags on the OpenAI server)::

    LLM(model=...,
        scheduler_cls=SCHEDULER_CLS,                  # --scheduler-cls
        logits_processors=[LOGITS_PROCESSOR],         # --logits-processors
        reasoning_parser="deepseek_r1")               # --reasoning-parser, for the API

Environment (inherited by vLLM's engine and worker processes): ``MERIDIAN_CONFIG`` (path of
meridian.toml), ``MERIDIAN_MODEL`` (model family; auto-detected when unset),
``MERIDIAN_OUTPUT_BUDGET_ROWS`` (overrides ``[scheduler] output_budget_rows``: ``auto``, 0 for
no deferral, or a number of rows).
"""

from __future__ import annotations

__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "LOGITS_PROCESSOR",
    "LOGITS_PROCESSOR_V2",
    "SCHEDULER_CLS",
    "SHADOW_ASYNC_SCHEDULER_CLS",
    "SHADOW_SCHEDULER_CLS",
]

#: ``--scheduler-cls`` for vLLM's synchronous scheduling (the CPU default).
SCHEDULER_CLS = "meridian.vllm.scheduler.MeridianScheduler"
#: ``--scheduler-cls`` for asynchronous scheduling (the GPU default).
ASYNC_SCHEDULER_CLS = "meridian.vllm.scheduler.MeridianAsyncScheduler"
#: Stock order with Meridian's counters: the baseline of A/B runs.
SHADOW_SCHEDULER_CLS = "meridian.vllm.scheduler.MeridianShadowScheduler"
#: The same baseline for asynchronous scheduling.
SHADOW_ASYNC_SCHEDULER_CLS = "meridian.vllm.scheduler.MeridianShadowAsyncScheduler"
#: ``--logits-processors`` for the V1 model runner (the CPU build's; vLLM 0.33's GPU build uses
#: it only where V2 cannot run: :mod:`meridian.vllm.resolve` asks vLLM which runner it picks).
LOGITS_PROCESSOR = "meridian.vllm.logits:MeridianLogitsProcessor"
#: ``--logits-processors`` for the V2 model runner (vLLM 0.33's GPU default).
LOGITS_PROCESSOR_V2 = "meridian.vllm.logits:MeridianLogitsProcessorV2"
