"""The ``nixl`` fabric: MRDN frames to and from a kvpool process over NIXL (UCX), one host.

Both sides hold a NIXL agent with the UCX backend and one registered DRAM region: the pool its
slab, the producer a staging buffer. The pool's agent metadata reaches the producer through
NIXL's own listener (``fetch_remote_metadata``); slots are negotiated on the kvpool control
plane (:mod:`meridian.disagg.kvpool`). A push copies the frame into the staging buffer and
posts a NIXL WRITE into the pool's slot; a pull posts a NIXL READ. Transfers are polled
(``check_xfer_state``) until done or until the operation's deadline: agents run without a
progress thread (``enable_prog_thread=False``), so polling is what moves them, and the pool
polls its agent every millisecond (UCX's TCP transport needs the target to progress).

Loopback only: ``UCX_NET_DEVICES`` defaults to ``lo``, ``UCX_MODULES`` to ``^ib`` and
``NIXL_LOG_LEVEL`` to ``WARN`` (set them yourself to override). NIXL's metadata listeners bind
their port on every interface (NIXL 1.5.1 has no bind address); the pool only ever announces
127.0.0.1, and UCX's own sockets bind to ``lo``.

Install: ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (the ``nixl`` package's own
dependencies pull in CUDA torch, which NIXL's DRAM path does not need); the cu12 wheel bundles
UCX. ``scripts/install-fabrics.sh`` does it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from meridian.disagg.fabric import FabricError, FabricTimeout, FabricUnavailable
from meridian.disagg.kvpool import DEFAULT_TIMEOUT_S, PoolFabric, parse_address
from meridian.disagg.kvpool.client import (
    MIN_STAGING_BYTES,
    POLL_SLEEP_S,
    SPIN_POLLS,
    load_transport,
)
from meridian.disagg.wire import BytesLike

_log = logging.getLogger(__name__)

NIXL_INSTALL_HINT: Final = (
    "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 (or run scripts/install-fabrics.sh)"
)
# UCX_MODULES=^ib: UCX's InfiniBand modules are useless on loopback, and with them loaded the
# bundled libnl-route crashes in its destructor at process exit (SIGSEGV in
# rtnl_tc_unregister, seen with nixl-cu12 1.5.1 next to Debian's ibverbs providers).
ENV_DEFAULTS: Final = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def load_nixl() -> Any:
    """NIXL's Python API (``nixl._api``), with the loopback environment defaults applied.

    Raises FabricUnavailable, naming the packages to install, when NIXL is missing.
    """
    return load_transport(
        "nixl._api",
        fabric="nixl",
        library="the NIXL library",
        env_defaults=ENV_DEFAULTS,
        install_hint=NIXL_INSTALL_HINT,
    )


def _nixl_failure(action: str, exc: Exception) -> FabricError:
    """A FabricError for an exception raised by NIXL's bindings."""
    kind = type(exc).__name__
    if "Disconnect" in kind:
        return FabricUnavailable(f"NIXL lost the kvpool during {action} ({kind}): it stopped")
    return FabricUnavailable(f"NIXL failed to {action}: {kind}: {exc}")


class _Staging:
    """A registered DRAM buffer that grows (re-registered) to the largest frame seen."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.buffer: np.ndarray[Any, np.dtype[np.uint8]] = np.empty(0, np.uint8)
        self._registration: Any = None

    @property
    def address(self) -> int:
        """The buffer's virtual address."""
        return int(self.buffer.ctypes.data)

    def ensure(self, num_bytes: int) -> None:
        """Make the buffer hold at least ``num_bytes``."""
        if self.buffer.nbytes >= num_bytes:
            return
        self.release()
        size = max(num_bytes, 2 * self.buffer.nbytes, MIN_STAGING_BYTES)
        buffer = np.empty(size, np.uint8)
        try:
            self._registration = self._agent.register_memory(
                [(int(buffer.ctypes.data), size, 0, "")], "DRAM"
            )
        except Exception as exc:
            raise _nixl_failure(f"register a {size}-byte staging buffer", exc) from exc
        self.buffer = buffer

    def release(self) -> None:
        """Deregister the buffer (idempotent)."""
        registration, self._registration = self._registration, None
        if registration is not None:
            try:
                self._agent.deregister_memory(registration)
            except Exception as exc:  # best effort: the agent is going away or broken
                _log.debug("NIXL deregister_memory failed: %s", exc)
        self.buffer = np.empty(0, np.uint8)


