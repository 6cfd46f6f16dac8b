"""Phase-aware tiered KV block manager.

Every owned block belongs to one request and one :class:`~meridian.core.types.Tier`
(``THINK_ACTIVE`` while its request thinks, ``THINK_COMPLETE`` after ``</think>``,
``OUTPUT_CRITICAL`` for prompt and answer blocks); the tier is the MRDN wire format's and the
offload layer's label. A block is ``LOCAL`` (it holds one of the ``num_blocks`` device slots) or
``OFFLOADED`` (its KV lives behind a disaggregation fabric; it stays owned but holds no slot).

Block ids are logical handles, not slot indices: an offloaded block keeps its id while its slot
is reused, so ids may exceed ``num_blocks`` once blocks are offloaded. Freed ids are reused.

Layout (what ``check_integrity`` verifies)::

    _blocks[block_id]     -> BlockLocation(request_id, tier, residency)    every owned block
    _requests[request_id] -> _RequestBlocks: per tier, its LOCAL and OFFLOADED block ids in
                             allocation order, and its logical last-touch time
    _lru[tier]            -> OrderedDict request_id -> that request's LOCAL blocks of the tier
                             (the same dict object), least recently touched request first

Recency is a logical counter, never wall time: ``allocate``, a demotion that moves blocks and
``ingest_block`` make a request the most recently touched one. Because every insertion into an
LRU map is also a touch, each map stays sorted by last-touch time.

NOTE: this manager serves the disaggregation layer (:mod:`meridian.disagg.offload`). The
simulator models vLLM's own block pool (:mod:`meridian.sim.kvcache`) and the vLLM integration
uses vLLM's; neither evicts blocks of a live request (its answer attends over them).
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import NoReturn

from meridian.config.schema import KvMemoryConfig
from meridian.core.types import Tier
from meridian.errors import ConfigError, FabricNotConfigured, MeridianError

_TIERS: tuple[Tier, ...] = tuple(Tier)

# An insertion-ordered set of block ids: ``popitem()`` removes the most recently added one.
_BlockSet = dict[int, None]


class Residency(enum.Enum):
    """Where a block's KV lives: in a local device slot, or behind the fabric."""

    LOCAL = "local"
    OFFLOADED = "offloaded"


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Owner, tier and residency of one owned block."""

    request_id: str
    tier: Tier
    residency: Residency


class OutOfBlocksError(MeridianError):
    """An allocation or ingest cannot be satisfied; nothing was changed."""


class BlockStateError(MeridianError):
    """A block id is not owned, or is not in the residency the operation needs."""


class BlockIntegrityError(AssertionError):
    """The block manager's bookkeeping is inconsistent (a bug, not a user error)."""


@dataclass(slots=True)
class _RequestBlocks:
    """One request's blocks, indexed by tier value; exists only while it owns a block."""

    last_touch: int
    local: tuple[_BlockSet, _BlockSet, _BlockSet]
    offloaded: tuple[_BlockSet, _BlockSet, _BlockSet]

    def num_blocks(self) -> int:
        return sum(len(s) for s in self.local) + sum(len(s) for s in self.offloaded)


