"""JSONL traces: round trip with generated workloads, and one test per error the reader reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.bench.traces import NS_PER_S, TraceError, read_trace, write_trace
from meridian.bench.workloads import MAX_DURATION_S, WORKLOADS, WorkloadParams, generate_workload
from meridian.errors import MeridianError
from meridian.sim.request import RequestKind, RequestSpec


def fields_of(spec: RequestSpec) -> tuple[Any, ...]:
    entropy = None if spec.think_entropy is None else spec.think_entropy.tobytes()
    dtype = None if spec.think_entropy is None else spec.think_entropy.dtype
    return (
        spec.request_id,
        spec.arrival_ns,
        spec.num_prompt_tokens,
        spec.num_think_tokens,
        spec.num_answer_tokens,
        spec.kind,
        entropy,
        dtype,
        spec.settle_token,
    )


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def record(**overrides: Any) -> str:
    base: dict[str, Any] = {
        "arrival_s": 0.5,
        "prompt_tokens": 10,
        "think_tokens": 3,
        "answer_tokens": 4,
    }
    base.update(overrides)
    return json.dumps({k: v for k, v in base.items() if v is not _DROP})


_DROP = object()


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("name", WORKLOADS)
def test_round_trip_generated_workload(tmp_path: Path, name: str) -> None:
    specs = generate_workload(name, WorkloadParams(arrival_rate=3.0, duration_s=20.0, seed=11))
    assert specs
    path = tmp_path / f"{name}.jsonl"
    write_trace(path, specs)
    back = read_trace(path)
    assert [fields_of(s) for s in back] == [fields_of(s) for s in specs]
    assert len(path.read_text().splitlines()) == len(specs)


def test_round_trip_extreme_values(tmp_path: Path) -> None:
    tiny = np.array([0.0, 1e-30, 1.17549435e-38, 3.4028235e38, 7.999999, 2.5000002], np.float32)
    specs = [
        RequestSpec("late", 3_600_123_456_789, 1, 6, 1, RequestKind.REASONING, tiny, 6),
        RequestSpec("early", 0, 2048, 0, 9, RequestKind.CHAT),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, specs)
    back = read_trace(path)
    # Sorted by arrival on read.
    assert [s.request_id for s in back] == ["early", "late"]
    assert [fields_of(s) for s in back] == [fields_of(specs[1]), fields_of(specs[0])]


@settings(max_examples=40, deadline=None)
@given(
    arrival_ns=st.integers(min_value=0, max_value=int(MAX_DURATION_S) * NS_PER_S),
    entropy=st.lists(
        st.floats(min_value=0.0, max_value=20.0, allow_nan=False, width=32), max_size=50
    ),
)
def test_round_trip_is_exact(tmp_path_factory: Any, arrival_ns: int, entropy: list[float]) -> None:
    values = np.array(entropy, dtype=np.float32)
    kind = RequestKind.REASONING if values.size else RequestKind.CHAT
    spec = RequestSpec("x", arrival_ns, 5, values.size, 7, kind, values if values.size else None)
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(path, [spec])
    (back,) = read_trace(path)
    assert fields_of(back) == fields_of(spec)


def test_reader_accepts_hand_written_traces(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "mine.jsonl",
        '{"arrival_s": 2, "prompt_tokens": 100, "think_tokens": 0, "answer_tokens": 50}',
        "",
        '{"arrival_s": 1.5, "prompt_tokens": 80, "think_tokens": 2, "answer_tokens": 20,'
        ' "entropy": [0.5, 3], "settle_token": 2, "id": "mine"}',
        "   ",
    )
    chat, reasoning = sorted(read_trace(path), key=lambda s: s.num_think_tokens)
    assert reasoning.request_id == "mine" and reasoning.arrival_ns == 1_500_000_000
    assert reasoning.kind is RequestKind.REASONING and reasoning.settle_token == 2
    assert reasoning.think_entropy is not None
    assert reasoning.think_entropy.tolist() == [0.5, 3.0]
    # Default id: the record's position in the file.
    assert chat.request_id == "r000000" and chat.kind is RequestKind.CHAT
    assert [s.request_id for s in read_trace(path)] == ["mine", "r000000"]


def test_ties_keep_file_order(tmp_path: Path) -> None:
    lines = [record(arrival_s=1.0, id=f"q{i}") for i in range(5)]
    assert [s.request_id for s in read_trace(write_lines(tmp_path / "t", *lines))] == [
        f"q{i}" for i in range(5)
    ]


# ---------------------------------------------------------------------------------------------
# Errors: every message names the file, the line and the field


def error_for(tmp_path: Path, *lines: str) -> str:
    path = write_lines(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert isinstance(info.value, MeridianError)
    return str(info.value)


def test_error_not_json(tmp_path: Path) -> None:
    message = error_for(tmp_path, record(), "{arrival_s: 1}")
    assert message.startswith(f"{tmp_path / 'bad.jsonl'}:2: not valid JSON")
    assert "column" in message


def test_error_not_an_object(tmp_path: Path) -> None:
    assert ":1: expected a JSON object; got array" in error_for(tmp_path, "[1, 2]")


@pytest.mark.parametrize("field", ["arrival_s", "prompt_tokens", "think_tokens", "answer_tokens"])
def test_error_missing_field(tmp_path: Path, field: str) -> None:
    message = error_for(tmp_path, record(), record(**{field: _DROP}))
    assert message.endswith(f":2: {field}: required field is missing")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"prompt_tokens": "12"}, "prompt_tokens: input should be a valid integer; got '12'"),
        ({"think_tokens": 2.0}, "think_tokens: input should be a valid integer; got 2.0"),
        ({"answer_tokens": True}, "answer_tokens: input should be a valid integer; got True"),
        ({"arrival_s": "now"}, "arrival_s: input should be a valid number; got 'now'"),
        ({"arrival_s": None}, "arrival_s: input should be a valid number; got None"),
        ({"id": 7}, "id must be a non-empty string; got 7"),
        ({"id": ""}, "id must be a non-empty string; got ''"),
        ({"entropy": "1,2,3"}, "entropy: input should be a valid list; got '1,2,3'"),
        ({"entropy": [0.1, "x", 0.3]}, "entropy[1]: input should be a valid number; got 'x'"),
        ({"entropy": [0.1, 0.2, False]}, "entropy[2]: input should be a valid number; got False"),
        ({"settle_token": 1.5}, "settle_token: input should be a valid integer; got 1.5"),
    ],
)
def test_error_wrong_type(tmp_path: Path, overrides: dict[str, Any], expected: str) -> None:
    message = error_for(tmp_path, record(**overrides))
    assert ":1: " in message
    assert expected in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"arrival_s": -0.1}, "arrival_s must be a finite number >= 0; got -0.1"),
        (
            {"prompt_tokens": -5},
            "prompt_tokens: input should be greater than or equal to 1; got -5",
        ),
        ({"prompt_tokens": 0}, "prompt_tokens: input should be greater than or equal to 1; got 0"),
        (
            {"think_tokens": -1, "entropy": _DROP},
            "think_tokens: input should be greater than or equal to 0; got -1",
        ),
        ({"answer_tokens": 0}, "answer_tokens: input should be greater than or equal to 1; got 0"),
        ({"settle_token": -2}, "settle_token: input should be greater than or equal to 0; got -2"),
        ({"entropy": [0.1, -0.2, 0.3]}, "entropy[1] must be a finite number >= 0; got -0.2"),
    ],
)
def test_error_negative_numbers(tmp_path: Path, overrides: dict[str, Any], expected: str) -> None:
    assert expected in error_for(tmp_path, record(**overrides))


def test_error_non_finite_numbers(tmp_path: Path) -> None:
    assert ":1: arrival_s must be a finite number >= 0; got inf" in error_for(
        tmp_path,
        '{"arrival_s": Infinity, "prompt_tokens": 1, "think_tokens": 0, "answer_tokens": 1}',
    )
    assert "entropy[0] must be a finite number >= 0; got nan" in error_for(
        tmp_path,
        '{"arrival_s": 1, "prompt_tokens": 1, "think_tokens": 1, '
        '"answer_tokens": 1, "entropy": [NaN]}',
    )


def test_error_entropy_length(tmp_path: Path) -> None:
    message = error_for(tmp_path, record(), record(), record(entropy=[0.1, 0.2]))
    assert ":3: entropy must hold one value per think token (3); got 2 values" in message


def test_error_settle_token_out_of_range(tmp_path: Path) -> None:
    assert ":1: settle_token must be <= think_tokens (3); got 4" in error_for(
        tmp_path, record(settle_token=4)
    )
    assert "think_tokens is 0 (a chat request)" in error_for(
        tmp_path, record(think_tokens=0, settle_token=0)
    )


def test_error_unknown_field(tmp_path: Path) -> None:
    message = error_for(tmp_path, record(setle_token=1))
    assert ":1: setle_token: unknown field (allowed: arrival_s," in message


def test_error_duplicate_id(tmp_path: Path) -> None:
    message = error_for(tmp_path, record(id="a"), record(id="b"), record(id="a"))
    assert ":3: id: duplicate id 'a' (first on line 1)" in message


def test_error_empty_file(tmp_path: Path) -> None:
    assert "trace file is empty" in error_for(tmp_path)
    assert "trace file is empty" in error_for(tmp_path, "", "  ")


def test_error_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace file not found"):
        read_trace(tmp_path / "nope.jsonl")


def test_error_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="cannot read trace file"):
        read_trace(path)


def test_write_errors(tmp_path: Path) -> None:
    spec = RequestSpec("x", 0, 1, 0, 1, RequestKind.CHAT)
    # A folder that does not exist yet is created (bench sim --export-trace NEW/DIR/t.jsonl).
    write_trace(tmp_path / "missing-dir" / "sub" / "t.jsonl", [spec])
    assert [r.request_id for r in read_trace(tmp_path / "missing-dir" / "sub" / "t.jsonl")] == ["x"]
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(TraceError, match="cannot write trace file"):
        write_trace(tmp_path / "a-file" / "t.jsonl", [spec])
    bad = np.array([0.1, np.nan], dtype=np.float32)
    nan_spec = RequestSpec("y", 0, 1, 2, 1, RequestKind.REASONING, bad)
    with pytest.raises(TraceError, match=r"request y: entropy\[1\] is nan"):
        write_trace(tmp_path / "t.jsonl", [nan_spec])


def test_negative_zero_keeps_its_sign(tmp_path: Path) -> None:
    values = np.array([-0.0, 0.0, 1.0], dtype=np.float32)
    spec = RequestSpec("z", 0, 1, 3, 1, RequestKind.REASONING, values)
    write_trace(tmp_path / "z.jsonl", [spec])
    (back,) = read_trace(tmp_path / "z.jsonl")
    assert fields_of(back) == fields_of(spec)
