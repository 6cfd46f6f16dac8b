"""Benchmark: write+read throughput through the real transports (NIXL, Mooncake) to another process.

For 16 KiB, 1 MiB and 64 MiB bodies, each framed once as MRDN v1: the time of ``write`` (the
frame goes into a region another process registered, one-sided) and of ``read`` (it comes back
into this process as ``bytes``), per transport. The target is ``tests/fabrics/endpoint_child.py``
(the fabric tests' target process). Baseline in the same run: ``numpy.copyto`` of the same
buffer into a pre-faulted destination (a local memcpy), the floor any transfer pays.

Throughput is body bytes / (write + read seconds); ``vs copyto`` is that over the copyto
throughput (1.00x would be a transport as fast as one local copy; each direction here also
crosses the process boundary and copies into or out of a registered staging buffer).

Run: ``.venv/bin/python benchmarks/bench_fabrics.py`` (about 30 s; starts and stops its targets).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from meridian.core.types import Tier
from meridian.disagg.transport import ProducerPlane, make_producer_plane
from meridian.disagg.wire import encode
from timing import seconds_per_call

KIB = 1024
MIB = 1024 * KIB
SIZES = ((16 * KIB, 200), (1 * MIB, 40), (64 * MIB, 3))  # body size, round trips per round
ROUNDS = 3
FABRICS = ("nixl", "mooncake")
REGION_BYTES = 80 * MIB
TIMEOUT_S = 30.0
TARGET = Path(__file__).resolve().parents[1] / "tests" / "fabrics" / "endpoint_child.py"


@contextmanager
def target(fabric: str) -> Iterator[dict[str, Any]]:
    """A target child process with a registered region; yields its description."""
    proc = subprocess.Popen(
        [sys.executable, str(TARGET), fabric, str(REGION_BYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        description = next((json.loads(line) for line in proc.stdout if line[:1] == "{"), None)
        if description is None:
            raise SystemExit(f"{fabric} target did not start (exit {proc.wait()})")
        yield description
    finally:
        proc.kill()
        proc.wait()


def write_read_seconds(plane: ProducerPlane, frame: bytes, calls: int) -> tuple[float, float]:
    """Median (write, read) seconds per call."""
    writes: list[float] = []
    reads: list[float] = []
    for index in range(calls * ROUNDS + 1):
        start = time.perf_counter()
        plane.write(frame, 0, time.monotonic() + TIMEOUT_S)
        written = time.perf_counter()
        back = plane.read(0, len(frame), time.monotonic() + TIMEOUT_S)
        read = time.perf_counter()
        if index == 0:
            assert back == frame, "the transport returned other bytes"
            continue  # warm-up: connection set-up, staging buffers
        writes.append(written - start)
        reads.append(read - written)
    return statistics.median(writes), statistics.median(reads)


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
        "write+read of one MRDN frame to another process and back (GB/s of body, higher is better)"
    )
    print(
        f"  {'fabric':<9} {'body':>7} {'write ms':>9} {'read ms':>9} {'write GB/s':>10}"
        f" {'read GB/s':>10} {'both':>10} {'copyto':>8} {'vs copyto':>10}"
    )
    for name in FABRICS:
        with target(name) as description:
            plane = make_producer_plane(name)
            try:
                plane.attach(description, time.monotonic() + TIMEOUT_S)
                for size, calls in SIZES:
                    frame = encode(Tier.THINK_COMPLETE, bodies[size])
                    write_s, read_s = write_read_seconds(plane, frame, calls)
                    both = size / (write_s + read_s) / 1e9
                    copy_gbps = size / copy_s[size] / 1e9
                    print(
                        f"  {name:<9} {human(size):>7} {write_s * 1e3:9.3f} {read_s * 1e3:9.3f}"
                        f" {size / write_s / 1e9:10.2f} {size / read_s / 1e9:10.2f} {both:10.2f}"
                        f" {copy_gbps:8.2f} {both / copy_gbps:9.3f}x"
                    )
            finally:
                plane.close()
    print("  write = stage (1 copy) + one-sided WRITE; read = one-sided READ + copy out")
    print(f"\n(total {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
