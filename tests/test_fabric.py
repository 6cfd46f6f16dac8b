"""Tests of the Fabric protocol, InProcessFabric and its fault injection, and the transport
factories."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from meridian.disagg.fabric import (
    Fabric,
    FabricError,
    FabricTimeout,
    FabricUnavailable,
    InProcessFabric,
    PoolFull,
    UnknownHandle,
)
from meridian.disagg.transport import make_endpoint, make_producer_plane
from meridian.errors import ConfigError, MeridianError


def test_inprocess_fabric_satisfies_the_protocol_and_never_claims_nixl() -> None:
    fabric = InProcessFabric()
    assert isinstance(fabric, Fabric)
    assert fabric.label == "inprocess"


def test_push_pull_discard_round_trip() -> None:
    fabric = InProcessFabric()
    first, second = fabric.push(b"one"), fabric.push(bytearray(b"two"))  # type: ignore[arg-type]
    assert first != second
    assert fabric.pull(first) == b"one"
    assert fabric.pull(second) == b"two"
    assert fabric.pull(first) == b"one"  # pulling does not consume
    assert fabric.used_bytes == 6 and fabric.num_stored == 2
    fabric.discard(first)
    fabric.discard(first)  # idempotent
    assert fabric.used_bytes == 3
    with pytest.raises(UnknownHandle, match="holds nothing under handle"):
        fabric.pull(first)
    fabric.check_integrity()


def test_pushed_mutable_buffers_are_copied() -> None:
    fabric = InProcessFabric()
    buffer = bytearray(b"abc")
    handle = fabric.push(buffer)  # type: ignore[arg-type]
    buffer[0] = ord("z")
    assert fabric.pull(handle) == b"abc"


def test_full_pool_raises_a_clear_error_and_stores_nothing() -> None:
    fabric = InProcessFabric(capacity_bytes=10)
    handle = fabric.push(b"123456")
    with pytest.raises(PoolFull, match=r"fabric full: .* holds 6 of 10 bytes.* 5 more"):
        fabric.push(b"12345")
    assert fabric.num_stored == 1
    fabric.push(b"1234")  # exactly fills it
    fabric.discard(handle)
    fabric.push(b"12345")
    fabric.check_integrity()
    with pytest.raises(ConfigError):
        InProcessFabric(capacity_bytes=-1)


def test_fail_next_pushes_after_some_succeed() -> None:
    fabric = InProcessFabric()
    fabric.fail_next_pushes(2, after=1, error=FabricTimeout)
    fabric.push(b"a")
    for _ in range(2):
        with pytest.raises(FabricTimeout, match="injected push failure"):
            fabric.push(b"b")
    fabric.push(b"c")
    assert sorted(fabric.pull(h) for h in fabric.handles()) == [b"a", b"c"]
    assert fabric.num_pushes == 4


def test_fail_next_pulls_keeps_the_payload() -> None:
    fabric = InProcessFabric()
    handle = fabric.push(b"kv")
    fabric.fail_next_pulls(1)
    with pytest.raises(FabricUnavailable):
        fabric.pull(handle)
    assert fabric.pull(handle) == b"kv"


def test_unavailable_pool_fails_every_transfer_until_it_returns() -> None:
    fabric = InProcessFabric()
    handle = fabric.push(b"kv")
    fabric.available = False
    with pytest.raises(FabricUnavailable, match="unreachable"):
        fabric.push(b"x")
    with pytest.raises(FabricUnavailable):
        fabric.pull(handle)
    fabric.available = True
    assert fabric.pull(handle) == b"kv"


def test_corrupt_flips_bits_at_rest() -> None:
    fabric = InProcessFabric()
    handle = fabric.push(b"\x00\x00")
    fabric.corrupt(handle, offset=1, mask=0x80)
    assert fabric.pull(handle) == b"\x00\x80"
    with pytest.raises(UnknownHandle):
        fabric.corrupt("inprocess:nope")
    with pytest.raises(ValueError, match="mask"):
        fabric.corrupt(handle, mask=0)


def test_delay_and_hold_slow_transfers_down() -> None:
    fabric = InProcessFabric()
    fabric.delay_s = 0.05
    start = time.perf_counter()
    fabric.push(b"x")
    assert time.perf_counter() - start >= 0.05
    fabric.delay_s = 0.0

    fabric.hold_transfers()
    done = threading.Event()

    def held_push() -> None:
        fabric.push(b"held")
        done.set()

    worker = threading.Thread(target=held_push)
    worker.start()
    assert not done.wait(0.1)  # blocked while held
    assert fabric.num_stored == 1  # inspection is not blocked
    fabric.release_transfers()
    assert done.wait(2.0)
    worker.join()
    assert fabric.num_stored == 2


def test_close_fails_later_calls_and_releases_held_transfers() -> None:
    fabric = InProcessFabric()
    handle = fabric.push(b"x")
    fabric.hold_transfers()
    errors: list[BaseException] = []

    def held_push() -> None:
        try:
            fabric.push(b"y")
        except FabricError as exc:
            errors.append(exc)

    worker = threading.Thread(target=held_push)
    worker.start()
    fabric.close()
    worker.join(2.0)
    assert len(errors) == 1 and isinstance(errors[0], FabricUnavailable)
    for call in (lambda: fabric.push(b"z"), lambda: fabric.pull(handle)):
        with pytest.raises(FabricUnavailable, match="closed"):
            call()
    fabric.close()  # idempotent
    assert fabric.used_bytes == 0


def test_concurrent_pushes_are_all_stored() -> None:
    fabric = InProcessFabric()
    handles: list[str] = []
    lock = threading.Lock()

    def pusher(n: int) -> None:
        for i in range(200):
            handle = fabric.push(f"{n}-{i}".encode())
            with lock:
                handles.append(handle)

    threads = [threading.Thread(target=pusher, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(handles)) == 800 == fabric.num_stored
    fabric.check_integrity()


@pytest.mark.parametrize("name", ["inprocess", "none", "rdma", ""])
def test_transport_factories_reject_other_names(name: str) -> None:
    with pytest.raises(ConfigError, match=r"transport must be one of nixl, mooncake"):
        make_endpoint(name, np.zeros(16, np.uint8))
    with pytest.raises(ConfigError, match=r"transport must be one of nixl, mooncake"):
        make_producer_plane(name)


def test_error_hierarchy() -> None:
    for cls in (FabricUnavailable, FabricTimeout, UnknownHandle, PoolFull):
        assert issubclass(cls, FabricError)
    assert issubclass(FabricError, MeridianError)


class PoolMachine(RuleBasedStateMachine):
    """InProcessFabric against a dict model: capacity, handles and contents always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.fabric = InProcessFabric(capacity_bytes=64)
        self.model: dict[str, bytes] = {}

    @rule(payload=st.binary(max_size=24))
    def push(self, payload: bytes) -> None:
        used = sum(len(p) for p in self.model.values())
        if used + len(payload) > 64:
            with pytest.raises(PoolFull):
                self.fabric.push(payload)
        else:
            handle = self.fabric.push(payload)
            assert handle not in self.model
            self.model[handle] = payload

    @rule(data=st.data())
    def pull_or_discard(self, data: st.DataObject) -> None:
        if not self.model:
            return
        handle = data.draw(st.sampled_from(sorted(self.model)))
        assert self.fabric.pull(handle) == self.model[handle]
        if data.draw(st.booleans()):
            self.fabric.discard(handle)
            del self.model[handle]

    @invariant()
    def agrees_with_model(self) -> None:
        self.fabric.check_integrity()
        assert self.fabric.used_bytes == sum(len(p) for p in self.model.values())
        assert set(self.fabric.handles()) == set(self.model)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
