"""The control protocol both sides speak, and what they share: length-prefixed JSON messages,
error codes, the protocol version, addresses and sizes.

A message is a u32 little-endian length, then that many bytes of UTF-8 JSON (an object). A
request carries ``"op"``; its reply carries ``"ok"``, and on failure an ``"error"`` code that
maps to a :class:`~meridian.disagg.fabric.FabricError` subclass (``_ERRORS``).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import struct
from collections.abc import Mapping
from typing import Any, Final

from meridian.disagg.fabric import FabricError, PoolFull, UnknownHandle
from meridian.errors import ConfigError

PROTOCOL_VERSION: Final = 1
DEFAULT_LISTEN: Final = "127.0.0.1:7470"
FAULTS_ENV: Final = "MERIDIAN_KVPOOL_FAULTS"
MAX_MESSAGE_BYTES: Final = 1 << 16
_LENGTH: Final = struct.Struct("<I")
_SIZE_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ProtocolError(FabricError):
    """A control message could not be parsed, or the peer does not speak this protocol."""


def send_message(sock: socket.socket, message: Mapping[str, object]) -> None:
    """Send one control message: a u32 little-endian length, then UTF-8 JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one control message; None when the peer closed the connection cleanly."""
    head = _recv_exactly(sock, _LENGTH.size, allow_eof=True)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    body = _recv_exactly(sock, size, allow_eof=False)
    assert body is not None
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"control message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("control message is not a JSON object")
    return message


def _recv_exactly(sock: socket.socket, size: int, *, allow_eof: bool) -> bytes | None:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = sock.recv(remaining)
        if not chunk:
            if allow_eof and remaining == size:
                return None
            raise ConnectionResetError("the peer closed the connection mid-message")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


_ERRORS: Final[dict[str, type[FabricError]]] = {
    "pool_full": PoolFull,
    "unknown_handle": UnknownHandle,
}


def _error_reply(exc: Exception) -> dict[str, object]:
    code = next((c for c, cls in _ERRORS.items() if isinstance(exc, cls)), "bad_request")
    return {"ok": False, "error": code, "message": str(exc)}


# -- addresses and sizes --------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:7470"`` -> ``("127.0.0.1", 7470)``; IPv4 loopback only (else ConfigError)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"KV pool address must be HOST:PORT (e.g. {DEFAULT_LISTEN}); got {address!r}"
        )
    host = host or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"KV pool address {address!r} is not an IPv4 loopback address: this build's "
            f"fabrics move KV between processes on one host; use 127.0.0.1:PORT"
        )
    return host, int(port_text)


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"1G"``, ``"4096"`` -> bytes (binary units); ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise ConfigError(f"size must look like 4096, 512MiB or 1GiB; got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]
