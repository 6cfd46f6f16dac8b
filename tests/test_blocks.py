"""Tests of the phase-aware tiered KV block manager (``meridian.core.blocks``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from meridian.config.schema import KvMemoryConfig
from meridian.core.blocks import (
    BlockIntegrityError,
    BlockLocation,
    BlockStateError,
    OutOfBlocksError,
    Residency,
    TieredBlockManager,
)
from meridian.core.types import Tier
from meridian.errors import ConfigError, FabricNotConfigured

TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL
BLOCK = 1024


def make(num_blocks: int = 10) -> TieredBlockManager:
    return TieredBlockManager(KvMemoryConfig(block_size_bytes=BLOCK), num_blocks * BLOCK)


# -- construction and accounting -------------------------------------------------------------------


def test_sizes_round_down_to_whole_blocks() -> None:
    mgr = TieredBlockManager(KvMemoryConfig(block_size_bytes=BLOCK), 10 * BLOCK + 1000)
    assert mgr.num_blocks == 10
    assert mgr.num_free_blocks == 10
    assert mgr.capacity_bytes == 10 * BLOCK
    assert mgr.used_bytes == 0
    mgr.check_integrity()


def test_capacity_below_one_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="block_size_bytes"):
        TieredBlockManager(KvMemoryConfig(block_size_bytes=BLOCK), BLOCK - 1)


def test_allocate_hands_out_distinct_blocks_and_counts_them() -> None:
    mgr = make()
    a = mgr.allocate("a", TA, 3)
    b = mgr.allocate("b", OC, 2)
    assert len(set(a) | set(b)) == 5
    assert mgr.num_free_blocks == 5
    assert mgr.used_bytes == 5 * BLOCK
    assert mgr.num_blocks_in_tier(TA) == 3
    assert mgr.num_blocks_in_tier(OC) == 2
    assert mgr.num_blocks_in_tier(TC) == 0
    assert mgr.used_bytes_by_tier == {TC: 0, TA: 3 * BLOCK, OC: 2 * BLOCK}
    assert mgr.blocks_for_request("a") == sorted(a)
    assert mgr.block_location(b[0]) == BlockLocation("b", OC, Residency.LOCAL)
    assert mgr.num_requests == 2
    mgr.check_integrity()


def test_allocate_zero_blocks_is_a_no_op() -> None:
    mgr = make()
    assert mgr.allocate("a", OC, 0) == []
    assert mgr.num_requests == 0
    with pytest.raises(ValueError, match="num_blocks must be >= 0"):
        mgr.allocate("a", OC, -1)


@pytest.mark.parametrize("tier", list(Tier))
def test_can_allocate_respects_free_blocks_in_every_tier(tier: Tier) -> None:
    mgr = make(4)
    assert mgr.can_allocate(4, tier)
    assert not mgr.can_allocate(5, tier)
    mgr.allocate("a", tier, 3)
    assert mgr.can_allocate(1, tier)
    assert not mgr.can_allocate(2, tier)
    mgr.allocate("b", tier, 1)
    assert mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_failed_allocate_changes_nothing_and_frees_nothing() -> None:
    mgr = make(4)
    a = mgr.allocate("a", TC, 2)
    b = mgr.allocate("b", OC, 2)
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 1 OUTPUT_CRITICAL .*'c'"):
        mgr.allocate("c", OC, 1)
    assert mgr.num_blocks_in_tier(TC) == 2
    assert mgr.blocks_for_request("c") == []
    assert mgr.blocks_for_request("a") == sorted(a)
    assert mgr.blocks_for_request("b") == sorted(b)
    assert mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_free_releases_everything_and_is_idempotent() -> None:
    mgr = make()
    ids = mgr.allocate("a", TA, 2) + mgr.allocate("a", OC, 3)
    assert mgr.free("a") == 5
    assert mgr.free("a") == 0
    assert mgr.free("never-seen") == 0
    assert mgr.num_free_blocks == mgr.num_blocks
    assert mgr.num_requests == 0
    assert mgr.last_touched("a") is None
    for block_id in ids:
        with pytest.raises(BlockStateError, match="not allocated"):
            mgr.block_location(block_id)
    # Freed ids are handed out again.
    assert set(mgr.allocate("b", OC, 5)) == set(ids)
    mgr.check_integrity()


# -- recency --------------------------------------------------------------------------------------


def test_recency_is_logical_and_advanced_by_allocate_and_demotion() -> None:
    mgr = make()
    assert mgr.last_touched("ghost") is None
    mgr.allocate("a", OC)
    mgr.allocate("b", TA)
    first_a, first_b = mgr.last_touched("a"), mgr.last_touched("b")
    assert first_a is not None and first_b is not None and first_b > first_a
    mgr.allocate("a", OC)
    touched_a = mgr.last_touched("a")
    assert touched_a is not None and touched_a > first_b
    assert mgr.demote_think_blocks("b") == 1
    demoted_b = mgr.last_touched("b")
    assert demoted_b is not None and demoted_b > touched_a
    # A demotion that moves nothing does not touch; a zero-block allocation neither.
    assert mgr.demote_think_blocks("a") == 0
    assert mgr.allocate("a", OC, 0) == []
    assert mgr.last_touched("a") == touched_a
    mgr.check_integrity()


# -- demotion --------------------------------------------------------------------------------------


def test_demotion_moves_think_active_to_think_complete() -> None:
    mgr = make(10)
    think = mgr.allocate("a", TA, 3)
    out = mgr.allocate("a", OC, 1)
    assert mgr.demote_think_blocks("a") == 3
    assert {mgr.block_location(b).tier for b in think} == {TC}
    assert mgr.block_location(out[0]).tier is OC
    assert mgr.num_blocks_in_tier(TA) == 0
    assert mgr.num_blocks_in_tier(TC) == 3
    assert mgr.demote_think_blocks("a") == 0
    assert mgr.demote_think_blocks("ghost") == 0
    mgr.check_integrity()


def test_demotion_is_one_way() -> None:
    mgr = make(10)
    old = mgr.allocate("a", TA, 2)
    mgr.demote_think_blocks("a")
    new = mgr.allocate("a", TA, 1)  # more thinking creates new blocks; old ones stay demoted
    assert [mgr.block_location(b).tier for b in old] == [TC, TC]
    assert mgr.block_location(new[0]).tier is TA
    assert (mgr.num_blocks_in_tier(TC), mgr.num_blocks_in_tier(TA)) == (2, 1)
    mgr.check_integrity()


# -- fabric ----------------------------------------------------------------------------------------


def test_offload_and_ingest_need_a_fabric() -> None:
    mgr = make()
    [block] = mgr.allocate("a", TC)
    assert not mgr.fabric_attached
    with pytest.raises(FabricNotConfigured, match=r"\[disagg\] enabled = true"):
        mgr.offload_block(block)
    with pytest.raises(FabricNotConfigured, match="ingest_block"):
        mgr.ingest_block(block)
    assert mgr.block_location(block).residency is Residency.LOCAL


def test_offload_frees_the_slot_and_keeps_ownership() -> None:
    mgr = make(4)
    mgr.attach_fabric(object())
    assert mgr.fabric_attached
    blocks = mgr.allocate("a", TC, 2)
    mgr.offload_block(blocks[0])
    assert mgr.block_location(blocks[0]) == BlockLocation("a", TC, Residency.OFFLOADED)
    assert mgr.num_free_blocks == 3
    assert mgr.used_bytes == BLOCK
    assert mgr.num_blocks_in_tier(TC) == 1
    assert mgr.num_offloaded_blocks == 1
    assert mgr.blocks_for_request("a") == sorted(blocks)
    with pytest.raises(BlockStateError, match="already offloaded"):
        mgr.offload_block(blocks[0])
    mgr.check_integrity()
    # The freed slot is reusable while the offloaded block keeps its id.
    others = mgr.allocate("b", OC, 3)
    assert not set(blocks) & set(others)
    assert mgr.num_free_blocks == 0
    assert mgr.block_location(blocks[0]) == BlockLocation("a", TC, Residency.OFFLOADED)
    mgr.check_integrity()


def test_ingest_needs_a_free_slot() -> None:
    mgr = make(4)
    mgr.attach_fabric(object())
    [block] = mgr.allocate("a", TC)
    mgr.offload_block(block)
    mgr.allocate("c", OC, 4)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 1 THINK_COMPLETE"):
        mgr.ingest_block(block)
    assert mgr.block_location(block).residency is Residency.OFFLOADED
    mgr.check_integrity()
    mgr.free("c")
    mgr.ingest_block(block)
    assert mgr.block_location(block).residency is Residency.LOCAL
    assert mgr.num_offloaded_blocks == 0
    with pytest.raises(BlockStateError, match="already local"):
        mgr.ingest_block(block)
    mgr.check_integrity()


def test_free_and_demote_cover_offloaded_blocks() -> None:
    mgr = make(10)
    mgr.attach_fabric(object())
    think = mgr.allocate("a", TA, 2)
    mgr.offload_block(think[0])
    assert mgr.demote_think_blocks("a") == 2
    assert mgr.block_location(think[0]) == BlockLocation("a", TC, Residency.OFFLOADED)
    assert mgr.block_location(think[1]) == BlockLocation("a", TC, Residency.LOCAL)
    assert mgr.free("a") == 2
    assert mgr.num_offloaded_blocks == 0
    assert mgr.num_free_blocks == 10
    mgr.check_integrity()


def test_offloading_the_last_local_block_leaves_no_lru_entry() -> None:
    mgr = make(4)
    mgr.attach_fabric(object())
    [block] = mgr.allocate("a", TA)
    mgr.offload_block(block)
    assert "a" not in mgr._lru[TA]
    mgr.check_integrity()
    mgr.allocate("b", OC, 4)
    mgr.free("b")
    mgr.ingest_block(block)  # back in a slot: the request is in the LRU map again
    assert list(mgr._lru[TA]) == ["a"]
    mgr.check_integrity()


# -- integrity -------------------------------------------------------------------------------------


def test_check_integrity_detects_corruption() -> None:
    mgr = make()
    mgr.allocate("a", TA, 2)
    mgr.check_integrity()
    mgr._num_free += 1
    with pytest.raises(BlockIntegrityError, match="free"):
        mgr.check_integrity()
    mgr._num_free -= 1
    mgr._blocks[next(iter(mgr._blocks))] = BlockLocation("a", OC, Residency.LOCAL)
    with pytest.raises(BlockIntegrityError, match="block"):
        mgr.check_integrity()


def test_check_integrity_detects_a_leaked_id() -> None:
    mgr = make()
    mgr.allocate("a", OC, 2)
    mgr.free("a")
    mgr._free_ids.pop()
    with pytest.raises(BlockIntegrityError, match="lost"):
        mgr.check_integrity()


# -- property-based: a random sequence of operations -----------------------------------------------

REQUESTS = ("r0", "r1", "r2", "r3", "r4")
NUM_BLOCKS = 24


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager with random operations and checks it against a light model.

    The model tracks each owned block's owner/tier/residency and each request's recency, and
    verifies properties of what the manager did rather than re-implementing its choices.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mgr = make(NUM_BLOCKS)
        self.owned: dict[int, BlockLocation] = {}
        self.recency: dict[str, int] = {}
        self.clock = 0

    @initialize(fabric=st.booleans())
    def setup(self, fabric: bool) -> None:
        self.mgr = make(NUM_BLOCKS)
        if fabric:
            self.mgr.attach_fabric(object())

    def _touch(self, request_id: str) -> None:
        self.clock += 1
        self.recency[request_id] = self.clock

    def _request_blocks(self, request_id: str) -> set[int]:
        return {b for b, loc in self.owned.items() if loc.request_id == request_id}

    def _drop_unowned_requests(self) -> None:
        holders = {loc.request_id for loc in self.owned.values()}
        self.recency = {r: t for r, t in self.recency.items() if r in holders}

    def _num_local(self) -> int:
        return sum(1 for loc in self.owned.values() if loc.residency is Residency.LOCAL)

    def _local_in_tier(self, tier: Tier) -> int:
        return sum(
            1
            for loc in self.owned.values()
            if loc.tier is tier and loc.residency is Residency.LOCAL
        )

    @rule(
        request_id=st.sampled_from(REQUESTS),
        tier=st.sampled_from(list(Tier)),
        num_blocks=st.integers(1, 8),
    )
    def allocate(self, request_id: str, tier: Tier, num_blocks: int) -> None:
        expected = self._num_local() + num_blocks <= NUM_BLOCKS
        assert self.mgr.can_allocate(num_blocks, tier) == expected
        if not expected:
            with pytest.raises(OutOfBlocksError):
                self.mgr.allocate(request_id, tier, num_blocks)
            return
        ids = self.mgr.allocate(request_id, tier, num_blocks)
        assert len(ids) == num_blocks and not set(ids) & self.owned.keys()
        for block_id in ids:
            self.owned[block_id] = BlockLocation(request_id, tier, Residency.LOCAL)
        self._touch(request_id)

    @rule(request_id=st.sampled_from(REQUESTS))
    def free(self, request_id: str) -> None:
        mine = self._request_blocks(request_id)
        assert self.mgr.free(request_id) == len(mine)
        assert self.mgr.free(request_id) == 0
        for block_id in mine:
            del self.owned[block_id]
        self._drop_unowned_requests()

    @rule(request_id=st.sampled_from(REQUESTS))
    def demote(self, request_id: str) -> None:
        mine = self._request_blocks(request_id)
        active = {b for b in mine if self.owned[b].tier is TA}
        complete = {b for b in mine if self.owned[b].tier is TC}
        assert self.mgr.demote_think_blocks(request_id) == len(active)
        for block_id in active:
            self.owned[block_id] = BlockLocation(request_id, TC, self.owned[block_id].residency)
        if active:
            self._touch(request_id)
        # One-way: nothing this request held as THINK_COMPLETE is in a higher tier now.
        for block_id in complete:
            assert self.mgr.block_location(block_id).tier is TC

    @precondition(lambda self: bool(self.owned))
    @rule(data=st.data())
    def offload_or_ingest(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.owned)))
        loc = self.owned[block_id]
        if not self.mgr.fabric_attached:
            with pytest.raises(FabricNotConfigured):
                self.mgr.offload_block(block_id)
            with pytest.raises(FabricNotConfigured):
                self.mgr.ingest_block(block_id)
            return
        if loc.residency is Residency.LOCAL:
            self.mgr.offload_block(block_id)
            self.owned[block_id] = BlockLocation(loc.request_id, loc.tier, Residency.OFFLOADED)
        elif self._num_local() < NUM_BLOCKS:
            self.mgr.ingest_block(block_id)
            self.owned[block_id] = BlockLocation(loc.request_id, loc.tier, Residency.LOCAL)
            self._touch(loc.request_id)
        else:
            with pytest.raises(OutOfBlocksError):
                self.mgr.ingest_block(block_id)

    @invariant()
    def integrity(self) -> None:
        self.mgr.check_integrity()

    @invariant()
    def matches_model(self) -> None:
        mgr = self.mgr
        local = self._num_local()
        assert mgr.num_free_blocks == NUM_BLOCKS - local >= 0
        assert mgr.used_bytes == local * BLOCK <= mgr.capacity_bytes
        assert mgr.num_offloaded_blocks == len(self.owned) - local
        assert mgr.num_requests == len(self.recency)
        for tier in Tier:
            assert mgr.num_blocks_in_tier(tier) == self._local_in_tier(tier)
        for block_id, loc in self.owned.items():
            assert mgr.block_location(block_id) == loc
        for request_id in REQUESTS:
            mine = self._request_blocks(request_id)
            assert mgr.blocks_for_request(request_id) == sorted(mine)
            assert (mgr.last_touched(request_id) is None) == (request_id not in self.recency)
        # Recency: the manager orders requests by last touch exactly as the model does.
        by_model = sorted(self.recency, key=self.recency.__getitem__)
        assert sorted(self.recency, key=lambda r: mgr.last_touched(r) or 0) == by_model

    def teardown(self) -> None:
        # No leaks: once every request is freed, every slot is free again.
        for request_id in REQUESTS:
            self.mgr.free(request_id)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.num_offloaded_blocks == 0
        assert self.mgr.num_requests == 0
        self.mgr.check_integrity()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
