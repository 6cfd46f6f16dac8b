"""Benchmark: MRDN v1 framing and push+pull through InProcessFabric.

- Frames encoded and decoded (with checksum verification) per second for a 16 KiB body, against
  the two costs a frame cannot avoid, measured in the same run: one BLAKE3 pass over the body
  and one copy of it (``bytearray(body)``).
- Push+pull throughput through :class:`InProcessFabric` for 16 KiB, 1 MiB and 64 MiB bodies:
  the raw fabric (a pre-encoded frame in and out; InProcessFabric moves references, so this is
  the fabric's bookkeeping only) and the full offload/ingest data path (encode, push, pull,
  decode with verification). Baseline in the same run: ``numpy.copyto`` of the same buffer into
  a pre-faulted destination, i.e. a local memcpy.

Run: ``.venv/bin/python benchmarks/bench_wire.py`` (deterministic data, about 10 s).
"""

from __future__ import annotations

import time

import numpy as np

from meridian.core.types import Tier
from meridian.disagg.fabric import InProcessFabric
from meridian.disagg.wire import checksum, decode, encode
from timing import seconds_per_call

KIB = 1024
MIB = 1024 * KIB
SIZES = ((16 * KIB, 2000), (1 * MIB, 60), (64 * MIB, 3))  # body size, calls per round


def human(num_bytes: int) -> str:
    return f"{num_bytes // MIB} MiB" if num_bytes >= MIB else f"{num_bytes // KIB} KiB"


def bench_framing() -> None:
    body = np.random.default_rng(0).integers(0, 256, 16 * KIB, dtype=np.uint8).tobytes()
    frame = encode(Tier.THINK_COMPLETE, body)
    encode_s = seconds_per_call(lambda: encode(Tier.THINK_COMPLETE, body), 20_000)
    decode_s = seconds_per_call(lambda: decode(frame, expected_tier=Tier.THINK_COMPLETE), 20_000)
    hash_s = seconds_per_call(lambda: checksum(body), 20_000)
    copy_s = seconds_per_call(lambda: bytearray(body), 20_000)  # bytes(body) would not copy
    print("MRDN v1 framing, 16 KiB body:")
    print(f"  encode            {1 / encode_s:10,.0f} frames/s  ({encode_s * 1e6:6.2f} µs/frame)")
    print(f"  decode + verify   {1 / decode_s:10,.0f} frames/s  ({decode_s * 1e6:6.2f} µs/frame)")
    print(f"  baseline BLAKE3   {1 / hash_s:10,.0f} hashes/s  ({hash_s * 1e6:6.2f} µs)")
    print(f"  baseline copy     {1 / copy_s:10,.0f} copies/s  ({copy_s * 1e6:6.2f} µs)")
    print(
        f"  encode = {encode_s / hash_s:.2f}x one BLAKE3 pass, "
        f"{encode_s / (hash_s + copy_s):.2f}x (BLAKE3 + one copy); "
        f"decode = {decode_s / hash_s:.2f}x one BLAKE3 pass"
    )


def bench_fabric() -> None:
    rng = np.random.default_rng(1)
    fabric = InProcessFabric()
    print("push+pull through InProcessFabric (throughput in body GB/s, higher is better):")
    print(
        f"  {'body':>7} {'numpy.copyto':>13} {'raw push+pull':>14} {'framed round trip':>18}"
        f" {'framed / copyto':>16}"
    )
    for size, calls in SIZES:
        src = rng.integers(0, 256, size, dtype=np.uint8)
        dst = np.ones_like(src)  # written once, so the baseline does not pay page faults
        body = src.tobytes()
        frame = encode(Tier.THINK_COMPLETE, body)

        def raw(frame: bytes = frame) -> None:
            handle = fabric.push(frame)
            fabric.pull(handle)
            fabric.discard(handle)

        def framed(body: bytes = body) -> None:
            handle = fabric.push(encode(Tier.THINK_COMPLETE, body))
            restored = decode(fabric.pull(handle), expected_tier=Tier.THINK_COMPLETE)
            fabric.discard(handle)
            assert restored.body.nbytes == len(body)

        def copy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            np.copyto(dst, src)

        copy_s = seconds_per_call(copy, calls)
        raw_s = seconds_per_call(raw, calls)
        framed_s = seconds_per_call(framed, calls)
        assert np.array_equal(dst, src)
        assert bytes(decode(fabric.pull(fabric.push(frame))).body) == body

        def gbps(seconds: float, size: int = size) -> str:
            return f"{size / seconds / 1e9:9.2f}"

        print(
            f"  {human(size):>7} {gbps(copy_s):>13} {gbps(raw_s):>14} {gbps(framed_s):>18}"
            f" {copy_s / framed_s:15.2f}x"
        )
    fabric.close()
    print(
        "  raw push+pull moves references (no copy); the framed round trip pays one copy and "
        "two BLAKE3 passes per block"
    )


def main() -> None:
    start = time.perf_counter()
    bench_framing()
    print()
    bench_fabric()
    print(f"\n(total {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
