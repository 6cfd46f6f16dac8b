"""One engine run per process, for the vLLM benchmarks (imported as a sibling: scripts run from
here). The child prints ``RESULT <json>`` as its last result line; vLLM's log is kept quiet
unless ``VLLM_LOGGING_LEVEL`` says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

PREFIX = "RESULT "


def emit(result: dict[str, Any]) -> None:
    """The child's side: print ``result`` for :func:`run_child`."""
    print(PREFIX + json.dumps(result), flush=True)


def run_child(cmd: list[str], label: str) -> dict[str, Any]:
    """Run ``cmd`` and return the result it emitted; exit with its output if it failed."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{label} run failed (exit {proc.returncode})")
    return dict(json.loads(lines[-1][len(PREFIX) :]))
