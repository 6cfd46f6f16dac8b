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
    EvictedBlock,
    OutOfBlocksError,
    Residency,
    TieredBlockManager,
)
from meridian.core.types import Tier
from meridian.errors import ConfigError, FabricNotConfigured

TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL
BLOCK = 1024


def make(
    num_blocks: int = 10, *, think_fraction: float = 0.5, aggressive: bool = False
) -> TieredBlockManager:
    config = KvMemoryConfig(
        block_size_bytes=BLOCK,
        think_phase_memory_fraction=think_fraction,
        aggressive_think_eviction=aggressive,
    )
    return TieredBlockManager(config, num_blocks * BLOCK)


# -- construction and accounting -------------------------------------------------------------------


def test_sizes_round_down_to_whole_blocks() -> None:
    config = KvMemoryConfig(block_size_bytes=BLOCK, think_phase_memory_fraction=0.3)
    mgr = TieredBlockManager(config, 10 * BLOCK + 1000)
    assert mgr.num_blocks == 10
    assert mgr.num_free_blocks == 10
    assert mgr.capacity_bytes == 10 * BLOCK
    assert mgr.used_bytes == 0
    assert mgr.think_block_budget == 3
    mgr.check_integrity()


def test_think_budget_is_not_lowered_by_float_noise() -> None:
    # 0.29 * 100 is 28.999999999999996 in binary floating point; the budget is 29 blocks.
    assert make(100, think_fraction=0.29).think_block_budget == 29


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


def test_can_allocate_respects_free_blocks() -> None:
    mgr = make(4)
    assert mgr.can_allocate(4, OC)
    assert not mgr.can_allocate(5, OC)
    mgr.allocate("a", OC, 3)
    assert mgr.can_allocate(1, OC)
    assert not mgr.can_allocate(2, OC)


def test_think_cap_limits_both_think_tiers_but_not_output() -> None:
    mgr = make(10, think_fraction=0.4)  # think budget: 4 blocks
    mgr.allocate("a", TA, 3)
    mgr.allocate("b", TC, 1)
    assert not mgr.can_allocate(1, TA)
    assert not mgr.can_allocate(1, TC)
    assert mgr.can_allocate(6, OC)
    with pytest.raises(OutOfBlocksError, match="think_phase_memory_fraction"):
        mgr.allocate("c", TA, 1)
    mgr.allocate("c", OC, 6)
    assert mgr.num_free_blocks == 0


def test_failed_allocate_changes_nothing_and_never_evicts() -> None:
    mgr = make(4)
    mgr.allocate("a", TC, 2)
    mgr.allocate("b", OC, 2)
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 1 OUTPUT_CRITICAL .*'c'"):
        mgr.allocate("c", OC, 1)
    assert mgr.num_blocks_in_tier(TC) == 2
    assert mgr.blocks_for_request("c") == []
    assert mgr.evictions_by_tier == {TC: 0, TA: 0, OC: 0}
    mgr.check_integrity()


def test_free_releases_everything_and_is_idempotent() -> None:
    mgr = make()
    ids = mgr.allocate("a", TA, 2) + mgr.allocate("a", OC, 3)
    assert mgr.free("a") == 5
    assert mgr.free("a") == 0
    assert mgr.free("never-seen") == 0
    assert mgr.num_free_blocks == mgr.num_blocks
    assert mgr.request_tier("a") is None
    for block_id in ids:
        with pytest.raises(BlockStateError, match="not allocated"):
            mgr.block_location(block_id)
    # Freed ids are handed out again.
    assert set(mgr.allocate("b", OC, 5)) == set(ids)
    mgr.check_integrity()


def test_request_tier_is_the_highest_tier_held() -> None:
    mgr = make()
    assert mgr.request_tier("a") is None
    mgr.allocate("a", TC)
    assert mgr.request_tier("a") is TC
    mgr.allocate("a", OC)
    mgr.allocate("a", TA)
    assert mgr.request_tier("a") is OC


# -- eviction --------------------------------------------------------------------------------------


def test_evict_takes_lowest_tier_first() -> None:
    mgr = make(10)
    mgr.allocate("out", OC, 3)
    mgr.allocate("act", TA, 2)
    mgr.allocate("done", TC, 2)
    mgr.touch("done")  # recency must not beat tier order
    evicted = mgr.evict_for(mgr.num_free_blocks + 3)
    assert [e.tier for e in evicted] == [TC, TC, TA]
    assert [e.request_id for e in evicted] == ["done", "done", "act"]
    assert mgr.num_free_blocks == 6
    assert mgr.evictions_by_tier == {TC: 2, TA: 1, OC: 0}
    assert mgr.num_output_critical_evictions == 0
    mgr.check_integrity()


