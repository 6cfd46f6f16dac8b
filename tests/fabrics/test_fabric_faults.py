"""Faults between two processes over the NIXL and Mooncake transports: the target killed or
stopped mid-conversation, frames corrupted at rest. Each ends within the caller's deadline in
a completed transfer or a clear FabricError or WireError (never a hang, never wrong KV
accepted), and the producer works again against a new target.
"""

from __future__ import annotations

import signal
import time

import pytest
from fabric_support import FABRICS, TA, TC, StartTarget, deadline, kv_block

from meridian.disagg.fabric import FabricError
from meridian.disagg.transport import ProducerPlane
from meridian.disagg.wire import HEADER_SIZE, ChecksumMismatch, TierMismatch, decode, encode

pytestmark = pytest.mark.parametrize("fabric_name", FABRICS)


def test_a_killed_target_fails_transfers_and_the_producer_moves_to_a_new_one(
    fabric_name: str, plane: ProducerPlane, start_target: StartTarget
) -> None:
    target = start_target(fabric_name)
    plane.attach(target.description, deadline())
    frame = encode(TC, kv_block(1))
    plane.write(frame, 0, deadline())
    target.kill()
    start = time.monotonic()
    with pytest.raises(FabricError):
        plane.read(0, len(frame), deadline(2.0))
    assert time.monotonic() - start < 10.0

    plane.detach()
    fresh = start_target(fabric_name)
    plane.attach(fresh.description, deadline())
    plane.write(frame, 0, deadline())
    assert plane.read(0, len(frame), deadline()) == frame


def test_a_stopped_target_never_blocks_the_producer_past_its_deadline(
    fabric_name: str, plane: ProducerPlane, start_target: StartTarget
) -> None:
    # The retired KV pool, SIGSTOPped, held its caller 24 s. A one-sided transfer either lands
    # without the target running (UCX moves same-host bytes with cross-memory attach) or fails
    # by its deadline; it never waits on the stopped process.
    target = start_target(fabric_name)
    plane.attach(target.description, deadline())
    frame = encode(TC, kv_block(2))
    plane.write(frame, 0, deadline())
    target.signal(signal.SIGSTOP)
    start = time.monotonic()
    try:
        plane.write(frame, len(frame), deadline(0.5))
        assert plane.read(len(frame), len(frame), deadline(0.5)) == frame
    except FabricError:
        pass
    assert time.monotonic() - start < 5.0
    target.signal(signal.SIGCONT)


def test_frames_corrupted_at_rest_are_rejected_by_decode(
    fabric_name: str, plane: ProducerPlane, start_target: StartTarget
) -> None:
    plane.attach(start_target(fabric_name).description, deadline())
    frame = encode(TC, kv_block(3))
    plane.write(frame, 0, deadline())
    plane.write(frame, len(frame), deadline())
    body_byte = HEADER_SIZE + 100
    plane.write(bytes([frame[body_byte] ^ 0x10]), body_byte, deadline())  # a body bit
    plane.write(bytes([frame[12] ^ 0x01]), len(frame) + 12, deadline())  # tier byte: 0 -> 1
    with pytest.raises(ChecksumMismatch):
        decode(plane.read(0, len(frame), deadline()), expected_tier=TC)
    tampered = plane.read(len(frame), len(frame), deadline())
    assert decode(tampered).tier is TA  # the checksum covers the body only ...
    with pytest.raises(TierMismatch):  # ... so the receiver names the tier it expects
        decode(tampered, expected_tier=TC)
