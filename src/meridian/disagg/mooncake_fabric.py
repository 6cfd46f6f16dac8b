"""The ``mooncake`` transport: MRDN frames to and from another process's memory over
Mooncake's transfer engine.

Both sides run a Mooncake ``TransferEngine`` with the TCP transport in P2P-handshake mode
(``metadata_server="P2PHANDSHAKE"``: no etcd, no metadata server; each engine answers
handshakes on its own RPC port). The target (:class:`MooncakeEndpoint`) registers the region
frames go to; the initiator (:class:`MooncakeProducerPlane`) registers a staging buffer and
moves frames with one-sided transfers into and out of that region: ``transfer_submit_write``
for a write, ``batch_transfer_async_read`` for a read, both polled with
``transfer_check_status`` until done or until the operation's deadline. The MRDN frame travels
unchanged, header included.

An initiator keeps one engine for its lifetime (tearing one down takes up to a second). A
restarted target has a new RPC port, hence a new session name, so the engine's cached
description of the old one is never used for the new one.

Loopback only: ``MC_TCP_BIND_ADDRESS`` defaults to ``127.0.0.1`` and ``MC_LOG_LEVEL`` to
``ERROR``. Whoever learns the target's session can read and write its whole region: see
:mod:`meridian.disagg.transport`. Install: ``pip install
mooncake-transfer-engine-non-cuda==0.3.13.post1`` and Debian's ``libibverbs1`` (the engine
links it even for TCP); the plain ``mooncake-transfer-engine`` wheel needs the CUDA driver.
``scripts/install-fabrics.sh`` does it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from meridian.disagg.fabric import FabricTimeout, FabricUnavailable
from meridian.disagg.transport import MIN_STAGING_BYTES, POLL_SLEEP_S, SPIN_POLLS, load_transport
from meridian.disagg.wire import BytesLike

_log = logging.getLogger(__name__)

MOONCAKE_INSTALL_HINT: Final = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 and apt-get install "
    "libibverbs1 (or run scripts/install-fabrics.sh)"
)
ENV_DEFAULTS: Final = {"MC_LOG_LEVEL": "ERROR", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
# transfer_check_status codes
_DONE: Final = 1
_IN_PROGRESS: Final = 0
_TIMED_OUT: Final = -2


def load_mooncake() -> Any:
    """``mooncake.engine``, with the loopback environment defaults applied.

    Raises FabricUnavailable, naming what to install, when the engine cannot be imported.
    """
    return load_transport(
        "mooncake.engine",
        fabric="mooncake",
        library="Mooncake's transfer engine",
        env_defaults=ENV_DEFAULTS,
        install_hint=MOONCAKE_INSTALL_HINT,
    )


def start_engine(api: Any, host: str) -> Any:
    """A TransferEngine on ``host`` with the TCP transport and P2P handshakes."""
    engine = api.TransferEngine()
    status = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if status != 0:
        raise FabricUnavailable(
            f"Mooncake's transfer engine failed to start on {host} (initialize returned "
            f"{status}); see its log above"
        )
    return engine


class MooncakeProducerPlane:
    """The initiator's Mooncake side: an engine, a staging buffer, transfers to a peer's region.

    Implements :class:`~meridian.disagg.transport.ProducerPlane`.
    """

    def __init__(self) -> None:
        self._api = load_mooncake()
        self._engine: Any = None
        self._staging: np.ndarray[Any, np.dtype[np.uint8]] = np.empty(0, np.uint8)
        self._session: str | None = None
        self._region_addr = 0

    def attach(self, description: Mapping[str, Any], deadline: float) -> None:
        """Start the engine (once) and aim it at the target's session."""
        session = str(description["session"])
        if self._engine is None:
            self._engine = start_engine(self._api, "127.0.0.1")
        self._session = session
        self._region_addr = int(description["region_addr"])

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        """Stage ``payload`` and write it to the region at ``offset``."""
        source = np.frombuffer(payload, np.uint8)
        session, remote = self._target(offset)
        self._ensure_staging(source.nbytes)
        np.copyto(self._staging[: source.nbytes], source)
        address = int(self._staging.ctypes.data)
        batch = self._engine.transfer_submit_write(session, address, remote, source.nbytes)
        self._wait(batch, "write", source.nbytes, deadline)

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        """Read ``num_bytes`` of the region at ``offset``."""
        session, remote = self._target(offset)
        self._ensure_staging(num_bytes)
        address = int(self._staging.ctypes.data)
        batch = self._engine.batch_transfer_async_read(session, [address], [remote], [num_bytes])
        self._wait(batch, "read", num_bytes, deadline)
        return self._staging[:num_bytes].tobytes()

    def detach(self) -> None:
        """Forget the target's session."""
        self._session = None

    def close(self) -> None:
        """Release the staging buffer and the engine."""
        self.detach()
        self._unregister_staging()
        self._engine = None

    def _target(self, offset: int) -> tuple[str, int]:
        if self._session is None or self._engine is None:
            raise FabricUnavailable("Mooncake: not attached to a peer (call attach first)")
        return self._session, self._region_addr + offset

    def _ensure_staging(self, num_bytes: int) -> None:
        if self._staging.nbytes >= num_bytes:
            return
        self._unregister_staging()
        size = max(num_bytes, 2 * self._staging.nbytes, MIN_STAGING_BYTES)
        staging = np.empty(size, np.uint8)
        status = self._engine.register_memory(int(staging.ctypes.data), size)
        if status != 0:
            raise FabricUnavailable(
                f"Mooncake could not register a {size}-byte staging buffer (status {status})"
            )
        self._staging = staging

    def _wait(self, batch: int, op: str, num_bytes: int, deadline: float) -> None:
        if batch <= 0:
            raise FabricUnavailable(
                f"Mooncake could not submit a {num_bytes}-byte {op} to the peer at "
                f"{self._session} (returned {batch}): it stopped or is unreachable"
            )
        num_polls = 0
        while (status := self._engine.transfer_check_status(batch)) == _IN_PROGRESS:
            if time.monotonic() > deadline:
                raise FabricTimeout(
                    f"Mooncake {op} of {num_bytes} bytes did not finish in time; the peer may "
                    f"be overloaded, stopped or gone"
                )
            num_polls += 1
            if num_polls > SPIN_POLLS:
                time.sleep(POLL_SLEEP_S)
        if status == _TIMED_OUT:
            raise FabricTimeout(f"Mooncake {op} of {num_bytes} bytes timed out in the engine")
        if status != _DONE:
            raise FabricUnavailable(
                f"Mooncake {op} of {num_bytes} bytes to the peer at {self._session} failed "
                f"(status {status}): it stopped or was killed"
            )

    def _unregister_staging(self) -> None:
        if self._staging.nbytes and self._engine is not None:
            self._engine.unregister_memory(int(self._staging.ctypes.data))
        self._staging = np.empty(0, np.uint8)


class MooncakeEndpoint:
    """The target's Mooncake side: an engine with ``region`` registered.

    Implements :class:`~meridian.disagg.transport.Endpoint`.
    """

    label: Final = "mooncake"
    progress_interval_s: Final = 0.05  # the engine runs its own threads; nothing to poll

    def __init__(self, region: np.ndarray[Any, Any], *, host: str = "127.0.0.1") -> None:
        self._engine = start_engine(load_mooncake(), host)
        self._host = host
        self._region = region
        status = self._engine.register_memory(int(region.ctypes.data), region.nbytes)
        if status != 0:
            raise FabricUnavailable(
                f"Mooncake could not register a {region.nbytes}-byte region (status {status})"
            )

    def describe(self) -> dict[str, object]:
        """The engine's session name and where the region is."""
        return {
            "session": f"{self._host}:{self._engine.get_rpc_port()}",
            "region_addr": int(self._region.ctypes.data),
            "region_bytes": self._region.nbytes,
        }

    def progress(self) -> None:
        """Nothing to do: the engine progresses on its own threads."""

    def close(self) -> None:
        """Deregister the region."""
        self._engine.unregister_memory(int(self._region.ctypes.data))
