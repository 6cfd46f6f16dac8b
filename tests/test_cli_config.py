"""`meridian config check`: prints the effective config; bad input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meridian.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_check_example_prints_effective_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(REPO / "meridian.toml.example")]) == 0
    out = capsys.readouterr().out
    header, _, body = out.partition("\n")
    assert header.endswith(": OK")
    effective = json.loads(body)
    assert effective["entropy"]["effective_eat_min_distance"] == 40
    assert "granite_3_2" in effective["model"]


def test_check_bad_file_is_one_line_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "meridian.toml"
    bad.write_text("[entropy]\nema_alpha = 1.5\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "entropy.ema_alpha must be in (0, 1]; got 1.5" in err
    assert "Traceback" not in err


def test_check_with_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(
        json.dumps(
            {
                "model": {"vocab": {"x": 0}},
                "added_tokens": [
                    {"id": 151667, "content": "<think>"},
                    {"id": 151668, "content": "</think>"},
                ],
            }
        )
    )
    assert main(["config", "check", "--tokenizer", str(tok), "--model", "qwen3"]) == 0
    assert "boundaries of qwen3: {'think_start': [151667], 'think_end': [151668]}" in (
        capsys.readouterr().out
    )
    # The same tokenizer contradicts the R1-distill ids: a clear error, exit 2.
    assert main(["config", "check", "--tokenizer", str(tok), "--model", "r1_distill_qwen"]) == 2
    assert "think_start_token_ids is [151648]" in capsys.readouterr().err


def test_an_unknown_model_family_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    # `--model` was read only with --tokenizer: a misspelt family passed with exit 0.
    assert main(["config", "check", "--model", "nosuchfamily"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: unknown model family 'nosuchfamily'; known: ")
    assert captured.err.count("\n") == 1
    assert main(["config", "check", "--model", "qwen3"]) == 0
