"""The labelled set of ``meridian bench accuracy``: loading a JSONL dataset and grading an answer
against an item (the checkers are described in :mod:`meridian.bench.accuracy`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meridian.errors import MeridianError

__all__ = ["CHECKERS", "DatasetError", "Item", "grade", "load_dataset"]

CHECKERS = ("exact", "numeric", "regex", "choice")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")
_LETTER = re.compile(r"\b([A-Z])\b")


class DatasetError(MeridianError):
    """A dataset line that is not a valid item (the message names file, line and field)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One labelled question."""

    id: str
    prompt: str
    answer: str
    checker: str = "exact"
    tolerance: float = 0.0
    pattern: str | None = None
    choices: tuple[str, ...] = ()


def load_dataset(path: Path) -> list[Item]:
    """The items of a JSONL file; a bad line raises :class:`DatasetError` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc}") from None
    items: list[Item] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: an item must be a JSON object")
        items.append(_item(raw, where, len(items)))
    if not items:
        raise DatasetError(f"{path}: no items")
    return items


def _item(raw: dict[str, Any], where: str, index: int) -> Item:
    def text(key: str, required: bool = True) -> str | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if key == "answer" and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or (required and not value):
            raise DatasetError(f"{where}: {key} must be a non-empty string; got {value!r}")
        return value

    unknown = sorted(set(raw) - {"id", "prompt", "answer", "checker", "tolerance", "pattern",
                                 "choices"})  # fmt: skip
    if unknown:
        raise DatasetError(f"{where}: unknown field {unknown[0]!r}")
    checker = raw.get("checker", "exact")
    if checker not in CHECKERS:
        raise DatasetError(
            f"{where}: checker must be one of {', '.join(CHECKERS)}; got {checker!r}"
        )
    tolerance = raw.get("tolerance", 0.0)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise DatasetError(f"{where}: tolerance must be a number; got {tolerance!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise DatasetError(f"{where}: tolerance must be a finite number >= 0; got {tolerance!r}")
    answer = text("answer")
    assert answer is not None
    if checker == "numeric" and _last_number(answer) is None:
        raise DatasetError(f"{where}: answer must be a number for the numeric checker")
    pattern = text("pattern", required=False)
    if checker == "regex":
        try:
            re.compile(pattern or answer)
        except re.error as exc:
            raise DatasetError(f"{where}: pattern is not a regular expression ({exc})") from None
    choices = raw.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DatasetError(f"{where}: choices must be a list of strings")
    if checker == "choice" and not re.fullmatch(r"[A-Z]", answer.strip()):
        raise DatasetError(f"{where}: answer must be one capital letter for the choice checker")
    item_id = raw.get("id", f"item-{index}")
    prompt = text("prompt")
    assert prompt is not None
    return Item(str(item_id), prompt, answer, checker, float(tolerance), pattern, tuple(choices))


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold().rstrip(".")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def grade(item: Item, content: str) -> bool:
    """Whether the answer text ``content`` is right for ``item`` (see the module docstring).

    >>> grade(Item("a", "?", "42", "numeric", 0.5), "so the total is 42.3.")
    True
    >>> grade(Item("b", "?", "C", "choice", choices=("x", "y", "z")), "I pick C")
    True
    """
    if item.checker == "exact":
        return _normal(content) == _normal(item.answer)
    if item.checker == "numeric":
        got, want = _last_number(content), _last_number(item.answer)
        return got is not None and want is not None and abs(got - want) <= item.tolerance
    if item.checker == "regex":
        return re.search(item.pattern or item.answer, content) is not None
    letters = _LETTER.findall(content)
    if item.choices:
        letters = [x for x in letters if ord(x) - ord("A") < len(item.choices)]
    return bool(letters) and letters[-1] == item.answer.strip()
