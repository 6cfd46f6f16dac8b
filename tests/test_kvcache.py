"""The fast engine's block pool: vLLM's free queue and prefix cache, as the scheduler sees them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.sim.kvcache import KvCacheError, PrefixCachingBlockPool


def test_one_block_is_vllms_null_block() -> None:
    pool = PrefixCachingBlockPool(num_blocks=10, block_size=4)
    assert pool.num_usable_blocks == 9 and pool.num_free_blocks == 9
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2
    with pytest.raises(KvCacheError, match=">= 2 blocks"):
        PrefixCachingBlockPool(num_blocks=1, block_size=4)


def test_a_preempted_request_finds_its_full_computed_blocks_until_they_are_reused() -> None:
    pool = PrefixCachingBlockPool(num_blocks=7, block_size=4)  # 6 usable
    pool.allocate("a", 3)
    pool.cache("a", num_computed_tokens=10)  # blocks 0 and 1 are full; block 2 is partial
    pool.free("a")
    assert pool.num_free_blocks == 6
    # At most num_tokens - 1 tokens hit: the last token is always computed.
    assert pool.num_cached_prefix_tokens("a", num_tokens=11) == 8
    assert pool.num_cached_prefix_tokens("a", num_tokens=8) == 4
    # The partial block went to the front of the free queue, the cached ones to the back, tail
    # first: 4 blocks are the partial one and the 3 never used; then a's block 1, then block 0.
    pool.allocate("b", 4)
    assert pool.num_cached_prefix_tokens("a", num_tokens=11) == 8
    pool.allocate("c", 1)
    assert pool.num_cached_prefix_tokens("a", num_tokens=11) == 4
    pool.allocate("d", 1)
    assert pool.num_cached_prefix_tokens("a", num_tokens=11) == 0
    pool.check_integrity()


def test_taking_the_cached_prefix_back_holds_those_blocks() -> None:
    pool = PrefixCachingBlockPool(num_blocks=9, block_size=4)
    pool.allocate("a", 3)
    pool.cache("a", 12)
    pool.free("a")
    hit = pool.num_cached_prefix_tokens("a", num_tokens=13)
    assert hit == 12
    pool.take_cached_prefix("a", hit)
    assert pool.num_held("a") == 3 and pool.num_free_blocks == 5
    pool.allocate("a", 1)
    pool.check_integrity()
    with pytest.raises(KvCacheError, match="already holds blocks"):
        pool.take_cached_prefix("a", 4)
    with pytest.raises(KvCacheError, match="cannot allocate 9 blocks"):
        pool.allocate("z", 9)


def test_only_a_requests_own_blocks_match() -> None:
    pool = PrefixCachingBlockPool(num_blocks=5, block_size=2)
    pool.allocate("a", 2)
    pool.cache("a", 4)
    pool.free("a")
    assert pool.num_cached_prefix_tokens("b", num_tokens=5) == 0


def test_content_computed_again_elsewhere_moves_its_cache_entry() -> None:
    # a caches block 0, frees it, then allocates a fresh block and computes the same content
    # there instead of taking its cached copy back: one cache entry, on the new block.
    pool = PrefixCachingBlockPool(num_blocks=12, block_size=3)
    pool.allocate("a", 1)
    pool.cache("a", 3)
    pool.free("a")
    pool.allocate("a", 1)
    pool.cache("a", 3)
    pool.check_integrity()
    pool.free("a")
    assert pool.num_cached_prefix_tokens("a", num_tokens=4) == 3
    pool.take_cached_prefix("a", 3)
    pool.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 12)), max_size=60))
def test_random_operations_keep_the_pool_consistent(ops: list[tuple[int, int, int]]) -> None:
    """Allocate, compute (cache), free and re-admit at random: every block is free or held by
    one request, cached content survives exactly until its block is reused, and a re-admitted
    request never gets more than its own computed full blocks back."""
    pool = PrefixCachingBlockPool(num_blocks=12, block_size=3)
    computed: dict[str, int] = {}  # live requests' computed tokens
    for op, who, n in ops:
        rid = f"r{who}"
        if op == 0 and pool.num_free_blocks >= n % 4:
            if rid not in computed:
                computed[rid] = 0
            pool.allocate(rid, n % 4)
        elif op == 1 and rid in computed:
            tokens = min(computed[rid] + n, pool.num_held(rid) * 3)
            computed[rid] = tokens
            pool.cache(rid, tokens)
        elif op == 2 and rid in computed:
            pool.free(rid)
            done = computed.pop(rid)
            hit = pool.num_cached_prefix_tokens(rid, num_tokens=done + 1)
            assert hit % 3 == 0 and hit <= done
        elif op == 3 and rid not in computed:
            hit = pool.num_cached_prefix_tokens(rid, num_tokens=n * 3)
            if hit and pool.num_free_blocks >= hit // 3:
                pool.take_cached_prefix(rid, hit)
                computed[rid] = hit
        pool.check_integrity()
        assert sum(pool.num_held(r) for r in computed) + pool.num_free_blocks == 11
