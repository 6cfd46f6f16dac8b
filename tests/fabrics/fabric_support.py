"""Helpers of the fabric tests: a target process with a registered region, and KV blocks.

The target runs as a real second process (``endpoint_child.py``), so every test that uses
:class:`TargetProcess` moves bytes between two processes through the real library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from meridian.core.types import Tier

FABRICS = ("nixl", "mooncake")
START_TIMEOUT_S = 60.0
REGION_BYTES = 32 << 20
CHILD = Path(__file__).with_name("endpoint_child.py")

BLOCK_SHAPE = (2, 4, 16, 8, 32)  # K/V, layers, tokens per block, KV heads, head dim (float16)
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 2
TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL


class TargetProcess:
    """A child process holding a region registered with ``fabric``; always killable."""

    def __init__(self, fabric: str, *, region_bytes: int = REGION_BYTES) -> None:
        self.fabric = fabric
        self.region_bytes = region_bytes
        self.description: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> dict[str, Any]:
        """Start the target; returns its description (what a producer plane attaches to)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), self.fabric, str(self.region_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._proc = proc
        assert proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        lines: list[str] = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                self.description = json.loads(line)
                return self.description
            lines.append(line)  # the libraries' own start-up logging
        self.kill()
        raise AssertionError(f"{self.fabric} target did not start:\n{''.join(lines[-40:])}")

    def region_hex(self, offset: int, num_bytes: int) -> bytes:
        """The target's own view of ``num_bytes`` of its region at ``offset``."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"hex {offset} {num_bytes}\n")
        proc.stdin.flush()
        while True:  # the libraries log to the same pipe: skip their lines
            raw = proc.stdout.readline()
            assert raw, "the target exited"
            line = raw.strip()
            if len(line) == 2 * num_bytes and all(c in "0123456789abcdef" for c in line):
                return bytes.fromhex(line)

    def signal(self, signum: signal.Signals) -> None:
        assert self._proc is not None
        self._proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL (no clean-up at all, as a crash), then reap."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a stopped process cannot be reaped
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)


StartTarget = Callable[[str], TargetProcess]


@contextmanager
def running_targets() -> Iterator[list[TargetProcess]]:
    """Collects targets started in a test; every one is killed at the end, whatever happens."""
    targets: list[TargetProcess] = []
    try:
        yield targets
    finally:
        for target in targets:
            target.kill()


def kv_block(seed: int) -> bytes:
    """One KV block of random float16 values (a deterministic function of ``seed``)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(BLOCK_SHAPE).astype(np.float16).tobytes()


def deadline(seconds: float = 10.0) -> float:
    """A transfer deadline ``seconds`` from now (``time.monotonic()``)."""
    return time.monotonic() + seconds
