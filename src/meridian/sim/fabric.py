"""A fabric model for the simulator: how long moving KV blocks to a KV pool takes.

transfer time = latency + bytes / bandwidth, in integer nanoseconds. The presets are round numbers
for the two transports Meridian supports, labelled as assumptions (replace them with your own
measurements of ``benchmarks/bench_fabrics.py``):

- ``rdma``: NIXL over UCX/RDMA on a 400 Gb/s NIC — 50 GB/s, 10 µs per transfer.
- ``tcp``: Mooncake's transfer engine over 25 Gb/s TCP — 3.1 GB/s, 50 µs per transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from meridian.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FabricModel:
    """Latency and bandwidth of one transfer between the engine and the KV pool."""

    name: str
    latency_ns: int
    bandwidth_bytes_per_s: float

    def transfer_ns(self, num_bytes: int) -> int:
        """Nanoseconds to move ``num_bytes`` in one transfer.

        >>> FabricModel("x", 1_000, 1e9).transfer_ns(1_000_000)
        1001000
        """
        return self.latency_ns + int(num_bytes * 1e9 / self.bandwidth_bytes_per_s)


FABRIC_MODELS: dict[str, FabricModel] = {
    "rdma": FabricModel("rdma", 10_000, 50e9),
    "tcp": FabricModel("tcp", 50_000, 3.1e9),
}


def fabric_model(name: str) -> FabricModel:
    """A preset by name; a clear error listing the known ones."""
    try:
        return FABRIC_MODELS[name]
    except KeyError:
        raise ConfigError(
            f"--disagg: unknown fabric model {name!r}; known: {', '.join(FABRIC_MODELS)}"
        ) from None
