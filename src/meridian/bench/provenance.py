"""Where a benchmark's figures came from: the commit they ran at and the vLLM they ran with.

The benchmark scripts write these into their results files (``benchmarks/bench_targets.py``,
``benchmarks/bench_cluster.py``), so a committed figure names the code that produced it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["commit", "has_changes", "vllm_version"]


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def commit(repo: Path) -> str:
    """``repo``'s HEAD, abbreviated to 7 characters (empty outside a git checkout)."""
    return _git(repo, "rev-parse", "--short=7", "HEAD")


def has_changes(repo: Path, *paths: str) -> bool:
    """Whether ``paths`` of ``repo`` differ from HEAD (uncommitted or untracked files)."""
    return bool(_git(repo, "status", "--porcelain", "--", *paths))


def vllm_version() -> str | None:
    """The installed vLLM's version (``None``: not installed)."""
    try:
        import vllm
    except ImportError:
        return None
    return str(vllm.__version__)