def test_evict_least_recently_touched_request_first_and_tail_blocks_first() -> None:
    mgr = make(10, think_fraction=0.9)
    a = mgr.allocate("a", TC, 2)
    b = mgr.allocate("b", TC, 2)
    c = mgr.allocate("c", TC, 2)
    mgr.touch("a")  # recency now: b, c, a
    evicted = mgr.evict_for(mgr.num_free_blocks + 3)
    assert evicted == [
        EvictedBlock(b[1], "b", TC),
        EvictedBlock(b[0], "b", TC),
        EvictedBlock(c[1], "c", TC),
    ]
    assert mgr.blocks_for_request("c") == [c[0]]
    assert mgr.blocks_for_request("a") == sorted(a)
    assert mgr.request_tier("b") is None  # fully evicted requests are forgotten
    assert mgr.last_touched("b") is None
    mgr.check_integrity()


def test_evict_for_nothing_when_enough_is_free() -> None:
    mgr = make(10)
    mgr.allocate("a", TC, 2)
    assert mgr.evict_for(8) == []
    assert mgr.evict_for(0) == []
    assert mgr.num_blocks_in_tier(TC) == 2


def test_evict_for_respects_max_tier_and_is_atomic_when_impossible() -> None:
    mgr = make(10)
    mgr.allocate("done", TC, 2)
    mgr.allocate("out", OC, 8)
    assert mgr.can_evict_for(2, max_tier=TA)
    assert not mgr.can_evict_for(3, max_tier=TA)
    with pytest.raises(OutOfBlocksError, match="up to THINK_ACTIVE"):
        mgr.evict_for(3, max_tier=TA)
    assert mgr.num_blocks_in_tier(TC) == 2  # nothing was evicted
    assert len(mgr.evict_for(2, max_tier=TA)) == 2
    with pytest.raises(OutOfBlocksError):
        mgr.evict_for(11)


def test_output_critical_evictions_are_counted() -> None:
    mgr = make(4)
    mgr.allocate("a", TA, 1)
    mgr.allocate("b", OC, 3)
    evicted = mgr.evict_for(3)
    assert [e.tier for e in evicted] == [TA, OC, OC]
    assert mgr.num_output_critical_evictions == 2
    assert mgr.evictions_by_tier[OC] == 2
    mgr.check_integrity()


def test_evictions_by_tier_is_a_copy() -> None:
    mgr = make()
    mgr.evictions_by_tier[OC] = 99
    assert mgr.num_output_critical_evictions == 0


def test_touch_is_logical_and_unknown_requests_are_ignored() -> None:
    mgr = make()
    mgr.allocate("a", OC)
    mgr.allocate("b", OC)
    first_a = mgr.last_touched("a")
    assert first_a is not None
    mgr.touch("a")
    touched_a, touched_b = mgr.last_touched("a"), mgr.last_touched("b")
    assert touched_a is not None and touched_b is not None
    assert touched_a > touched_b > first_a
    mgr.touch("ghost")
    assert mgr.last_touched("ghost") is None
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
    assert mgr.request_tier("a") is TA
    mgr.check_integrity()


def test_demoted_blocks_are_evicted_before_active_think() -> None:
    mgr = make(10)
    mgr.allocate("thinker", TA, 2)
    mgr.allocate("done", TA, 2)
    mgr.demote_think_blocks("done")  # also the most recently touched
    evicted = mgr.evict_for(mgr.num_free_blocks + 2)
    assert {e.request_id for e in evicted} == {"done"}


def test_aggressive_demotion_frees_think_blocks() -> None:
    mgr = make(10, aggressive=True)
    mgr.allocate("a", TA, 3)
    mgr.allocate("a", TC, 1)
    out = mgr.allocate("a", OC, 2)
    assert mgr.demote_think_blocks("a") == 4
    assert mgr.blocks_for_request("a") == sorted(out)
    assert mgr.num_free_blocks == 8
    assert mgr.evictions_by_tier == {TC: 0, TA: 0, OC: 0}  # a policy free, not an eviction
    mgr.allocate("b", TA, 1)
    assert mgr.demote_think_blocks("b") == 1
    assert mgr.num_requests == 1
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
    # Offloaded blocks hold no slot, so eviction never returns them.
    evicted = mgr.evict_for(4)
    assert [e.block_id for e in evicted] == [blocks[1]]
    assert mgr.request_tier("a") is TC
    mgr.check_integrity()
    # The freed slot is reusable while the offloaded block keeps its id.
    others = mgr.allocate("b", OC, 4)
    assert blocks[0] not in others
    mgr.check_integrity()