class NixlProducerPlane:
    """The producer's NIXL side: an agent, a staging buffer, WRITE/READ to the pool's slab."""

    def __init__(self) -> None:
        api = load_nixl()
        name = f"meridian-producer-{os.getpid()}-{secrets.token_hex(3)}"
        # The listener (on an ephemeral port) is what fetch_remote_metadata works through.
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=True, listen_port=0
        )
        try:
            self._agent: Any = api.nixl_agent(name, config)
        except Exception as exc:
            raise _nixl_failure("create a NIXL agent with the UCX backend", exc) from exc
        if "UCX" not in self._agent.backends:
            raise FabricUnavailable(
                f"NIXL has no UCX backend here (plugins: {self._agent.get_plugin_list()}); "
                f"reinstall with: {NIXL_INSTALL_HINT}"
            )
        self._staging = _Staging(self._agent)
        self._remote: str | None = None
        self._slab_addr = 0

    def attach(self, data_plane: Mapping[str, Any], deadline: float) -> None:
        """Load the pool agent's metadata through its NIXL listener."""
        name, host, port = (
            str(data_plane["agent"]),
            str(data_plane["host"]),
            int(data_plane["port"]),
        )
        try:
            self._agent.fetch_remote_metadata(name, host, port)
            while not self._agent.check_remote_metadata(name):
                if time.monotonic() > deadline:
                    raise FabricTimeout(
                        f"the kvpool's NIXL listener at {host}:{port} sent no agent metadata "
                        f"in time; is the pool overloaded or stopping?"
                    )
                time.sleep(0.001)
        except FabricError:
            raise
        except Exception as exc:
            raise _nixl_failure(f"fetch the kvpool's metadata from {host}:{port}", exc) from exc
        self._remote = name
        self._slab_addr = int(data_plane["slab_addr"])

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        """Stage ``payload`` and NIXL-WRITE it to the slab at ``offset``."""
        source = np.frombuffer(payload, np.uint8)
        self._staging.ensure(source.nbytes)
        np.copyto(self._staging.buffer[: source.nbytes], source)
        self._transfer("WRITE", offset, source.nbytes, deadline)

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        """NIXL-READ ``num_bytes`` of the slab at ``offset``."""
        self._staging.ensure(num_bytes)
        self._transfer("READ", offset, num_bytes, deadline)
        return self._staging.buffer[:num_bytes].tobytes()

    def detach(self) -> None:
        """Forget the pool agent (NIXL disconnects from it)."""
        remote, self._remote = self._remote, None
        if remote is not None:
            try:
                self._agent.remove_remote_agent(remote)
            except Exception as exc:
                _log.debug("NIXL remove_remote_agent(%s) failed: %s", remote, exc)

    def close(self) -> None:
        """Release the staging buffer and the agent."""
        self.detach()
        self._staging.release()
        self._agent = None

    def _transfer(self, op: str, offset: int, num_bytes: int, deadline: float) -> None:
        remote = self._remote
        if remote is None:
            raise FabricUnavailable("NIXL: not attached to a kvpool")
        agent = self._agent
        handle: Any = None
        try:
            local = agent.get_xfer_descs([(self._staging.address, num_bytes, 0)], "DRAM")
            target = agent.get_xfer_descs([(self._slab_addr + offset, num_bytes, 0)], "DRAM")
            handle = agent.initialize_xfer(op, local, target, remote)
            state = agent.transfer(handle)
            num_polls = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise FabricTimeout(
                        f"NIXL {op} of {num_bytes} bytes to the kvpool did not finish in time; "
                        f"the pool may be overloaded or hung"
                    )
                num_polls += 1
                if num_polls > SPIN_POLLS:
                    time.sleep(POLL_SLEEP_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise FabricUnavailable(
                    f"NIXL {op} of {num_bytes} bytes to the kvpool failed (state {state})"
                )
        except FabricError:
            raise
        except Exception as exc:
            raise _nixl_failure(f"{op} {num_bytes} bytes", exc) from exc
        finally:
            if handle is not None:
                try:
                    handle.release()  # aborts a transfer still in flight
                except Exception as exc:
                    _log.debug("NIXL could not release a transfer handle: %s", exc)


class NixlPoolEndpoint:
    """The kvpool's NIXL side: an agent with a listener, and the slab registered as DRAM."""

    label: Final = "nixl"
    progress_interval_s: Final = 0.001

    def __init__(self, slab: np.ndarray[Any, Any], *, host: str, epoch: str) -> None:
        api = load_nixl()
        self._host = host
        # NIXL 1.5.1 cannot report the port of an ephemeral listener, so pick a free one.
        self._port = _free_port(host)
        self._name = f"meridian-kvpool-{epoch}"
        self._slab = slab
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=True, listen_port=self._port
        )
        try:
            self._agent: Any = api.nixl_agent(self._name, config)
            self._registration: Any = self._agent.register_memory(
                [(int(slab.ctypes.data), slab.nbytes, 0, "")], "DRAM"
            )
        except Exception as exc:
            raise _nixl_failure(f"register the kvpool's {slab.nbytes}-byte slab", exc) from exc

    def describe(self) -> dict[str, object]:
        """The pool agent's name and listener, and where the slab is."""
        return {
            "agent": self._name,
            "host": self._host,
            "port": self._port,
            "slab_addr": int(self._slab.ctypes.data),
            "slab_bytes": self._slab.nbytes,
        }

    def progress(self) -> None:
        """Poll the agent. Meridian sends no notifications; the call is what progresses UCX
        (connection set-up and TCP-emulated RDMA need the target side to poll)."""
        try:
            self._agent.get_new_notifs()
        except Exception as exc:
            _log.debug("NIXL progress: %s", exc)

    def close(self) -> None:
        """Deregister the slab."""
        try:
            self._agent.deregister_memory(self._registration)
        except Exception as exc:
            _log.debug("NIXL deregister_memory failed: %s", exc)


class NixlFabric(PoolFabric):
    """Push and pull MRDN frames to a ``meridian kvpool --fabric nixl`` process over NIXL.

    Contract: :class:`~meridian.disagg.fabric.Fabric`. Errors: the pool gone or a failed
    transfer -> FabricUnavailable; an operation over ``timeout_s`` -> FabricTimeout; no room
    -> PoolFull; a handle the pool does not hold (or held before it restarted) ->
    UnknownHandle. Thread-safe (operations are serialized).

    >>> fabric = NixlFabric("127.0.0.1:7470")          # doctest: +SKIP
    >>> fabric.pull(fabric.push(frame)) == frame        # doctest: +SKIP
    True
    """

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        parse_address(address)  # a bad address fails before NIXL starts
        super().__init__("nixl", address, NixlProducerPlane(), timeout_s=timeout_s)


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the caller binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
