"""The Fabric interface: a store of MRDN frames under handles it chooses, and its errors.

A fabric stores opaque payloads (MRDN frames) under handles it chooses. It does not parse them:
verification is the receiver's job (:func:`meridian.disagg.wire.decode`). Calls are blocking.

:class:`InProcessFabric` (tests, benchmarks, single-process use) is the implementation here.
The NIXL and Mooncake modules are one-sided transports between processes
(:mod:`meridian.disagg.transport`), not stores: the KV pool that made a store of them is
retired (docs/disaggregation.md). Every transport error is a :class:`FabricError`.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Final, Protocol, runtime_checkable

from meridian.errors import ConfigError, MeridianError


class FabricError(MeridianError):
    """A fabric operation failed; the payload it concerned was not moved."""


class FabricUnavailable(FabricError):  # noqa: N818  (names from the design's vocabulary)
    """The fabric (or the peer behind it) cannot be reached, is closed, or is not built in."""


class FabricTimeout(FabricError):  # noqa: N818
    """An operation did not complete in time; whether it took effect is unknown."""


class UnknownHandle(FabricError):  # noqa: N818
    """The fabric holds nothing under this handle (never pushed, or discarded)."""


class PoolFull(FabricError):  # noqa: N818
    """The fabric has no room for the payload; nothing was stored."""


@runtime_checkable
class Fabric(Protocol):
    """A store of frames under handles. Every error it raises is a :class:`FabricError`.

    Contract:

    - ``push`` stores a copy of ``payload`` (or an immutable reference to it) and returns a
      handle only once the pool holds it: a returned handle is an acknowledgement.
    - ``pull`` returns exactly the bytes pushed under ``handle``; the pool keeps them until
      ``discard``. Pulling twice is allowed.
    - ``discard`` releases a handle's storage; idempotent (unknown handles are ignored).
    - ``close`` releases the fabric; idempotent. Afterwards every call raises
      :class:`FabricUnavailable`.
    """

    @property
    def label(self) -> str:
        """The fabric's name in metrics and logs (``inprocess``, ``nixl``, ``mooncake``)."""
        ...

    def push(self, payload: bytes) -> str:
        """Store ``payload`` in the pool; returns its handle."""
        ...

    def pull(self, handle: str) -> bytes:
        """The payload stored under ``handle``."""
        ...

    def discard(self, handle: str) -> None:
        """Release the storage of ``handle``."""
        ...

    def close(self) -> None:
        """Release the fabric."""
        ...


