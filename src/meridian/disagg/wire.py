"""MRDN v1: the frame that carries one KV block over a disaggregation fabric.

Layout (little-endian), a 32-byte header followed by the body::

    offset  size  field
         0     4  magic      b"MRDN"
         4     4  version    u32, 1
         8     4  body_len   u32, bytes of body that follow the header
        12     1  tier       u8, a :class:`~meridian.core.types.Tier` code (0, 1, 2)
        13     3  padding    must be zero
        16    16  checksum   first 16 bytes of BLAKE3(body)
        32     -  body       opaque bytes (the block's KV)

The checksum covers the body only (as the format specifies). Every single-bit flip of a frame
is caught by :func:`decode` except one kind: the tier byte's two low bits can flip one valid
code into another (0 <-> 1, 0 <-> 2), which no field of the frame can reveal. A receiver that
knows which tier it asked for passes ``expected_tier`` and then catches those too
(:class:`TierMismatch`). ``docs/wire-format.md`` has the test vectors a peer in another
language can check itself against.

The checksum detects corruption, not forgery: it is an unkeyed hash, so anyone who can write a
frame can write a valid one. Authenticate the channel or the peer if that matters.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, TypeAlias

import blake3

from meridian.core.types import Tier
from meridian.errors import MeridianError

MAGIC: Final = b"MRDN"
VERSION: Final = 1
HEADER_SIZE: Final = 32
CHECKSUM_SIZE: Final = 16
MAX_BODY_SIZE: Final = 2**32 - 1

# magic | version | body_len | tier | padding | checksum
_HEADER: Final = struct.Struct("<4sIIB3s16s")
_PADDING: Final = b"\x00\x00\x00"
_TIER_OFFSET: Final = 12
_PADDING_OFFSET: Final = 13
_CHECKSUM_OFFSET: Final = 16
# Below this size BLAKE3's thread start-up costs more than it saves.
_MULTITHREAD_MIN_BYTES: Final = 1 << 20
_TIERS_BY_CODE: Final = {int(t): t for t in Tier}
_KNOWN_TIERS: Final = ", ".join(f"{int(t)} {t.name}" for t in Tier)

BytesLike: TypeAlias = bytes | bytearray | memoryview

assert _HEADER.size == HEADER_SIZE


class WireError(MeridianError):
    """A payload is not a valid MRDN v1 frame, or a body cannot be framed."""


class BadMagic(WireError):  # noqa: N818  (the names are the format's error vocabulary)
    """The payload does not start with ``b"MRDN"``; ``found`` holds the bytes it starts with."""

    def __init__(self, found: bytes) -> None:
        self.found = found
        super().__init__(
            f"bad magic {found!r} (expected {MAGIC!r}): this payload is not an MRDN frame; "
            f"check that the peer speaks MRDN and that the fabric hands over whole payloads"
        )


class UnsupportedVersion(WireError):  # noqa: N818
    """The frame's version is not the one this build reads (fail fast: the layout may differ)."""

    def __init__(self, found: int) -> None:
        self.found = found
        self.supported = VERSION
        super().__init__(
            f"unsupported MRDN version {found}; this build reads version {VERSION} only: "
            f"run the same Meridian release on both ends, or make the peer emit version {VERSION}"
        )


class TruncatedHeader(WireError):  # noqa: N818
    """Fewer bytes than a header arrived."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        super().__init__(
            f"truncated MRDN header: the payload has {num_bytes} bytes, a v{VERSION} header "
            f"alone is {HEADER_SIZE}; the transfer was cut short, check the fabric's transfer size"
        )


class BodyLengthMismatch(WireError):  # noqa: N818
    """The header's ``body_len`` disagrees with the bytes that follow (short or trailing)."""

    def __init__(self, declared: int, actual: int) -> None:
        self.declared = declared
        self.actual = actual
        if actual < declared:
            detail = f"{declared - actual} bytes short: the transfer was cut off"
        else:
            detail = (
                f"{actual - declared} trailing bytes: the fabric returned a larger buffer than "
                f"the frame; hand over exactly the frame's bytes"
            )
        super().__init__(
            f"MRDN body length mismatch: the header declares {declared} bytes, the payload "
            f"carries {actual} ({detail})"
        )


class UnknownTier(WireError):  # noqa: N818
    """The tier code is not a :class:`~meridian.core.types.Tier` value."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(
            f"unknown MRDN tier code {code} (known: {_KNOWN_TIERS}); the header is corrupt or "
            f"the peer uses tiers this build does not know"
        )


class NonZeroPadding(WireError):  # noqa: N818
    """Header bytes 13..15 are not zero."""

    def __init__(self, padding: bytes) -> None:
        self.padding = padding
        super().__init__(
            f"non-zero MRDN header padding {padding.hex(' ')} at bytes 13..15 (must be "
            f"00 00 00): the header is corrupt, or the peer writes fields version "
            f"{VERSION} does not have"
        )


class ChecksumMismatch(WireError):  # noqa: N818
    """The body does not hash to the header's checksum: it was corrupted on the way or at rest."""

    def __init__(self, expected: bytes, actual: bytes, num_bytes: int) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"MRDN checksum mismatch: the header says {expected.hex()}, the {num_bytes}-byte "
            f"body hashes to {actual.hex()}; the block was corrupted in transfer or at rest: "
            f"discard it and recompute"
        )


