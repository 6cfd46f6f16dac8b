"""The labelled set of ``meridian bench accuracy``: loading a JSONL dataset and grading an answer
against an item (the checkers are described in :mod:`meridian.bench.accuracy`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, PlainValidator, StrictStr, model_validator

from meridian.bench.jsonl import FiniteNonNegative, NonEmptyText, read_jsonl
from meridian.config.files import MIB
from meridian.errors import MeridianError

__all__ = ["CHECKERS", "DatasetError", "Item", "grade", "load_dataset"]

Checker = Literal["exact", "numeric", "regex", "choice"]
CHECKERS: tuple[str, ...] = get_args(Checker)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")
_LETTER = re.compile(r"\b([A-Z])\b")
# Labelled sets are small (MATH-500: 500 items, under 1 MiB; MMLU's test split: 14,042 items);
# each item is sent once per policy.
MAX_DATASET_BYTES = 64 * MIB
MAX_DATASET_ITEMS = 100_000


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


def _answer_text(value: object) -> str:
    """An answer as text: a non-empty string, or a JSON number written as Python does."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise ValueError("must be a non-empty string or a number")


class ItemLine(BaseModel):
    """One line of the dataset as written (the module docstring of
    :mod:`meridian.bench.accuracy` describes the fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Any = None  # any JSON value, as text; item-N (its position) when absent
    prompt: NonEmptyText
    answer: Annotated[str, PlainValidator(_answer_text)]
    checker: Checker = "exact"
    tolerance: FiniteNonNegative = 0.0
    pattern: StrictStr | None = None
    choices: list[StrictStr] = []

    @model_validator(mode="after")
    def _fits_checker(self) -> ItemLine:
        answer = self.answer
        if self.checker == "numeric" and _last_number(answer) is None:
            raise ValueError(f"answer must be a number for the numeric checker; got {answer!r}")
        if self.checker == "regex":
            try:
                re.compile(self.pattern or answer)
            except re.error as exc:
                raise ValueError(
                    f"pattern is not a regular expression ({exc}); got {self.pattern or answer!r}"
                ) from None
        if self.checker == "choice" and not re.fullmatch(r"[A-Z]", answer.strip()):
            raise ValueError(
                f"answer must be one capital letter for the choice checker; got {answer!r}"
            )
        return self

    def item(self, index: int) -> Item:
        """The item, ``index`` its position in the file (the default id)."""
        item_id = f"item-{index}" if self.id is None else str(self.id)
        return Item(item_id, self.prompt, self.answer, self.checker, self.tolerance,
                    self.pattern, tuple(self.choices))  # fmt: skip


def load_dataset(path: Path) -> list[Item]:
    """The items of a JSONL file; a bad line raises :class:`DatasetError` naming it."""
    lines = read_jsonl(
        path,
        ItemLine,
        DatasetError,
        what="dataset",
        max_bytes=MAX_DATASET_BYTES,
        max_lines=MAX_DATASET_ITEMS,
    )
    return [line.item(index) for index, (_, line) in enumerate(lines)]


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
