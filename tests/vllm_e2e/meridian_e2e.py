"""Helpers of the end-to-end tests: reach into a single-process engine."""

from __future__ import annotations

from typing import Any


def scheduler_of(llm: Any) -> Any:
    """The engine's scheduler (single-process mode only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def meridian_processor_of(llm: Any) -> Any:
    """Meridian's V1 logits processor inside the engine's model runner (single process)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    procs = runner.model_runner.input_batch.logitsprocs.all
    return next(p for p in procs if type(p).__name__ == "MeridianLogitsProcessor")


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
