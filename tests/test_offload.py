"""Tests of offload/ingest of ThinkComplete KV over a fabric (``meridian.disagg.offload``).

A fake device holds each block's bytes. Whenever a block is offloaded its device slot is
overwritten with garbage (the slot is reused), so a test only passes if ingest really restores
the KV from the pool, and "no lost or wrong KV" is checked byte for byte.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meridian.config.schema import DisaggConfig, KvMemoryConfig
from meridian.core.blocks import (
    BlockStateError,
    OutOfBlocksError,
    Residency,
    TieredBlockManager,
)
from meridian.core.types import Tier
from meridian.disagg.fabric import FabricTimeout, InProcessFabric
from meridian.disagg.offload import (
    InlineExecutor,
    OffloadManager,
    OffloadMetrics,
    OffloadState,
)
from meridian.disagg.wire import HEADER_SIZE, decode
from meridian.errors import ConfigError

_P = ParamSpec("_P")
_T = TypeVar("_T")

BLOCK = 256
FRAME = BLOCK + HEADER_SIZE
GARBAGE = b"\xee" * BLOCK
TC, TA, OC = Tier.THINK_COMPLETE, Tier.THINK_ACTIVE, Tier.OUTPUT_CRITICAL
LOG = "meridian.disagg.offload"


def content(request_id: str, index: int) -> bytes:
    """The true KV of a request's ``index``-th think block."""
    seed = f"{request_id}/{index}/".encode()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RecordingExecutor(InlineExecutor):
    """Inline, and records how many blocks each submitted batch carries."""

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        bodies = args[1]
        assert isinstance(bodies, list)
        self.batch_sizes.append(len(bodies))
        return super().submit(fn, *args, **kwargs)


class ManualExecutor(Executor):
    """Runs submitted calls only when the test says so: transfers stay in flight meanwhile."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        future: Future[_T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as exc:
                future.set_exception(exc)

        self.queue.append(run)
        return future

    def run(self, num_calls: int) -> None:
        for call in self.queue[:num_calls]:
            call()
        del self.queue[:num_calls]


class Harness:
    """A block manager, a fabric, a fake device and the offload manager between them."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        threshold: int = 4,
        max_inflight: int | None = None,
        capacity_bytes: int | None = None,
        executor: Executor | None = None,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        config = KvMemoryConfig(block_size_bytes=BLOCK)
        self.blocks = TieredBlockManager(config, num_blocks * BLOCK)
        self.fabric = InProcessFabric(capacity_bytes=capacity_bytes)
        self.device: dict[int, bytes] = {}
        self.truth: dict[int, bytes] = {}  # block id -> its true KV, for every owned block
        self.clock = Clock()
        self.executor = executor if executor is not None else RecordingExecutor()
        self.manager = OffloadManager(
            self.blocks,
            self.fabric,
            read_block=self.read,
            write_block=self.write,
            offload_threshold_blocks=threshold,
            max_inflight_blocks=max_inflight,
            retry_interval_s=1.0,
            executor=self.executor,
            clock=self.clock,
            metrics=metrics,
        )

    def read(self, block_id: int) -> bytes:
        return self.device[block_id]

    def write(self, block_id: int, data: memoryview) -> None:
        self.device[block_id] = bytes(data)

    def think(self, request_id: str, num_think: int, num_prompt: int = 1) -> list[int]:
        """Prefill a prompt, think ``num_think`` blocks, then see ``</think>``."""
        for block_id in self.blocks.allocate(request_id, OC, num_prompt):
            self.device[block_id] = self.truth[block_id] = content(request_id, -block_id - 1)
        ids = self.blocks.allocate(request_id, TA, num_think)
        for index, block_id in enumerate(ids):
            self.device[block_id] = self.truth[block_id] = content(request_id, index)
        self.blocks.demote_think_blocks(request_id)
        return ids

    def poll(self) -> None:
        self.manager.poll()
        self.scramble()

    def exit_think(self, request_id: str) -> int:
        queued = self.manager.on_exit_think(request_id)
        self.scramble()
        return queued

    def scramble(self) -> None:
        """Offloaded blocks lose their slot: overwrite it, as the next owner would."""
        for block_id in self.truth:
            if self.blocks.block_location(block_id).residency is Residency.OFFLOADED:
                self.device[block_id] = GARBAGE

    def free(self, request_id: str) -> None:
        self.manager.forget_request(request_id)
        for block_id in self.blocks.blocks_for_request(request_id):
            del self.truth[block_id]
            self.device.pop(block_id, None)
        self.blocks.free(request_id)

    def residency(self, ids: list[int]) -> list[Residency]:
        return [self.blocks.block_location(b).residency for b in ids]

    def assert_no_wrong_kv(self) -> None:
        """Every local block holds its true KV; every pooled frame holds its block's KV."""
        for block_id, want in self.truth.items():
            if self.blocks.block_location(block_id).residency is Residency.LOCAL:
                assert self.device[block_id] == want, f"block {block_id} holds wrong KV"
        self.check()

    def pooled_body(self, block_id: int) -> bytes:
        handle = self.manager._pooled[block_id].handle
        return bytes(decode(self.fabric.pull(handle), expected_tier=TC).body)

    def check(self) -> None:
        self.blocks.check_integrity()
        self.manager.check_integrity()
        self.fabric.check_integrity()


