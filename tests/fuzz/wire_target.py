"""atheris (libFuzzer) target for the MRDN v1 decoder: any input either decodes or raises a
WireError subclass; a valid frame re-encodes to itself. Run by tests/test_wire_atheris.py."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from meridian.core.types import Tier
    from meridian.disagg.wire import WireError, decode, encode


def one_input(data: bytes) -> None:
    try:
        frame = decode(data)
    except WireError:
        return
    assert encode(frame.tier, frame.body) == data, "a decoded frame must re-encode to its input"


def seeds() -> list[bytes]:
    return [encode(tier, body) for tier in Tier for body in (b"", b"x", bytes(range(48)))]


if __name__ == "__main__":
    corpus = sys.argv.pop() if len(sys.argv) > 1 and not sys.argv[-1].startswith("-") else None
    if corpus is not None:
        import pathlib

        for i, seed in enumerate(seeds()):
            (pathlib.Path(corpus) / f"seed{i}").write_bytes(seed)
        sys.argv.append(corpus)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
