"""The ``nixl`` transport: MRDN frames to and from another process's memory over NIXL (UCX).

Both sides hold a NIXL agent with the UCX backend and one registered DRAM region: the target
(:class:`NixlEndpoint`) the region frames go to, the initiator (:class:`NixlProducerPlane`) a
staging buffer. The target's agent metadata reaches the initiator through NIXL's own listener
(``fetch_remote_metadata``). A write copies the frame into the staging buffer and posts a NIXL
WRITE at an offset of the target's region; a read posts a NIXL READ. Transfers are polled
(``check_xfer_state``) until done or until the operation's deadline: agents run without a
progress thread (``enable_prog_thread=False``), so polling is what moves them, and the target
must call :meth:`NixlEndpoint.progress` often (UCX's TCP transport needs the target to progress).

Loopback only: ``UCX_NET_DEVICES`` defaults to ``lo``, ``UCX_MODULES`` to ``^ib`` and
``NIXL_LOG_LEVEL`` to ``WARN`` (set them yourself to override). NIXL's metadata listeners bind
their port on every interface (NIXL 1.5.1 has no bind address), and whoever fetches the
target's metadata can read and write its whole region: see :mod:`meridian.disagg.transport`.

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
from meridian.disagg.transport import MIN_STAGING_BYTES, POLL_SLEEP_S, SPIN_POLLS, load_transport
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
        return FabricUnavailable(f"NIXL lost the peer during {action} ({kind}): it stopped")
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
    """The initiator's NIXL side: an agent, a staging buffer, WRITE/READ to a peer's region.

    Implements :class:`~meridian.disagg.transport.ProducerPlane`.
    """

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
        self._region_addr = 0

    def attach(self, description: Mapping[str, Any], deadline: float) -> None:
        """Load the target agent's metadata through its NIXL listener."""
        name, host, port = (
            str(description["agent"]),
            str(description["host"]),
            int(description["port"]),
        )
        try:
            self._agent.fetch_remote_metadata(name, host, port)
            while not self._agent.check_remote_metadata(name):
                if time.monotonic() > deadline:
                    raise FabricTimeout(
                        f"the NIXL listener at {host}:{port} sent no agent metadata in time; "
                        f"is the peer overloaded or stopping?"
                    )
                time.sleep(0.001)
        except FabricError:
            raise
        except Exception as exc:
            raise _nixl_failure(f"fetch the peer's metadata from {host}:{port}", exc) from exc
        self._remote = name
        self._region_addr = int(description["region_addr"])

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        """Stage ``payload`` and NIXL-WRITE it to the region at ``offset``."""
        source = np.frombuffer(payload, np.uint8)
        self._staging.ensure(source.nbytes)
        np.copyto(self._staging.buffer[: source.nbytes], source)
        self._transfer("WRITE", offset, source.nbytes, deadline)

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        """NIXL-READ ``num_bytes`` of the region at ``offset``."""
        self._staging.ensure(num_bytes)
        self._transfer("READ", offset, num_bytes, deadline)
        return self._staging.buffer[:num_bytes].tobytes()

    def detach(self) -> None:
        """Forget the target agent (NIXL disconnects from it)."""
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
            raise FabricUnavailable("NIXL: not attached to a peer (call attach first)")
        agent = self._agent
        handle: Any = None
        try:
            local = agent.get_xfer_descs([(self._staging.address, num_bytes, 0)], "DRAM")
            target = agent.get_xfer_descs([(self._region_addr + offset, num_bytes, 0)], "DRAM")
            handle = agent.initialize_xfer(op, local, target, remote)
            state = agent.transfer(handle)
            num_polls = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise FabricTimeout(
                        f"NIXL {op} of {num_bytes} bytes did not finish in time; the peer may "
                        f"be overloaded, stopped or gone"
                    )
                num_polls += 1
                if num_polls > SPIN_POLLS:
                    time.sleep(POLL_SLEEP_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise FabricUnavailable(
                    f"NIXL {op} of {num_bytes} bytes to the peer failed (state {state})"
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


class NixlEndpoint:
    """The target's NIXL side: an agent with a listener, and ``region`` registered as DRAM.

    Implements :class:`~meridian.disagg.transport.Endpoint`. Call :meth:`progress` every
    ``progress_interval_s`` while initiators transfer.
    """

    label: Final = "nixl"
    progress_interval_s: Final = 0.001

    def __init__(self, region: np.ndarray[Any, Any], *, host: str = "127.0.0.1") -> None:
        api = load_nixl()
        self._host = host
        # NIXL 1.5.1 cannot report the port of an ephemeral listener, so pick a free one.
        self._port = _free_port(host)
        self._name = f"meridian-endpoint-{os.getpid()}-{secrets.token_hex(3)}"
        self._region = region
        config = api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=True, listen_port=self._port
        )
        try:
            self._agent: Any = api.nixl_agent(self._name, config)
            self._registration: Any = self._agent.register_memory(
                [(int(region.ctypes.data), region.nbytes, 0, "")], "DRAM"
            )
        except Exception as exc:
            raise _nixl_failure(f"register a {region.nbytes}-byte region", exc) from exc

    def describe(self) -> dict[str, object]:
        """The agent's name and listener, and where the region is."""
        return {
            "agent": self._name,
            "host": self._host,
            "port": self._port,
            "region_addr": int(self._region.ctypes.data),
            "region_bytes": self._region.nbytes,
        }

    def progress(self) -> None:
        """Poll the agent. Meridian sends no notifications; the call is what progresses UCX
        (connection set-up and TCP-emulated RDMA need the target side to poll)."""
        try:
            self._agent.get_new_notifs()
        except Exception as exc:
            _log.debug("NIXL progress: %s", exc)

    def close(self) -> None:
        """Deregister the region."""
        try:
            self._agent.deregister_memory(self._registration)
        except Exception as exc:
            _log.debug("NIXL deregister_memory failed: %s", exc)


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the caller binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