def state(h: Harness) -> OffloadState:
    return h.manager.state


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelname == "WARNING"]


# -- the normal path -------------------------------------------------------------------------------


def test_exit_think_offloads_in_batches_and_ingest_restores_the_kv() -> None:
    h = Harness(threshold=4)
    ids = h.think("r1", 10, num_prompt=2)
    free_before = h.blocks.num_free_blocks
    assert h.exit_think("r1") == 10
    assert isinstance(h.executor, RecordingExecutor)
    assert h.executor.batch_sizes == [4, 4, 2]
    assert h.residency(ids) == [Residency.OFFLOADED] * 10
    assert h.blocks.num_free_blocks == free_before + 10
    assert h.blocks.num_blocks_in_tier(OC) == 2  # the prompt stays local
    counters = h.manager.counters
    assert (counters.num_blocks_offloaded, counters.num_bytes_offloaded) == (10, 10 * BLOCK)
    assert counters.fabric_label == "inprocess"
    assert counters.num_stale_acks == counters.num_push_failures == 0
    assert len(counters.push_latency_s) == 10
    assert h.fabric.used_bytes == 10 * FRAME
    assert all(h.pooled_body(b) == h.truth[b] for b in ids)
    assert all(h.device[b] == GARBAGE for b in ids)
    h.check()

    result = h.manager.ingest_request("r1")
    assert result.ingested == tuple(ids) and not result.needs_recompute
    assert h.residency(ids) == [Residency.LOCAL] * 10
    assert (counters.num_blocks_ingested, counters.num_bytes_ingested) == (10, 10 * BLOCK)
    assert len(counters.pull_latency_s) == 10
    assert h.fabric.num_stored == 0  # ingested frames are released from the pool
    h.assert_no_wrong_kv()


def test_exit_think_queues_only_local_think_complete_blocks_once() -> None:
    h = Harness()
    h.blocks.allocate("r1", TA, 3)  # still thinking: nothing to offload
    assert h.manager.on_exit_think("r1") == 0
    assert h.manager.on_exit_think("unknown") == 0
    h.think("r2", 2)
    assert h.exit_think("r2") == 2
    assert h.exit_think("r2") == 0  # already offloaded
    assert h.manager.counters.num_blocks_offloaded == 2


def test_from_config_uses_the_disagg_batch_size() -> None:
    config = KvMemoryConfig(block_size_bytes=BLOCK)
    blocks = TieredBlockManager(config, 16 * BLOCK)
    executor = RecordingExecutor()
    disagg = DisaggConfig(enabled=True, fabric="inprocess", offload_threshold_blocks=3)
    manager = OffloadManager.from_config(
        disagg, blocks, InProcessFabric(), read_block=lambda b: b"x", write_block=lambda b, d: None
    )
    manager._executor = executor
    blocks.allocate("r", TA, 7)
    blocks.demote_think_blocks("r")
    manager.on_exit_think("r")
    assert executor.batch_sizes == [3, 3, 1]
    assert blocks.fabric_attached


def test_invalid_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="offload_threshold_blocks must be >= 1"):
        Harness(threshold=0)
    with pytest.raises(ConfigError, match=r"max_inflight_blocks \(2\) must be >= "):
        Harness(threshold=4, max_inflight=2)


# -- fault injection -------------------------------------------------------------------------------


