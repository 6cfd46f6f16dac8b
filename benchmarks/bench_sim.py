"""Simulator speed and the honest-results targets of `meridian bench sim`, printed.

Run: .venv/bin/python benchmarks/bench_sim.py [--full]

1. Speed: the default A/B (all policies, 30 s of traffic at 8 req/s) in wall seconds (target
   < 15 s), and 10 minutes of traffic at 8 req/s per policy (target < 60 s each; meridian and
   vllm-fcfs, or every policy with --full), with simulated request-steps per second.
2. Results near saturation (synthetic workload, 24 req/s, seed 0): Meridian against vllm-fcfs on
   the issue's targets, each printed with PASS or MISS and the figures behind it.
"""

from __future__ import annotations

import argparse
import time

from meridian.bench.metrics import PolicySummary
from meridian.bench.simrun import SimRunSpec, load_requests, run_policy, simulate


def _speed(full: bool) -> None:
    spec = SimRunSpec()
    started = time.perf_counter()
    report, results = simulate(spec, 8.0)
    wall = time.perf_counter() - started
    rows = sum(r.counters.num_scheduled_rows for r in results.values())
    print(
        f"default A/B: {len(results)} policies x {report.summaries['meridian'].num_requests} "
        f"requests (30 s at 8 req/s) in {wall:.2f} s wall (target < 15 s): "
        f"{'PASS' if wall < 15 else 'MISS'}; {rows / wall:,.0f} simulated request-steps/s"
    )
    long = SimRunSpec(duration_s=600.0)
    requests = load_requests(long, 8.0)
    policies = long.policies if full else ("meridian", "vllm-fcfs")
    for name in policies:
        started = time.perf_counter()
        result = run_policy(long, name, requests)
        wall = time.perf_counter() - started
        rate = result.counters.num_scheduled_rows / wall
        print(
            f"10 min at 8 req/s, {name}: {len(requests)} requests, {result.counters.num_steps} "
            f"steps in {wall:.1f} s wall (target < 60 s): {'PASS' if wall < 60 else 'MISS'}; "
            f"{rate:,.0f} request-steps/s"
        )


def _check(label: str, ok: bool, detail: str) -> None:
    print(f"  {'PASS' if ok else 'MISS'}  {label}: {detail}")


def _results(rate: float) -> None:
    report, _ = simulate(SimRunSpec(policies=("meridian", "vllm-fcfs")), rate)
    m: PolicySummary = report.summaries["meridian"]
    f: PolicySummary = report.summaries["vllm-fcfs"]
    print(f"near saturation: synthetic, {rate:g} req/s, 30 s, seed 0 (meridian vs vllm-fcfs)")
    mi, fi = m.output_itl_s.p99, f.output_itl_s.p99
    assert mi is not None and fi is not None
    _check("output ITL P99 below vllm-fcfs", mi < fi, f"{mi * 1e3:.2f} ms vs {fi * 1e3:.2f} ms")
    _check(
        "no OutputCritical evictions where vllm-fcfs preempts answers",
        m.num_output_critical_evictions == 0 and f.preemptions.output > 0,
        f"meridian {m.num_output_critical_evictions} evictions / {m.preemptions.output} answer "
        f"preemptions; vllm-fcfs {f.num_output_critical_evictions} / {f.preemptions.output}",
    )
    mt, ft = m.ttfvt_s.p95, f.ttfvt_s.p95
    assert mt is not None and ft is not None
    _check(
        "TTFVT P95 within 5 % of vllm-fcfs or better",
        mt <= ft * 1.05,
        f"{mt:.1f} s vs {ft:.1f} s ({(mt / ft - 1) * 100:+.1f} %)",
    )
    mx, fx = m.throughput_tok_s, f.throughput_tok_s
    assert mx is not None and fx is not None
    _check(
        "throughput within 3 % of vllm-fcfs",
        mx >= fx * 0.97,
        f"{mx:,.0f} vs {fx:,.0f} tokens/s ({(mx / fx - 1) * 100:+.1f} %)",
    )
    mk, fk = m.think_tokens.mean, f.think_tokens.mean
    assert mk is not None and fk is not None
    premature = m.premature_force_pct
    _check(
        "fewer think tokens than no forcing, low premature-force rate (model)",
        mk < fk and premature is not None and premature < 10,
        f"{mk:,.0f} vs {fk:,.0f} think tokens avg; premature {premature} % of forced stops",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="time every policy at 10 minutes")
    parser.add_argument("--rate", type=float, default=24.0, help="near-saturation rate (24)")
    args = parser.parse_args()
    _speed(args.full)
    _results(args.rate)


if __name__ == "__main__":
    main()
