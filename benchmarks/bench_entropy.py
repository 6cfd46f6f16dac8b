"""Entropy kernel and probe cost.

Prints, for a ``[64, 151936]`` float32 logits batch (Qwen vocab): the median time of
``entropy_nats`` and its effective bandwidth (input bytes / time), against ``numpy.sum`` over the
same array measured in the same run (the floor: one read of the input) and against an unchunked
textbook numpy entropy. Then the per-token cost of ``EntropyProbe.observe`` against an empty
method call. Run: ``.venv/bin/python benchmarks/bench_entropy.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from meridian.config.schema import EntropyConfig
from meridian.core.entropy import entropy_nats
from meridian.core.signals import EntropyProbe

ROWS, VOCAB = 64, 151936
REPEATS = 15
NUM_OBSERVE = 500_000


def median_ms(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm-up: page faults, buffer allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def textbook_entropy(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The obvious numpy version: full-size temporaries, probabilities formed explicitly."""
    z = x - x.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    result: npt.NDArray[Any] = -(np.exp(logp) * logp).sum(axis=1)
    return result


class _Empty:
    __slots__ = ()

    def observe(self, entropy: float) -> None:
        pass


def per_call_ns(observe: Callable[[float], None], values: list[float]) -> float:
    start = time.perf_counter()
    for h in values:
        observe(h)
    return (time.perf_counter() - start) / len(values) * 1e9


def main() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((ROWS, VOCAB), dtype=np.float32) * 3.0).astype(np.float32)
    nbytes = x.nbytes
    masked = x.copy()
    masked[:, rng.random(VOCAB) < 0.3] = -np.inf
    half = x.astype(np.float16)

    t_sum = median_ms(lambda: np.sum(x))
    t_ent = median_ms(lambda: entropy_nats(x))
    t_text = median_ms(lambda: textbook_entropy(x), repeats=5)
    t_masked = median_ms(lambda: entropy_nats(masked))
    t_half = median_ms(lambda: entropy_nats(half), repeats=7)
    err = float(np.max(np.abs(entropy_nats(x) - textbook_entropy(x.astype(np.float64)))))

    def gbps(ms: float, size: int = nbytes) -> float:
        return size / (ms * 1e-3) / 1e9

    print(f"logits [{ROWS}, {VOCAB}] float32 = {nbytes / 1e6:.1f} MB, median of {REPEATS} runs")
    print(f"  numpy.sum (baseline)      {t_sum:8.2f} ms  {gbps(t_sum):6.2f} GB/s")
    print(
        f"  entropy_nats              {t_ent:8.2f} ms  {gbps(t_ent):6.2f} GB/s  "
        f"= {t_ent / t_sum:.2f}x numpy.sum"
    )
    print(
        f"  textbook numpy entropy    {t_text:8.2f} ms  {gbps(t_text):6.2f} GB/s  "
        f"(entropy_nats is {t_text / t_ent:.2f}x faster)"
    )
    print(
        f"  entropy_nats, 30% masked  {t_masked:8.2f} ms  {gbps(t_masked):6.2f} GB/s  "
        f"= {t_masked / t_sum:.2f}x numpy.sum"
    )
    print(
        f"  entropy_nats, float16     {t_half:8.2f} ms  {gbps(t_half, half.nbytes):6.2f} GB/s  "
        f"= {t_half / t_sum:.2f}x numpy.sum (float32)"
    )
    print(f"  max |entropy_nats - float64 textbook| = {err:.2e} nats")

    values = (rng.random(NUM_OBSERVE) * 4.0).tolist()
    probe = EntropyProbe(EntropyConfig())
    empty = _Empty()
    per_call_ns(probe.observe, values[:10_000])  # warm-up
    t_empty = per_call_ns(empty.observe, values)
    t_probe = per_call_ns(probe.observe, values)
    print(f"EntropyProbe.observe over {NUM_OBSERVE} tokens")
    print(f"  empty method call (baseline) {t_empty:7.1f} ns/token")
    print(
        f"  EntropyProbe.observe         {t_probe:7.1f} ns/token  = {t_probe / t_empty:.1f}x "
        f"(rpdi={probe.rpdi:.2f}, eat_samples={probe.num_eat_samples})"
    )


if __name__ == "__main__":
    main()