def test_fabric_failing_mid_batch_loses_nothing_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOG)
    h = Harness(threshold=4)
    ids = h.think("r1", 8)
    h.fabric.fail_next_pushes(1, after=2)
    h.exit_think("r1")
    # The first two pushes were acknowledged; the third failed: its block and the fourth stay.
    assert h.residency(ids) == [Residency.OFFLOADED] * 2 + [Residency.LOCAL] * 6
    assert state(h) is OffloadState.BACKING_OFF
    assert h.manager.num_pending_blocks == 6
    counters = h.manager.counters
    assert (counters.num_push_failures, counters.num_offload_pauses) == (1, 1)
    assert len(warnings_in(caplog)) == 1
    assert "paused" in warnings_in(caplog)[0] and "injected push failure" in warnings_in(caplog)[0]
    h.assert_no_wrong_kv()

    for _ in range(5):  # before the retry interval: nothing moves, nothing more is logged
        h.poll()
    assert h.residency(ids).count(Residency.LOCAL) == 6
    assert len(warnings_in(caplog)) == 1

    h.clock.now = 1.5
    for _ in range(3):
        h.poll()
    assert state(h) is OffloadState.FLOWING
    assert h.residency(ids) == [Residency.OFFLOADED] * 8
    assert any("resumed" in r.getMessage() for r in caplog.records)
    assert h.manager.counters.num_offload_pauses == 1

    assert h.manager.ingest_request("r1").ingested == tuple(ids)
    h.assert_no_wrong_kv()


def test_failed_probe_keeps_backing_off_without_new_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOG)
    h = Harness(threshold=2)
    ids = h.think("r1", 4)
    h.fabric.available = False
    h.exit_think("r1")
    assert h.residency(ids) == [Residency.LOCAL] * 4
    for step in range(1, 6):  # the pool stays down across several probes
        h.clock.now = 2.0 * step
        h.poll()
        assert state(h) is OffloadState.BACKING_OFF
    assert h.manager.counters.num_push_failures == 6  # the first push, then one per probe
    assert len(warnings_in(caplog)) == 1
    assert h.manager.counters.num_offload_pauses == 1
    # Serving continues meanwhile: the block manager still allocates.
    h.blocks.allocate("r2", OC, 3)
    h.fabric.available = True
    h.clock.now = 100.0
    for _ in range(4):
        h.poll()
    assert h.residency(ids) == [Residency.OFFLOADED] * 4
    h.assert_no_wrong_kv()


def test_corrupted_frames_in_the_pool_fall_back_to_recompute() -> None:
    h = Harness(threshold=4)
    ids = h.think("r1", 4)
    h.exit_think("r1")
    handles = {b: h.manager._pooled[b].handle for b in ids}
    h.fabric.corrupt(handles[ids[1]], offset=-1)  # a body bit: checksum mismatch
    h.fabric.corrupt(handles[ids[2]], offset=12, mask=0x01)  # tier 0 -> 1: a valid-looking frame

    result = h.manager.ingest_request("r1")
    assert result.ingested == (ids[0], ids[3])
    assert result.fallback == (ids[1], ids[2]) and result.needs_recompute
    counters = h.manager.counters
    assert (counters.num_checksum_failures, counters.num_corrupt_frames) == (1, 1)
    assert counters.num_fallbacks == 2
    # Corrupt KV was never written: the fallback blocks are still offloaded, slots untouched.
    local, offloaded = Residency.LOCAL, Residency.OFFLOADED
    assert h.residency(ids) == [local, offloaded, offloaded, local]
    assert h.device[ids[1]] == h.device[ids[2]] == GARBAGE
    assert h.fabric.num_stored == 0  # corrupt frames are dropped from the pool too
    h.assert_no_wrong_kv()

    again = h.manager.ingest_request("r1")  # the lost blocks are reported again, not pulled
    assert again.fallback == (ids[1], ids[2]) and h.fabric.num_pulls == 4
    h.free("r1")  # the caller recomputes: preempt by recompute
    h.check()
    assert h.blocks.num_offloaded_blocks == 0