class TieredBlockManager:
    """Allocates KV blocks per request and tier, and tracks which are offloaded.

    Invariants (checked by :meth:`check_integrity`):

    - ``num_free_blocks + sum(num_blocks_in_tier(t)) == num_blocks`` (offloaded blocks hold no
      slot); capacity is never exceeded.
    - Nothing is evicted implicitly: ``allocate`` raises :class:`OutOfBlocksError`.
    - Demotion is one-way: there is no API that moves a block to a higher tier.

    >>> mgr = TieredBlockManager(KvMemoryConfig(block_size_bytes=1024), capacity_bytes=8 * 1024)
    >>> mgr.allocate("r1", Tier.THINK_ACTIVE, 2)
    [0, 1]
    >>> mgr.demote_think_blocks("r1"), mgr.block_location(0).tier
    (2, <Tier.THINK_COMPLETE: 0>)
    """

    def __init__(self, config: KvMemoryConfig, capacity_bytes: int) -> None:
        block_size = config.block_size_bytes
        if capacity_bytes < block_size:
            raise ConfigError(
                f"kv_memory.capacity_bytes ({capacity_bytes}) is smaller than one block "
                f"(kv_memory.block_size_bytes = {block_size}): no KV block fits; raise the "
                f"capacity or lower the block size"
            )
        self._block_size_bytes = block_size
        self._num_blocks = capacity_bytes // block_size
        self._num_free = self._num_blocks
        self._num_local_by_tier = [0, 0, 0]
        self._num_offloaded = 0
        self._blocks: dict[int, BlockLocation] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self._lru: tuple[OrderedDict[str, _BlockSet], ...] = tuple(OrderedDict() for _ in _TIERS)
        self._free_ids: list[int] = []
        self._next_id = 0
        self._clock = 0
        self._fabric: object | None = None

    # -- sizes and counters -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Local block slots: ``capacity_bytes // block_size_bytes``."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Local slots not held by any block."""
        return self._num_free

    @property
    def capacity_bytes(self) -> int:
        """Usable capacity: ``num_blocks * block_size_bytes`` (a partial block is unusable)."""
        return self._num_blocks * self._block_size_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of local slots in use; offloaded blocks do not count."""
        return (self._num_blocks - self._num_free) * self._block_size_bytes

    @property
    def used_bytes_by_tier(self) -> dict[Tier, int]:
        """Bytes of local slots in use, per tier."""
        return {t: self._num_local_by_tier[t] * self._block_size_bytes for t in _TIERS}

    @property
    def num_offloaded_blocks(self) -> int:
        """Owned blocks whose KV is behind the fabric."""
        return self._num_offloaded

    @property
    def num_requests(self) -> int:
        """Requests owning at least one block (local or offloaded)."""
        return len(self._requests)

    def num_blocks_in_tier(self, tier: Tier) -> int:
        """Local blocks of ``tier`` (offloaded blocks hold no slot and are not counted)."""
        return self._num_local_by_tier[tier]

    # -- allocation -------------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, tier: Tier) -> bool:
        """True when ``num_blocks`` slots are free (any tier)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0; got {num_blocks}")
        return num_blocks <= self._num_free

    def allocate(self, request_id: str, tier: Tier, num_blocks: int = 1) -> list[int]:
        """Give ``request_id`` ``num_blocks`` new local blocks of ``tier``; returns their ids.

        Raises :class:`OutOfBlocksError` (changing nothing) unless ``can_allocate``; it never
        frees anything. Allocating touches the request.
        """
        if not self.can_allocate(num_blocks, tier):
            raise OutOfBlocksError(self._explain_shortage(request_id, tier, num_blocks))
        if num_blocks == 0:
            return []
        state = self._requests.get(request_id)
        if state is None:
            state = self._new_request(request_id)
        blocks = state.local[tier]
        location = BlockLocation(request_id, tier, Residency.LOCAL)
        ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.pop()
            else:
                block_id = self._next_id
                self._next_id += 1
            blocks[block_id] = None
            self._blocks[block_id] = location
            ids.append(block_id)
        self._num_free -= num_blocks
        self._num_local_by_tier[tier] += num_blocks
        self._lru[tier].setdefault(request_id, blocks)
        self._touch(request_id, state)
        return ids

    def free(self, request_id: str) -> int:
        """Release every block of ``request_id`` (local and offloaded); returns how many.

        Idempotent: an unknown or already freed request returns 0.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return 0
        num_freed = 0
        for tier in _TIERS:
            num_freed += self._release_all(request_id, state, tier)
        return num_freed

    # -- recency --------------------------------------------------------------------------------

    def last_touched(self, request_id: str) -> int | None:
        """The logical time ``request_id`` was last touched, or None if it owns no block."""
        state = self._requests.get(request_id)
        return None if state is None else state.last_touch

    # -- phase transitions ------------------------------------------------------------------------

    def demote_think_blocks(self, request_id: str) -> int:
        """At ``ExitThink``: move the request's THINK_ACTIVE blocks to THINK_COMPLETE.

        One-way: nothing ever promotes a block; every block stays owned (the answer attends
        over them). Returns the number of blocks demoted; 0 for an unknown request.
        """
        state = self._requests.get(request_id)
        if state is None:
            return 0
        active, complete = Tier.THINK_ACTIVE, Tier.THINK_COMPLETE
        num_local = len(state.local[active])
        num_offloaded = len(state.offloaded[active])
        if num_local + num_offloaded == 0:
            return 0
        for residency, sources, targets in (
            (Residency.LOCAL, state.local, state.local),
            (Residency.OFFLOADED, state.offloaded, state.offloaded),
        ):
            location = BlockLocation(request_id, complete, residency)
            for block_id in sources[active]:
                self._blocks[block_id] = location
                targets[complete][block_id] = None
            # clear() rather than a new dict: the LRU map holds this very object.
            sources[active].clear()
        self._num_local_by_tier[active] -= num_local
        self._num_local_by_tier[complete] += num_local
        self._lru[active].pop(request_id, None)
        if state.local[complete]:
            self._lru[complete].setdefault(request_id, state.local[complete])
        self._touch(request_id, state)
        return num_local + num_offloaded

    # -- queries ----------------------------------------------------------------------------------

    def blocks_for_request(self, request_id: str) -> list[int]:
        """Ids of every block ``request_id`` owns (local and offloaded), ascending."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        ids = [b for s in state.local for b in s] + [b for s in state.offloaded for b in s]
        return sorted(ids)

    def block_location(self, block_id: int) -> BlockLocation:
        """Owner, tier and residency of an owned block; :class:`BlockStateError` if it is free."""
        location = self._blocks.get(block_id)
        if location is None:
            raise BlockStateError(f"block {block_id} is not allocated (free or never handed out)")
        return location

    # -- disaggregation ---------------------------------------------------------------------------

    def attach_fabric(self, fabric: object) -> None:
        """Enable :meth:`offload_block`/:meth:`ingest_block` over ``fabric``.

        Only residency is tracked for now; the data transfer is wired by the disagg layer.
        """
        self._fabric = fabric

    @property
    def fabric_attached(self) -> bool:
        """True once :meth:`attach_fabric` was called."""
        return self._fabric is not None

    def offload_block(self, block_id: int) -> None:
        """Mark a LOCAL block OFFLOADED: its slot is freed, the block stays owned (same tier)."""
        self._require_fabric("offload_block")
        location = self.block_location(block_id)
        if location.residency is Residency.OFFLOADED:
            raise BlockStateError(f"offload_block: block {block_id} is already offloaded")
        request_id, tier = location.request_id, location.tier
        state = self._requests[request_id]
        del state.local[tier][block_id]
        if not state.local[tier]:
            del self._lru[tier][request_id]
        state.offloaded[tier][block_id] = None
        self._blocks[block_id] = BlockLocation(request_id, tier, Residency.OFFLOADED)
        self._num_free += 1
        self._num_local_by_tier[tier] -= 1
        self._num_offloaded += 1

    def ingest_block(self, block_id: int) -> None:
        """Bring an OFFLOADED block back into a free local slot; touches its request.

        Needs a free slot, else raises :class:`OutOfBlocksError`.
        """
        self._require_fabric("ingest_block")
        location = self.block_location(block_id)
        if location.residency is Residency.LOCAL:
            raise BlockStateError(f"ingest_block: block {block_id} is already local")
        request_id, tier = location.request_id, location.tier
        if not self.can_allocate(1, tier):
            raise OutOfBlocksError(self._explain_shortage(request_id, tier, 1))
        state = self._requests[request_id]
        del state.offloaded[tier][block_id]
        state.local[tier][block_id] = None
        self._lru[tier].setdefault(request_id, state.local[tier])
        self._blocks[block_id] = BlockLocation(request_id, tier, Residency.LOCAL)
        self._num_free -= 1
        self._num_local_by_tier[tier] += 1
        self._num_offloaded -= 1
        self._touch(request_id, state)

    # -- integrity --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Verify every invariant of the bookkeeping; raises :class:`BlockIntegrityError`."""

        def fail(message: str) -> NoReturn:
            raise BlockIntegrityError(f"TieredBlockManager: {message}")

        num_local = [0, 0, 0]
        num_offloaded = 0
        seen: set[int] = set()
        for request_id, state in self._requests.items():
            if state.num_blocks() == 0:
                fail(f"request {request_id!r} is tracked but owns no block")
            if not 0 < state.last_touch <= self._clock:
                fail(f"request {request_id!r} last_touch {state.last_touch} > {self._clock}")
            for tier in _TIERS:
                for residency, blocks in (
                    (Residency.LOCAL, state.local[tier]),
                    (Residency.OFFLOADED, state.offloaded[tier]),
                ):
                    for block_id in blocks:
                        want = BlockLocation(request_id, tier, residency)
                        if self._blocks.get(block_id) != want:
                            fail(f"block {block_id}: {self._blocks.get(block_id)} != {want}")
                        if block_id in seen:
                            fail(f"block {block_id} is held twice")
                        seen.add(block_id)
                num_local[tier] += len(state.local[tier])
                num_offloaded += len(state.offloaded[tier])
                in_lru = self._lru[tier].get(request_id)
                if state.local[tier] and in_lru is not state.local[tier]:
                    fail(f"request {request_id!r} has {tier.name} blocks but no LRU entry")
                if not state.local[tier] and in_lru is not None:
                    fail(f"request {request_id!r} has an LRU entry in {tier.name} but no blocks")
        if seen != self._blocks.keys():
            fail(f"blocks owned by nobody: {sorted(self._blocks.keys() - seen)[:10]}")
        free_ids = set(self._free_ids)
        if len(free_ids) != len(self._free_ids) or free_ids & seen:
            fail("the free id list has duplicates or owned ids")
        if free_ids | seen != set(range(self._next_id)):
            fail("a block id was lost (neither owned nor free)")
        if num_local != self._num_local_by_tier or num_offloaded != self._num_offloaded:
            fail(f"tier counts {self._num_local_by_tier} != recount {num_local}")
        if self._num_free + sum(num_local) != self._num_blocks or self._num_free < 0:
            fail(f"{self._num_free} free + {sum(num_local)} used != {self._num_blocks} blocks")
        for tier in _TIERS:
            touches = [self._requests[r].last_touch for r in self._lru[tier]]
            if any(a >= b for a, b in itertools.pairwise(touches)):
                fail(f"{tier.name} LRU map is not ordered by last touch")
            if self._lru[tier].keys() - self._requests.keys():
                fail(f"{tier.name} LRU map holds untracked requests")

    # -- internals --------------------------------------------------------------------------------

    def _new_request(self, request_id: str) -> _RequestBlocks:
        state = _RequestBlocks(0, ({}, {}, {}), ({}, {}, {}))
        self._requests[request_id] = state
        return state

    def _touch(self, request_id: str, state: _RequestBlocks) -> None:
        self._clock += 1
        state.last_touch = self._clock
        for tier in _TIERS:
            if state.local[tier]:
                self._lru[tier].move_to_end(request_id)

    def _release_all(self, request_id: str, state: _RequestBlocks, tier: Tier) -> int:
        """Free all of a request's blocks of one tier; the caller drops the request if empty."""
        local, offloaded = state.local[tier], state.offloaded[tier]
        num_local, num_offloaded = len(local), len(offloaded)
        for block_id in (*local, *offloaded):
            del self._blocks[block_id]
            self._free_ids.append(block_id)
        local.clear()
        offloaded.clear()
        self._lru[tier].pop(request_id, None)
        self._num_free += num_local
        self._num_local_by_tier[tier] -= num_local
        self._num_offloaded -= num_offloaded
        return num_local + num_offloaded

    def _require_fabric(self, operation: str) -> None:
        if self._fabric is None:
            raise FabricNotConfigured(
                f"{operation}: no KV fabric is attached; set [disagg] enabled = true and a "
                f"fabric (nixl, mooncake or inprocess) in meridian.toml"
            )

    def _explain_shortage(self, request_id: str, tier: Tier, num_blocks: int) -> str:
        return (
            f"cannot allocate {num_blocks} {tier.name} blocks for request {request_id!r}: "
            f"{self._num_free} of {self._num_blocks} blocks are free; free or preempt first"
        )
