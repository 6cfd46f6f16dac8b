"""Tests of the MRDN v1 wire format (``meridian.disagg.wire``) and its published test vectors."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.core.types import Tier
from meridian.disagg import wire
from meridian.disagg.wire import (
    HEADER_SIZE,
    BadMagic,
    BodyLengthMismatch,
    BodyTooLarge,
    ChecksumMismatch,
    Frame,
    NonZeroPadding,
    TierMismatch,
    TruncatedHeader,
    UnknownTier,
    UnsupportedVersion,
    WireError,
    checksum,
    decode,
    encode,
)
from meridian.errors import MeridianError

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"
ERRORS: dict[str, type[WireError]] = {
    cls.__name__: cls
    for cls in (
        BadMagic,
        UnsupportedVersion,
        TruncatedHeader,
        BodyLengthMismatch,
        UnknownTier,
        NonZeroPadding,
        ChecksumMismatch,
        TierMismatch,
    )
}
TIER_BYTE = 12


def doc_table(section: str) -> list[list[str]]:
    """Rows of the table between ``<!-- mrdn-vectors:SECTION:begin/end -->`` in the doc."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(
        rf"<!-- mrdn-vectors:{section}:begin -->(.*?)<!-- mrdn-vectors:{section}:end -->",
        text,
        re.S,
    )
    assert match is not None, f"docs/wire-format.md lost its {section} vectors"
    lines = [ln.strip() for ln in match.group(1).strip().splitlines()]
    rows = [[c.strip().strip("`") for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert rows, f"no {section} vectors"
    return rows


def unhex(cell: str) -> bytes:
    return b"" if cell == "-" else bytes.fromhex(cell.replace(" ", ""))


# -- published vectors -----------------------------------------------------------------------------


VALID = doc_table("valid")
INVALID = doc_table("invalid")


def test_doc_vectors_cover_every_tier_and_the_required_sizes() -> None:
    assert {int(row[1]) for row in VALID} == {int(t) for t in Tier}
    assert {len(unhex(row[2])) for row in VALID} >= {0, 1, 16}
    assert {row[2] for row in INVALID} == set(ERRORS)


@pytest.mark.parametrize("row", VALID, ids=[r[0] for r in VALID])
def test_valid_doc_vector_matches_encode_and_decode(row: list[str]) -> None:
    _, tier_code, body_hex, frame_hex = row
    tier, body, frame = Tier(int(tier_code)), unhex(body_hex), unhex(frame_hex)
    assert encode(tier, body) == frame
    decoded = decode(frame, expected_tier=tier)
    assert decoded.tier is tier
    assert bytes(decoded.body) == body


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_doc_vector_raises_the_documented_error(row: list[str]) -> None:
    _, expected, error_name, frame_hex = row
    expected_tier = None if expected == "-" else Tier(int(expected))
    with pytest.raises(ERRORS[error_name]):
        decode(unhex(frame_hex), expected_tier=expected_tier)


def test_checksum_is_truncated_reference_blake3() -> None:
    # Reference BLAKE3 hashes of "" and "abc" from the BLAKE3 specification's test vectors.
    assert checksum(b"").hex() == "af1349b9f5f9a1a6a0404dea36dcc949"
    assert checksum(b"abc").hex() == "6437b3ac38465133ffb63b75273a8db5"


# -- layout and round trip -------------------------------------------------------------------------


def test_header_layout_is_32_little_endian_bytes() -> None:
    frame = encode(Tier.OUTPUT_CRITICAL, b"x" * 300)
    magic, version, body_len, tier, padding, digest = struct.unpack_from("<4sIIB3s16s", frame)
    assert (magic, version, body_len, tier, padding) == (b"MRDN", 1, 300, 2, b"\0\0\0")
    assert digest == checksum(b"x" * 300)
    assert len(frame) == HEADER_SIZE + 300 == wire.frame_size(300)


def test_decode_body_is_a_zero_copy_view_of_the_payload() -> None:
    payload = bytearray(encode(Tier.THINK_COMPLETE, b"abcdef"))
    frame = decode(payload)
    assert frame.body.obj is payload
    payload[HEADER_SIZE] = ord("z")  # the view sees the payload's memory
    assert bytes(frame.body) == b"zbcdef"


def test_encode_accepts_any_contiguous_buffer() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    frame = encode(Tier.THINK_ACTIVE, array.data)
    assert bytes(decode(frame).body) == array.tobytes()
    assert encode(Tier.THINK_ACTIVE, bytearray(b"ab")) == encode(Tier.THINK_ACTIVE, b"ab")
    with pytest.raises(WireError, match="C-contiguous"):
        encode(Tier.THINK_ACTIVE, array[:, ::2].data)


def test_large_body_uses_the_same_checksum_as_small_ones() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: the multithreaded hash path
    frame = encode(Tier.THINK_COMPLETE, body)
    assert frame[16:32] == checksum(body)
    assert bytes(decode(frame).body) == body


@given(st.sampled_from(list(Tier)), st.binary(max_size=2048))
@settings(max_examples=200, deadline=None)
def test_round_trip(tier: Tier, body: bytes) -> None:
    frame = decode(encode(tier, body), expected_tier=tier)
    assert frame == Frame(tier, memoryview(body))


# -- errors ----------------------------------------------------------------------------------------


def test_errors_are_meridian_errors_with_actionable_messages() -> None:
    assert all(issubclass(cls, WireError) for cls in ERRORS.values())
    assert issubclass(WireError, MeridianError)
    good = encode(Tier.THINK_COMPLETE, b"hello")
    with pytest.raises(BadMagic, match=r"bad magic b'XXXX' \(expected b'MRDN'\)") as bad:
        decode(b"XXXX" + good[4:])
    assert bad.value.found == b"XXXX"
    with pytest.raises(UnsupportedVersion, match="version 7; this build reads version 1"):
        decode(good[:4] + struct.pack("<I", 7) + good[8:])
    with pytest.raises(TruncatedHeader, match="has 20 bytes, a v1 header alone is 32"):
        decode(good[:20])
    with pytest.raises(BodyLengthMismatch, match="2 bytes short"):
        decode(good[:-2])
    with pytest.raises(BodyLengthMismatch, match="3 trailing bytes"):
        decode(good + b"abc")
    with pytest.raises(UnknownTier, match="unknown MRDN tier code 9"):
        decode(good[:TIER_BYTE] + b"\x09" + good[TIER_BYTE + 1 :])
    with pytest.raises(NonZeroPadding, match="00 ff 00"):
        decode(good[:14] + b"\xff" + good[15:])
    with pytest.raises(ChecksumMismatch, match="discard it and recompute"):
        decode(good[:-1] + b"!")
    with pytest.raises(TierMismatch, match=r"THINK_COMPLETE .* but OUTPUT_CRITICAL"):
        decode(good, expected_tier=Tier.OUTPUT_CRITICAL)
    with pytest.raises(WireError, match="bytes-like"):
        decode("not bytes")  # type: ignore[arg-type]


def test_expected_tier_takes_a_tier_or_its_wire_code() -> None:
    frame = encode(Tier.THINK_COMPLETE, b"hello")
    # The wire code works like the Tier it names (it used to raise AttributeError on mismatch).
    assert decode(frame, expected_tier=0).tier is Tier.THINK_COMPLETE
    mismatch = r"THINK_COMPLETE \(0\) but OUTPUT_CRITICAL \(2\)"
    with pytest.raises(TierMismatch, match=mismatch) as err:
        decode(frame, expected_tier=2)
    assert err.value.expected is Tier.OUTPUT_CRITICAL
    for bad in (3, -1, True, "0", 0.0):
        with pytest.raises(ValueError, match=r"expected_tier must be a Tier or its wire code"):
            decode(frame, expected_tier=bad)  # type: ignore[arg-type]


def test_version_is_checked_before_the_rest_of_the_header() -> None:
    # A v2 peer may have a different header size: fail on the version, not on the length.
    with pytest.raises(UnsupportedVersion):
        decode(b"MRDN" + struct.pack("<I", 2) + b"\xff" * 100)
    with pytest.raises(UnsupportedVersion):
        decode(b"MRDN" + struct.pack("<I", 2))


def test_short_payloads_report_magic_or_truncation() -> None:
    assert isinstance(_error(b""), TruncatedHeader)
    assert isinstance(_error(b"MRD"), TruncatedHeader)
    assert isinstance(_error(b"MRX"), BadMagic)
    assert isinstance(_error(b"MRDN\x01\x00\x00"), TruncatedHeader)


def test_encode_rejects_unknown_tiers_and_oversized_bodies(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnknownTier):
        encode(3, b"")  # type: ignore[arg-type]
    monkeypatch.setattr(wire, "MAX_BODY_SIZE", 4)
    with pytest.raises(BodyTooLarge, match="at most 4 bytes"):
        encode(Tier.THINK_COMPLETE, b"12345")


# -- fuzzing ---------------------------------------------------------------------------------------


def _error(payload: bytes, expected_tier: Tier | None = None) -> WireError | None:
    """The WireError decode raises, None if it succeeds; any other exception fails the test."""
    try:
        decode(payload, expected_tier=expected_tier)
    except WireError as exc:
        return exc
    return None


def _flip(payload: bytes, bit: int) -> bytes:
    mutated = bytearray(payload)
    mutated[bit // 8] ^= 1 << (bit % 8)
    return bytes(mutated)


def _tier_aliases(tier: Tier) -> set[int]:
    """Bit positions in the tier byte whose flip yields another *valid* tier code."""
    return {TIER_BYTE * 8 + b for b in range(8) if (int(tier) ^ (1 << b)) in {int(t) for t in Tier}}


@pytest.mark.parametrize("tier", list(Tier))
def test_every_single_bit_flip_is_detected_exhaustively(tier: Tier) -> None:
    frame = encode(tier, bytes(range(16)))
    aliases = _tier_aliases(tier)
    assert aliases  # each tier has a one-bit neighbour among the codes: 0-1, 0-2
    for bit in range(len(frame) * 8):
        flipped = _flip(frame, bit)
        assert _error(flipped, expected_tier=tier) is not None, f"bit {bit} undetected"
        without = _error(flipped)
        if bit in aliases:
            # The checksum covers the body only: the frame is valid, with another tier.
            assert without is None
            assert decode(flipped).tier is not tier
        else:
            assert without is not None, f"bit {bit} undetected without expected_tier"


@given(st.sampled_from(list(Tier)), st.binary(min_size=0, max_size=256), st.data())
@settings(max_examples=300, deadline=None)
def test_random_single_bit_flips_are_detected(tier: Tier, body: bytes, data: st.DataObject) -> None:
    frame = encode(tier, body)
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    assert _error(_flip(frame, bit), expected_tier=tier) is not None


@given(st.binary(max_size=512))
@settings(max_examples=500, deadline=None)
def test_random_payloads_raise_only_wire_errors(payload: bytes) -> None:
    _error(payload)
    _error(b"MRDN\x01\x00\x00\x00" + payload)


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[bytes, bytes]:
    frame = encode(draw(st.sampled_from(list(Tier))), draw(st.binary(max_size=128)))
    mutated = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "insert", "delete", "truncate", "extend"]))
        position = draw(st.integers(0, max(len(mutated) - 1, 0)))
        if kind == "set" and mutated:
            mutated[position] = draw(st.integers(0, 255))
        elif kind == "insert":
            mutated[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and mutated:
            del mutated[position]
        elif kind == "truncate":
            del mutated[position:]
        elif kind == "extend":
            mutated += draw(st.binary(min_size=1, max_size=8))
    return frame, bytes(mutated)


@given(mutated_frames())
@settings(max_examples=500, deadline=None)
def test_mutated_frames_raise_only_wire_errors_or_decode_the_original(
    case: tuple[bytes, bytes],
) -> None:
    original, mutated = case
    if _error(mutated) is None:
        # Only a no-op mutation or a tier alias can still decode; the body is then intact.
        assert bytes(decode(mutated).body) == bytes(decode(original).body)
        assert mutated[:TIER_BYTE] + mutated[TIER_BYTE + 1 :] == (
            original[:TIER_BYTE] + original[TIER_BYTE + 1 :]
        )
