"""Disaggregated KV transfer: the MRDN v1 wire format, fabrics, and offload/ingest of KV blocks.

- :mod:`meridian.disagg.wire`: encode/decode one KV block as an MRDN v1 frame.
- :mod:`meridian.disagg.fabric`: the :class:`Fabric` protocol and :class:`InProcessFabric`.
- :mod:`meridian.disagg.offload`: :class:`OffloadManager`, which moves ThinkComplete blocks of
  a :class:`~meridian.core.blocks.TieredBlockManager` to a fabric at ``</think>`` and back.
"""

from __future__ import annotations

from meridian.disagg.fabric import (
    Fabric,
    FabricError,
    FabricTimeout,
    FabricUnavailable,
    InProcessFabric,
    PoolFull,
    UnknownHandle,
    make_fabric,
)
from meridian.disagg.offload import (
    IngestResult,
    InlineExecutor,
    OffloadCounters,
    OffloadManager,
    OffloadState,
)
from meridian.disagg.wire import Frame, WireError, decode, encode

__all__ = [
    "Fabric",
    "FabricError",
    "FabricTimeout",
    "FabricUnavailable",
    "Frame",
    "InProcessFabric",
    "IngestResult",
    "InlineExecutor",
    "OffloadCounters",
    "OffloadManager",
    "OffloadState",
    "PoolFull",
    "UnknownHandle",
    "WireError",
    "decode",
    "encode",
    "make_fabric",
]
