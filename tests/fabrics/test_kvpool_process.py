"""The ``meridian kvpool`` process: its start line, clean shutdown on SIGTERM, argument errors,
and :func:`run_kvpool` embedded in a thread."""

from __future__ import annotations

import importlib
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from fabric_support import FABRICS, TC, PoolProcess, fabric_for, kv_block

from meridian.disagg.fabric import FabricError, FabricUnavailable
from meridian.disagg.kvpool import FAULTS_ENV, PoolClient, faults_from_env, run_kvpool
from meridian.disagg.kvpool import client as kvpool_client
from meridian.disagg.wire import encode

StartPool = Callable[..., PoolProcess]


@pytest.mark.parametrize("fabric_name", FABRICS)
def test_kvpool_logs_one_start_line_and_stops_cleanly_on_sigterm(
    fabric_name: str, start_pool: StartPool
) -> None:
    pool = start_pool(fabric_name, capacity="64MiB")
    started = [line for line in pool.lines if "listening on" in line]
    assert len(started) == 1
    assert f"fabric {fabric_name} listening on {pool.address}" in started[0]
    assert "capacity 67108864 bytes" in started[0]
    fabric = fabric_for(pool)
    try:
        fabric.push(encode(TC, kv_block(7)))
    finally:
        fabric.close()
    assert pool.terminate() == 0
    output = pool.output()
    assert "SIGTERM received, shutting down" in output
    assert "stopped; dropped 1 frames" in output
    assert "Traceback" not in output


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meridian.disagg.kvpool", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvpool_refuses_bad_arguments_with_one_line_errors() -> None:
    remote = run_cli("--fabric", "mooncake", "--listen", "10.0.0.1:7470")
    assert remote.returncode == 2
    assert "error: KV pool address '10.0.0.1:7470' is not an IPv4 loopback address" in remote.stderr
    size = run_cli("--fabric", "mooncake", "--capacity", "lots")
    assert size.returncode == 2 and "size must look like" in size.stderr
    fabric = run_cli("--fabric", "rdma")
    assert fabric.returncode == 2 and "invalid choice: 'rdma'" in fabric.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = run_cli("--fabric", "mooncake", "--listen", f"127.0.0.1:{port}")
    assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    for result in (remote, size, taken):
        assert "Traceback" not in result.stderr


@contextmanager
def kvpool_thread(**options: object) -> Iterator[str]:
    """Run a 1 MiB mooncake pool in a thread (``run_kvpool`` with ``options``); yields its
    address, and on exit stops it and checks that the thread ended."""
    stop, started, ready = threading.Event(), threading.Event(), []

    def on_ready(address: str) -> None:
        ready.append(address)
        started.set()

    worker = threading.Thread(
        target=run_kvpool,
        args=("mooncake", "127.0.0.1:0"),
        kwargs={"capacity_bytes": 1 << 20, "stop": stop, "on_ready": on_ready, **options},
    )
    worker.start()
    try:
        assert started.wait(30)
        yield ready[0]
    finally:
        stop.set()
        worker.join(30)
    assert not worker.is_alive()


def test_run_kvpool_in_a_thread_refuses_faults_unless_enabled() -> None:
    with kvpool_thread() as address:
        client = PoolClient(address)
        handle, _ = client.alloc(16)
        client.commit(handle)
        with pytest.raises(FabricError, match="fault injection is off"):
            client.corrupt(handle)
        client.disconnect()


def test_fault_injection_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert not faults_from_env()
    monkeypatch.setenv(FAULTS_ENV, "1")
    assert faults_from_env()
    monkeypatch.setenv(FAULTS_ENV, "no")
    assert not faults_from_env()


@pytest.mark.parametrize(
    ("module", "loader", "hint"),
    [
        ("meridian.disagg.nixl_fabric", "load_nixl", "nixl-cu12==1.5.1"),
        ("meridian.disagg.mooncake_fabric", "load_mooncake", "libibverbs1"),
    ],
)
def test_a_missing_library_is_unavailable_with_what_to_install(
    module: str, loader: str, hint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fabric_module = importlib.import_module(module)

    def missing(name: str) -> object:
        raise ImportError(f"No module named {name!r}")

    # Both fabrics import their transport through the shared kvpool.client.load_transport.
    monkeypatch.setattr(kvpool_client.importlib, "import_module", missing)
    with pytest.raises(FabricUnavailable, match=f"cannot be imported .*{re.escape(hint)}"):
        getattr(fabric_module, loader)()


def test_kvpool_reports_through_the_metric_catalogue() -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    with kvpool_thread(metrics_port=metrics_port) as address:
        client = PoolClient(address)
        handle, _ = client.alloc(100)
        client.commit(handle)
        client.open(handle)
        client.close_handle(handle)
        client.disconnect()
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    samples = {
        (s.name, s.labels.get("fabric")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("meridian_disagg_offloaded_blocks_total", "mooncake")] == 1
    assert samples[("meridian_disagg_offloaded_bytes_total", "mooncake")] == 100
    assert samples[("meridian_disagg_ingested_blocks_total", "mooncake")] == 1
    assert samples[("meridian_kv_capacity_bytes", None)] == 1 << 20
