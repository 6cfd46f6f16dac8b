"""The kvpool's own logic without any fabric library: the slab allocator, the frame store, the
control protocol, and PoolFabric's reconnect and error mapping (over an in-process data plane).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meridian.disagg.fabric import (
    FabricError,
    FabricTimeout,
    FabricUnavailable,
    PoolFull,
    UnknownHandle,
)
from meridian.disagg.kvpool import (
    MAX_MESSAGE_BYTES,
    KvPoolServer,
    PoolClient,
    PoolFabric,
    PoolStore,
    ProtocolError,
    SlabAllocator,
    parse_address,
    parse_size,
    recv_message,
    send_message,
)
from meridian.disagg.wire import BytesLike
from meridian.errors import ConfigError

# -- SlabAllocator -------------------------------------------------------------------------------


def test_allocator_rounds_aligns_and_coalesces() -> None:
    slab = SlabAllocator(1024, align=64)
    a, b, c = slab.allocate(1), slab.allocate(64), slab.allocate(65)
    assert (a, b, c) == (0, 64, 128)
    assert slab.used_bytes == 256 and slab.largest_free_extent == 768
    slab.free(b)
    assert slab.largest_free_extent == 768 and slab.allocate(64) == 64  # first fit reuses it
    slab.free(64)
    slab.free(a)
    slab.free(c)
    assert slab.used_bytes == 0 and slab.largest_free_extent == 1024
    slab.check_integrity()
    with pytest.raises(PoolFull, match="no free extent of 2048 bytes"):
        slab.allocate(2000)
    with pytest.raises(AssertionError, match="not allocated"):
        slab.free(5)


class AllocatorMachine(RuleBasedStateMachine):
    """Extents never overlap, stay inside the slab, and freeing everything restores one extent."""

    def __init__(self) -> None:
        super().__init__()
        self.slab = SlabAllocator(4096, align=64)
        self.live: dict[int, int] = {}  # offset -> requested bytes

    @rule(num_bytes=st.integers(1, 1500))
    def allocate(self, num_bytes: int) -> None:
        if self.slab.can_allocate(num_bytes):
            offset = self.slab.allocate(num_bytes)
            assert offset % 64 == 0 and offset + num_bytes <= 4096
            for other, size in self.live.items():
                assert offset + num_bytes <= other or other + size <= offset, "overlap"
            self.live[offset] = num_bytes
        else:
            with pytest.raises(PoolFull):
                self.slab.allocate(num_bytes)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[offset]
        self.slab.free(offset)
        if not self.live:
            assert self.slab.largest_free_extent == 4096

    @invariant()
    def tiles_the_slab(self) -> None:
        self.slab.check_integrity()
        assert self.slab.used_bytes == sum(self.slab.extent_size(n) for n in self.live.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- PoolStore -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_push_pull_protocol_and_pins() -> None:
    store = PoolStore(1024, label="nixl", epoch="e1", quarantine_s=5.0, clock=Clock())
    handle, offset = store.reserve(100, owner=1)
    assert handle == "nixl:e1:1"
    with pytest.raises(UnknownHandle):
        store.open(handle, owner=1)  # not committed yet
    with pytest.raises(UnknownHandle, match="no reservation"):
        store.commit(handle, owner=2)  # someone else's reservation
    store.commit(handle, owner=1)
    assert store.open(handle, owner=2) == (offset, 100)
    store.discard(handle)  # pinned: freed when its reader is done
    assert store.stats().used_bytes == 128
    with pytest.raises(UnknownHandle):
        store.open(handle, owner=3)
    store.check_integrity()
    store.close(handle, owner=2)
    assert store.stats().used_bytes == 0
    store.discard(handle)  # idempotent
    store.check_integrity()


def test_store_quarantines_abandoned_reservations_and_reclaims_them_later() -> None:
    clock = Clock()
    store = PoolStore(256, label="nixl", quarantine_s=5.0, clock=clock)
    kept, _ = store.reserve(100, owner=1)
    store.commit(kept, owner=1)
    store.reserve(100, owner=1)  # written, never committed
    assert store.drop_owner(1) == 1  # the connection closed
    stats = store.stats()
    assert (stats.num_frames, stats.num_reserved, stats.num_quarantined) == (1, 0, 1)
    with pytest.raises(PoolFull, match="KV pool full: the nixl pool holds 256 of 256"):
        store.reserve(100, owner=2)  # the quarantined slot is not reused early
    clock.now = 5.0
    store.reserve(100, owner=2)  # reserve reclaims what is due
    assert store.stats().num_quarantined == 0
    store.check_integrity()


def test_store_explains_handles_from_an_earlier_run_and_corrupts_in_place() -> None:
    store = PoolStore(256, label="mooncake", epoch="new")
    with pytest.raises(UnknownHandle, match=r"earlier run of the pool .*epoch old, now new"):
        store.open("mooncake:old:1", owner=1)
    handle, offset = store.reserve(4, owner=1)
    store.slab[offset : offset + 4] = [1, 2, 3, 4]
    store.commit(handle, owner=1)
    store.corrupt(handle, offset=-1, mask=0x80)
    assert list(store.slab[offset : offset + 4]) == [1, 2, 3, 0x84]
    with pytest.raises(ValueError, match="outside the 4-byte frame"):
        store.corrupt(handle, offset=4)
    with pytest.raises(ValueError, match="mask"):
        store.corrupt(handle, mask=0)


class StoreMachine(RuleBasedStateMachine):
    """PoolStore against a model: stored handles, reservations and capacity always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = PoolStore(2048, label="nixl", quarantine_s=1.0, clock=self.clock)
        self.reserved: dict[str, int] = {}  # handle -> owner
        self.stored: set[str] = set()
        self.readers: list[tuple[str, int]] = []

    @rule(num_bytes=st.integers(1, 700), owner=st.integers(1, 2))
    def reserve(self, num_bytes: int, owner: int) -> None:
        try:
            handle, _ = self.store.reserve(num_bytes, owner)
        except PoolFull:
            return
        self.reserved[handle] = owner

    @precondition(lambda self: bool(self.reserved))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.reserved)))
        self.store.commit(handle, self.reserved.pop(handle))
        self.stored.add(handle)

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data(), owner=st.integers(1, 2))
    def open(self, data: st.DataObject, owner: int) -> None:
        handle = data.draw(st.sampled_from(sorted(self.stored)))
        self.store.open(handle, owner)
        self.readers.append((handle, owner))

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        handle, owner = self.readers.pop(data.draw(st.integers(0, len(self.readers) - 1)))
        self.store.close(handle, owner)

    @precondition(lambda self: bool(self.stored))
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(sorted(self.stored)))
        self.store.discard(handle)
        self.stored.discard(handle)
        with pytest.raises(UnknownHandle):
            self.store.open(handle, 1)

    @rule(owner=st.integers(1, 2))
    def drop_owner(self, owner: int) -> None:
        self.store.drop_owner(owner)
        self.reserved = {h: o for h, o in self.reserved.items() if o != owner}
        self.readers = [(h, o) for h, o in self.readers if o != owner]

    @rule()
    def time_passes(self) -> None:
        self.clock.now += 0.6
        self.store.reclaim()

    @invariant()
    def agrees_with_model(self) -> None:
        self.store.check_integrity()
        stats = self.store.stats()
        assert stats.num_frames == len(self.stored)
        assert stats.num_reserved == len(self.reserved)
        assert stats.used_bytes <= stats.capacity_bytes


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


