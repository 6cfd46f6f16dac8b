"""Two-process round trips of real KV blocks through the NIXL and Mooncake fabrics.

The producer is this test process; the KV pool is a ``meridian kvpool`` child process. If a
fabric's library cannot work here, these tests fail with the library's reason (no skip).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from fabric_support import (
    BLOCK_BYTES,
    BLOCK_SHAPE,
    FABRICS,
    OC,
    TA,
    TC,
    KvHarness,
    PoolProcess,
    fabric_for,
    kv_block,
)

from meridian.core.blocks import Residency
from meridian.core.types import Tier
from meridian.disagg.fabric import (
    Fabric,
    FabricUnavailable,
    UnknownHandle,
    make_fabric,
)
from meridian.disagg.kvpool import PoolFabric
from meridian.disagg.mooncake_fabric import MooncakeFabric
from meridian.disagg.nixl_fabric import NixlFabric
from meridian.disagg.wire import HEADER_SIZE, decode, encode
from meridian.errors import ConfigError

SharedPool = Callable[[str], PoolProcess]
pytestmark = pytest.mark.parametrize("fabric_name", FABRICS)


def test_real_kv_blocks_round_trip_with_their_tier(
    fabric_name: str, shared_pool: SharedPool
) -> None:
    pool = shared_pool(fabric_name)
    fabric = fabric_for(pool)
    try:
        assert isinstance(fabric, Fabric) and fabric.label == fabric_name
        handles: list[tuple[str, Tier, bytes]] = []
        for seed, tier in enumerate([TC, TA, OC, TC]):
            body = kv_block(seed)
            handle = fabric.push(encode(tier, body))
            handles.append((handle, tier, body))
        assert len({h for h, _, _ in handles}) == 4
        assert pool.control().stats().num_frames == 4
        for handle, tier, body in reversed(handles):
            frame = decode(fabric.pull(handle), expected_tier=tier)
            assert frame.tier is tier
            kv = np.frombuffer(frame.body, np.float16).reshape(BLOCK_SHAPE)
            assert np.array_equal(kv, np.frombuffer(body, np.float16).reshape(BLOCK_SHAPE))
            assert fabric.pull(handle) == encode(tier, body)  # pulling twice is allowed
            fabric.discard(handle)
            fabric.discard(handle)  # idempotent
            with pytest.raises(UnknownHandle, match="holds nothing"):
                fabric.pull(handle)
        assert pool.control().stats().num_frames == 0
    finally:
        fabric.close()


@pytest.mark.parametrize("num_bytes", [1, 16 << 10, 8 << 20])
def test_frames_of_every_size_come_back_byte_exact(
    fabric_name: str, num_bytes: int, shared_pool: SharedPool
) -> None:
    fabric = fabric_for(shared_pool(fabric_name))
    try:
        body = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, np.uint8).tobytes()
        frame = encode(TC, body)
        handle = fabric.push(frame)
        back = fabric.pull(handle)
        assert len(back) == num_bytes + HEADER_SIZE
        assert back == frame
        fabric.discard(handle)
    finally:
        fabric.close()


def test_offload_manager_moves_think_blocks_to_the_pool_and_back(
    fabric_name: str, shared_pool: SharedPool
) -> None:
    pool = shared_pool(fabric_name)
    with KvHarness(fabric_for(pool), threshold=3) as h:
        ids = h.think("r1", 7)
        free_before = h.blocks.num_free_blocks
        h.offload("r1")
        assert h.residency(ids) == [Residency.OFFLOADED] * 7
        assert h.blocks.num_free_blocks == free_before + 7
        counters = h.manager.counters
        assert counters.fabric_label == fabric_name
        assert (counters.num_blocks_offloaded, counters.num_push_failures) == (7, 0)
        stats = pool.control().stats()
        assert (stats.num_frames, stats.stored_bytes) == (7, 7 * (BLOCK_BYTES + HEADER_SIZE))

        result = h.manager.ingest_request("r1")
        assert result.ingested == tuple(ids) and not result.needs_recompute
        assert counters.num_blocks_ingested == 7
        h.assert_no_wrong_kv()
        assert all(h.device[b] == h.truth[b] for b in ids)
        assert pool.control().stats().num_frames == 0  # ingested frames are released


def test_concurrent_pushes_from_threads_are_all_stored_intact(
    fabric_name: str, shared_pool: SharedPool
) -> None:
    fabric = fabric_for(shared_pool(fabric_name))
    stored: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def pusher(worker: int) -> None:
        try:
            for i in range(10):
                frame = encode(TC, kv_block(1000 * worker + i)[: 4096 + worker])
                handle = fabric.push(frame)
                with lock:
                    stored.append((handle, frame))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pusher, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert len({h for h, _ in stored}) == 40
        for handle, frame in stored:
            assert fabric.pull(handle) == frame
            fabric.discard(handle)
    finally:
        fabric.close()


def test_make_fabric_builds_the_real_fabric_and_explains_what_it_needs(
    fabric_name: str, shared_pool: SharedPool
) -> None:
    pool = shared_pool(fabric_name)
    expected = {"nixl": NixlFabric, "mooncake": MooncakeFabric}[fabric_name]
    fabric = make_fabric(fabric_name, address=pool.address)
    assert isinstance(fabric, expected) and isinstance(fabric, PoolFabric)
    assert fabric.address == pool.address
    fabric.close()
    fabric.close()  # idempotent
    with pytest.raises(FabricUnavailable, match="closed"):
        fabric.push(b"x")
    with pytest.raises(ConfigError, match="needs the address of a running KV pool"):
        make_fabric(fabric_name)
    with pytest.raises(ConfigError, match="set on the pool process"):
        make_fabric(fabric_name, address=pool.address, capacity_bytes=1 << 20)
    with pytest.raises(ConfigError, match="not an IPv4 loopback address"):
        make_fabric(fabric_name, address="10.1.2.3:7470")


def test_a_pool_of_the_other_fabric_is_refused_clearly(
    fabric_name: str, shared_pool: SharedPool
) -> None:
    other = next(f for f in ("nixl", "mooncake") if f != fabric_name)
    fabric = make_fabric(fabric_name, address=shared_pool(other).address)
    try:
        with pytest.raises(FabricUnavailable, match=rf"serves fabric '{other}'.*--fabric"):
            fabric.push(b"frame")
    finally:
        fabric.close()
