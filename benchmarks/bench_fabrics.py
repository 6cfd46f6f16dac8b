"""Benchmark: push+pull throughput through the real fabrics (NIXL, Mooncake) to a kvpool process.

For 16 KiB, 1 MiB and 64 MiB bodies, each framed once as MRDN v1: the time of ``push`` (the
frame goes to a ``meridian kvpool`` child process and is acknowledged) and of ``pull`` (it comes
back into this process as ``bytes``), per fabric. Baseline in the same run: ``numpy.copyto`` of
the same buffer into a pre-faulted destination (a local memcpy), the floor any transfer pays.

Throughput is body bytes / (push + pull seconds); ``vs copyto`` is that over the copyto
throughput (1.00x would be a fabric as fast as one local copy; each direction here also
crosses the process boundary and copies into or out of a registered staging buffer).

Run: ``.venv/bin/python benchmarks/bench_fabrics.py`` (about 15 s; starts and stops its pools).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from meridian.core.types import Tier
from meridian.disagg.fabric import Fabric, make_fabric
from meridian.disagg.wire import encode
from timing import seconds_per_call

KIB = 1024
MIB = 1024 * KIB
SIZES = ((16 * KIB, 200), (1 * MIB, 40), (64 * MIB, 3))  # body size, round trips per round
ROUNDS = 3
FABRICS = ("nixl", "mooncake")
POOL_ARGS = ("--listen", "127.0.0.1:0", "--capacity", "256MiB")


@contextmanager
def kvpool(fabric: str) -> Iterator[str]:
    """A ``meridian kvpool`` child process for the benchmark; yields its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "meridian.disagg.kvpool", "--fabric", fabric, *POOL_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
            if match:
                address = match.group(1)
                break
        if not address:
            raise SystemExit(f"kvpool --fabric {fabric} did not start (exit {proc.wait()})")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        yield address
    finally:
        proc.kill()
        proc.wait()


def push_pull_seconds(fabric: Fabric, frame: bytes, calls: int) -> tuple[float, float]:
    """Median (push, pull) seconds per call; frames are discarded outside the timing."""
    pushes: list[float] = []
    pulls: list[float] = []
    for index in range(calls * ROUNDS + 1):
        start = time.perf_counter()
        handle = fabric.push(frame)
        pushed = time.perf_counter()
        back = fabric.pull(handle)
        pulled = time.perf_counter()
        fabric.discard(handle)
        if index == 0:
            assert back == frame, "the fabric returned other bytes"
            continue  # warm-up: connection set-up, staging buffers
        pushes.append(pushed - start)
        pulls.append(pulled - pushed)
    return statistics.median(pushes), statistics.median(pulls)


def human(num_bytes: int) -> str:
    return f"{num_bytes // MIB} MiB" if num_bytes >= MIB else f"{num_bytes // KIB} KiB"


def main() -> None:
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    bodies = {size: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size, _ in SIZES}
    copy_s: dict[int, float] = {}
    for size, calls in SIZES:
        src = np.frombuffer(bodies[size], np.uint8)
        dst = np.ones_like(src)  # pre-faulted, so the baseline pays no page faults

        def copy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            np.copyto(dst, src)

        copy_s[size] = seconds_per_call(copy, calls, ROUNDS)

    print(
        "push+pull of one MRDN frame to a kvpool process and back (GB/s of body, higher is better)"
    )
    print(
        f"  {'fabric':<9} {'body':>7} {'push ms':>9} {'pull ms':>9} {'push GB/s':>10}"
        f" {'pull GB/s':>10} {'push+pull':>10} {'copyto':>8} {'vs copyto':>10}"
    )
    for name in FABRICS:
        with kvpool(name) as address:
            fabric = make_fabric(name, address=address, timeout_s=30.0)
            try:
                for size, calls in SIZES:
                    frame = encode(Tier.THINK_COMPLETE, bodies[size])
                    push_s, pull_s = push_pull_seconds(fabric, frame, calls)
                    both = size / (push_s + pull_s) / 1e9
                    copy_gbps = size / copy_s[size] / 1e9
                    print(
                        f"  {name:<9} {human(size):>7} {push_s * 1e3:9.3f} {pull_s * 1e3:9.3f}"
                        f" {size / push_s / 1e9:10.2f} {size / pull_s / 1e9:10.2f} {both:10.2f}"
                        f" {copy_gbps:8.2f} {both / copy_gbps:9.3f}x"
                    )
            finally:
                fabric.close()
    print(
        "  push = alloc + stage (1 copy) + one-sided WRITE + commit; pull = open + READ + "
        "copy out + close; control messages are loopback TCP round trips"
    )
    print(f"\n(total {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
