"""Benchmark provenance: the commit and whether the code differed from it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meridian.bench import provenance


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_commit_and_changes_of_a_checkout(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "other.txt").write_text("y\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert len(provenance.commit(tmp_path)) == 7 and head.startswith(provenance.commit(tmp_path))
    assert not provenance.has_changes(tmp_path, "src")
    (tmp_path / "other.txt").write_text("changed\n")
    assert not provenance.has_changes(tmp_path, "src")  # outside the paths asked about
    (tmp_path / "src" / "a.py").write_text("x = 2\n")
    assert provenance.has_changes(tmp_path, "src")


def test_outside_a_checkout_there_is_no_commit(tmp_path: Path) -> None:
    assert provenance.commit(tmp_path) == ""
