"""What a replica's failure looks like to the cluster's ingress (no Ray import).

A replica whose engine stops answering raises :class:`ReplicaFailedError` for the requests it can no
longer serve (:class:`~meridian.ray.server.MeridianLLMServer`); Ray Serve hands it to the caller,
the ingress (:mod:`meridian.ray.ingress`), wrapped in its own task error. :func:`replica_failure`
finds it there, and :func:`is_connection_failure` recognises Ray's own errors for a replica that
could not be reached at all.
"""

from __future__ import annotations

__all__ = ["ReplicaFailedError", "is_connection_failure", "replica_failure"]

# Ray's errors for a replica actor that died or cannot be reached (by name: no Ray import here).
_CONNECTION_ERRORS = frozenset({"ActorDiedError", "ActorUnavailableError"})


class ReplicaFailedError(RuntimeError):
    """Replica ``replica`` (its unique id, the router's name for it) failed a request because its
    engine no longer answers; ``cause`` names what was raised there."""

    def __init__(self, replica: str, cause: str) -> None:
        super().__init__(replica, cause)
        self.replica = replica
        self.cause = cause

    def __str__(self) -> str:
        return f"replica {self.replica} failed ({self.cause})"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps (Ray's ``cause``, Python's ``__cause__``), outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        wrapped = getattr(current, "cause", None)
        current = wrapped if isinstance(wrapped, BaseException) else current.__cause__
    return seen


def replica_failure(exc: BaseException) -> ReplicaFailedError | None:
    """The :class:`ReplicaFailedError` ``exc`` is or wraps, if any.

    >>> replica_failure(RuntimeError("x")) is None
    True
    >>> str(replica_failure(ReplicaFailedError("r1", "EngineDeadError")))
    'replica r1 failed (EngineDeadError)'
    """
    # The innermost: Ray re-raises a replica's exception as a class derived from both its task
    # error and the exception's class, whose instance holds the original as ``cause``.
    found = [e for e in _chain(exc) if isinstance(e, ReplicaFailedError) and hasattr(e, "replica")]
    return found[-1] if found else None


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is (or wraps) Ray's error for a replica that died or is unreachable."""
    return any(cls.__name__ in _CONNECTION_ERRORS for e in _chain(exc) for cls in type(e).__mro__)
