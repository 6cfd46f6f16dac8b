"""Run the ``meridian`` command as a user does, in a process of its own, and measure it: exit
code, stdout, stderr, wall and CPU seconds, and peak memory (the child's own ``ru_maxrss``).

Bad input must end in one ``error:`` line and a non-zero exit within 5 s, with memory bounded
(issue 41: ``--workload /dev/zero`` grew to 6.9 GB in 9 s and never ended). The 5 s are checked on
the CPU time the command used: this machine's two cores are shared, so its wall time also counts
other people's work; a command that hangs without using CPU (blocked on a FIFO) is caught by the
wall-clock limit, after which it is killed and the test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The command as installed in this environment (the console script beside the interpreter).
MERIDIAN = str(Path(sys.executable).with_name("meridian"))
# Bad input ends within this much CPU time...
CPU_LIMIT_S = 5.0
# ... and is killed (the test fails) after this much wall time.
WALL_LIMIT_S = 30.0
# Importing Meridian (numpy, pydantic, matplotlib) takes about 150 MB; a runaway read, gigabytes.
MEMORY_LIMIT_MB = 400.0


@dataclass(frozen=True)
class Ran:
    """What one run of the command did."""

    code: int
    out: str
    err: str
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    killed: bool

    def assert_refused(self, *phrases: str) -> None:
        """Exit 2 with one ``error:`` line holding every phrase, no traceback, within the CPU,
        wall and memory limits."""
        assert not self.killed, f"still running after {WALL_LIMIT_S} s: {self.err[-500:]}"
        lines = self.err.strip().splitlines()
        assert self.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), self.err
        assert "Traceback" not in self.err + self.out
        for phrase in phrases:
            assert phrase in lines[0], (phrase, lines[0])
        self.assert_bounded()

    def assert_bounded(self) -> None:
        assert self.cpu_s < CPU_LIMIT_S, f"{self.cpu_s:.1f} s of CPU"
        assert self.max_rss_mb < MEMORY_LIMIT_MB, f"{self.max_rss_mb:.0f} MB"


def run_meridian(
    args: Sequence[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    command: Sequence[str] = (MERIDIAN,),
    wall_limit_s: float = WALL_LIMIT_S,
    close_stdout: bool = False,
) -> Ran:
    """Run ``meridian ARGS`` (``command`` replaces ``meridian``) with stdin closed.
    ``close_stdout``: stdout is a pipe whose reading end is closed at once, as ``| head -1``
    leaves it."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [*command, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if close_stdout else out,
            stderr=err,
            cwd=cwd,
            env=env,
        )
        if close_stdout:
            assert proc.stdout is not None
            proc.stdout.close()  # before the child has imported anything, let alone printed
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(wall_limit_s, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: for its rusage)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        return Ran(
            code=proc.returncode,
            out=out.read().decode("utf-8", "replace"),
            err=err.read().decode("utf-8", "replace"),
            wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime,
            max_rss_mb=usage.ru_maxrss / 1024,
            killed=killed.is_set(),
        )
