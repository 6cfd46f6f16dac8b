"""Simulator speed, and scheduling near saturation with forcing held equal, printed.

Run: .venv/bin/python benchmarks/bench_sim.py            (the fast engine only)
     .venv-vllm/bin/python benchmarks/bench_sim.py       (also vLLM's scheduler)

1. Speed: the nine-policy A/B on the fast engine (every policy, 30 s of traffic at 8 req/s) in wall
   seconds, and 10 minutes of traffic at 8 req/s for `meridian` and `vllm-fcfs` with simulated
   request-steps per second. With vLLM installed, the same 10-minute `meridian` run on vLLM's
   own scheduler, and the fast engine's speed-up measured in the same run.
2. Near saturation (synthetic, 24 req/s, 30 s, seed 0; on vLLM's scheduler when installed, else
   the fast engine, which says so): what scheduling buys with forcing held equal (`meridian`
   against `vllm-fcfs+forcing`, and `meridian-sched` against `vllm-fcfs`), each figure with
   both values and the ratio, and what forcing buys with scheduling held equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time

from meridian.bench.simrun import SimRunSpec, StreamSet, load_requests, run_policy, simulate
from meridian.bench.summary import PolicySummary
from meridian.sim.policies import parse_policy


def _has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm.v1.core.sched.scheduler") is not None
    except ImportError:
        return False


def _speed() -> None:
    spec = SimRunSpec()
    started = time.perf_counter()
    report, results = simulate(spec, 8.0)
    wall = time.perf_counter() - started
    rows = sum(r.counters.num_scheduled_rows for r in results.values())
    print(
        f"A/B, fast engine: {len(results)} policies x "
        f"{report.summaries['meridian'].num_requests} requests (30 s at 8 req/s) in {wall:.1f} s "
        f"wall; {rows / wall:,.0f} simulated request-steps/s"
    )
    long = SimRunSpec(duration_s=600.0)
    requests = load_requests(long, 8.0)
    streams = StreamSet(requests, long.config)
    walls: dict[str, float] = {}
    engines = [("model", "meridian"), ("model", "vllm-fcfs")]
    if _has_vllm():
        engines.append(("vllm", "meridian"))
    for engine, name in engines:
        run = dataclasses.replace(long, engine=engine, async_scheduling=False)
        started = time.perf_counter()
        result = run_policy(run, parse_policy(name), streams)
        wall = walls[f"{engine}/{name}"] = time.perf_counter() - started
        rate = result.counters.num_scheduled_rows / wall
        print(
            f"10 min at 8 req/s, {name} on the {engine} engine: {len(requests)} requests, "
            f"{result.counters.num_steps} steps in {wall:.1f} s wall; {rate:,.0f} request-steps/s"
        )
    if "vllm/meridian" in walls:
        ratio = walls["vllm/meridian"] / walls["model/meridian"]
        print(f"fast engine speed-up over vLLM's scheduler (same run, same policy): {ratio:.1f}x")


def _row(label: str, a: float | None, b: float | None, unit: str, scale: float = 1.0) -> str:
    if a is None or b is None:
        return f"  {label}: {a} vs {b} {unit}"
    ratio = f"{a / b:.3f}x" if b else ("equal" if a == b else "from 0")
    return f"  {label}: {a * scale:,.4g} vs {b * scale:,.4g} {unit} ({ratio})"


def _compare(title: str, m: PolicySummary, f: PolicySummary) -> None:
    print(title)
    print(_row("output ITL P99", m.output_itl_s.p99, f.output_itl_s.p99, "ms", 1000))
    print(_row("TTFVT P95", m.ttfvt_s.p95, f.ttfvt_s.p95, "s"))
    print(_row("TTFT P95", m.ttft_s.p95, f.ttft_s.p95, "s"))
    print(_row("throughput", m.throughput_tok_s, f.throughput_tok_s, "tokens/s"))
    print(_row("goodput", m.goodput_req_s, f.goodput_req_s, "requests/s"))
    print(_row("recomputed tokens", m.num_recomputed_tokens, f.num_recomputed_tokens, "tokens"))
    print(
        f"  preemptions answer/think: {m.preemptions.output}/{m.preemptions.think} vs "
        f"{f.preemptions.output}/{f.preemptions.think}; worst answer gap "
        f"{m.worst_answer_gap_steps} vs {f.worst_answer_gap_steps} steps"
    )


def _results(rate: float) -> None:
    engine = "vllm" if _has_vllm() else "model"
    policies = ("meridian", "vllm-fcfs+forcing", "meridian-sched", "vllm-fcfs")
    report, _ = simulate(SimRunSpec(engine=engine, policies=policies), rate)
    s = report.summaries
    print(f"near saturation: synthetic, {rate:g} req/s, 30 s, seed 0, engine {engine}")
    forced = [s[p].think_tokens.mean for p in ("meridian", "vllm-fcfs+forcing")]
    print(f"  forcing held equal: think tokens avg {forced[0]} and {forced[1]}")
    _compare("scheduling, forcing on both sides (meridian vs vllm-fcfs+forcing):",
             s["meridian"], s["vllm-fcfs+forcing"])  # fmt: skip
    _compare("scheduling, no forcing (meridian-sched vs vllm-fcfs):",
             s["meridian-sched"], s["vllm-fcfs"])  # fmt: skip
    _compare("forcing, stock scheduling (vllm-fcfs+forcing vs vllm-fcfs):",
             s["vllm-fcfs+forcing"], s["vllm-fcfs"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=24.0, help="near-saturation rate (24)")
    parser.add_argument("--skip-speed", action="store_true", help="only the comparison")
    args = parser.parse_args()
    if not args.skip_speed:
        _speed()
    _results(args.rate)


if __name__ == "__main__":
    main()
