"""The pool's store: a slab allocator and the frames it holds, by handle.

:class:`PoolStore` keeps the invariants listed in :mod:`meridian.disagg.kvpool`; it knows
nothing of sockets or fabrics (the control server in :mod:`~meridian.disagg.kvpool.server`
drives it).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from meridian.disagg.fabric import PoolFull, UnknownHandle
from meridian.disagg.offload import OffloadMetrics
from meridian.errors import ConfigError

DEFAULT_QUARANTINE_S: Final = 30.0
ALIGN_BYTES: Final = 64  # slots start on cache lines


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
        for index, offset in enumerate(self._free_offsets):
            free = self._free_sizes[offset]
            if free < size:
                continue
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
    :meth:`drop_owner` is called (the connection closed). See :mod:`meridian.disagg.kvpool`
    for the rules.
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