def test_full_pool_keeps_blocks_local_and_offloads_more_once_space_frees(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(threshold=4, capacity_bytes=3 * FRAME)
    ids = h.think("r1", 8)
    h.exit_think("r1")
    assert h.residency(ids).count(Residency.OFFLOADED) == 3
    counters = h.manager.counters
    assert (counters.num_pool_full, counters.num_push_failures) == (1, 1)
    assert "KV pool full" in warnings_in(caplog)[0]
    h.assert_no_wrong_kv()

    other = h.think("r2", 2)
    h.exit_think("r2")  # queued behind r1's blocks while backing off
    assert h.residency(other) == [Residency.LOCAL] * 2

    assert len(h.manager.ingest_request("r1").ingested) == 3  # frees the pool
    h.clock.now = 5.0
    for _ in range(4):
        h.poll()
    # The pool takes 3 more of r1's queued blocks; the rest wait, still local and correct.
    offloaded = [b for b in ids + other if h.residency([b]) == [Residency.OFFLOADED]]
    assert len(offloaded) == 3
    assert all(h.pooled_body(b) == h.truth[b] for b in offloaded)
    h.assert_no_wrong_kv()


def test_transient_pull_failure_keeps_the_frame_for_a_later_try() -> None:
    h = Harness(threshold=2)
    ids = h.think("r1", 2)
    h.exit_think("r1")
    h.fabric.fail_next_pulls(1, error=FabricTimeout)
    first = h.manager.ingest_request("r1")
    assert first.fallback == (ids[0],) and first.ingested == (ids[1],)
    assert h.manager.counters.num_pull_failures == 1
    second = h.manager.ingest_request("r1")
    assert second.ingested == (ids[0],) and not second.needs_recompute
    h.assert_no_wrong_kv()


def test_pool_that_lost_a_frame_falls_back_to_recompute() -> None:
    h = Harness(threshold=2)
    ids = h.think("r1", 2)
    h.exit_think("r1")
    h.fabric.discard(h.manager._pooled[ids[0]].handle)  # e.g. the pool restarted
    result = h.manager.ingest_request("r1")
    assert result.fallback == (ids[0],)
    assert h.manager.num_pooled_blocks == 0
    h.assert_no_wrong_kv()


def test_failed_write_restores_the_offloaded_state() -> None:
    h = Harness(threshold=2)
    ids = h.think("r1", 2)
    h.exit_think("r1")

    def broken_write(block_id: int, data: memoryview) -> None:
        raise RuntimeError("device write failed")

    h.manager._write_block = broken_write
    with pytest.raises(RuntimeError, match="device write failed"):
        h.manager.ingest_request("r1")
    assert h.residency(ids) == [Residency.OFFLOADED] * 2
    assert h.manager.num_pooled_blocks == 2
    h.check()
    h.manager._write_block = h.write
    assert h.manager.ingest_request("r1").ingested == tuple(ids)
    h.assert_no_wrong_kv()


def test_ingest_without_room_changes_nothing() -> None:
    h = Harness(num_blocks=8, threshold=4)
    h.think("r1", 4)
    h.exit_think("r1")
    h.blocks.allocate("r2", OC, h.blocks.num_free_blocks)
    assert not h.manager.can_ingest("r1")
    with pytest.raises(OutOfBlocksError, match="need 4 free local slots"):
        h.manager.ingest_request("r1")
    assert h.fabric.num_pulls == 0
    h.check()


# -- back-pressure with real worker threads --------------------------------------------------------


@contextlib.contextmanager
def held_fabric(
    *, threshold: int, pool: ThreadPoolExecutor, max_inflight: int | None = None
) -> Iterator[Harness]:
    """A harness on worker threads whose fabric hangs until the test releases it.

    The fabric is released on the way out even if the test fails, so the pool can shut down.
    """
    h = Harness(threshold=threshold, max_inflight=max_inflight, executor=pool)
    h.fabric.hold_transfers()
    try:
        yield h
    finally:
        h.fabric.release_transfers()


def test_slow_fabric_bounds_in_flight_transfers_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, LOG)
    with ThreadPoolExecutor(2) as pool, held_fabric(threshold=2, max_inflight=4, pool=pool) as h:
        requests = {f"r{i}": h.think(f"r{i}", 4) for i in range(3)}
        for request_id in requests:
            h.exit_think(request_id)
        for _ in range(20):
            h.poll()
        assert h.manager.num_inflight_blocks == 4
        assert h.manager.num_pending_blocks == 8
        assert state(h) is OffloadState.STALLED
        assert h.manager.counters.num_offload_pauses == 1
        assert len(warnings_in(caplog)) == 1 and "in flight" in warnings_in(caplog)[0]
        assert h.blocks.num_offloaded_blocks == 0  # nothing released before acknowledgement
        h.blocks.allocate("serving", OC, 5)  # serving continues
        h.check()

        h.fabric.release_transfers()
        while h.manager.num_pending_blocks or h.manager.num_inflight_blocks:
            assert h.manager.drain(timeout_s=5.0)
        h.scramble()
        assert state(h) is OffloadState.FLOWING
        assert h.blocks.num_offloaded_blocks == 12
        assert any("resumed" in r.getMessage() for r in caplog.records)
        for request_id in requests:
            assert not h.manager.ingest_request(request_id).needs_recompute
        h.assert_no_wrong_kv()
        h.manager.close()


