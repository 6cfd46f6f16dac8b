"""Helpers of the fabric tests: a kvpool child process, and a producer harness.

The kvpool runs as a real second process (``python -m meridian.disagg.kvpool``), so every test
that uses :class:`PoolProcess` moves bytes between two processes through the real library.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from meridian.config.schema import KvMemoryConfig
from meridian.core.blocks import Residency, TieredBlockManager
from meridian.core.types import Tier
from meridian.disagg.fabric import Fabric, make_fabric
from meridian.disagg.kvpool import PoolClient
from meridian.disagg.offload import OffloadManager, OffloadState

FABRICS = ("nixl", "mooncake")
START_TIMEOUT_S = 60.0
_READY = re.compile(r"listening on (127\.0\.0\.1:\d+)")

BLOCK_SHAPE = (2, 4, 16, 8, 32)  # K/V, layers, tokens per block, KV heads, head dim (float16)
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2
GARBAGE = b"\xee" * BLOCK_BYTES
TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL


class PoolProcess:
    """A ``meridian kvpool`` child process; restartable on the same port, always killable."""

    def __init__(self, fabric: str, *, capacity: str = "256MiB", quarantine_s: float = 0.0) -> None:
        self.fabric = fabric
        self.capacity = capacity
        self.quarantine_s = quarantine_s
        self.port = 0
        self.address = ""
        self.lines: list[str] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> str:
        """Start the pool (on the previous port after a restart); returns its address."""
        assert not self.alive
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable,
            "-m",
            "meridian.disagg.kvpool",
            "--fabric",
            self.fabric,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--capacity",
            self.capacity,
            "--quarantine-s",
            str(self.quarantine_s),
            "--fault-injection",
        ]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self._proc = proc
        ready = threading.Event()
        found: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append(line.rstrip("\n"))
                match = _READY.search(line)
                if match and not ready.is_set():
                    found.append(match.group(1))
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.05):
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"kvpool did not start in time:\n{self.output()}")
        if not found:
            proc.wait(5)
            raise AssertionError(
                f"kvpool --fabric {self.fabric} exited ({proc.returncode}) before serving:\n"
                f"{self.output()}"
            )
        self.address = found[0]
        self.port = int(self.address.rsplit(":", 1)[1])
        return self.address

    def kill(self) -> None:
        """SIGKILL (no clean-up at all, as a crash), then reap."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)
        status = self._proc.wait(timeout_s)
        if self._reader is not None:
            self._reader.join(5)
        return status

    def restart(self) -> str:
        self.kill()
        return self.start()

    def control(self, timeout_s: float = 5.0) -> PoolClient:
        """A separate control connection (for stats and fault injection)."""
        return PoolClient(self.address, timeout_s=timeout_s)

    def output(self) -> str:
        return "\n".join(self.lines[-60:])


@contextmanager
def running_pools() -> Iterator[list[PoolProcess]]:
    """Collects pools started in a test; every one is killed at the end, whatever happens."""
    pools: list[PoolProcess] = []
    try:
        yield pools
    finally:
        for pool in pools:
            pool.kill()


def kv_block(seed: int) -> bytes:
    """One KV block of random float16 values (a deterministic function of ``seed``)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(BLOCK_SHAPE).astype(np.float16).tobytes()


class KvHarness:
    """A block manager, a real fabric, a fake device and an OffloadManager between them.

    Offloaded blocks lose their device slot (overwritten with garbage), so a block only holds
    its true KV again if ingest really restored it from the pool.
    """

    def __init__(self, fabric: Fabric, *, num_blocks: int = 64, threshold: int = 4) -> None:
        config = KvMemoryConfig(block_size_bytes=BLOCK_BYTES)
        self.blocks = TieredBlockManager(config, num_blocks * BLOCK_BYTES)
        self.fabric = fabric
        self.device: dict[int, bytes] = {}
        self.truth: dict[int, bytes] = {}
        self.manager = OffloadManager(
            self.blocks,
            fabric,
            read_block=lambda b: self.device[b],
            write_block=self._write,
            offload_threshold_blocks=threshold,
            retry_interval_s=0.05,
        )
        self._seed = 0

    def _write(self, block_id: int, data: memoryview) -> None:
        self.device[block_id] = bytes(data)

    def think(self, request_id: str, num_think: int) -> list[int]:
        """Prefill one prompt block, think ``num_think`` blocks, then see ``</think>``."""
        for block_id in [*self.blocks.allocate(request_id, OC, 1)]:
            self._fill(block_id)
        ids = self.blocks.allocate(request_id, TA, num_think)
        for block_id in ids:
            self._fill(block_id)
        self.blocks.demote_think_blocks(request_id)
        return ids

    def _fill(self, block_id: int) -> None:
        self._seed += 1
        self.device[block_id] = self.truth[block_id] = kv_block(self._seed)

    def offload(self, request_id: str, timeout_s: float = 30.0) -> None:
        """ExitThink: queue the request's blocks and wait for the transfers."""
        self.manager.on_exit_think(request_id)
        assert self.manager.drain(timeout_s)
        self.scramble()

    def retry_until_offloaded(self, ids: list[int], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.residency(ids) != [Residency.OFFLOADED] * len(ids):
            assert time.monotonic() < deadline, f"not offloaded: {self.residency(ids)}"
            time.sleep(0.05)
            self.manager.poll()
            self.manager.drain(timeout_s)
        self.scramble()

    def scramble(self) -> None:
        for block_id in self.truth:
            if self.blocks.block_location(block_id).residency is Residency.OFFLOADED:
                self.device[block_id] = GARBAGE

    def state(self) -> OffloadState:
        return self.manager.state

    def residency(self, ids: list[int]) -> list[Residency]:
        return [self.blocks.block_location(b).residency for b in ids]

    def handle_of(self, block_id: int) -> str:
        return self.manager._pooled[block_id].handle

    def assert_no_wrong_kv(self) -> None:
        """Every local block holds exactly its true KV; bookkeeping is consistent."""
        for block_id, want in self.truth.items():
            if self.blocks.block_location(block_id).residency is Residency.LOCAL:
                assert self.device[block_id] == want, f"block {block_id} holds wrong KV"
        self.blocks.check_integrity()
        self.manager.check_integrity()

    def close(self) -> None:
        self.manager.close(timeout_s=10)

    def __enter__(self) -> KvHarness:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stop the manager, then close its fabric."""
        self.close()
        self.fabric.close()


def fabric_for(pool: PoolProcess, *, timeout_s: float = 10.0) -> Fabric:
    return make_fabric(pool.fabric, address=pool.address, timeout_s=timeout_s)
