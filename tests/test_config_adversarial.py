"""Adversarial config files: every field of every section, set to values that break arithmetic
(non-finite, denormal, overflowing, negative, wrong type), plus malformed files as a whole.

Each file either fails ``meridian config check`` with exit 2 and one line naming the dotted
field path, or it is accepted, and then a short ``meridian bench sim`` on it runs to the end:
a value ``config check`` accepts must not crash what uses it (the first version let
``output_tpot_budget_ms = inf`` through and ``bench sim`` died with an ``OverflowError``).
The corpus is generated from the schema, so a new field is covered when it is added.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import BaseModel

from meridian.cli import main
from meridian.config.schema import MeridianConfig

# TOML spellings of values that have broken number handling somewhere.
NUMBERS = (
    "inf", "-inf", "nan", "1e400", "-1e400", "1e308", "-1e308", "5e-324", "-5e-324", "0", "-0.0",
    "-1", "1", "0.5", "2147483648", "9223372036854775807", "-9223372036854775808",
)  # fmt: skip
WRONG_TYPES = ('"12"', "true", "[]", "{}", '"auto"', '""')
STRINGS = ('""', '"\\u0000"', '"' + "x" * 5000 + '"', '"127.0.0.1:99999"', '":"', '"é"')
# Whole files: (text, what the one-line error names).
MALFORMED = [
    ("scheduler = 5", "scheduler"),
    ("[scheduler]\n[scheduler]", "malformed TOML"),
    ("[scheduler]\nmax_think_tokens = 1\nmax_think_tokens = 2", "malformed TOML"),
    ("[scheduler]\nno_such_field = 1", "scheduler.no_such_field"),
    ("[no_such_section]\nx = 1", "no_such_section"),
    ("x = " + "[" * 5000 + "]" * 5000, "malformed TOML"),
    ("x = " + "{a = " * 3000 + "1" + "}" * 3000, "malformed TOML"),
    ("[model.x]\nthink_start = 5", "model.x.think_start"),
    ("[model]\nx = 5", "model.x"),
    ("\ufeff[scheduler]", "malformed TOML"),
]

SECTIONS: dict[str, type[BaseModel]] = {
    name: field.annotation
    for name, field in MeridianConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
}


def corpus() -> list[tuple[str, str, str]]:
    """(dotted path, value, TOML text) for every field of every section."""
    cases = []
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            default = field.default
            if isinstance(default, bool):
                values: tuple[str, ...] = ("1", '"yes"', "inf")
            elif isinstance(default, str):
                values = (*STRINGS, "1", "nan")
            else:
                values = NUMBERS + WRONG_TYPES
            for value in values:
                cases.append((f"{section}.{name}", value, f"[{section}]\n{name} = {value}\n"))
    return cases


CORPUS = corpus()


def write_trace(path: Path) -> Path:
    """Eight short requests (one chat), 700 think tokens each with an entropy that settles:
    enough for every signal and the budget to act, small enough to run 90 files."""
    lines = []
    for i in range(8):
        think = 0 if i == 3 else 700
        entropy = [round(0.3 + 0.5 * math.sin(t / 7) ** 2 * (1 - t / 700), 4) for t in range(think)]
        request = {
            "id": f"r{i}", "arrival_s": 0.05 * i, "prompt_tokens": 64 + 8 * i,
            "think_tokens": think, "answer_tokens": 30 + i,
        }  # fmt: skip
        if think:
            request |= {"entropy": entropy, "settle_token": 400}
        lines.append(json.dumps(request))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["config", "check", str(path)])
    return code, capsys.readouterr().err


def assert_one_line_naming(err: str, name: str) -> None:
    """One ``error:`` line naming ``name`` (several mistakes in one file: a line each)."""
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3, err[:2000]
    assert lines[0].startswith("error: "), lines[0]
    assert name in lines[0], lines[0]
    assert "Traceback" not in err


def test_the_corpus_covers_every_field() -> None:
    fields = {path for path, _, _ in CORPUS}
    assert len(fields) == sum(len(m.model_fields) for m in SECTIONS.values())
    assert {"scheduler", "entropy", "kv_memory", "telemetry"} == set(SECTIONS)
    assert len(CORPUS) > 400


def test_every_adversarial_field_is_rejected_by_name_or_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One test over the whole corpus (a parametrized one would print 500 ids): accepted
    files run ``bench sim`` on a short trace with Meridian and stock vLLM order, forcing on
    both. ``bench sim`` may still refuse a value with one line naming it (a KV capacity that
    holds fewer than two blocks of the simulated model), never crash."""
    trace = write_trace(tmp_path / "trace.jsonl")
    accepted: list[tuple[str, str, Path]] = []
    for i, (field, value, text) in enumerate(CORPUS):
        path = tmp_path / f"m{i}.toml"
        path.write_text(text, encoding="utf-8")
        code, err = check(path, capsys)
        if code == 0:
            accepted.append((field, value, path))
            continue
        assert code == 2, (field, value, err)
        assert_one_line_naming(err, field)
    # The corpus is adversarial: most of it must be refused, and what is refused is named above.
    assert len(accepted) < len(CORPUS) / 2
    failures: list[str] = []
    for field, value, path in accepted:
        out = tmp_path / f"out-{path.stem}"
        argv = ["bench", "sim", "--config", str(path), "--workload", str(trace), "--no-plots"]
        argv += ["--policies", "meridian,vllm-fcfs+forcing"]
        try:
            code = main([*argv, "--out-dir", str(out)])
        except Exception as exc:  # the point is to name any crash
            failures.append(f"{field} = {value[:40]}: {type(exc).__name__}: {exc}")
            continue
        # stderr also carries the progress bars: the error is the last line.
        last = capsys.readouterr().err.strip().splitlines()[-1:] or [""]
        if code == 2 and last[0].startswith("error: ") and field in last[0]:
            continue
        if code != 0:
            failures.append(f"{field} = {value[:40]}: exit {code}: {last[0][:300]}")
    assert failures == []


@pytest.mark.parametrize(("text", "name"), MALFORMED)
def test_malformed_files_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, name: str
) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    code, err = check(path, capsys)
    assert code == 2, err
    assert_one_line_naming(err, name)


def test_bytes_that_are_not_utf8_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.toml"
    path.write_bytes(b'[scheduler]\nforce_transition_phrase = "\xff\xfe"\n')
    code, err = check(path, capsys)
    assert code == 2
    assert_one_line_naming(err, "m.toml")
