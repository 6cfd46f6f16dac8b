"""The pool's side: the slab registered with a fabric (:class:`PoolEndpoint`) and the control
server (:class:`KvPoolServer`) that serves producers from one :class:`PoolStore`.

The fabric modules are imported lazily (in :func:`make_pool_endpoint`): they import the
producer's side of this package, and their libraries are optional.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from meridian.disagg.fabric import POOL_FABRICS, FabricError
from meridian.disagg.kvpool.protocol import (
    FAULTS_ENV,
    PROTOCOL_VERSION,
    ProtocolError,
    _error_reply,
    recv_message,
    send_message,
)
from meridian.disagg.kvpool.store import PoolStore
from meridian.errors import ConfigError

_log = logging.getLogger(__name__)


class PoolEndpoint(Protocol):
    """The pool's side of a data plane: the slab registered with the fabric's library."""

    @property
    def label(self) -> str:
        """The fabric's name."""
        ...

    @property
    def progress_interval_s(self) -> float:
        """How often :meth:`progress` must run."""
        ...

    def describe(self) -> dict[str, object]:
        """What a producer needs to reach the slab (sent in the ``hello`` reply)."""
        ...

    def progress(self) -> None:
        """Let the library make progress (some transports need the target to poll)."""
        ...

    def close(self) -> None:
        """Deregister the slab and release the library's resources."""
        ...


def make_pool_endpoint(
    fabric: str, slab: np.ndarray[Any, Any], *, host: str, epoch: str
) -> PoolEndpoint:
    """The :class:`PoolEndpoint` of ``fabric`` over ``slab``; FabricUnavailable if the library
    is missing."""
    if fabric == "nixl":
        from meridian.disagg.nixl_fabric import NixlPoolEndpoint

        return NixlPoolEndpoint(slab, host=host, epoch=epoch)
    if fabric == "mooncake":
        from meridian.disagg.mooncake_fabric import MooncakePoolEndpoint

        return MooncakePoolEndpoint(slab, host=host, epoch=epoch)
    raise ConfigError(f"kvpool --fabric must be one of {', '.join(POOL_FABRICS)}; got {fabric!r}")


class KvPoolServer(socketserver.ThreadingTCPServer):
    """The control server: one thread per producer connection, all sharing one PoolStore."""

    daemon_threads = True
    allow_reuse_address = True  # a restarted pool takes its port back at once
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        store: PoolStore,
        endpoint: PoolEndpoint,
        *,
        fault_injection: bool = False,
    ) -> None:
        self.store = store
        self.endpoint = endpoint
        self.fault_injection = fault_injection
        self._owners = itertools.count(1)
        self._stall_next_commit_s = 0.0
        self._fault_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        super().__init__(address, _ControlHandler)

    def open_connection(self, sock: socket.socket) -> int:
        """Track a producer connection; returns its owner id."""
        with self._fault_lock:
            self._connections.add(sock)
        return next(self._owners)

    def close_connection(self, sock: socket.socket) -> None:
        """Forget a producer connection."""
        with self._fault_lock:
            self._connections.discard(sock)

    def server_close(self) -> None:
        """Stop listening and cut every producer connection (they see the pool go away)."""
        super().server_close()
        with self._fault_lock:
            connections, self._connections = self._connections, set()
        for sock in connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                sock.shutdown(socket.SHUT_RDWR)

    def dispatch(self, owner: int, message: Mapping[str, Any]) -> dict[str, object]:
        """Serve one control request; errors become ``{"ok": false, "error": code}`` replies."""
        store = self.store
        op = message.get("op")
        try:
            if op == "hello":
                if message.get("version") != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"kvpool speaks control protocol v{PROTOCOL_VERSION}, the producer "
                        f"v{message.get('version')}: run the same Meridian release on both"
                    )
                return {
                    "ok": True,
                    "version": PROTOCOL_VERSION,
                    "fabric": self.endpoint.label,
                    "epoch": store.epoch,
                    "capacity_bytes": store.slab.nbytes,
                    "data_plane": self.endpoint.describe(),
                }
            if op == "alloc":
                handle, offset = store.reserve(int(message["num_bytes"]), owner)
                return {"ok": True, "handle": handle, "offset": offset}
            if op == "commit":
                self._maybe_stall()
                store.commit(str(message["handle"]), owner)
                return {"ok": True}
            if op == "open":
                offset, num_bytes = store.open(str(message["handle"]), owner)
                return {"ok": True, "offset": offset, "num_bytes": num_bytes}
            if op == "close":
                store.close(str(message["handle"]), owner)
                return {"ok": True}
            if op == "discard":
                store.discard(str(message["handle"]))
                return {"ok": True}
            if op == "stats":
                return {"ok": True, **dataclasses.asdict(store.stats())}
            if op == "fault":
                return self._fault(message)
            raise ProtocolError(f"unknown control op {op!r}")
        except (FabricError, KeyError, TypeError, ValueError) as exc:
            return _error_reply(exc)

    def _fault(self, message: Mapping[str, Any]) -> dict[str, object]:
        if not self.fault_injection:
            raise ProtocolError(
                f"fault injection is off in this kvpool (start it with --fault-injection or "
                f"{FAULTS_ENV}=1); refusing {message.get('kind')!r}"
            )
        kind = message.get("kind")
        if kind == "corrupt":
            self.store.corrupt(
                str(message["handle"]),
                offset=int(message.get("offset", -1)),
                mask=int(message.get("mask", 1)),
            )
        elif kind == "stall_next_commit":
            with self._fault_lock:
                self._stall_next_commit_s = float(message["seconds"])
        else:
            raise ProtocolError(f"unknown fault {kind!r} (known: corrupt, stall_next_commit)")
        _log.warning("kvpool: fault injected: %s", dict(message))
        return {"ok": True}

    def _maybe_stall(self) -> None:
        with self._fault_lock:
            stall_s, self._stall_next_commit_s = self._stall_next_commit_s, 0.0
        if stall_s > 0:
            time.sleep(stall_s)


class _ControlHandler(socketserver.BaseRequestHandler):
    server: KvPoolServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        owner = self.server.open_connection(sock)
        try:
            while True:
                message = recv_message(sock)
                if message is None:
                    return
                send_message(sock, self.server.dispatch(owner, message))
        except (OSError, ProtocolError) as exc:
            _log.debug("kvpool: producer connection %d ended: %s", owner, exc)
        finally:
            self.server.close_connection(sock)
            if self.server.store.drop_owner(owner):
                _log.info("kvpool: producer %d left with uncommitted slots (quarantined)", owner)
