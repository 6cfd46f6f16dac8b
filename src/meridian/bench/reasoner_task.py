"""The synthetic task of the small trained reasoner (``scripts/train_reasoner.py``): a problem
whose answer needs its reasoning, with reasoning lengths from tens to a few hundred tokens.

A problem is a running sum mod 10: ``x_k = (x_{k-1} + b) mod 10``; the question gives ``b``,
``x_0`` and ``n`` and asks for ``x_n``. The reasoning writes one step
per line-free group, ``CC X;`` (the steps still to go after it, two digits, and the value), counting
down to ``00``; then ``</think>`` and the answer, ``x_n``. Every step depends only on the one
before it and on ``a`` and ``b``, so a small model learns it; the answer is the last step's value,
so a model stopped early answers ``x_k`` for ``k < n``, right only when ``n - k`` is a multiple of
10 (``b`` is 1, 3, 7 or 9: the sequence visits every digit before it repeats). An earlier version
with ``x_k = (a x_{k-1} + b) mod 10`` reached 63 % exact after 1,500 steps of training, every
error in a step's value (two look-ups in the question per step); this one needs one.

>>> p = Problem(b=3, x0=2, n=3)
>>> p.prompt(), p.reasoning(), p.answer
('b=3 x=2 n=3', '02 5;01 8;00 1;', '1')
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_STEPS", "MIN_STEPS", "Problem", "problems", "write_dataset"]

MIN_STEPS = 4
MAX_STEPS = 60
_STRIDES = (1, 3, 7, 9)


@dataclass(frozen=True, slots=True)
class Problem:
    """One question of the task."""

    b: int
    x0: int
    n: int

    def values(self) -> list[int]:
        """``x_1 .. x_n``."""
        x, out = self.x0, []
        for _ in range(self.n):
            x = (x + self.b) % 10
            out.append(x)
        return out

    def prompt(self) -> str:
        return f"b={self.b} x={self.x0} n={self.n}"

    def reasoning(self) -> str:
        """The think text (between ``<think>\\n`` and ``\\n</think>``)."""
        return "".join(f"{self.n - k:02d} {x};" for k, x in enumerate(self.values(), start=1))

    @property
    def answer(self) -> str:
        return str(self.values()[-1])


def problems(
    count: int, seed: int, min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS
) -> list[Problem]:
    """``count`` problems drawn with ``seed`` (steps uniform in ``[min_steps, max_steps]``)."""
    rng = random.Random(seed)
    return [
        Problem(rng.choice(_STRIDES), rng.randrange(10), rng.randint(min_steps, max_steps))
        for _ in range(count)
    ]


def write_dataset(path: Path, items: list[Problem]) -> Path:
    """The problems as a ``meridian bench accuracy`` dataset (exact checker on the digit)."""
    lines = []
    for i, p in enumerate(items):
        item = {"id": f"sum-{i}-n{p.n}", "prompt": p.prompt(), "answer": p.answer}
        lines.append(json.dumps({**item, "checker": "exact"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