def test_ingest_needs_a_free_slot_and_think_budget() -> None:
    mgr = make(4, think_fraction=0.5)  # think budget: 2 blocks
    mgr.attach_fabric(object())
    [block] = mgr.allocate("a", TC)
    mgr.offload_block(block)
    mgr.allocate("b", TA, 2)
    with pytest.raises(OutOfBlocksError, match="think"):
        mgr.ingest_block(block)
    mgr.free("b")
    mgr.allocate("c", OC, 4)
    with pytest.raises(OutOfBlocksError):
        mgr.ingest_block(block)
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
    mgr.allocate("b", OC, 4)
    assert not mgr.can_evict_for(5)
    assert [e.request_id for e in mgr.evict_for(1)] == ["b"]
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
        self.aggressive = False

    @initialize(
        aggressive=st.booleans(),
        fabric=st.booleans(),
        think_fraction=st.sampled_from([0.1, 0.4, 0.75, 0.99]),
    )
    def setup(self, aggressive: bool, fabric: bool, think_fraction: float) -> None:
        self.aggressive = aggressive
        self.mgr = make(NUM_BLOCKS, think_fraction=think_fraction, aggressive=aggressive)
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
        think = self._local_in_tier(TA) + self._local_in_tier(TC)
        local = sum(1 for loc in self.owned.values() if loc.residency is Residency.LOCAL)
        expected = local + num_blocks <= NUM_BLOCKS and (
            tier is OC or think + num_blocks <= self.mgr.think_block_budget
        )
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
    def touch(self, request_id: str) -> None:
        self.mgr.touch(request_id)
        if request_id in self.recency:
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
        affected = self.mgr.demote_think_blocks(request_id)
        if self.aggressive:
            assert affected == len(active) + len(complete)
            for block_id in active | complete:
                del self.owned[block_id]
            self._drop_unowned_requests()
        else:
            assert affected == len(active)
            for block_id in active:
                self.owned[block_id] = BlockLocation(request_id, TC, self.owned[block_id].residency)
            if active:
                self._touch(request_id)
        # One-way: nothing this request held as THINK_COMPLETE is in a higher tier now.
        for block_id in complete:
            if block_id in self.owned:
                assert self.mgr.block_location(block_id).tier is TC

    @rule(
        extra=st.integers(0, NUM_BLOCKS),
        max_tier=st.sampled_from(list(Tier)),
    )
    def evict(self, extra: int, max_tier: Tier) -> None:
        target = min(NUM_BLOCKS + 1, self.mgr.num_free_blocks + extra)
        reclaimable = sum(self._local_in_tier(t) for t in Tier if t <= max_tier)
        possible = self.mgr.num_free_blocks + reclaimable >= target
        assert self.mgr.can_evict_for(target, max_tier=max_tier) == possible
        if not possible:
            before = dict(self.owned)
            with pytest.raises(OutOfBlocksError):
                self.mgr.evict_for(target, max_tier=max_tier)
            assert all(self.mgr.block_location(b) == loc for b, loc in before.items())
            return
        free_before = self.mgr.num_free_blocks
        local_before = {t: self._local_in_tier(t) for t in Tier}
        evicted = self.mgr.evict_for(target, max_tier=max_tier)
        assert self.mgr.num_free_blocks >= target
        assert len(evicted) == max(0, target - free_before)  # never more than needed
        tiers = [e.tier for e in evicted]
        assert tiers == sorted(tiers)
        for e in evicted:
            assert e.tier <= max_tier
            loc = self.owned.pop(e.block_id)
            assert (loc.request_id, loc.tier, loc.residency) == (
                e.request_id,
                e.tier,
                Residency.LOCAL,
            )
            # Never a higher tier while a lower tier still had blocks.
            taken_below = sum(1 for x in evicted if x.tier < e.tier)
            assert taken_below == sum(local_before[t] for t in Tier if t < e.tier)
        for tier in Tier:
            order = [e.request_id for e in evicted if e.tier is tier]
            groups = [r for i, r in enumerate(order) if i == 0 or order[i - 1] != r]
            assert len(groups) == len(set(groups)), "a request's tier blocks go together"
            touches = [self.recency[r] for r in groups]
            assert touches == sorted(touches), "least recently touched first"
            if groups:
                # Every request still holding local blocks of this tier is more recent than
                # the fully evicted ones (the last group may be partial).
                still = {
                    loc.request_id
                    for loc in self.owned.values()
                    if loc.tier is tier and loc.residency is Residency.LOCAL
                }
                for r in groups[:-1]:
                    assert r not in still
                assert all(self.recency[r] >= touches[-1] for r in still)
        self._drop_unowned_requests()

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
        elif self.mgr.can_allocate(1, loc.tier):
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
        local = sum(1 for loc in self.owned.values() if loc.residency is Residency.LOCAL)
        assert mgr.num_free_blocks == NUM_BLOCKS - local >= 0
        assert mgr.used_bytes == local * BLOCK <= mgr.capacity_bytes
        assert mgr.num_blocks_in_tier(TA) + mgr.num_blocks_in_tier(TC) <= mgr.think_block_budget
        for tier in Tier:
            assert mgr.num_blocks_in_tier(tier) == self._local_in_tier(tier)
        for block_id, loc in self.owned.items():
            assert mgr.block_location(block_id) == loc
        for request_id in REQUESTS:
            mine = self._request_blocks(request_id)
            assert mgr.blocks_for_request(request_id) == sorted(mine)
            want = max((self.owned[b].tier for b in mine), default=None)
            assert mgr.request_tier(request_id) == want
        assert mgr.num_output_critical_evictions == mgr.evictions_by_tier[OC]

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
