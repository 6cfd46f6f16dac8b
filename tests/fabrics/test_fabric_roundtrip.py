"""Two-process round trips of real KV blocks through the NIXL and Mooncake transports.

The producer is this test process; the target is a child process that registered a region
(``endpoint_child.py``). If a transport's library cannot work here, these tests fail with the
library's reason (no skip).
"""

from __future__ import annotations

import numpy as np
import pytest
from fabric_support import (
    BLOCK_BYTES,
    BLOCK_SHAPE,
    FABRICS,
    OC,
    TA,
    TC,
    StartTarget,
    deadline,
    kv_block,
)

from meridian.core.types import Tier
from meridian.disagg.fabric import FabricUnavailable
from meridian.disagg.mooncake_fabric import MooncakeEndpoint, MooncakeProducerPlane
from meridian.disagg.nixl_fabric import NixlEndpoint, NixlProducerPlane
from meridian.disagg.transport import ProducerPlane, make_endpoint, make_producer_plane
from meridian.disagg.wire import HEADER_SIZE, decode, encode

pytestmark = pytest.mark.parametrize("fabric_name", FABRICS)


def test_real_kv_blocks_land_in_the_target_and_come_back_with_their_tier(
    fabric_name: str, plane: ProducerPlane, start_target: StartTarget
) -> None:
    target = start_target(fabric_name)
    plane.attach(target.description, deadline())
    stride = BLOCK_BYTES + HEADER_SIZE
    written: list[tuple[int, Tier, bytes]] = []
    for slot, tier in enumerate([TC, TA, OC, TC]):
        body = kv_block(slot)
        plane.write(encode(tier, body), slot * stride, deadline())
        written.append((slot * stride, tier, body))
    # The bytes are in the target's own memory, not only in this process's staging buffer.
    assert target.region_hex(0, stride) == encode(TC, kv_block(0))
    for offset, tier, body in reversed(written):
        frame = decode(plane.read(offset, stride, deadline()), expected_tier=tier)
        assert frame.tier is tier
        kv = np.frombuffer(frame.body, np.float16).reshape(BLOCK_SHAPE)
        assert np.array_equal(kv, np.frombuffer(body, np.float16).reshape(BLOCK_SHAPE))


@pytest.mark.parametrize("num_bytes", [1, 16 << 10, 8 << 20])
def test_frames_of_every_size_come_back_byte_exact(
    fabric_name: str, num_bytes: int, plane: ProducerPlane, start_target: StartTarget
) -> None:
    plane.attach(start_target(fabric_name).description, deadline())
    body = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, np.uint8).tobytes()
    frame = encode(TC, body)
    offset = 4096 + 7  # any offset in the region, aligned or not
    plane.write(frame, offset, deadline())
    back = plane.read(offset, len(frame), deadline())
    assert len(back) == num_bytes + HEADER_SIZE
    assert back == frame


def test_factories_build_the_transport_named(fabric_name: str) -> None:
    endpoint_cls = {"nixl": NixlEndpoint, "mooncake": MooncakeEndpoint}[fabric_name]
    plane_cls = {"nixl": NixlProducerPlane, "mooncake": MooncakeProducerPlane}[fabric_name]
    region = np.zeros(1 << 20, np.uint8)
    endpoint = make_endpoint(fabric_name, region)
    try:
        assert isinstance(endpoint, endpoint_cls) and endpoint.label == fabric_name
        description = endpoint.describe()
        assert description["region_addr"] == region.ctypes.data
        assert description["region_bytes"] == region.nbytes
    finally:
        endpoint.close()
    plane = make_producer_plane(fabric_name)
    try:
        assert isinstance(plane, plane_cls)
        with pytest.raises(FabricUnavailable, match="not attached to a peer"):
            plane.write(b"frame", 0, deadline())
    finally:
        plane.close()
