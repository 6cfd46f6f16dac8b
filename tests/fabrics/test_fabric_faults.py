"""Fault injection against a real kvpool process: killed mid-transfer, corrupted frames, a full
pool, a hung pool. Each ends in a recompute fallback (through OffloadManager) or a clear error,
with no lost or wrong KV, and the producer keeps working once the pool is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from fabric_support import (
    BLOCK_BYTES,
    FABRICS,
    TC,
    KvHarness,
    PoolProcess,
    fabric_for,
    kv_block,
)

from meridian.core.blocks import Residency
from meridian.disagg.fabric import FabricTimeout, FabricUnavailable, PoolFull, UnknownHandle
from meridian.disagg.offload import OffloadState
from meridian.disagg.wire import HEADER_SIZE, encode

StartPool = Callable[..., PoolProcess]
pytestmark = pytest.mark.parametrize("fabric_name", FABRICS)
FRAME_BYTES = BLOCK_BYTES + HEADER_SIZE


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_pool_killed_mid_push_keeps_blocks_local_and_offload_resumes_after_restart(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name)
    with KvHarness(fabric_for(pool), threshold=4) as h:
        ids = h.think("r1", 4)
        control = pool.control()
        # The pool stores the first frame's bytes, then hangs before acknowledging it ...
        control.stall_next_commit(30.0)
        h.manager.on_exit_think("r1")
        wait_for(lambda: control.stats().num_reserved == 1)
        # ... and dies there: the push is mid-transfer (written, never acknowledged).
        pool.kill()
        assert h.manager.drain(20.0)
        counters = h.manager.counters
        assert counters.num_push_failures == 1 and counters.num_blocks_offloaded == 0
        assert h.state() is OffloadState.BACKING_OFF
        assert h.residency(ids) == [Residency.LOCAL] * 4  # nothing was lost
        h.assert_no_wrong_kv()

        pool.start()  # same port, new epoch
        h.retry_until_offloaded(ids)
        assert h.state() is OffloadState.FLOWING
        result = h.manager.ingest_request("r1")
        assert not result.needs_recompute
        h.assert_no_wrong_kv()
        assert all(h.device[b] == h.truth[b] for b in ids)


def test_pool_killed_with_frames_pooled_falls_back_to_recompute_and_producer_recovers(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name)
    with KvHarness(fabric_for(pool), threshold=4) as h:
        lost = h.think("lost", 3)
        h.offload("lost")
        assert h.residency(lost) == [Residency.OFFLOADED] * 3

        pool.kill()
        result = h.manager.ingest_request("lost")
        assert result.fallback == tuple(lost) and not result.ingested  # pool down: recompute
        assert h.residency(lost) == [Residency.OFFLOADED] * 3  # nothing wrong was written
        assert all(h.device[b] != h.truth[b] for b in lost)
        assert h.manager.num_pooled_blocks == 3  # a transient failure keeps the handles

        pool.start()  # the restarted pool lost every frame: old handles are unknown
        result = h.manager.ingest_request("lost")
        assert result.fallback == tuple(lost)
        assert h.manager.num_pooled_blocks == 0
        counters = h.manager.counters
        assert counters.num_pull_failures == 6 and counters.num_fallbacks == 6
        h.assert_no_wrong_kv()

        fresh = h.think("fresh", 5)  # the producer keeps working against the new pool
        h.offload("fresh")
        assert h.residency(fresh) == [Residency.OFFLOADED] * 5
        assert not h.manager.ingest_request("fresh").needs_recompute
        assert all(h.device[b] == h.truth[b] for b in fresh)
        h.assert_no_wrong_kv()


def test_corrupted_frames_in_the_pool_are_caught_and_recomputed(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name)
    with KvHarness(fabric_for(pool), threshold=4) as h:
        ids = h.think("r1", 4)
        h.offload("r1")
        control = pool.control()
        control.corrupt(h.handle_of(ids[1]), offset=HEADER_SIZE + 100, mask=0x10)  # body
        control.corrupt(h.handle_of(ids[2]), offset=12, mask=0x01)  # tier byte: 0 -> 1
        result = h.manager.ingest_request("r1")
        assert result.ingested == (ids[0], ids[3])
        assert result.fallback == (ids[1], ids[2])
        counters = h.manager.counters
        assert (counters.num_checksum_failures, counters.num_corrupt_frames) == (1, 1)
        assert h.residency([ids[1], ids[2]]) == [Residency.OFFLOADED] * 2
        assert h.device[ids[1]] != h.truth[ids[1]]  # the corrupt KV was never written
        h.assert_no_wrong_kv()
        assert control.stats().num_frames == 0  # rejected frames were discarded too


def test_full_pool_refuses_cleanly_and_offload_resumes_when_room_returns(
    fabric_name: str, start_pool: StartPool
) -> None:
    slots = 3
    slot_bytes = -(-FRAME_BYTES // 64) * 64
    pool = start_pool(fabric_name, capacity=str(slots * slot_bytes))
    fabric = fabric_for(pool)
    with pytest.raises(PoolFull, match=r"KV pool full.*--capacity"):
        fabric.push(b"x" * (slots * slot_bytes + 1))
    with KvHarness(fabric, threshold=2) as h:
        first = h.think("first", 3)
        second = h.think("second", 3)
        h.offload("first")
        h.offload("second")
        counters = h.manager.counters
        assert counters.num_blocks_offloaded == 3 and counters.num_pool_full >= 1
        assert h.state() is OffloadState.BACKING_OFF
        assert h.residency(second) == [Residency.LOCAL] * 3  # refused blocks stay local
        h.assert_no_wrong_kv()

        assert not h.manager.ingest_request("first").needs_recompute  # frees the pool
        h.retry_until_offloaded(second)
        assert not h.manager.ingest_request("second").needs_recompute
        assert all(h.device[b] == h.truth[b] for b in first + second)
        h.assert_no_wrong_kv()


def test_hung_pool_times_out_and_the_unacknowledged_frame_neither_leaks_nor_is_reused(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name, quarantine_s=60.0)
    fabric = fabric_for(pool, timeout_s=0.5)
    control = pool.control()
    try:
        control.stall_next_commit(2.0)
        frame = encode(TC, kv_block(1))
        start = time.monotonic()
        with pytest.raises(FabricTimeout, match="did not answer 'commit'"):
            fabric.push(frame)
        assert time.monotonic() - start < 1.5
        # The producer reconnects for its next push and first releases the frame whose
        # acknowledgement it never saw; the pool holds that slot back (a late write may still
        # land there) instead of handing it out again.
        handle = fabric.push(frame)
        assert fabric.pull(handle) == frame
        stats = control.stats()
        assert (stats.num_frames, stats.num_reserved, stats.num_quarantined) == (1, 0, 1)
        time.sleep(2.0)  # the stalled commit wakes up and finds its reservation gone
        stats = control.stats()
        assert (stats.num_frames, stats.num_reserved, stats.num_quarantined) == (1, 0, 1)
        with pytest.raises(UnknownHandle):
            fabric.pull(handle.rsplit(":", 1)[0] + ":ffff")
    finally:
        fabric.close()


def test_no_pool_at_the_address_is_unavailable_with_a_fix(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name)
    fabric = fabric_for(pool)
    try:
        pool.kill()
        with pytest.raises(FabricUnavailable, match=r"no KV pool answers at .*meridian kvpool"):
            fabric.push(b"frame")
    finally:
        fabric.close()
