"""Offload ThinkComplete KV blocks over a fabric at ``</think>``; ingest them back on resume.

The block manager (:class:`~meridian.core.blocks.TieredBlockManager`) tracks residency only;
this module moves the bytes. The caller owns device memory and lends two callables:
``read_block(block_id)`` returns a block's KV bytes, ``write_block(block_id, data)`` stores them.

Offload path (caller's thread except the push itself)::

    on_exit_think(rid) ──> pending ──poll()──> batch of <= offload_threshold_blocks ──> worker:
                                               encode + fabric.push per block, in order
    poll() <── result: acknowledged prefix of the batch ──> block_manager.offload_block(b)
                       failed / unattempted rest       ──> back to the front of pending

Guarantees:

- A block's local slot is released only after the fabric returned a handle for its frame, so
  a fabric failure at any point leaves every block either local or safely pooled.
- At most ``max_inflight_blocks`` blocks are in flight. A slow fabric fills that bound and
  offload pauses (``STALLED``); a failing one makes it back off for ``retry_interval_s`` and
  then probe with one batch (``BACKING_OFF``). Each pause counts once and logs one warning;
  recovery logs one info line. Meanwhile blocks stay local and serving continues.
- Only the caller's thread touches the block manager and the counters; workers only encode and
  push. An acknowledgement is applied only if the block is still the same local ThinkComplete
  block of the same request (not evicted, not freed and reused); otherwise the pooled copy is
  discarded.
- Ingest verifies each frame (checksum, tier, size) before writing it; anything that fails is
  left offloaded, never written, and reported as needing recompute (counted).

Caller contract: call :meth:`OffloadManager.forget_request` *before*
``TieredBlockManager.free(request_id)`` (completion, abort, preemption by recompute), so pooled
copies are released and acknowledgements in flight cannot land on reused block ids.
ThinkComplete blocks must not change while they are queued or in flight (true by construction:
a request no longer writes its think KV after ``</think>``).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn, ParamSpec, Protocol, TypeVar

from meridian.config.schema import DisaggConfig
from meridian.core.blocks import (
    BlockLocation,
    BlockStateError,
    OutOfBlocksError,
    Residency,
    TieredBlockManager,
)
from meridian.core.types import Tier
from meridian.disagg.fabric import Fabric, FabricError, PoolFull, UnknownHandle
from meridian.disagg.wire import BytesLike, ChecksumMismatch, WireError, decode, encode
from meridian.errors import ConfigError

_log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

BlockReader = Callable[[int], BytesLike]
BlockWriter = Callable[[int, memoryview], None]

LATENCY_SAMPLES = 4096


class OffloadState(enum.Enum):
    """Whether offload is moving blocks, or paused and why."""

    FLOWING = "flowing"
    STALLED = "stalled"  # the in-flight bound is reached: the fabric is slower than demand
    BACKING_OFF = "backing_off"  # a push failed: wait, then probe with one batch


class OffloadMetrics(Protocol):
    """The part of :class:`meridian.telemetry.metrics.MeridianMetrics` the manager reports to."""

    def count_offloaded(self, fabric: str, blocks: int, nbytes: int) -> None: ...
    def count_ingested(self, fabric: str, blocks: int, nbytes: int) -> None: ...
    def observe_transfer_seconds(
        self, fabric: str, seconds: float, direction: Any = ...
    ) -> None: ...
    def count_offload_fallback(self, fabric: str, n: int = 1) -> None: ...
    def count_checksum_failure(self, fabric: str, n: int = 1) -> None: ...


@dataclass(slots=True)
class OffloadCounters:
    """What the offload manager did, for metrics (one fabric per manager). Updated in place."""

    fabric_label: str
    num_blocks_offloaded: int = 0
    num_bytes_offloaded: int = 0  # KV body bytes; frames add 32 bytes each
    num_blocks_ingested: int = 0
    num_bytes_ingested: int = 0
    num_push_failures: int = 0  # frames the fabric failed or refused; the block stayed local
    num_pool_full: int = 0  # of those, refused because the pool was full
    num_pull_failures: int = 0
    num_checksum_failures: int = 0
    num_corrupt_frames: int = 0  # other MRDN errors: header damage, tier or size mismatch
    num_fallbacks: int = 0  # blocks that could not be ingested and must be recomputed
    num_offload_pauses: int = 0  # transitions into STALLED or BACKING_OFF
    num_stale_acks: int = 0  # acknowledgements for blocks evicted or freed meanwhile
    num_discard_failures: int = 0  # pooled copies the fabric could not release
    push_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    pull_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))


@dataclass(frozen=True, slots=True)
class IngestResult:
    """Outcome of :meth:`OffloadManager.ingest_request`.

    ``ingested`` blocks are local again with verified KV. ``fallback`` blocks are still
    OFFLOADED and hold nothing usable: the caller recomputes from the first of them (with vLLM,
    preempt by recompute: ``forget_request`` then ``free``).
    """

    request_id: str
    ingested: tuple[int, ...]
    fallback: tuple[int, ...]

    @property
    def needs_recompute(self) -> bool:
        """True when some KV of the request could not be restored."""
        return bool(self.fallback)


class InlineExecutor(Executor):
    """Runs each submitted call at once in the caller's thread: deterministic, for tests and
    the simulator. With it, :meth:`OffloadManager.poll` sees every transfer already finished."""

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future


@dataclass(frozen=True, slots=True)
class _Ticket:
    """One queued offload of one block; a new enqueue of the same block gets a new number."""

    number: int
    block_id: int
    request_id: str


@dataclass(slots=True)
class _Pooled:
    """A block whose KV sits in the pool under ``handle``."""

    request_id: str
    tier: Tier
    handle: str
    num_bytes: int


@dataclass(slots=True)
class _BatchResult:
    handles: list[str]  # handles[i] acknowledges the batch's i-th block; the rest failed
    latencies_s: list[float]
    error: FabricError | None


@dataclass(slots=True)
class _Batch:
    tickets: list[_Ticket]
    num_bytes: list[int]
    future: Future[_BatchResult]
    is_probe: bool


def _push_batch(fabric: Fabric, bodies: list[BytesLike]) -> _BatchResult:
    """Worker: frame and push each body in order; stop at the first fabric error."""
    handles: list[str] = []
    latencies: list[float] = []
    for body in bodies:
        frame = encode(Tier.THINK_COMPLETE, body)
        start = time.perf_counter()
        try:
            handles.append(fabric.push(frame))
        except FabricError as exc:
            return _BatchResult(handles, latencies, exc)
        latencies.append(time.perf_counter() - start)
    return _BatchResult(handles, latencies, None)


class OffloadManager:
    """Moves a block manager's ThinkComplete blocks to a fabric and back. See the module doc.

    Drive it from the scheduler's thread: :meth:`on_exit_think` when ``</think>`` is seen (after
    ``demote_think_blocks``), :meth:`poll` once per step, :meth:`ingest_request` before a
    request with offloaded blocks runs again, :meth:`forget_request` before freeing one.
    """

    def __init__(
        self,
        block_manager: TieredBlockManager,
        fabric: Fabric,
        *,
        read_block: BlockReader,
        write_block: BlockWriter,
        offload_threshold_blocks: int = 4,
        max_inflight_blocks: int | None = None,
        retry_interval_s: float = 1.0,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        self._metrics = metrics
        if offload_threshold_blocks < 1:
            raise ConfigError(
                f"disagg.offload_threshold_blocks must be >= 1; got {offload_threshold_blocks}"
            )
        if max_inflight_blocks is None:
            max_inflight_blocks = 4 * offload_threshold_blocks
        if max_inflight_blocks < offload_threshold_blocks:
            raise ConfigError(
                f"max_inflight_blocks ({max_inflight_blocks}) must be >= "
                f"offload_threshold_blocks ({offload_threshold_blocks}), or no batch fits"
            )
        if not retry_interval_s >= 0:
            raise ConfigError(f"retry_interval_s must be >= 0; got {retry_interval_s}")
        self._blocks = block_manager
        self._fabric = fabric
        self._read_block = read_block
        self._write_block = write_block
        self._threshold = offload_threshold_blocks
        self._max_inflight = max_inflight_blocks
        self._retry_interval_s = retry_interval_s
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(2, thread_name_prefix="meridian-offload")
        self._clock = clock
        self._counters = OffloadCounters(fabric.label)
        self._state = OffloadState.FLOWING
        self._retry_at = 0.0
        self._tickets = itertools.count()
        # block id -> its live ticket; a pending or in-flight ticket not found here is stale.
        self._queued: dict[int, _Ticket] = {}
        self._queued_by_request: dict[str, set[int]] = {}
        self._pending: deque[_Ticket] = deque()
        self._inflight: list[_Batch] = []
        self._num_inflight = 0
        self._pooled: dict[int, _Pooled] = {}
        block_manager.attach_fabric(fabric)

    @classmethod
    def from_config(
        cls,
        config: DisaggConfig,
        block_manager: TieredBlockManager,
        fabric: Fabric,
        *,
        read_block: BlockReader,
        write_block: BlockWriter,
        metrics: OffloadMetrics | None = None,
    ) -> OffloadManager:
        """A manager with ``[disagg]`` settings (the batch size is ``offload_threshold_blocks``)."""
        return cls(
            block_manager,
            fabric,
            read_block=read_block,
            write_block=write_block,
            offload_threshold_blocks=config.offload_threshold_blocks,
            metrics=metrics,
        )

    # -- state ------------------------------------------------------------------------------------

    @property
    def state(self) -> OffloadState:
        """FLOWING, or why offload is paused."""
        return self._state

    @property
    def counters(self) -> OffloadCounters:
        """Live counters (updated in place; do not modify)."""
        return self._counters

    @property
    def num_pending_blocks(self) -> int:
        """Blocks queued for offload and not yet handed to the fabric (still local)."""
        return sum(1 for t in self._pending if self._queued.get(t.block_id) is t)

    @property
    def num_inflight_blocks(self) -> int:
        """Blocks whose push is under way (still local until acknowledged)."""
        return self._num_inflight

    @property
    def num_pooled_blocks(self) -> int:
        """Offloaded blocks whose KV this manager holds a pool handle for."""
        return len(self._pooled)

    # -- offload ----------------------------------------------------------------------------------

    def on_exit_think(self, request_id: str) -> int:
        """Queue ``request_id``'s local ThinkComplete blocks for offload; returns how many.

        Call it after ``demote_think_blocks``. Blocks already queued are not queued twice.
        Starts transfers at once if the fabric has room (it calls :meth:`poll`).
        """
        num_queued = 0
        for block_id in self._blocks.blocks_for_request(request_id):
            if block_id in self._queued or not self._is_local_tc(block_id, request_id):
                continue
            ticket = _Ticket(next(self._tickets), block_id, request_id)
            self._queued[block_id] = ticket
            self._queued_by_request.setdefault(request_id, set()).add(block_id)
            self._pending.append(ticket)
            num_queued += 1
        self.poll()
        return num_queued

    def poll(self) -> int:
        """Apply finished transfers, then start new ones if allowed; returns blocks offloaded.

        Never blocks on the fabric. A batch that is already finished when it is started (an
        :class:`InlineExecutor`, or a fast fabric) is applied at once, so a failure stops the
        batches behind it. While backing off, at most one probe batch is started per call.
        """
        num_offloaded = self._finish_done()
        if self._is_backing_off():
            if (
                self._clock() < self._retry_at
                or any(b.is_probe for b in self._inflight)
                or not self._prune_pending()
                or self._num_inflight + min(self._threshold, len(self._pending))
                > self._max_inflight
            ):
                return num_offloaded
            num_offloaded += self._start_batch(is_probe=True)
            if self._is_backing_off():
                return num_offloaded
        while self._prune_pending():
            size = min(self._threshold, len(self._pending))
            if self._num_inflight + size > self._max_inflight:
                num_offloaded += self._finish_done()
                if self._num_inflight + size > self._max_inflight:
                    self._pause(OffloadState.STALLED)
                    return num_offloaded
            if self._state is OffloadState.STALLED:
                self._resume("the fabric has room again")
            num_offloaded += self._start_batch(is_probe=False)
            if self._is_backing_off():
                return num_offloaded
        if self._state is OffloadState.STALLED:
            self._resume("nothing is waiting any more")
        return num_offloaded

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is in flight (or ``timeout_s`` passed), polling as batches finish.

        Returns True when nothing is in flight. Pending blocks may still wait (paused offload).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.poll()
        while self._inflight:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            wait([b.future for b in self._inflight], remaining, FIRST_COMPLETED)
            self.poll()
        return True

    # -- ingest -----------------------------------------------------------------------------------

    def can_ingest(self, request_id: str) -> bool:
        """True when local slots exist for all of the request's offloaded blocks."""
        return self._fits_locally(self._offloaded_blocks(request_id))

    def ingest_request(self, request_id: str) -> IngestResult:
        """Pull, verify and write back every offloaded block of ``request_id``.

        Raises :class:`~meridian.core.blocks.OutOfBlocksError` (changing nothing) unless
        :meth:`can_ingest`. A block whose pull fails or whose frame does not verify stays
        OFFLOADED, is never written, and is listed in ``fallback`` (counted). A transient
        fabric error keeps the pool handle for a later try; a lost or corrupt frame drops it.
        """
        offloaded = self._offloaded_blocks(request_id)
        if not self._fits_locally(offloaded):
            raise OutOfBlocksError(
                f"cannot ingest request {request_id!r}: its offloaded blocks need "
                f"{len(offloaded)} free local slots and {self._blocks.num_free_blocks} are free; "
                "free or preempt first"
            )
        ingested: list[int] = []
        fallback: list[int] = []
        for block_id, location in offloaded:
            if self._ingest_block(block_id, location):
                ingested.append(block_id)
            else:
                fallback.append(block_id)
        self._counters.num_fallbacks += len(fallback)
        if fallback and self._metrics is not None:
            self._metrics.count_offload_fallback(self._fabric.label, len(fallback))
        if fallback:
            _log.warning(
                "ingest of request %r over fabric %s: %d of %d blocks could not be restored "
                "and must be recomputed",
                request_id,
                self._fabric.label,
                len(fallback),
                len(fallback) + len(ingested),
            )
        return IngestResult(request_id, tuple(ingested), tuple(fallback))

    # -- lifecycle --------------------------------------------------------------------------------

    def forget_request(self, request_id: str) -> None:
        """Drop the request's queued offloads and release its pooled copies (best effort).

        Call it before ``TieredBlockManager.free(request_id)``. Acknowledgements still in flight
        for the request become stale and their pooled copies are discarded when they land.
        """
        for block_id in self._queued_by_request.pop(request_id, set()):
            del self._queued[block_id]
        for block_id in self._blocks.blocks_for_request(request_id):
            pooled = self._pooled.get(block_id)
            if pooled is not None and pooled.request_id == request_id:
                del self._pooled[block_id]
                self._discard(pooled.handle)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Finish transfers in flight (up to ``timeout_s``) and stop the manager's own workers.

        Pending blocks stay local. The fabric is the caller's and stays open.
        """
        self.drain(timeout_s)
        if self._owns_executor:
            self._executor.shutdown(wait=timeout_s is None, cancel_futures=True)

    def check_integrity(self) -> None:
        """Verify the manager's bookkeeping against the block manager; raises AssertionError."""

        def fail(message: str) -> NoReturn:
            raise AssertionError(f"OffloadManager: {message}")

        for block_id, pooled in self._pooled.items():
            want = BlockLocation(pooled.request_id, pooled.tier, Residency.OFFLOADED)
            try:
                location = self._blocks.block_location(block_id)
            except BlockStateError:
                fail(f"pooled block {block_id} is not owned (freed without forget_request?)")
            else:
                if location != want:
                    fail(f"pooled block {block_id} is {location}, expected {want}")
        live = [t for t in self._pending if self._queued.get(t.block_id) is t]
        inflight = [t for b in self._inflight for t in b.tickets]
        if self._num_inflight != len(inflight) or self._num_inflight > self._max_inflight:
            fail(f"in-flight count {self._num_inflight} != {len(inflight)} or over the bound")
        tracked = [t.block_id for t in live] + [
            t.block_id for t in inflight if self._queued.get(t.block_id) is t
        ]
        if len(tracked) != len(set(tracked)) or set(tracked) != self._queued.keys():
            fail("queued blocks are not each pending or in flight exactly once")
        by_request = {b for ids in self._queued_by_request.values() for b in ids}
        if by_request != self._queued.keys() or not all(self._queued_by_request.values()):
            fail("the per-request index of queued blocks disagrees with the queue")
        if self._queued.keys() & self._pooled.keys():
            fail("a block is both queued for offload and pooled")
        if sum(b.is_probe for b in self._inflight) > 1:
            fail("more than one probe batch in flight")

    # -- internals: offload -----------------------------------------------------------------------

    def _is_local_tc(self, block_id: int, request_id: str) -> bool:
        try:
            location = self._blocks.block_location(block_id)
        except BlockStateError:
            return False
        return location == BlockLocation(request_id, Tier.THINK_COMPLETE, Residency.LOCAL)

    def _is_live(self, ticket: _Ticket) -> bool:
        """The ticket is current and its block is still the request's local TC block."""
        return self._queued.get(ticket.block_id) is ticket and self._is_local_tc(
            ticket.block_id, ticket.request_id
        )

    def _unqueue(self, ticket: _Ticket) -> None:
        if self._queued.get(ticket.block_id) is not ticket:
            return
        del self._queued[ticket.block_id]
        ids = self._queued_by_request[ticket.request_id]
        ids.discard(ticket.block_id)
        if not ids:
            del self._queued_by_request[ticket.request_id]

    def _is_backing_off(self) -> bool:
        # A call, not an inline comparison: mypy would keep a narrowed state across calls.
        return self._state is OffloadState.BACKING_OFF

    def _prune_pending(self) -> bool:
        """Drop stale tickets (evicted, freed or forgotten) from the head; True if any remain."""
        while self._pending and not self._is_live(self._pending[0]):
            self._unqueue(self._pending.popleft())
        return bool(self._pending)

    def _finish_done(self) -> int:
        num_offloaded = 0
        for batch in [b for b in self._inflight if b.future.done()]:
            num_offloaded += self._finish(batch)
        return num_offloaded

    def _start_batch(self, *, is_probe: bool) -> int:
        """Hand up to ``offload_threshold_blocks`` live pending blocks to a worker.

        The caller checked the in-flight bound. Returns blocks offloaded if the batch was
        already finished (it is then applied at once).
        """
        tickets: list[_Ticket] = []
        bodies: list[BytesLike] = []
        while self._pending and len(tickets) < self._threshold:
            ticket = self._pending.popleft()
            if not self._is_live(ticket):
                self._unqueue(ticket)
                continue
            tickets.append(ticket)
            bodies.append(self._read_block(ticket.block_id))
        if not tickets:
            return 0
        future = self._executor.submit(_push_batch, self._fabric, bodies)
        num_bytes = [memoryview(b).nbytes for b in bodies]
        batch = _Batch(tickets, num_bytes, future, is_probe)
        self._inflight.append(batch)
        self._num_inflight += len(tickets)
        return self._finish(batch) if future.done() else 0

    def _finish(self, batch: _Batch) -> int:
        """Apply one finished batch: offload its acknowledged prefix, requeue the rest."""
        self._inflight.remove(batch)
        self._num_inflight -= len(batch.tickets)
        exc = batch.future.exception()
        if exc is not None:
            # A bug, not a fabric failure (those come back in the result): keep the blocks
            # local and queued, then surface it.
            self._pending.extendleft(reversed(batch.tickets))
            raise exc
        result = batch.future.result()
        counters = self._counters
        num_offloaded = offloaded_bytes = 0
        for ticket, handle, num_bytes in zip(
            batch.tickets, result.handles, batch.num_bytes, strict=False
        ):
            if not self._is_live(ticket):
                self._unqueue(ticket)
                counters.num_stale_acks += 1
                self._discard(handle)
                continue
            self._unqueue(ticket)
            self._blocks.offload_block(ticket.block_id)
            self._pooled[ticket.block_id] = _Pooled(
                ticket.request_id, Tier.THINK_COMPLETE, handle, num_bytes
            )
            counters.num_blocks_offloaded += 1
            counters.num_bytes_offloaded += num_bytes
            num_offloaded += 1
            offloaded_bytes += num_bytes
        counters.push_latency_s.extend(result.latencies_s)
        metrics = self._metrics
        if metrics is not None:
            label = self._fabric.label
            if num_offloaded:
                metrics.count_offloaded(label, num_offloaded, offloaded_bytes)
            for seconds in result.latencies_s:
                metrics.observe_transfer_seconds(label, seconds)
        if result.error is None:
            if batch.is_probe and self._state is OffloadState.BACKING_OFF:
                self._resume("a probe batch went through")
            return num_offloaded
        counters.num_push_failures += 1
        if isinstance(result.error, PoolFull):
            counters.num_pool_full += 1
        self._pending.extendleft(reversed(batch.tickets[len(result.handles) :]))
        self._retry_at = self._clock() + self._retry_interval_s
        self._pause(OffloadState.BACKING_OFF, result.error)
        return num_offloaded

    def _pause(self, state: OffloadState, error: FabricError | None = None) -> None:
        if self._state is state or self._state is OffloadState.BACKING_OFF:
            return  # already paused: one count and one log line per pause
        self._state = state
        self._counters.num_offload_pauses += 1
        if error is None:
            reason = (
                f"{self._num_inflight} blocks in flight reach the bound of {self._max_inflight}"
            )
        else:
            reason = f"{error}; retrying in {self._retry_interval_s:g} s"
        _log.warning(
            "KV offload over fabric %s paused (%s); %d blocks stay local until it recovers",
            self._fabric.label,
            reason,
            self.num_pending_blocks,
        )

    def _resume(self, why: str) -> None:
        _log.info("KV offload over fabric %s resumed: %s", self._fabric.label, why)
        self._state = OffloadState.FLOWING

    # -- internals: ingest ------------------------------------------------------------------------

    def _offloaded_blocks(self, request_id: str) -> list[tuple[int, BlockLocation]]:
        located = [
            (b, self._blocks.block_location(b)) for b in self._blocks.blocks_for_request(request_id)
        ]
        return [(b, loc) for b, loc in located if loc.residency is Residency.OFFLOADED]

    def _fits_locally(self, offloaded: list[tuple[int, BlockLocation]]) -> bool:
        """Local slots exist for all of ``offloaded``."""
        return self._blocks.can_allocate(len(offloaded), Tier.OUTPUT_CRITICAL)

    def _ingest_block(self, block_id: int, location: BlockLocation) -> bool:
        """Restore one block; False (nothing written, still offloaded) when it cannot."""
        counters = self._counters
        pooled = self._pooled.get(block_id)
        if pooled is None or pooled.request_id != location.request_id:
            return False  # its pooled copy was lost earlier (or it was offloaded elsewhere)
        start = time.perf_counter()
        try:
            payload = self._fabric.pull(pooled.handle)
        except FabricError as exc:
            counters.num_pull_failures += 1
            if isinstance(exc, UnknownHandle):
                del self._pooled[block_id]
            _log.debug("pull of block %d failed: %s", block_id, exc)
            return False
        counters.pull_latency_s.append(time.perf_counter() - start)
        if self._metrics is not None:
            from meridian.telemetry.catalogue import TransferDirection

            self._metrics.observe_transfer_seconds(
                self._fabric.label, counters.pull_latency_s[-1], TransferDirection.INGEST
            )
        try:
            frame = decode(payload, expected_tier=location.tier)
            if frame.body.nbytes != pooled.num_bytes:
                raise WireError(
                    f"block {block_id}: the frame carries {frame.body.nbytes} bytes, "
                    f"{pooled.num_bytes} were offloaded"
                )
        except WireError as exc:
            if isinstance(exc, ChecksumMismatch):
                counters.num_checksum_failures += 1
                if self._metrics is not None:
                    self._metrics.count_checksum_failure(self._fabric.label)
            else:
                counters.num_corrupt_frames += 1
            del self._pooled[block_id]
            self._discard(pooled.handle)
            _log.debug("frame of block %d rejected: %s", block_id, exc)
            return False
        self._blocks.ingest_block(block_id)
        try:
            self._write_block(block_id, frame.body)
        except BaseException:
            self._blocks.offload_block(block_id)  # the pooled copy is still there
            raise
        del self._pooled[block_id]
        self._discard(pooled.handle)
        counters.num_blocks_ingested += 1
        counters.num_bytes_ingested += pooled.num_bytes
        if self._metrics is not None:
            self._metrics.count_ingested(self._fabric.label, 1, pooled.num_bytes)
        return True

    def _discard(self, handle: str) -> None:
        try:
            self._fabric.discard(handle)
        except FabricError as exc:
            self._counters.num_discard_failures += 1
            _log.debug("discard of %s failed: %s", handle, exc)
