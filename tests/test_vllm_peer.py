"""The peer suite's verdict (``tests/vllm_peer/run.py``), without vLLM: what makes it fail, and
the table of expected differences it reads from docs/vllm.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

RUN = Path(__file__).resolve().parent / "vllm_peer" / "run.py"


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_peer_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def record(outcome: str = "passed", **kw: Any) -> dict[str, Any]:
    base = {"outcome": outcome, "reason": "", "num_built": 1, "priority": False,
            "kept_stock": [], "num_reasoned": 0, "violations": []}  # fmt: skip
    return {**base, **kw}


T = "tests/v1/core/test_scheduler.py::"


def runs(peer: ModuleType, **changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Three sessions of four tests, in which everything holds, then ``changes`` by run."""
    tests = {
        "stock": {T + "a": record(), T + "b": record(), T + "c": record("failed", reason="x"),
                  T + "prio": record()},
        "meridian": {T + "a": record(), T + "b": record(), T + "c": record("failed"),
                     T + "prio": record("failed", priority=True)},
        "reasoning": {T + "a": record(num_reasoned=2), T + "b": record("failed", num_reasoned=1),
                      T + "c": record("failed"), T + "prio": record("failed", priority=True)},
    }  # fmt: skip
    for run, tests_changed in changes.items():
        for test, rec in tests_changed.items():
            tests[run][T + test] = rec
    return {name: peer.Run(name, t, 1.0) for name, t in tests.items()}


EXPECTED = {"test_scheduler.py::b": "a rule"}


def test_the_suite_holds_when_only_documented_tests_differ(peer: ModuleType) -> None:
    assert peer.compare("0.32.0", runs(peer), EXPECTED) == []


@pytest.mark.parametrize(
    ("changes", "expected", "problem"),
    [
        ({"meridian": {"a": record("failed")}}, EXPECTED, "not with Meridian"),
        ({"meridian": {"a": record(num_reasoned=1)}}, EXPECTED, "reasoned in the run without"),
        ({"reasoning": {"a": record("failed", num_reasoned=1)}}, EXPECTED, "not listed"),
        ({"reasoning": {"b": record(num_reasoned=1)}}, EXPECTED, "no longer differs"),
        ({}, {}, "not listed"),
        ({"reasoning": {"a": record(), "b": record("failed")}}, EXPECTED, "no request reasoned"),
        ({"meridian": {"a": record(violations=["teardown: x"])}}, EXPECTED, "teardown: x"),
        ({"reasoning": {"a": record(num_reasoned=1, violations=["y"])}}, EXPECTED, ": y"),
        ({"meridian": {"a": record(num_built=0), "b": record(num_built=0)}}, EXPECTED, "only 0"),
    ],
)
def test_the_suite_fails_on_each_broken_promise(
    peer: ModuleType, changes: dict[str, Any], expected: dict[str, str], problem: str
) -> None:
    problems = peer.compare("0.32.0", runs(peer, **changes), expected)
    assert any(problem in p for p in problems), problems


def test_the_table_of_differences_is_read_by_line(peer: ModuleType) -> None:
    text = "\n".join(
        [
            "| 0.32 | `test_scheduler.py::x` | outside the markers |",
            peer.DIFF_BEGIN,
            "| line | test | rule |",
            "|---|---|---|",
            "| 0.32 | `test_scheduler.py::a[1-2]` | rule a |",
            "| 0.33 | `test_scheduler.py::b` | rule b |",
            peer.DIFF_END,
        ]
    )
    assert peer.documented_differences("0.32.0", text) == {"test_scheduler.py::a[1-2]": "rule a"}
    assert peer.documented_differences("0.33.0", text) == {"test_scheduler.py::b": "rule b"}
    with pytest.raises(SystemExit):
        peer.documented_differences("0.32.0", "no table")


def test_docs_list_a_rule_for_every_difference_of_both_lines(peer: ModuleType) -> None:
    text = peer.DOCS.read_text(encoding="utf-8")
    for line in peer.LINES:
        rows = peer.documented_differences(line, text)
        assert rows and all(rule.strip() for rule in rows.values()), line
