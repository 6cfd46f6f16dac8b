# mypy: disable-error-code="import-not-found"
"""Run by ``test_engine_resolution.py`` in a fresh interpreter: vLLM's own resolution of engine
arguments, and vLLM's own loaders given the processor Meridian picks from it.

Reads a JSON list of cases on stdin, prints a JSON list of results. A case is ``{"args": [...],
"env": "1" | "0" | null, "triton": bool, "platform": "gpu-like" | "native"}`` (``env``:
``$VLLM_USE_V2_MODEL_RUNNER``; ``triton``: what vLLM's config code believes of Triton).

"gpu-like" is vLLM's CPU platform without its CPU-only config overrides (the CPU platform turns
asynchronous scheduling and dual-batch overlap off and picks CPU backends; a GPU platform does
not). It must be installed before vLLM's config module binds ``current_platform``, hence a
fresh interpreter. The rules under test (``VllmConfig.use_v2_model_runner``, the asynchronous
scheduling default, the loaders) are vLLM's code and run unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _gpu_like() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class GpuLikePlatform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            return None

    platforms._current_platform = GpuLikePlatform()


def _load(runner: str, fqcn: str) -> tuple[str | None, str | None]:
    """(class name, None) if ``runner``'s loader accepts ``fqcn``, else (None, vLLM's error)."""
    if runner == "V2":
        from vllm.v1.worker.gpu.sample.logits_processor import loader

        load = loader._load_v2_logitsprocs_by_fqcns
    else:
        from vllm.v1.sample import logits_processor

        load = logits_processor._load_logitsprocs_by_fqcns
    try:
        (cls,) = load([fqcn])
    except (ValueError, RuntimeError) as exc:
        return None, str(exc)
    return cls.__name__, None


def _v1_refuses_processors_under_speculation(model: str, args: list[str]) -> str | None:
    """vLLM's V1 ``build_logitsprocs`` given Meridian's V1 processor with this (speculative)
    config: its error (``None`` if it accepted it)."""
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.sample.logits_processor import build_logitsprocs

    from meridian.vllm import LOGITS_PROCESSOR
    from meridian.vllm.resolve import _vllm_parser

    parsed = _vllm_parser().parse_args(["--model", model, *args])
    config = AsyncEngineArgs.from_cli_args(parsed).create_engine_config()
    try:
        build_logitsprocs(config, torch.device("cpu"), False, False, [LOGITS_PROCESSOR])
    except ValueError as exc:
        return str(exc)
    return None


def main() -> None:
    cases = json.load(sys.stdin)
    if any(case["platform"] == "gpu-like" for case in cases):
        assert all(case["platform"] == "gpu-like" for case in cases), "one platform per run"
        _gpu_like()
    import vllm.config.vllm as vllm_config_module
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from meridian.errors import MeridianError
    from meridian.vllm.resolve import resolve_engine, stand_in_model

    model = str(stand_in_model(Path(tempfile.mkdtemp())))
    results = []
    for case in cases:
        if case["env"] is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = case["env"]
        vllm_config_module.HAS_TRITON = case["triton"]  # type: ignore[attr-defined]
        args = ["--skip-tokenizer-init", *case["args"]]
        try:
            engine = resolve_engine(model, args)
        except MeridianError as exc:  # vLLM refused the arguments: its reason, in one line
            results.append({"error": str(exc)})
            continue
        processor = engine.logits_processor
        other = "V1" if engine.runner.value == "V2" else "V2"
        result: dict[str, Any] = {
            "runner": engine.runner.value,
            "async": engine.async_scheduling,
            "processor": processor,
            "scheduler_cls": engine.scheduler_cls(),
            "scheduler_is_async": issubclass(
                resolve_obj_by_qualname(engine.scheduler_cls()), AsyncScheduler
            ),
            "notes": list(engine.notes),
        }
        if processor is not None:
            result["loaded"], result["refused"] = _load(engine.runner.value, processor)
            result["other_loader_refuses"] = _load(other, processor)[1] is not None
        elif engine.speculative_method is not None:
            result["v1_refusal"] = _v1_refuses_processors_under_speculation(model, args)
        results.append(result)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
