"""Fail open: Meridian's code inside a vLLM process never takes the engine down.

Both pieces inside vLLM, the scheduler (engine-core process) and the logits processor (worker
processes), run Meridian's code on vLLM's per-step path. An exception there must not stop the
engine: it is counted (:attr:`FailOpen.num_errors` and ``meridian_policy_errors_total{hook}``),
logged once per hook and error type with its context (later ones are counted, and logged at
debug level), and the step goes on with vLLM's stock behaviour (the caller's ``except`` or the
``with`` block ends there). :class:`FailOpen` is that one mechanism for both.

On the per-step hot path a plain ``try``/``except`` that calls :meth:`FailOpen.error` costs
nothing when nothing raises; elsewhere ``with fail_open("hook", request_id):`` (an object, not a
generator: cheaper on a per-request path) also times the block into the adapter's overhead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from meridian.telemetry.metrics import MeridianMetrics

__all__ = ["FailOpen", "Timed"]


class Timed(Protocol):
    """Where a guarded block's time goes (the scheduler's overhead counters)."""

    update_overhead_s: float


class FailOpen:
    """Counts, logs once and swallows exceptions of Meridian's code in one vLLM component.

    ``component`` names it in the log (``"scheduler"``, ``"logits processor"``); ``hook`` labels
    the metric unless ``metric_hook`` overrides it (the processor counts under one label);
    ``context()`` says where the engine was (step, batch size) in the first log line of each
    kind.
    """

    def __init__(
        self,
        metrics: MeridianMetrics,
        logger: logging.Logger,
        component: str,
        *,
        context: Callable[[], str] = lambda: "",
        metric_hook: str | None = None,
    ) -> None:
        self.metrics = metrics
        self.logger = logger
        self.component = component
        self.context = context
        self.metric_hook = metric_hook
        self.num_errors = 0
        self._logged: set[tuple[str, str]] = set()

    def error(self, hook: str, exc: BaseException, request_id: str | None = None) -> None:
        """Account one exception raised in ``hook`` (for ``request_id``, if one)."""
        self.num_errors += 1
        try:
            self.metrics.count_policy_error(self.metric_hook or hook)
        except Exception:
            self.logger.debug("Meridian: the error counter failed", exc_info=True)
        try:
            where = self.context()
        except Exception:
            where = ""
        context = (
            f"hook={hook}"
            + (f" {where}" if where else "")
            + (f" request={request_id}" if request_id else "")
        )
        key = (hook, type(exc).__name__)
        if key in self._logged:
            self.logger.debug("Meridian %s error again (%s): %s", self.component, context, exc)
            return
        self._logged.add(key)
        self.logger.error(
            "Meridian %s error (%s); vLLM's stock behaviour applies. Further %s errors in %s "
            "are counted, not logged.",
            self.component,
            context,
            type(exc).__name__,
            hook,
            exc_info=exc,
        )

    def __call__(
        self, hook: str, request_id: str | None = None, timed: Timed | None = None
    ) -> _Guarded:
        """``with fail_open(hook):``: the block fails open; with ``timed``, its time is added to
        ``timed.update_overhead_s``."""
        return _Guarded(self, hook, request_id, timed)


class _Guarded:
    """One guarded block (see :meth:`FailOpen.__call__`)."""

    __slots__ = ("fail_open", "hook", "request_id", "start", "timed")

    def __init__(
        self, fail_open: FailOpen, hook: str, request_id: str | None, timed: Timed | None
    ) -> None:
        self.fail_open = fail_open
        self.hook = hook
        self.request_id = request_id
        self.timed = timed
        self.start = 0.0

    def __enter__(self) -> None:
        if self.timed is not None:
            self.start = time.perf_counter()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if self.timed is not None:
            self.timed.update_overhead_s += time.perf_counter() - self.start
        if isinstance(exc, Exception):
            self.fail_open.error(self.hook, exc, self.request_id)
            return True  # fail open
        return False