# -- the control protocol and PoolFabric, over an in-process data plane ---------------------------


class FakeEndpoint:
    """A pool endpoint whose 'data plane' is the test process's own memory."""

    label = "fake"
    progress_interval_s = 0.01

    def describe(self) -> dict[str, object]:
        return {"kind": "in-process"}

    def progress(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakePlane:
    """Copies straight into the store's slab; can be told to fail."""

    def __init__(self, store: PoolStore) -> None:
        self.store = store
        self.attached = 0
        self.detached = 0
        self.fail_next: FabricError | None = None

    def attach(self, data_plane: Mapping[str, Any], deadline: float) -> None:
        assert data_plane == {"kind": "in-process"}
        self.attached += 1

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        self._maybe_fail()
        data = np.frombuffer(payload, np.uint8)
        self.store.slab[offset : offset + data.nbytes] = data

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        self._maybe_fail()
        return self.store.slab[offset : offset + num_bytes].tobytes()

    def detach(self) -> None:
        self.detached += 1

    def close(self) -> None:
        pass

    def _maybe_fail(self) -> None:
        error, self.fail_next = self.fail_next, None
        if error is not None:
            raise error


class Pool:
    """A KvPoolServer on a thread of this process."""

    def __init__(self, capacity: int = 4096, *, port: int = 0, faults: bool = True) -> None:
        self.store = PoolStore(capacity, label="fake", quarantine_s=0.0)
        self.server = KvPoolServer(
            ("127.0.0.1", port), self.store, FakeEndpoint(), fault_injection=faults
        )
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,))
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def pool() -> Iterator[Pool]:
    running = Pool()
    try:
        yield running
    finally:
        running.stop()


