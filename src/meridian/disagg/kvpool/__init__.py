"""The KV pool: a process that holds offloaded MRDN frames for producers, and its protocol.

``python -m meridian.disagg.kvpool --fabric nixl --listen 127.0.0.1:7470`` (or
:func:`run_kvpool`) starts a pool. It owns one slab of DRAM (``--capacity`` bytes), registered
with the fabric's library, and serves two planes::

    producer                                       kvpool process
    ────────                                       ──────────────
    control  TCP, --listen address  ─────────────> PoolStore: slab allocator, handles, pins
    data     NIXL (UCX) or Mooncake TE (TCP) ────> the registered slab (one-sided WRITE / READ)

The control plane is Meridian's own: length-prefixed JSON messages, one reply per request.
The data plane is the fabric's library; it moves the frame's bytes unchanged (MRDN header
included) between a producer's registered staging buffer and the pool's slab.

Push: ``alloc(n)`` reserves a slot and returns ``(handle, offset)``; the producer WRITEs the
frame there; ``commit(handle)`` makes it a stored frame and is the acknowledgement. Pull:
``open(handle)`` pins the frame and returns its place; the producer READs it; ``close(handle)``
unpins it. ``discard(handle)`` releases a frame (a pinned one when its last reader is done).

Invariants the pool keeps:

- A slot is never handed out twice while anyone may still write to or read from it. A
  reservation whose producer vanished before committing (connection lost, timeout) may still
  receive a late WRITE, so its slot is quarantined for ``quarantine_s`` before reuse.
- Handles carry the pool's epoch (random per start): after a restart every old handle is
  unknown, never silently aliased to a new frame.
- The pool never parses frames: verification (checksum, tier) is the receiver's job.

Fault injection for tests (``--fault-injection`` or ``MERIDIAN_KVPOOL_FAULTS=1``): the control
op ``fault`` can flip bits of a stored frame or stall the next commit; refused otherwise.

Modules: :mod:`~meridian.disagg.kvpool.store` (slab allocator, frames by handle),
:mod:`~meridian.disagg.kvpool.protocol` (control messages, error codes, addresses),
:mod:`~meridian.disagg.kvpool.server` (the pool's side: endpoint and control server),
:mod:`~meridian.disagg.kvpool.client` (the producer's side: :class:`PoolFabric`),
:mod:`~meridian.disagg.kvpool.process` (running a pool, the command line).
"""

from __future__ import annotations

from meridian.disagg.fabric import POOL_FABRICS
from meridian.disagg.kvpool.client import (
    DEFAULT_TIMEOUT_S,
    PoolClient,
    PoolFabric,
    ProducerPlane,
)
from meridian.disagg.kvpool.process import (
    DEFAULT_CAPACITY_BYTES,
    build_parser,
    faults_from_env,
    main,
    run_kvpool,
)
from meridian.disagg.kvpool.protocol import (
    DEFAULT_LISTEN,
    FAULTS_ENV,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    parse_address,
    parse_size,
    recv_message,
    send_message,
)
from meridian.disagg.kvpool.server import KvPoolServer, PoolEndpoint, make_pool_endpoint
from meridian.disagg.kvpool.store import (
    ALIGN_BYTES,
    DEFAULT_QUARANTINE_S,
    EntryState,
    PoolStats,
    PoolStore,
    SlabAllocator,
)

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_LISTEN",
    "DEFAULT_QUARANTINE_S",
    "DEFAULT_TIMEOUT_S",
    "FAULTS_ENV",
    "MAX_MESSAGE_BYTES",
    "POOL_FABRICS",
    "PROTOCOL_VERSION",
    "EntryState",
    "KvPoolServer",
    "PoolClient",
    "PoolEndpoint",
    "PoolFabric",
    "PoolStats",
    "PoolStore",
    "ProducerPlane",
    "ProtocolError",
    "SlabAllocator",
    "build_parser",
    "faults_from_env",
    "main",
    "make_pool_endpoint",
    "parse_address",
    "parse_size",
    "recv_message",
    "run_kvpool",
    "send_message",
]
