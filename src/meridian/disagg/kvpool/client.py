"""The producer's side: the control connection (:class:`PoolClient`), the data-plane
protocol a fabric supplies (:class:`ProducerPlane`), and :class:`PoolFabric`, the
:class:`~meridian.disagg.fabric.Fabric` built from the two (base of the NIXL and Mooncake
fabrics).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

from meridian.disagg.fabric import FabricError, FabricTimeout, FabricUnavailable
from meridian.disagg.kvpool.protocol import (
    _ERRORS,
    PROTOCOL_VERSION,
    ProtocolError,
    parse_address,
    recv_message,
    send_message,
)
from meridian.disagg.kvpool.store import PoolStats
from meridian.disagg.wire import BytesLike
from meridian.errors import ConfigError

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TIMEOUT_S: Final = 10.0
_MAX_ORPHANS: Final = 4096
# Shared by the producer planes: the smallest staging buffer they register, and how they poll
# a transfer (spin SPIN_POLLS polls, then sleep POLL_SLEEP_S between polls).
MIN_STAGING_BYTES: Final = 1 << 20
SPIN_POLLS: Final = 64
POLL_SLEEP_S: Final = 50e-6


def load_transport(
    module: str, *, fabric: str, library: str, env_defaults: Mapping[str, str], install_hint: str
) -> Any:
    """Import a fabric's transport ``module`` after applying its environment defaults.

    Raises FabricUnavailable naming ``library`` and how to install it when the import fails.
    """
    for name, value in env_defaults.items():
        os.environ.setdefault(name, value)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FabricUnavailable(
            f"fabric {fabric!r} needs {library}, which cannot be imported ({exc}); "
            f"install it with: {install_hint}"
        ) from exc


class PoolClient:
    """The control connection from a producer to a kvpool: one request at a time.

    Every error is a :class:`FabricError`: a refused or broken connection is
    FabricUnavailable (the pool is gone), a slow reply FabricTimeout; the connection is closed
    after either, and the next request reconnects. Not thread-safe: callers serialize.
    """

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self._host, self._port = parse_address(address)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self.hello: dict[str, Any] = {}

    @property
    def connected(self) -> bool:
        """True while a control connection is open."""
        return self._sock is not None

    def connect(self) -> dict[str, Any]:
        """Open the connection (if needed) and return the pool's ``hello`` reply."""
        if self._sock is not None:
            return self.hello
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout_s)
        except OSError as exc:
            raise FabricUnavailable(
                f"no KV pool answers at {self.address} ({exc.strerror or exc}); start one "
                f"with `meridian kvpool --fabric <nixl|mooncake> --listen {self.address}`"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.hello = self.request({"op": "hello", "version": PROTOCOL_VERSION})
        return self.hello

    def request(self, message: Mapping[str, object]) -> dict[str, Any]:
        """Send one request and return its successful reply; raises a FabricError."""
        if self._sock is None:
            self.connect()
        sock = self._sock
        assert sock is not None
        try:
            sock.settimeout(self.timeout_s)
            send_message(sock, message)
            reply = recv_message(sock)
        except TimeoutError as exc:
            self.disconnect()
            raise FabricTimeout(
                f"the KV pool at {self.address} did not answer {message.get('op')!r} within "
                f"{self.timeout_s:g} s; whether it took effect is unknown"
            ) from exc
        except (OSError, ProtocolError) as exc:
            self.disconnect()
            raise FabricUnavailable(
                f"lost the KV pool at {self.address} during {message.get('op')!r} ({exc}); it "
                f"stopped or was killed: offload pauses until it is back"
            ) from exc
        if reply is None:
            self.disconnect()
            raise FabricUnavailable(
                f"the KV pool at {self.address} closed the connection during "
                f"{message.get('op')!r}: it stopped or was killed"
            )
        if not reply.get("ok"):
            error = _ERRORS.get(str(reply.get("error")), FabricError)
            raise error(str(reply.get("message", "the KV pool refused the request")))
        return reply

    def alloc(self, num_bytes: int) -> tuple[str, int]:
        """Reserve a slot: ``(handle, offset in the slab)``."""
        reply = self.request({"op": "alloc", "num_bytes": num_bytes})
        return str(reply["handle"]), int(reply["offset"])

    def commit(self, handle: str) -> None:
        """Acknowledge a written slot as a stored frame."""
        self.request({"op": "commit", "handle": handle})

    def open(self, handle: str) -> tuple[int, int]:
        """Pin a frame for reading: ``(offset, num_bytes)``."""
        reply = self.request({"op": "open", "handle": handle})
        return int(reply["offset"]), int(reply["num_bytes"])

    def close_handle(self, handle: str) -> None:
        """Unpin a frame opened with :meth:`open`."""
        self.request({"op": "close", "handle": handle})

    def discard(self, handle: str) -> None:
        """Release a frame."""
        self.request({"op": "discard", "handle": handle})

    def stats(self) -> PoolStats:
        """The pool's usage."""
        reply = self.request({"op": "stats"})
        return PoolStats(**{f.name: int(reply[f.name]) for f in dataclasses.fields(PoolStats)})

    def corrupt(self, handle: str, *, offset: int = -1, mask: int = 0x01) -> None:
        """Fault injection (test pools only): flip bits of a stored frame."""
        self.request(
            {"op": "fault", "kind": "corrupt", "handle": handle, "offset": offset, "mask": mask}
        )

    def stall_next_commit(self, seconds: float) -> None:
        """Fault injection (test pools only): the next commit waits ``seconds`` first."""
        self.request({"op": "fault", "kind": "stall_next_commit", "seconds": seconds})

    def disconnect(self) -> None:
        """Close the connection (idempotent); the next request reconnects."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class ProducerPlane(Protocol):
    """The producer's side of a data plane: a registered staging buffer and one-sided ops."""

    def attach(self, data_plane: Mapping[str, Any], deadline: float) -> None:
        """Reach the pool's slab described by the ``hello`` reply."""
        ...

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        """Copy ``payload`` to the slab at ``offset``; returns when it has landed."""
        ...

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        """The slab's ``num_bytes`` at ``offset``."""
        ...

    def detach(self) -> None:
        """Forget the pool (after it failed or restarted)."""
        ...

    def close(self) -> None:
        """Release the library's resources."""
        ...


class PoolFabric:
    """A :class:`~meridian.disagg.fabric.Fabric` backed by a kvpool process (base of the NIXL
    and Mooncake fabrics, which supply the data plane).

    Every operation is serialized by one lock and bounded by ``timeout_s``. After the pool
    fails (FabricUnavailable or FabricTimeout) both planes are dropped; the next operation
    reconnects, so a producer keeps working once the pool is back. Handles from before a
    pool restart raise UnknownHandle.
    """

    def __init__(self, label: str, address: str, plane: ProducerPlane, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"fabric {label}: timeout_s must be > 0; got {timeout_s}")
        self._label = label
        self._pool = PoolClient(address, timeout_s=timeout_s)
        self._plane = plane
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._attached = False
        self._closed = False
        # Handles whose commit may or may not have taken effect (a timeout or a lost
        # connection while committing): released on the next connection, so none leaks.
        self._orphans: list[str] = []

    @property
    def label(self) -> str:
        """The fabric's name in metrics and logs."""
        return self._label

    @property
    def address(self) -> str:
        """The kvpool's control address."""
        return self._pool.address

    def push(self, payload: bytes) -> str:
        """Store ``payload`` in the pool; the returned handle is the pool's acknowledgement."""
        num_bytes = memoryview(payload).nbytes
        with self._lock:
            deadline = self._connect("push")
            handle, offset = self._pool.alloc(num_bytes)
            self._check_slot(offset, num_bytes)
            self._guarded(lambda: self._plane.write(payload, offset, deadline))
            try:
                self._pool.commit(handle)
            except (FabricUnavailable, FabricTimeout):
                if len(self._orphans) < _MAX_ORPHANS:
                    self._orphans.append(handle)
                raise
            return handle

    def pull(self, handle: str) -> bytes:
        """The payload stored under ``handle``."""
        with self._lock:
            deadline = self._connect("pull")
            offset, num_bytes = self._pool.open(handle)
            self._check_slot(offset, num_bytes)
            data = self._guarded(lambda: self._plane.read(offset, num_bytes, deadline))
            try:
                self._pool.close_handle(handle)
            except FabricError as exc:
                # The bytes are here; a lost connection releases the pin on the pool's side.
                _log.debug("kvpool close of %s failed after the read: %s", handle, exc)
                self._reset()
            return data

    def discard(self, handle: str) -> None:
        """Release ``handle``'s storage; unknown handles are ignored."""
        with self._lock:
            self._connect("discard")
            self._pool.discard(handle)

    def stats(self) -> PoolStats:
        """The pool's usage (connects if needed)."""
        with self._lock:
            self._connect("stats")
            return self._pool.stats()

    def close(self) -> None:
        """Disconnect and release the library; later calls raise FabricUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reset()
            self._plane.close()

    def _connect(self, operation: str) -> float:
        """Both planes up; returns the operation's deadline."""
        if self._closed:
            raise FabricUnavailable(f"fabric {self._label} is closed; cannot {operation}")
        if not self._pool.connected or not self._attached:
            self._reset()
            hello = self._pool.connect()
            deadline = time.monotonic() + self._timeout_s
            if hello.get("fabric") != self._label:
                self._pool.disconnect()
                raise FabricUnavailable(
                    f"the KV pool at {self._pool.address} serves fabric "
                    f"{hello.get('fabric')!r}, not {self._label!r}: start it with "
                    f"--fabric {self._label}"
                )
            self._guarded(lambda: self._plane.attach(hello["data_plane"], deadline))
            self._attached = True
            self._release_orphans()
        return time.monotonic() + self._timeout_s

    def _check_slot(self, offset: int, num_bytes: int) -> None:
        """Before a data-plane call: the pool's slot must lie inside its slab (the ``hello``
        reply's ``capacity_bytes``); otherwise drop both planes and raise FabricError."""
        slab_bytes = int(self._pool.hello["capacity_bytes"])
        if offset < 0 or offset + num_bytes > slab_bytes:
            self._reset()
            raise FabricError(
                f"kvpool slot [{offset}, {offset + num_bytes}) lies outside its "
                f"{slab_bytes}-byte slab: the pool and producer disagree"
            )

    def _release_orphans(self) -> None:
        """Discard frames of pushes that failed while committing (no-ops after a restart)."""
        while self._orphans:
            self._pool.discard(self._orphans[-1])
            self._orphans.pop()

    def _guarded(self, call: Callable[[], _T]) -> _T:
        """Run a data-plane call; any failure drops both planes (the next call reconnects)."""
        try:
            return call()
        except FabricError:
            self._reset()
            raise

    def _reset(self) -> None:
        self._pool.disconnect()
        if self._attached:
            self._plane.detach()
        self._attached = False
