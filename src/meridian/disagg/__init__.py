"""MRDN v1 frames and the transports that move them: a library, not used by ``meridian serve``.

- :mod:`meridian.disagg.wire`: encode/decode one KV block as an MRDN v1 frame (the format and
  its test vectors: ``docs/wire-format.md``).
- :mod:`meridian.disagg.fabric`: the :class:`Fabric` protocol (a store of frames under
  handles), its errors, and :class:`InProcessFabric`.
- :mod:`meridian.disagg.transport`: one-sided transports between two processes on one host,
  over NIXL (:mod:`~meridian.disagg.nixl_fabric`) or Mooncake's transfer engine
  (:mod:`~meridian.disagg.mooncake_fabric`); their libraries are optional
  (``scripts/install-fabrics.sh``).

Meridian itself offloads a preempted request's KV through vLLM's own ``OffloadingConnector``
(``meridian serve --kv-offload-gib N``; docs/vllm.md and
docs/adr/0014-kv-offload-through-vllm.md). Meridian's KV pool process and its offload manager,
which used this package, are retired: docs/disaggregation.md says why.
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
)
from meridian.disagg.transport import Endpoint, ProducerPlane, make_endpoint, make_producer_plane
from meridian.disagg.wire import Frame, WireError, decode, encode

__all__ = [
    "Endpoint",
    "Fabric",
    "FabricError",
    "FabricTimeout",
    "FabricUnavailable",
    "Frame",
    "InProcessFabric",
    "PoolFull",
    "ProducerPlane",
    "UnknownHandle",
    "WireError",
    "decode",
    "encode",
    "make_endpoint",
    "make_producer_plane",
]