def test_messages_round_trip_and_oversized_ones_are_refused() -> None:
    left, right = socket.socketpair()
    with left, right:
        send_message(left, {"op": "stats", "n": 1})
        assert recv_message(right) == {"op": "stats", "n": 1}
        left.sendall((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little"))
        with pytest.raises(ProtocolError, match="control message of"):
            recv_message(right)
        left.sendall(b"\x02\x00\x00\x00[]")
        with pytest.raises(ProtocolError, match="not a JSON object"):
            recv_message(right)
        left.close()
        assert recv_message(right) is None


def test_control_client_speaks_every_op(pool: Pool) -> None:
    client = PoolClient(pool.address)
    hello = client.connect()
    assert hello["fabric"] == "fake" and hello["epoch"] == pool.store.epoch
    handle, offset = client.alloc(10)
    client.commit(handle)
    assert client.open(handle) == (offset, 10)
    client.close_handle(handle)
    client.corrupt(handle, offset=0)
    assert client.stats().num_frames == 1
    client.discard(handle)
    with pytest.raises(UnknownHandle):
        client.open(handle)
    with pytest.raises(PoolFull):
        client.alloc(1 << 20)
    with pytest.raises(FabricError, match="unknown control op 'nope'"):
        client.request({"op": "nope"})
    with pytest.raises(FabricError, match=r"bad_request|num_bytes"):
        client.request({"op": "alloc"})
    assert client.stats().num_frames == 0  # errors leave the connection usable
    client.disconnect()


def test_fault_ops_are_refused_unless_enabled_and_versions_must_match() -> None:
    pool = Pool(faults=False)
    try:
        client = PoolClient(pool.address)
        with pytest.raises(FabricError, match=r"fault injection is off.*--fault-injection"):
            client.stall_next_commit(1.0)
        with pytest.raises(FabricError, match="protocol v1, the producer v99"):
            client.request({"op": "hello", "version": 99})
    finally:
        pool.stop()


def test_client_maps_a_missing_a_dead_and_a_slow_pool_to_typed_errors() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = PoolClient(f"127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(FabricUnavailable, match=r"no KV pool answers at 127.0.0.1"):
        client.stats()
    pool = Pool(port=port)
    client.stats()
    client.stall_next_commit(1.0)
    handle, _ = client.alloc(8)
    with pytest.raises(FabricTimeout, match=r"did not answer 'commit' within 0.3 s"):
        client.commit(handle)
    assert not client.connected
    pool.stop()  # the server goes away while the client is idle
    with pytest.raises(FabricUnavailable):
        client.stats()


def test_pool_fabric_reconnects_after_a_restart_and_releases_orphans() -> None:
    first = Pool()
    port = int(first.address.rsplit(":", 1)[1])
    plane = FakePlane(first.store)
    fabric = PoolFabric("fake", first.address, plane, timeout_s=0.3)
    try:
        handle = fabric.push(b"frame-1")
        assert fabric.pull(handle) == b"frame-1"
        assert plane.attached == 1

        plane.fail_next = FabricUnavailable("the data plane broke")
        with pytest.raises(FabricUnavailable, match="data plane broke"):
            fabric.push(b"frame-2")
        assert plane.detached == 1
        assert fabric.pull(handle) == b"frame-1"  # reconnected; the stored frame is intact
        assert plane.attached == 2
        assert first.store.stats().num_reserved == 0  # the failed slot went with the connection

        control = PoolClient(first.address)
        control.stall_next_commit(1.0)
        control.disconnect()
        with pytest.raises(FabricTimeout):
            fabric.push(b"frame-3")  # its commit outcome is unknown: an orphan
        time.sleep(1.0)  # the stalled commit lands after the producer gave up
        assert first.store.stats().num_frames == 2
        fabric.stats()  # the next connection releases the orphan
        assert first.store.stats().num_frames == 1

        first.stop()
        with pytest.raises(FabricUnavailable):
            fabric.pull(handle)
        second = Pool(port=port)  # a restarted pool on the same port, with a new epoch
        plane.store = second.store
        try:
            with pytest.raises(UnknownHandle, match="earlier run of the pool"):
                fabric.pull(handle)
            assert fabric.pull(fabric.push(b"after")) == b"after"
        finally:
            second.stop()
    finally:
        fabric.close()
    with pytest.raises(FabricUnavailable, match="closed"):
        fabric.pull("x")


# -- addresses and sizes -------------------------------------------------------------------------


def test_addresses_must_be_loopback_host_port() -> None:
    assert parse_address("127.0.0.1:7470") == ("127.0.0.1", 7470)
    assert parse_address("localhost:0") == ("127.0.0.1", 0)
    assert parse_address("127.1.2.3:80") == ("127.1.2.3", 80)
    for bad in ("127.0.0.1", "127.0.0.1:x", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_address(bad)
    for remote in ("10.0.0.1:80", "example.com:80", "0.0.0.0:80", "[::1]:80"):
        with pytest.raises(ConfigError, match="not an IPv4 loopback address"):
            parse_address(remote)


def test_sizes_use_binary_units() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1g") == parse_size("1GiB") == 1 << 30
    with pytest.raises(ConfigError, match="512MiB"):
        parse_size("lots")
