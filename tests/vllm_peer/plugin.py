# mypy: disable-error-code="import-not-found,misc"
"""pytest plugin for the peer suite: vLLM's own scheduler tests, stock or with Meridian's classes.

Loaded with ``-p plugin`` by :mod:`run` into a pytest session over vLLM's test files (never by
Meridian's own test runs). ``$MERIDIAN_PEER_MODE`` chooses:

- ``stock``: vLLM's ``Scheduler``/``AsyncScheduler`` unchanged; the plugin only records outcomes.
- ``meridian``: before each test, every ``Scheduler``/``AsyncScheduler`` name in the test
  modules and vLLM's test utilities (``tests.v1.core.utils.create_scheduler`` and the suite's
  own builders) is replaced by Meridian's class (:class:`PeerScheduler`,
  :class:`PeerAsyncScheduler`: ``MeridianScheduler``/``MeridianAsyncScheduler`` plus the checks
  below). A test that makes an uninitialised scheduler (``object.__new__(Scheduler)``, then
  vLLM's attributes by hand) builds no scheduler to substitute: its module keeps vLLM's name.

What Meridian must hold across the whole suite is checked at every ``update_from_output`` and
at each test's teardown, and recorded (``violations``), not asserted inside vLLM's test: the
fail-open error counter (``meridian_policy_errors``) stays 0, and every request
Meridian tracks (or is about to) is a live request of the scheduler.

The report (``$MERIDIAN_PEER_REPORT``, JSON) holds per test: the outcome, how many Meridian
schedulers it built, whether one was asked for a non-FCFS policy (Meridian refuses those by
design), whether its module kept vLLM's name, how many requests reasoned, and violations.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

MODE = os.environ.get("MERIDIAN_PEER_MODE", "stock")
if MODE not in ("stock", "meridian"):
    raise SystemExit(f'MERIDIAN_PEER_MODE must be "stock" or "meridian"; got {MODE!r}')


class _Record:
    """What one test did, as the report keeps it."""

    def __init__(self) -> None:
        self.outcome = "passed"
        self.reason = ""
        self.num_built = 0
        self.priority = False
        self.kept_stock: list[str] = []
        self.reasoned: set[str] = set()
        self.violations: list[str] = []

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "reason": self.reason,
            "num_built": self.num_built,
            "priority": self.priority,
            "kept_stock": self.kept_stock,
            "num_reasoned": len(self.reasoned),
            "violations": self.violations,
        }


_records: dict[str, _Record] = {}
_current: _Record | None = None
_live: list[Any] = []


def _check(scheduler: Any, where: str) -> None:
    """Record a violation of what Meridian must hold (module docstring)."""
    record = _current
    if record is None:
        return
    from meridian.core.types import Phase

    errors = scheduler.meridian_policy_errors
    if errors:
        record.violations.append(f"{where}: meridian_policy_errors = {errors}")
    policy = scheduler.meridian_policy
    tracked = set(policy.tracker.states) | set(scheduler._new_requests)
    outliving = sorted(tracked - set(scheduler.requests))
    if outliving:
        record.violations.append(f"{where}: tracked after vLLM dropped them: {outliving}")
    for rid in policy.tracker.states:
        if policy.phase(rid) is Phase.THINK:
            record.reasoned.add(rid)


def _observed(base: type) -> type:
    """``base`` (a Meridian scheduler class) with the suite's checks around it."""

    class Observed(base):  # type: ignore[valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if _current is not None:
                _current.num_built += 1
                policy = getattr(getattr(vllm_config, "scheduler_config", None), "policy", "fcfs")
                if str(policy) != "fcfs":
                    _current.priority = True  # Meridian refuses it (ConfigError) below
            super().__init__(*args, **kwargs)
            _live.append(self)

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().update_from_output(*args, **kwargs)
            finally:
                _check(self, "update_from_output")

    Observed.__name__ = Observed.__qualname__ = f"Peer{base.__name__}"
    return Observed


def _substitutes() -> dict[str, tuple[type, type]]:
    """vLLM's class -> Meridian's, by the name test modules import them under."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from meridian.vllm.scheduler import MeridianAsyncScheduler, MeridianScheduler

    return {
        "Scheduler": (Scheduler, _observed(MeridianScheduler)),
        "AsyncScheduler": (AsyncScheduler, _observed(MeridianAsyncScheduler)),
    }


_SUBSTITUTES: dict[str, tuple[type, type]] = {}


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("cpu_test", "skip_global_cleanup", "slow_test", "optional"):
        config.addinivalue_line("markers", f"{marker}: vLLM's marker")
    if MODE == "meridian":
        _SUBSTITUTES.update(_substitutes())


@pytest.fixture(autouse=True)
def _meridian_schedulers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Substitute Meridian's classes for this test (meridian mode), then check them."""
    global _current
    record = _records.setdefault(request.node.nodeid, _Record())
    _current = record
    _live.clear()
    if _SUBSTITUTES:
        try:
            source = inspect.getsource(request.function)
        except (OSError, TypeError):
            source = ""
        test_module = request.module.__name__
        for name, module in list(sys.modules.items()):
            if not name.startswith("tests.") or module is None:
                continue
            for attr, (stock, meridian) in _SUBSTITUTES.items():
                if getattr(module, attr, None) is not stock:
                    continue
                if name == test_module and f"object.__new__({attr})" in source:
                    record.kept_stock.append(f"{name}.{attr}")
                    continue
                monkeypatch.setattr(module, attr, meridian)
    yield
    for scheduler in _live:
        _check(scheduler, "teardown")
    _live.clear()
    _current = None


@pytest.fixture()
def temporary_enable_log_propagate() -> Iterator[None]:
    """vLLM's fixture of the same name (tests/conftest.py)."""
    import logging

    logger = logging.getLogger("vllm")
    previous = logger.propagate
    logger.propagate = True
    yield
    logger.propagate = previous


@pytest.fixture()
def caplog_vllm(
    temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture
) -> Iterator[pytest.LogCaptureFixture]:
    """vLLM's fixture of the same name (tests/conftest.py)."""
    import logging

    with caplog.at_level(logging.INFO):
        yield caplog


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _records.setdefault(report.nodeid, _Record())
    if report.outcome == "failed":
        if record.outcome != "failed":
            record.outcome = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            message = getattr(crash, "message", None) or str(report.longrepr)
            record.reason = message.strip().splitlines()[0][:300] if message.strip() else ""
    elif report.outcome == "skipped" and record.outcome == "passed":
        record.outcome = "skipped"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("MERIDIAN_PEER_REPORT")
    if path:
        report = {"mode": MODE, "tests": {k: r.as_dict() for k, r in _records.items()}}
        Path(path).write_text(json.dumps(report, indent=1, sort_keys=True), encoding="utf-8")
