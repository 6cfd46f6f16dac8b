"""Fail open: Meridian's code inside a vLLM process never takes the engine down.

Both pieces inside vLLM, the scheduler (engine-core process) and the logits processor (worker
processes), run Meridian's code on vLLM's per-step path. An exception there must not stop the
engine: it is counted (:attr:`FailOpen.num_errors` and ``meridian_policy_errors_total{hook}``),
logged once per hook and error type with its context (later ones are counted, and logged at
debug level), and the step goes on with vLLM's stock behaviour (the caller's ``except`` or the
``with`` block ends there). :class:`FailOpen` is that one mechanism for both.

Every guarded block goes through one object, :class:`Guard`: ``with fail_open(hook, ...)``
fails open and, given the counters (``timed``) and a field, adds the block's time to it; with
no :class:`FailOpen` (:meth:`Guard.time`) it only times (vLLM's own part of a hook). On the
per-step path a guard built once runs a call (:meth:`Guard.run`): a ``with`` costs twice the
Python calls; a batch of requests, each failing alone, runs under one (:meth:`Guard.each`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from meridian.telemetry.metrics import MeridianMetrics

__all__ = ["FailOpen", "Guard"]

T = TypeVar("T")


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
        self,
        hook: str,
        request_id: str | None = None,
        timed: object | None = None,
        field: str = "update_overhead_s",
    ) -> Guard:
        """``with fail_open(hook):``: the block fails open; with ``timed``, its time is added to
        ``timed.<field>``."""
        return Guard(self, hook, request_id, timed, field)


class Guard:
    """One guarded block: timed into ``timed.<field>`` (if ``timed``), failing open through
    ``fail_open`` (if one; without, exceptions propagate). ``net_of`` names a field of ``timed``
    whose growth inside the block is Meridian's, not the block's: it is taken out.

    (An object with slots, not a generator: cheaper on the per-step path.)
    """

    __slots__ = ("before", "fail_open", "field", "hook", "net_of", "request_id", "start", "timed")

    def __init__(
        self,
        fail_open: FailOpen | None,
        hook: str,
        request_id: str | None,
        timed: object | None,
        field: str,
        net_of: str | None = None,
    ) -> None:
        self.fail_open = fail_open
        self.hook = hook
        self.request_id = request_id
        self.timed = timed
        self.field = field
        self.net_of = net_of
        self.start = self.before = 0.0

    @classmethod
    def time(cls, timed: object, field: str, net_of: str | None = None) -> Guard:
        """Only time the block into ``timed.<field>`` (exceptions propagate)."""
        return cls(None, "", None, timed, field, net_of)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)`` guarded as a ``with`` block would be (``None`` if it failed
        open). Cheaper than ``with`` on the per-step path (one call, not two), and reentrant: a
        guard built once serves every step."""
        timed, net_of = self.timed, self.net_of
        before = getattr(timed, net_of) if net_of is not None else 0.0
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self.fail_open is None:
                raise
            self.fail_open.error(self.hook, exc, self.request_id)
            return None
        finally:
            if timed is not None:
                elapsed = time.perf_counter() - start
                if net_of is not None:
                    elapsed -= getattr(timed, net_of) - before
                setattr(timed, self.field, getattr(timed, self.field) + elapsed)

    def each(self, fn: Callable[[str, Any], object], items: Iterable[tuple[str, Any]]) -> None:
        """``fn(request_id, item)`` for each ``(request_id, item)`` of ``items``, timed once (as
        :meth:`run` times); one that raises fails open alone (counted for its request id) and the
        rest go on. (One guard a request cost about a microsecond each where a batch starts.)"""
        fail_open, hook = self.fail_open, self.hook

        def every() -> None:
            for request_id, item in items:
                try:
                    fn(request_id, item)
                except Exception as exc:
                    if fail_open is None:
                        raise
                    fail_open.error(hook, exc, request_id)

        self.run(every)

    def __enter__(self) -> None:
        timed = self.timed
        if timed is not None:
            if self.net_of is not None:
                self.before = getattr(timed, self.net_of)
            self.start = time.perf_counter()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        timed = self.timed
        if timed is not None:
            elapsed = time.perf_counter() - self.start
            if self.net_of is not None:
                elapsed -= getattr(timed, self.net_of) - self.before
            setattr(timed, self.field, getattr(timed, self.field) + elapsed)
        if self.fail_open is not None and isinstance(exc, Exception):
            self.fail_open.error(self.hook, exc, self.request_id)
            return True  # fail open
        return False
