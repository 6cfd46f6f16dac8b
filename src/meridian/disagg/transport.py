"""One-sided transports: how the NIXL and Mooncake fabrics move MRDN frames between processes.

A *target* process registers a region of its memory with a transport library (an
:class:`Endpoint`) and passes :meth:`Endpoint.describe` to an *initiator* process, whose
:class:`ProducerPlane` attaches to the region and WRITEs or READs bytes at offsets in it. The
transfers are one-sided: the target's code takes no part beyond calling
:meth:`Endpoint.progress`. How the description travels, and which offsets hold which frame,
is the caller's business; the frames verify themselves (:func:`meridian.disagg.wire.decode`).

No authentication, by design of the libraries: any process that learns the description can
read and overwrite the whole region, and NIXL's metadata listener binds every interface.
Register only memory that every process on the host may see. (Meridian's KV pool, which
put a control plane in front of such a region, is retired: docs/disaggregation.md says why.)

>>> import numpy as np
>>> region = np.zeros(1 << 20, np.uint8)
>>> endpoint = make_endpoint("nixl", region)                      # doctest: +SKIP
>>> plane = make_producer_plane("nixl")                           # doctest: +SKIP
>>> plane.attach(endpoint.describe(), deadline=time.monotonic() + 5)  # doctest: +SKIP
>>> plane.write(frame, 0, deadline)                               # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any, Final, Protocol

import numpy as np

from meridian.disagg.fabric import FabricUnavailable
from meridian.disagg.wire import BytesLike
from meridian.errors import ConfigError

TRANSPORTS: Final = ("nixl", "mooncake")
# Shared by the producer planes: the smallest staging buffer they register, and how they poll
# a transfer (spin SPIN_POLLS polls, then sleep POLL_SLEEP_S between polls).
MIN_STAGING_BYTES: Final = 1 << 20
SPIN_POLLS: Final = 64
POLL_SLEEP_S: Final = 50e-6


class ProducerPlane(Protocol):
    """The initiator's side: a registered staging buffer and one-sided ops on a peer's region.

    Every error is a :class:`~meridian.disagg.fabric.FabricError`: the peer gone or a failed
    transfer is FabricUnavailable, a transfer past its ``deadline`` (``time.monotonic()``)
    FabricTimeout. Not thread-safe: callers serialize.
    """

    def attach(self, description: Mapping[str, Any], deadline: float) -> None:
        """Reach the region an :meth:`Endpoint.describe` described."""
        ...

    def write(self, payload: BytesLike, offset: int, deadline: float) -> None:
        """Copy ``payload`` to the region at ``offset``; returns when it has landed."""
        ...

    def read(self, offset: int, num_bytes: int, deadline: float) -> bytes:
        """The region's ``num_bytes`` at ``offset``."""
        ...

    def detach(self) -> None:
        """Forget the peer (after it failed or restarted)."""
        ...

    def close(self) -> None:
        """Release the library's resources."""
        ...


class Endpoint(Protocol):
    """The target's side: a region of this process's memory registered with the library."""

    @property
    def label(self) -> str:
        """The transport's name (``nixl``, ``mooncake``)."""
        ...

    @property
    def progress_interval_s(self) -> float:
        """How often :meth:`progress` must run while peers transfer."""
        ...

    def describe(self) -> dict[str, object]:
        """What an initiator needs to reach the region (JSON-serialisable)."""
        ...

    def progress(self) -> None:
        """Let the library make progress (some transports need the target to poll)."""
        ...

    def close(self) -> None:
        """Deregister the region and release the library's resources."""
        ...


def make_endpoint(
    transport: str, region: np.ndarray[Any, Any], *, host: str = "127.0.0.1"
) -> Endpoint:
    """Register ``region`` with ``transport`` on ``host``; FabricUnavailable, naming what to
    install, when the library is missing."""
    if transport == "nixl":
        from meridian.disagg.nixl_fabric import NixlEndpoint

        return NixlEndpoint(region, host=host)
    if transport == "mooncake":
        from meridian.disagg.mooncake_fabric import MooncakeEndpoint

        return MooncakeEndpoint(region, host=host)
    raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")


def make_producer_plane(transport: str) -> ProducerPlane:
    """An initiator of ``transport`` (attach it to an endpoint's description before use)."""
    if transport == "nixl":
        from meridian.disagg.nixl_fabric import NixlProducerPlane

        return NixlProducerPlane()
    if transport == "mooncake":
        from meridian.disagg.mooncake_fabric import MooncakeProducerPlane

        return MooncakeProducerPlane()
    raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")


def load_transport(
    module: str, *, fabric: str, library: str, env_defaults: Mapping[str, str], install_hint: str
) -> Any:
    """Import a transport's ``module`` after applying its environment defaults.

    Raises FabricUnavailable naming ``library`` and how to install it when the import fails.
    """
    for name, value in env_defaults.items():
        os.environ.setdefault(name, value)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FabricUnavailable(
            f"fabric {fabric!r} needs {library}, which cannot be imported ({exc}); "
            f"install it with: {install_hint}"
        ) from exc