def test_acks_for_freed_blocks_are_discarded() -> None:
    with ThreadPoolExecutor(1) as pool, held_fabric(threshold=4, pool=pool) as h:
        victim_ids = h.think("victim", 4)
        h.exit_think("victim")
        freed_ids = h.think("done", 4)
        h.exit_think("done")
        # While the pushes hang: preempt the first request by recompute (its blocks are freed
        # and stay free), free the second and reuse its block ids for a new request of the
        # same name (preempted and re-admitted).
        h.free("victim")
        for block_id in victim_ids:
            with pytest.raises(BlockStateError):
                h.blocks.block_location(block_id)
        h.free("done")
        reused = h.think("done", 4)
        assert set(reused) & set(freed_ids)
        h.fabric.release_transfers()
        assert h.manager.drain(timeout_s=5.0)
        assert h.manager.counters.num_stale_acks == 8
        assert h.manager.counters.num_blocks_offloaded == 0
        assert h.fabric.num_stored == 0  # the stale frames were discarded
        assert h.residency(reused) == [Residency.LOCAL] * 4
        h.assert_no_wrong_kv()


def test_offloaded_bytes_metric_counts_only_blocks_offloaded_from_a_batch() -> None:
    from meridian.telemetry.metrics import MeridianMetrics

    metrics = MeridianMetrics()
    executor = ManualExecutor()
    h = Harness(threshold=4, max_inflight=4, executor=executor, metrics=metrics)
    labels = {"fabric": "inprocess"}
    get = metrics.registry.get_sample_value
    first = h.think("r0", 4)
    h.exit_think("r0")  # batch A: r0's 4 blocks, in flight (the bound is full)
    kept = h.think("r1", 2)
    h.exit_think("r1")
    gone = h.think("r2", 2)
    h.exit_think("r2")  # both wait behind batch A
    assert h.manager.num_pending_blocks == 4
    executor.run(1)
    h.poll()  # applies batch A, starts batch B: r1's and r2's blocks together
    assert h.residency(first) == [Residency.OFFLOADED] * 4
    assert h.manager.num_inflight_blocks == 4 and h.manager.num_pending_blocks == 0
    assert get("meridian_disagg_offloaded_bytes_total", labels) == 4 * BLOCK
    h.free("r2")  # preempted by recompute while batch B is in flight: its acks go stale
    executor.run(1)
    h.poll()
    counters = h.manager.counters
    assert (counters.num_blocks_offloaded, counters.num_stale_acks) == (6, 2)
    assert h.residency(kept) == [Residency.OFFLOADED] * 2
    assert not set(gone) & set(h.manager._pooled)
    assert get("meridian_disagg_offloaded_blocks_total", labels) == 6
    assert get("meridian_disagg_offloaded_bytes_total", labels) == 6 * BLOCK
    assert h.fabric.num_stored == 6  # the stale frames were discarded
    h.assert_no_wrong_kv()


def test_forget_request_releases_pooled_frames() -> None:
    h = Harness(threshold=2)
    h.think("r1", 4)
    h.exit_think("r1")
    assert h.fabric.num_stored == 4
    h.free("r1")
    assert h.fabric.num_stored == 0
    h.check()


def test_freeing_without_forget_is_caught_by_check_integrity() -> None:
    h = Harness(threshold=2)
    h.think("r1", 2)
    h.exit_think("r1")
    h.blocks.free("r1")
    with pytest.raises(AssertionError, match="freed without forget_request"):
        h.manager.check_integrity()


# -- property: random serving with a flaky fabric --------------------------------------------------


