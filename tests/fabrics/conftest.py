"""Fixtures of the fabric tests: kvpool child processes that are always cleaned up."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fabric_support import PoolProcess, running_pools

StartPool = Callable[..., PoolProcess]


@pytest.fixture
def start_pool() -> Iterator[StartPool]:
    """Start kvpool processes for one test; all are killed when it ends."""
    with running_pools() as pools:

        def start(fabric: str, **options: object) -> PoolProcess:
            pool = PoolProcess(fabric, **options)  # type: ignore[arg-type]
            pools.append(pool)
            pool.start()
            return pool

        yield start


@pytest.fixture(scope="module")
def shared_pool() -> Iterator[Callable[[str], PoolProcess]]:
    """One long-lived pool per fabric for a test module (tests must leave it empty)."""
    started: dict[str, PoolProcess] = {}
    with running_pools() as pools:

        def get(fabric: str) -> PoolProcess:
            if fabric not in started or not started[fabric].alive:
                pool = PoolProcess(fabric)
                pools.append(pool)
                pool.start()
                started[fabric] = pool
            return started[fabric]

        yield get
