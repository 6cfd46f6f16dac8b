"""The KV pool: a process that holds offloaded MRDN frames for producers, and its protocol.

``python -m meridian.disagg.kvpool --fabric nixl --listen 127.0.0.1:7470`` (or
:func:`run_kvpool`) starts a pool. It owns one slab of DRAM (``--capacity`` bytes), registered
with the fabric's library, and serves two planes::

    producer                                       kvpool process
    ────────                                       ──────────────
    control  TCP, --listen address  ─────────────> PoolStore: slab allocator, handles, pins
    data     NIXL (UCX) or Mooncake TE (TCP) ────> the registered slab (one-sided WRITE / READ)

The control plane is Meridian's own: length-prefixed JSON messages, one reply per request.
The data plane is the fabric's library; it moves the frame's bytes unchanged (MRDN header
included) between a producer's registered staging buffer and the pool's slab.

Push: ``alloc(n)`` reserves a slot and returns ``(handle, offset)``; the producer WRITEs the
frame there; ``commit(handle)`` makes it a stored frame and is the acknowledgement. Pull:
``open(handle)`` pins the frame and returns its place; the producer READs it; ``close(handle)``
unpins it. ``discard(handle)`` releases a frame (a pinned one when its last reader is done).

Invariants the pool keeps:

- A slot is never handed out twice while anyone may still write to or read from it. A
  reservation whose producer vanished before committing (connection lost, timeout) may still
  receive a late WRITE, so its slot is quarantined for ``quarantine_s`` before reuse.
- Handles carry the pool's epoch (random per start): after a restart every old handle is
  unknown, never silently aliased to a new frame.
- The pool never parses frames: verification (checksum, tier) is the receiver's job.

Fault injection for tests (``--fault-injection`` or ``MERIDIAN_KVPOOL_FAULTS=1``): the control
op ``fault`` can flip bits of a stored frame or stall the next commit; refused otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import enum
import ipaddress
import itertools
import json
import logging
import os
import re
import secrets
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final, Protocol, TypeVar

import numpy as np

from meridian.core.types import Tier
from meridian.disagg.fabric import (
    FabricError,
    FabricTimeout,
    FabricUnavailable,
    PoolFull,
    UnknownHandle,
)
from meridian.disagg.offload import OffloadMetrics
from meridian.disagg.wire import BytesLike
from meridian.errors import ConfigError, MeridianError

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

POOL_FABRICS: Final = ("nixl", "mooncake")
PROTOCOL_VERSION: Final = 1
DEFAULT_LISTEN: Final = "127.0.0.1:7470"
DEFAULT_CAPACITY_BYTES: Final = 1 << 30
DEFAULT_QUARANTINE_S: Final = 30.0
DEFAULT_TIMEOUT_S: Final = 10.0
ALIGN_BYTES: Final = 64  # slots start on cache lines
FAULTS_ENV: Final = "MERIDIAN_KVPOOL_FAULTS"
MAX_MESSAGE_BYTES: Final = 1 << 16
_MAX_ORPHANS: Final = 4096
_LENGTH: Final = struct.Struct("<I")
_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# -- the store ------------------------------------------------------------------------------------


class SlabAllocator:
    """First-fit allocator of aligned extents in ``[0, capacity_bytes)``; frees coalesce.

    Invariant (:meth:`check_integrity`): allocated and free extents tile the slab exactly, and
    no two free extents touch (they would have been merged).

    >>> slab = SlabAllocator(256, align=64)
    >>> slab.allocate(10), slab.allocate(100)
    (0, 64)
    >>> slab.free(0); slab.largest_free_extent
    64
    """

    def __init__(self, capacity_bytes: int, *, align: int = ALIGN_BYTES) -> None:
        if capacity_bytes < 0 or align < 1:
            raise ConfigError(f"slab capacity must be >= 0 and align >= 1; got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._align = align
        self._free_offsets: list[int] = [0] if capacity_bytes else []
        self._free_sizes: dict[int, int] = {0: capacity_bytes} if capacity_bytes else {}
        self._allocated: dict[int, int] = {}

    @property
    def capacity_bytes(self) -> int:
        """The slab's size."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (sizes rounded up to the alignment)."""
        return self._capacity - sum(self._free_sizes.values())

    @property
    def largest_free_extent(self) -> int:
        """The largest request that :meth:`allocate` can serve right now."""
        return max(self._free_sizes.values(), default=0)

    def extent_size(self, num_bytes: int) -> int:
        """Bytes an allocation of ``num_bytes`` occupies (rounded up, at least one unit)."""
        units = max(1, -(-num_bytes // self._align))
        return units * self._align

    def can_allocate(self, num_bytes: int) -> bool:
        """True when some free extent holds ``num_bytes``."""
        return self.extent_size(num_bytes) <= self.largest_free_extent

    def allocate(self, num_bytes: int) -> int:
        """The offset of a new extent of ``num_bytes``; raises PoolFull unless can_allocate."""
        size = self.extent_size(num_bytes)
        for offset in self._free_offsets:
            free = self._free_sizes[offset]
            if free < size:
                continue
            index = bisect.bisect_left(self._free_offsets, offset)
            del self._free_offsets[index]
            del self._free_sizes[offset]
            if free > size:
                self._free_offsets.insert(index, offset + size)
                self._free_sizes[offset + size] = free - size
            self._allocated[offset] = size
            return offset
        raise PoolFull(
            f"no free extent of {size} bytes in the KV pool's {self._capacity}-byte slab "
            f"({self.used_bytes} used, largest free extent {self.largest_free_extent})"
        )

    def free(self, offset: int) -> None:
        """Release the extent at ``offset``, merging it with free neighbours."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise AssertionError(f"SlabAllocator: offset {offset} is not allocated")
        index = bisect.bisect_left(self._free_offsets, offset)
        if index < len(self._free_offsets) and self._free_offsets[index] == offset + size:
            size += self._free_sizes.pop(self._free_offsets.pop(index))
        if index > 0:
            before = self._free_offsets[index - 1]
            if before + self._free_sizes[before] == offset:
                self._free_sizes[before] += size
                return
        self._free_offsets.insert(index, offset)
        self._free_sizes[offset] = size

    @property
    def num_extents(self) -> int:
        """Allocated extents."""
        return len(self._allocated)

    def is_allocated(self, offset: int) -> bool:
        """True when an extent starts at ``offset``."""
        return offset in self._allocated

    def check_integrity(self) -> None:
        """Verify that the extents tile the slab; raises AssertionError on a bookkeeping bug."""
        extents = sorted([*self._allocated.items(), *self._free_sizes.items()])
        position = 0
        for offset, size in extents:
            if offset != position or size <= 0:
                raise AssertionError(f"SlabAllocator: gap or overlap at {offset} (at {position})")
            position += size
        if position != self._capacity:
            raise AssertionError(f"SlabAllocator: extents cover {position} of {self._capacity}")
        if self._free_offsets != sorted(self._free_sizes):
            raise AssertionError("SlabAllocator: free offsets out of order")
        for a, b in itertools.pairwise(self._free_offsets):
            if a + self._free_sizes[a] == b:
                raise AssertionError(f"SlabAllocator: free extents at {a} and {b} not merged")


class EntryState(enum.Enum):
    """Where a slot is in the push protocol."""

    RESERVED = "reserved"  # handed to a producer by alloc; its WRITE may be under way
    STORED = "stored"  # committed: the producer's push returned this handle


@dataclass(slots=True)
class _Entry:
    offset: int
    num_bytes: int
    owner: int
    state: EntryState
    num_pins: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool (the ``stats`` control op)."""

    capacity_bytes: int
    used_bytes: int  # slab bytes not free: frames, reservations, pinned zombies, quarantine
    stored_bytes: int  # frame bytes of stored (committed) frames
    num_frames: int
    num_reserved: int
    num_quarantined: int


class PoolStore:
    """Frames by handle in one slab: ``reserve -> commit -> open/close -> discard``.

    Thread-safe. ``owner`` is the producer's connection id: its reservations and pins end when
    :meth:`drop_owner` is called (the connection closed). See the module doc for the rules.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        label: str,
        quarantine_s: float = DEFAULT_QUARANTINE_S,
        clock: Callable[[], float] = time.monotonic,
        epoch: str | None = None,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        if capacity_bytes < 1:
            raise ConfigError(f"kvpool capacity must be >= 1 byte; got {capacity_bytes}")
        self._metrics = metrics
        if not quarantine_s >= 0:
            raise ConfigError(f"kvpool quarantine_s must be >= 0; got {quarantine_s}")
        self.slab: np.ndarray[Any, np.dtype[np.uint8]] = np.zeros(capacity_bytes, np.uint8)
        self.label = label
        self.epoch = epoch or secrets.token_hex(4)
        self._alloc = SlabAllocator(capacity_bytes)
        self._quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        self._zombies: dict[str, _Entry] = {}  # discarded while pinned: freed at the last close
        self._pins: dict[int, Counter[str]] = {}  # owner -> handle -> open count
        self._quarantine: list[tuple[float, int]] = []  # (release time, offset)

    # -- the push and pull protocol ---------------------------------------------------------------

    def reserve(self, num_bytes: int, owner: int) -> tuple[str, int]:
        """A new slot of ``num_bytes`` for ``owner``: ``(handle, offset)``; raises PoolFull."""
        if num_bytes < 1:
            raise ValueError(f"alloc needs num_bytes >= 1; got {num_bytes}")
        with self._lock:
            if not self._alloc.can_allocate(num_bytes):
                self._reclaim()
            if not self._alloc.can_allocate(num_bytes):
                raise PoolFull(self._explain_full(num_bytes))
            offset = self._alloc.allocate(num_bytes)
            handle = f"{self.label}:{self.epoch}:{next(self._ids):x}"
            self._entries[handle] = _Entry(offset, num_bytes, owner, EntryState.RESERVED)
            return handle, offset

    def commit(self, handle: str, owner: int) -> None:
        """Make ``owner``'s reservation a stored frame; raises UnknownHandle otherwise."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or entry.state is not EntryState.RESERVED or entry.owner != owner:
                raise UnknownHandle(f"no reservation {handle!r} of this producer to commit")
            entry.state = EntryState.STORED
        if self._metrics is not None:
            self._metrics.count_offloaded(self.label, 1, entry.num_bytes)

    def open(self, handle: str, owner: int) -> tuple[int, int]:
        """Pin a stored frame for reading: ``(offset, num_bytes)``; raises UnknownHandle."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or entry.state is not EntryState.STORED:
                raise UnknownHandle(self._explain_unknown(handle))
            entry.num_pins += 1
            self._pins.setdefault(owner, Counter())[handle] += 1
        if self._metrics is not None:
            self._metrics.count_ingested(self.label, 1, entry.num_bytes)
        return entry.offset, entry.num_bytes

    def close(self, handle: str, owner: int) -> None:
        """Unpin a frame ``owner`` opened; a no-op for anything else."""
        with self._lock:
            self._unpin(handle, owner)

    def discard(self, handle: str) -> None:
        """Release a frame (idempotent). A pinned frame goes when its last reader closes it."""
        with self._lock:
            entry = self._entries.pop(handle, None)
            if entry is None:
                return
            if entry.num_pins:
                self._zombies[handle] = entry
            elif entry.state is EntryState.RESERVED:
                self._quarantine_slot(entry.offset)  # a WRITE may still land there
            else:
                self._alloc.free(entry.offset)

    def drop_owner(self, owner: int) -> int:
        """Forget a producer whose connection closed: its reservations are quarantined and its
        pins released. Returns how many reservations were abandoned."""
        with self._lock:
            abandoned = [
                h
                for h, e in self._entries.items()
                if e.owner == owner and e.state is EntryState.RESERVED
            ]
            for handle in abandoned:
                self._quarantine_slot(self._entries.pop(handle).offset)
            for handle, count in list(self._pins.get(owner, Counter()).items()):
                for _ in range(count):
                    self._unpin(handle, owner)
            self._pins.pop(owner, None)
            return len(abandoned)

    def reclaim(self) -> int:
        """Free quarantined slots whose time is up; returns how many."""
        with self._lock:
            return self._reclaim()

    # -- inspection and faults --------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """Current usage."""
        with self._lock:
            stored = [e for e in self._entries.values() if e.state is EntryState.STORED]
            return PoolStats(
                capacity_bytes=self._alloc.capacity_bytes,
                used_bytes=self._alloc.used_bytes,
                stored_bytes=sum(e.num_bytes for e in stored),
                num_frames=len(stored),
                num_reserved=len(self._entries) - len(stored),
                num_quarantined=len(self._quarantine),
            )

    def corrupt(self, handle: str, *, offset: int = -1, mask: int = 0x01) -> None:
        """Fault injection: XOR the stored frame's byte at ``offset`` with ``mask`` in place."""
        if not 0 < mask < 256:
            raise ValueError(f"mask must be in 1..255; got {mask}")
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or entry.state is not EntryState.STORED:
                raise UnknownHandle(self._explain_unknown(handle))
            if not -entry.num_bytes <= offset < entry.num_bytes:
                raise ValueError(f"offset {offset} is outside the {entry.num_bytes}-byte frame")
            self.slab[entry.offset + offset % entry.num_bytes] ^= mask

    def check_integrity(self) -> None:
        """Verify slots, pins and the allocator agree; raises AssertionError on a bug."""
        with self._lock:
            self._alloc.check_integrity()
            slots = [e.offset for e in (*self._entries.values(), *self._zombies.values())]
            slots += [offset for _, offset in self._quarantine]
            if len(slots) != len(set(slots)):
                raise AssertionError("PoolStore: a slot is used twice")
            if not all(self._alloc.is_allocated(offset) for offset in slots):
                raise AssertionError("PoolStore: a slot in use is not allocated")
            num_extents = self._alloc.num_extents
            if num_extents != len(slots):
                raise AssertionError(f"PoolStore: {num_extents} extents for {len(slots)} slots")
            pins: Counter[str] = Counter()
            for per_owner in self._pins.values():
                pins.update(per_owner)
            for handle, entry in (*self._entries.items(), *self._zombies.items()):
                if entry.num_pins != pins.get(handle, 0):
                    raise AssertionError(f"PoolStore: pin count of {handle} disagrees")
                if entry.num_pins and entry.state is not EntryState.STORED:
                    raise AssertionError(f"PoolStore: reservation {handle} is pinned")
            if any(not e.num_pins for e in self._zombies.values()):
                raise AssertionError("PoolStore: an unpinned discarded frame was not freed")

    # -- internals --------------------------------------------------------------------------------

    def _unpin(self, handle: str, owner: int) -> None:
        per_owner = self._pins.get(owner)
        if per_owner is None or per_owner[handle] <= 0:
            return
        per_owner[handle] -= 1
        if per_owner[handle] == 0:
            del per_owner[handle]
        entry = self._entries.get(handle) or self._zombies.get(handle)
        if entry is None:
            return
        entry.num_pins -= 1
        if entry.num_pins == 0 and handle in self._zombies:
            del self._zombies[handle]
            self._alloc.free(entry.offset)

    def _quarantine_slot(self, offset: int) -> None:
        if self._quarantine_s == 0:
            self._alloc.free(offset)
        else:
            self._quarantine.append((self._clock() + self._quarantine_s, offset))

    def _reclaim(self) -> int:
        now = self._clock()
        due = [(t, o) for t, o in self._quarantine if t <= now]
        if due:
            self._quarantine = [(t, o) for t, o in self._quarantine if t > now]
            for _, offset in due:
                self._alloc.free(offset)
        return len(due)

    def _explain_full(self, num_bytes: int) -> str:
        return (
            f"KV pool full: the {self.label} pool holds {self._alloc.used_bytes} of "
            f"{self._alloc.capacity_bytes} bytes (largest free extent "
            f"{self._alloc.largest_free_extent}) and cannot store a {num_bytes}-byte frame; "
            f"discard ingested frames or start the pool with a larger --capacity"
        )

    def _explain_unknown(self, handle: str) -> str:
        if handle.count(":") == 2 and handle.split(":")[1] != self.epoch:
            return (
                f"the KV pool holds nothing under {handle!r}: it was stored by an earlier run "
                f"of the pool (epoch {handle.split(':')[1]}, now {self.epoch}), so it was lost "
                f"when the pool restarted"
            )
        return f"the KV pool holds nothing under {handle!r} (never stored, or discarded)"


# -- the control protocol --------------------------------------------------------------------------


class ProtocolError(FabricError):
    """A control message could not be parsed, or the peer does not speak this protocol."""


def send_message(sock: socket.socket, message: Mapping[str, object]) -> None:
    """Send one control message: a u32 little-endian length, then UTF-8 JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one control message; None when the peer closed the connection cleanly."""
    head = _recv_exactly(sock, _LENGTH.size, allow_eof=True)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    body = _recv_exactly(sock, size, allow_eof=False)
    assert body is not None
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"control message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("control message is not a JSON object")
    return message


def _recv_exactly(sock: socket.socket, size: int, *, allow_eof: bool) -> bytes | None:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            if allow_eof and remaining == size:
                return None
            raise ConnectionResetError("the peer closed the connection mid-message")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


_ERRORS: Final[dict[str, type[FabricError]]] = {
    "pool_full": PoolFull,
    "unknown_handle": UnknownHandle,
}


def _error_reply(exc: Exception) -> dict[str, object]:
    code = next((c for c, cls in _ERRORS.items() if isinstance(exc, cls)), "bad_request")
    return {"ok": False, "error": code, "message": str(exc)}


# -- the pool's side of a fabric -------------------------------------------------------------------


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


def make_pool_endpoint(fabric: str, slab: np.ndarray[Any, Any], *, host: str, epoch: str) -> Any:
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


# -- the producer's side ---------------------------------------------------------------------------


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


# -- running a pool --------------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:7470"`` -> ``("127.0.0.1", 7470)``; IPv4 loopback only (else ConfigError)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"KV pool address must be HOST:PORT (e.g. {DEFAULT_LISTEN}); got {address!r}"
        )
    host = host or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"KV pool address {address!r} is not an IPv4 loopback address: this build's "
            f"fabrics move KV between processes on one host; use 127.0.0.1:PORT"
        )
    return host, int(port_text)


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"1G"``, ``"4096"`` -> bytes (binary units); ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise ConfigError(f"size must look like 4096, 512MiB or 1GiB; got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def faults_from_env() -> bool:
    """True when ``MERIDIAN_KVPOOL_FAULTS`` asks for fault injection."""
    return os.environ.get(FAULTS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def run_kvpool(
    fabric: str,
    listen: str = DEFAULT_LISTEN,
    *,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    quarantine_s: float = DEFAULT_QUARANTINE_S,
    fault_injection: bool = False,
    stop: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    metrics_port: int | None = None,
) -> int:
    """Serve a KV pool until ``stop`` is set or SIGTERM/SIGINT arrives; returns 0.

    Logs one line when serving, with the control address (the real port when ``listen`` asks
    for port 0), and calls ``on_ready(address)``. With ``metrics_port`` the pool reports frames
    stored and read, and its used and total bytes, through Meridian's metric catalogue on
    ``http://HOST:PORT/metrics`` (the same host as ``listen``). Raises ConfigError for bad
    arguments and FabricUnavailable when the fabric's library is missing.
    """
    if fabric not in POOL_FABRICS:
        raise ConfigError(
            f"kvpool --fabric must be one of {', '.join(POOL_FABRICS)}; got {fabric!r}"
        )
    host, port = parse_address(listen)
    metrics = metrics_server = None
    if metrics_port is not None:
        from meridian.telemetry.exporter import serve_metrics
        from meridian.telemetry.metrics import MeridianMetrics

        metrics = MeridianMetrics()
        metrics.set_kv_capacity_bytes(capacity_bytes)
        metrics_server, bound = serve_metrics(metrics, host=host, port=metrics_port)
        _log.info("meridian kvpool: metrics on http://%s:%d/metrics", host, bound)
    store = PoolStore(capacity_bytes, label=fabric, quarantine_s=quarantine_s, metrics=metrics)
    endpoint: PoolEndpoint = make_pool_endpoint(fabric, store.slab, host=host, epoch=store.epoch)
    stop = stop or threading.Event()
    try:
        server = KvPoolServer((host, port), store, endpoint, fault_injection=fault_injection)
    except OSError as exc:
        endpoint.close()
        raise FabricUnavailable(f"kvpool cannot listen on {listen}: {exc.strerror or exc}") from exc
    restore = _install_stop_signals(stop)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="kvpool-control")
    thread.start()
    address = f"{host}:{server.server_address[1]}"
    try:
        _log.info(
            "meridian kvpool: fabric %s listening on %s (capacity %d bytes, epoch %s%s)",
            fabric,
            address,
            capacity_bytes,
            store.epoch,
            ", fault injection ON" if fault_injection else "",
        )
        if on_ready is not None:
            on_ready(address)
        while not stop.wait(endpoint.progress_interval_s):
            endpoint.progress()
            store.reclaim()
            if metrics is not None:
                metrics.set_kv_used_bytes(Tier.THINK_COMPLETE, store.stats().stored_bytes)
    finally:
        if metrics_server is not None:
            from meridian.telemetry.exporter import stop_metrics_server

            stop_metrics_server(metrics_server)
        server.shutdown()
        server.server_close()
        thread.join()
        stats = store.stats()
        endpoint.close()
        restore()
        _log.info(
            "meridian kvpool: stopped; dropped %d frames (%d bytes)",
            stats.num_frames,
            stats.stored_bytes,
        )
    return 0


def _install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """Make SIGTERM and SIGINT set ``stop`` (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _log.info("meridian kvpool: %s received, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def build_parser() -> argparse.ArgumentParser:
    """The ``meridian kvpool`` / ``python -m meridian.disagg.kvpool`` arguments."""
    parser = argparse.ArgumentParser(
        prog="meridian kvpool",
        description="Hold offloaded KV blocks (MRDN frames) for Meridian producers.",
    )
    parser.add_argument("--fabric", required=True, choices=POOL_FABRICS, help="data plane")
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"control address, loopback (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--capacity", default="1GiB", help="slab size, e.g. 512MiB or 4GiB (default 1GiB)"
    )
    parser.add_argument(
        "--quarantine-s",
        type=float,
        default=DEFAULT_QUARANTINE_S,
        help="seconds an abandoned slot waits before reuse (late writes may still land)",
    )
    parser.add_argument(
        "--fault-injection",
        action="store_true",
        default=None,
        help=f"accept test-only fault ops (also {FAULTS_ENV}=1)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port of the --listen host (0: any free port)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        return run_kvpool(
            args.fabric,
            args.listen,
            capacity_bytes=parse_size(args.capacity),
            quarantine_s=args.quarantine_s,
            fault_injection=faults_from_env() if args.fault_injection is None else True,
            metrics_port=args.metrics_port,
        )
    except MeridianError as exc:
        print(f"meridian kvpool: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the canonical module's main, so that the fabrics (which import this module) and the
    # server share one copy of its classes.
    from meridian.disagg.kvpool import main as _main

    sys.exit(_main())