class OffloadMachine(RuleBasedStateMachine):
    """Requests think, offload, resume and are freed while the fabric misbehaves.

    Invariant: no wrong KV (every local block holds its true bytes, every pooled frame its
    block's bytes unless the test corrupted it) and no lost KV (an offloaded block without a
    pooled frame was reported as a fallback).
    """

    def __init__(self) -> None:
        super().__init__()
        self.executor = ManualExecutor()
        self.h = Harness(
            num_blocks=48,
            threshold=3,
            max_inflight=6,
            capacity_bytes=8 * FRAME,
            executor=self.executor,
        )
        self.live: list[str] = []
        self.thinking: list[str] = []
        self.counter = 0
        self.reported_lost: set[int] = set()
        self.flipped: dict[int, set[int]] = {}  # block id -> frame offsets flipped

    @rule(num_think=st.integers(1, 6), num_prompt=st.integers(1, 2), exit_now=st.booleans())
    def start(self, num_think: int, num_prompt: int, exit_now: bool) -> None:
        if not self.h.blocks.can_allocate(num_think + num_prompt, TA):
            return
        self.counter += 1
        request_id = f"r{self.counter}"
        self.h.think(request_id, num_think, num_prompt)
        self.live.append(request_id)
        if exit_now:
            self.h.exit_think(request_id)
        else:
            self.thinking.append(request_id)

    @precondition(lambda self: bool(self.thinking))
    @rule(data=st.data())
    def exit_think(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.thinking))
        self.thinking.remove(request_id)
        self.h.exit_think(request_id)

    @rule(num_calls=st.integers(0, 3), seconds=st.sampled_from([0.0, 0.5, 2.0]))
    def step(self, num_calls: int, seconds: float) -> None:
        """Time passes, some transfers finish, the scheduler polls."""
        self.h.clock.now += seconds
        self.executor.run(num_calls)
        self.h.poll()

    @rule(
        kind=st.sampled_from(["down", "up", "up", "fail_pushes", "fail_pulls"]),
        num=st.integers(1, 3),
        after=st.integers(0, 4),
    )
    def fault(self, kind: str, num: int, after: int) -> None:
        fabric = self.h.fabric
        if kind in ("down", "up"):
            fabric.available = kind == "up"
        elif kind == "fail_pushes":
            fabric.fail_next_pushes(num, after=after)
        else:
            fabric.fail_next_pulls(num)

    @precondition(lambda self: bool(self.h.manager._pooled))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(self.h.manager._pooled)))
        offset = data.draw(st.sampled_from([0, 8, 12, 13, 20, -1]))
        self.h.fabric.corrupt(self.h.manager._pooled[block_id].handle, offset=offset)
        # XOR: flipping the same bit twice restores the frame.
        self.flipped.setdefault(block_id, set()).symmetric_difference_update({offset})
        if not self.flipped[block_id]:
            del self.flipped[block_id]

    @property
    def corrupted(self) -> set[int]:
        return set(self.flipped)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.live))
        if not self.h.manager.can_ingest(request_id):
            return
        result = self.h.manager.ingest_request(request_id)
        assert not (set(result.ingested) & self.corrupted), "corrupt KV was ingested"
        self.reported_lost.update(result.fallback)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.live))
        self.live.remove(request_id)
        if request_id in self.thinking:
            self.thinking.remove(request_id)
        owned = set(self.h.blocks.blocks_for_request(request_id))
        self.reported_lost -= owned
        for block_id in owned:
            self.flipped.pop(block_id, None)
        self.h.free(request_id)

    @invariant()
    def no_lost_or_wrong_kv(self) -> None:
        h = self.h
        h.assert_no_wrong_kv()
        for block_id in h.truth:
            if h.blocks.block_location(block_id).residency is not Residency.OFFLOADED:
                continue
            pooled = h.manager._pooled.get(block_id)
            if pooled is None:
                assert block_id in self.reported_lost, f"block {block_id} lost silently"
            elif block_id not in self.corrupted:
                assert bytes(decode(h.fabric._store[pooled.handle]).body) == h.truth[block_id]


TestOffloadMachine = OffloadMachine.TestCase
TestOffloadMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_transfers_are_reported_through_the_metric_catalogue() -> None:
    from meridian.telemetry.metrics import MeridianMetrics

    metrics = MeridianMetrics()
    h = Harness(threshold=4, metrics=metrics)
    ids = h.think("r1", 4)
    h.exit_think("r1")
    h.fabric.corrupt(h.manager._pooled[ids[0]].handle, offset=-1)
    h.manager.ingest_request("r1")

    def value(name: str, **labels: str) -> float:
        got = metrics.registry.get_sample_value(name, {"fabric": "inprocess", **labels})
        assert got is not None, name
        return got

    assert value("meridian_disagg_offloaded_blocks_total") == 4
    assert value("meridian_disagg_offloaded_bytes_total") == 4 * BLOCK
    assert value("meridian_disagg_ingested_blocks_total") == 3
    assert value("meridian_disagg_checksum_failures_total") == 1
    assert value("meridian_disagg_fallbacks_total") == 1
