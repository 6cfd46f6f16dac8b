"""Fixtures of the fabric tests: target processes and producer planes, always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fabric_support import StartTarget, TargetProcess, running_targets

from meridian.disagg.transport import ProducerPlane, make_producer_plane


@pytest.fixture
def start_target() -> Iterator[StartTarget]:
    """Start target processes for one test; all are killed when it ends."""
    with running_targets() as targets:

        def start(fabric: str) -> TargetProcess:
            target = TargetProcess(fabric)
            targets.append(target)
            target.start()
            return target

        yield start


@pytest.fixture
def plane(fabric_name: str) -> Iterator[ProducerPlane]:
    """The producer plane of the test's fabric, closed when it ends."""
    producer = make_producer_plane(fabric_name)
    try:
        yield producer
    finally:
        producer.close()