class TierMismatch(WireError):  # noqa: N818
    """A valid frame carries another tier than the receiver asked for."""

    def __init__(self, found: Tier, expected: Tier) -> None:
        self.found = found
        self.expected = expected
        super().__init__(
            f"MRDN frame carries tier {found.name} ({int(found)}) but {expected.name} "
            f"({int(expected)}) was expected: the tier byte was corrupted (the checksum covers "
            f"the body only) or the handle points at another block"
        )


class BodyTooLarge(WireError):  # noqa: N818
    """:func:`encode` was given a body that ``body_len`` (u32) cannot describe."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        super().__init__(
            f"cannot frame a {num_bytes}-byte body: MRDN v{VERSION} bodies are at most "
            f"{MAX_BODY_SIZE} bytes (u32 body_len); split the block"
        )


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame. ``body`` is a zero-copy view into the payload given to :func:`decode`."""

    tier: Tier
    body: memoryview


def checksum(body: BytesLike) -> bytes:
    """The MRDN v1 checksum of ``body``: the first 16 bytes of its BLAKE3 hash.

    >>> checksum(b"").hex()
    'af1349b9f5f9a1a6a0404dea36dcc949'
    """
    num_bytes = memoryview(body).nbytes
    threads = blake3.blake3.AUTO if num_bytes >= _MULTITHREAD_MIN_BYTES else 1
    digest: bytes = blake3.blake3(body, max_threads=threads).digest(CHECKSUM_SIZE)
    return digest


def frame_size(body_len: int) -> int:
    """Bytes of the frame that carries a ``body_len``-byte body."""
    return HEADER_SIZE + body_len


def encode(tier: Tier, body: BytesLike) -> bytes:
    """Frame ``body`` (any C-contiguous buffer) as an MRDN v1 frame of ``tier``.

    The body is copied exactly once, into the returned frame.

    >>> encode(Tier.THINK_COMPLETE, b"")[:16].hex()
    '4d52444e010000000000000000000000'
    """
    code = int(tier)
    if code not in _TIERS_BY_CODE:
        raise UnknownTier(code)
    view = _as_bytes_view(body, "encode")
    num_bytes = view.nbytes
    if num_bytes > MAX_BODY_SIZE:
        raise BodyTooLarge(num_bytes)
    header = _HEADER.pack(MAGIC, VERSION, num_bytes, code, _PADDING, checksum(view))
    return b"".join((header, view))


def decode(payload: BytesLike, *, expected_tier: Tier | int | None = None) -> Frame:
    """Parse and verify one MRDN v1 frame; raises a :class:`WireError` subclass for any payload.

    Checks run in this order, so the first error names the most basic problem: magic, version
    (a newer version may lay out the rest differently, so nothing else is read), header length,
    padding, tier, body length, checksum, and ``expected_tier`` when given. The returned body
    is a view into ``payload`` (no copy); keep ``payload`` alive and unchanged while using it.

    ``expected_tier`` is a :class:`~meridian.core.types.Tier` or its wire code (``0``, ``1``,
    ``2``); anything else is the caller's mistake and raises ``ValueError`` before the payload
    is read.

    >>> decode(encode(Tier.THINK_ACTIVE, b"kv"), expected_tier=1).tier
    <Tier.THINK_ACTIVE: 1>
    """
    want = _expected_tier(expected_tier)
    try:
        view = _as_bytes_view(payload, "decode")
    except TypeError as exc:
        raise WireError(f"decode needs a bytes-like payload; got {type(payload).__name__}") from exc
    num_bytes = view.nbytes
    head = bytes(view[: len(MAGIC)])
    if head != MAGIC[: len(head)]:
        raise BadMagic(head)
    if num_bytes < 8:
        raise TruncatedHeader(num_bytes)
    (version,) = struct.unpack_from("<I", view, 4)
    if version != VERSION:
        raise UnsupportedVersion(version)
    if num_bytes < HEADER_SIZE:
        raise TruncatedHeader(num_bytes)
    _, _, body_len, code, padding, expected = _HEADER.unpack_from(view)
    if padding != _PADDING:
        raise NonZeroPadding(padding)
    tier = _TIERS_BY_CODE.get(code)
    if tier is None:
        raise UnknownTier(code)
    if num_bytes - HEADER_SIZE != body_len:
        raise BodyLengthMismatch(body_len, num_bytes - HEADER_SIZE)
    body = view[HEADER_SIZE:]
    actual = checksum(body)
    if actual != expected:
        raise ChecksumMismatch(expected, actual, body_len)
    if want is not None and tier is not want:
        raise TierMismatch(tier, want)
    return Frame(tier, body)


def _expected_tier(expected: Tier | int | None) -> Tier | None:
    """``expected_tier`` as a Tier: a Tier, a tier code, or ``None`` (no check)."""
    if expected is None or isinstance(expected, Tier):
        return expected
    # bool is an int, but True is no tier code a caller means.
    if isinstance(expected, int) and not isinstance(expected, bool) and expected in _TIERS_BY_CODE:
        return _TIERS_BY_CODE[expected]
    raise ValueError(
        f"decode: expected_tier must be a Tier or its wire code ({_KNOWN_TIERS}); got {expected!r}"
    )


def _as_bytes_view(data: BytesLike, operation: str) -> memoryview:
    """A flat unsigned-byte view of ``data`` (no copy)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise WireError(f"{operation} needs a C-contiguous buffer; copy it first (bytes(buf))")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")