class InProcessFabric:
    """A keyed in-memory store of frames in this process, for tests and benchmarks.

    It never claims to be NIXL: its label is ``inprocess``. It is thread-safe. Payloads are
    stored as immutable ``bytes`` (a ``bytes`` payload is kept by reference, anything else is
    copied once), so ``push`` and ``pull`` move references, not data.

    ``capacity_bytes`` bounds the stored payload bytes; a push that would exceed it raises
    :class:`PoolFull`. Fault injection for tests: :meth:`fail_next_pushes`,
    :meth:`fail_next_pulls`, ``available = False`` (the pool is down), ``delay_s`` (every
    transfer sleeps first), :meth:`hold_transfers` (transfers block until released) and
    :meth:`corrupt` (flip bits of a stored payload).

    >>> fabric = InProcessFabric()
    >>> handle = fabric.push(b"frame")
    >>> fabric.pull(handle)
    b'frame'
    """

    label: Final = "inprocess"

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ConfigError(f"InProcessFabric capacity_bytes must be >= 0; got {capacity_bytes}")
        self._capacity_bytes = capacity_bytes
        self._store: dict[str, bytes] = {}
        self._used_bytes = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._num_pushes = 0
        self._num_pulls = 0
        self._pushes_to_pass = 0
        self._pushes_to_fail = 0
        self._push_error: type[FabricError] = FabricUnavailable
        self._pulls_to_fail = 0
        self._pull_error: type[FabricError] = FabricUnavailable
        self._gate = threading.Event()
        self._gate.set()
        self.available = True
        self.delay_s = 0.0

    # -- the Fabric protocol ----------------------------------------------------------------------

    def push(self, payload: bytes) -> str:
        """Store ``payload``; raises PoolFull, FabricUnavailable or an injected failure."""
        self._before_transfer("push")
        stored = payload if type(payload) is bytes else bytes(payload)
        with self._lock:
            self._check_open("push")
            self._num_pushes += 1
            if self._pushes_to_pass > 0:
                self._pushes_to_pass -= 1
            elif self._pushes_to_fail > 0:
                self._pushes_to_fail -= 1
                raise self._push_error(f"fabric {self.label}: injected push failure")
            if (
                self._capacity_bytes is not None
                and self._used_bytes + len(stored) > self._capacity_bytes
            ):
                raise PoolFull(
                    f"fabric full: {self.label} holds {self._used_bytes} of "
                    f"{self._capacity_bytes} bytes and cannot store {len(stored)} more; discard "
                    f"frames that were ingested or give the pool more capacity"
                )
            handle = f"{self.label}:{next(self._ids):x}"
            self._store[handle] = stored
            self._used_bytes += len(stored)
            return handle

    def pull(self, handle: str) -> bytes:
        """The payload under ``handle``; raises UnknownHandle, FabricUnavailable or injected."""
        self._before_transfer("pull")
        with self._lock:
            self._check_open("pull")
            self._num_pulls += 1
            if self._pulls_to_fail > 0:
                self._pulls_to_fail -= 1
                raise self._pull_error(f"fabric {self.label}: injected pull failure")
            payload = self._store.get(handle)
            if payload is None:
                raise UnknownHandle(
                    f"fabric {self.label} holds nothing under handle {handle!r} (never pushed, "
                    f"or already discarded)"
                )
            return payload

    def discard(self, handle: str) -> None:
        """Release ``handle``'s storage; unknown handles are ignored."""
        with self._lock:
            self._check_open("discard")
            payload = self._store.pop(handle, None)
            if payload is not None:
                self._used_bytes -= len(payload)

    def close(self) -> None:
        """Drop every stored payload; later calls raise FabricUnavailable. Idempotent."""
        with self._lock:
            self._closed = True
            self._store.clear()
            self._used_bytes = 0
        self._gate.set()

    # -- inspection -------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        """The pool's capacity in payload bytes, or None when unbounded."""
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Payload bytes currently stored."""
        return self._used_bytes

    @property
    def num_stored(self) -> int:
        """Payloads currently stored."""
        return len(self._store)

    @property
    def num_pushes(self) -> int:
        """Push attempts that reached the pool (including injected and PoolFull failures)."""
        return self._num_pushes

    @property
    def num_pulls(self) -> int:
        """Pull attempts that reached the pool (including failures)."""
        return self._num_pulls

    def handles(self) -> list[str]:
        """Handles currently stored, oldest first."""
        with self._lock:
            return list(self._store)

    def check_integrity(self) -> None:
        """Verify the byte accounting; raises AssertionError on a bookkeeping bug."""
        with self._lock:
            recount = sum(len(p) for p in self._store.values())
            if recount != self._used_bytes:
                raise AssertionError(f"InProcessFabric: used_bytes {self._used_bytes} != {recount}")
            if self._capacity_bytes is not None and self._used_bytes > self._capacity_bytes:
                raise AssertionError("InProcessFabric: capacity exceeded")

    # -- fault injection --------------------------------------------------------------------------

    def fail_next_pushes(
        self, num_pushes: int, *, after: int = 0, error: type[FabricError] = FabricUnavailable
    ) -> None:
        """Let ``after`` pushes through, then fail ``num_pushes`` with ``error`` (not stored)."""
        with self._lock:
            self._pushes_to_pass = after
            self._pushes_to_fail = num_pushes
            self._push_error = error

    def fail_next_pulls(
        self, num_pulls: int, *, error: type[FabricError] = FabricUnavailable
    ) -> None:
        """Fail the next ``num_pulls`` pulls with ``error``; the stored payloads stay."""
        with self._lock:
            self._pulls_to_fail = num_pulls
            self._pull_error = error

    def corrupt(self, handle: str, *, offset: int = -1, mask: int = 0x01) -> None:
        """XOR the byte at ``offset`` of the payload under ``handle`` with ``mask`` (at rest)."""
        if not 0 < mask < 256:
            raise ValueError(f"mask must be in 1..255; got {mask}")
        with self._lock:
            payload = self._store.get(handle)
            if payload is None:
                raise UnknownHandle(f"cannot corrupt {handle!r}: fabric {self.label} lacks it")
            mutated = bytearray(payload)
            mutated[offset] ^= mask
            self._store[handle] = bytes(mutated)

    def hold_transfers(self) -> None:
        """Make every push and pull block until :meth:`release_transfers` (a stalled fabric)."""
        self._gate.clear()

    def release_transfers(self) -> None:
        """Let held and future transfers proceed."""
        self._gate.set()

    # -- internals --------------------------------------------------------------------------------

    def _before_transfer(self, operation: str) -> None:
        # Outside the lock: a slow or held transfer must not block discard() or inspection.
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        self._gate.wait()
        if not self.available:
            raise FabricUnavailable(
                f"fabric {self.label}: the store is unreachable ({operation} failed; "
                f"available is False)"
            )

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise FabricUnavailable(f"fabric {self.label} is closed; cannot {operation}")
