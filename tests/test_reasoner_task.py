"""The trained reasoner's task: deterministic problems whose answer needs every step."""

from __future__ import annotations

import json
from pathlib import Path

from meridian.bench.accuracy import grade, load_dataset
from meridian.bench.reasoner_task import MAX_STEPS, MIN_STEPS, problems, write_dataset


def test_problems_are_seeded_and_their_reasoning_counts_down() -> None:
    drawn = problems(200, seed=1)
    assert drawn == problems(200, seed=1) and drawn != problems(200, seed=2)
    assert {p.n for p in drawn} <= set(range(MIN_STEPS, MAX_STEPS + 1))
    for p in drawn:
        steps = p.reasoning().split(";")[:-1]
        assert len(p.reasoning()) == 5 * p.n and len(steps) == p.n
        assert [int(s[:2]) for s in steps] == list(range(p.n - 1, -1, -1))
        assert steps[-1][-1] == p.answer


def test_an_answer_from_stopped_reasoning_is_right_only_a_tenth_of_the_time() -> None:
    """The last value of a cut reasoning equals the answer only when the steps left are a
    multiple of 10: the harness can see a premature stop."""
    for p in problems(100, seed=3):
        values = p.values()
        for k in range(1, p.n):
            assert (str(values[k - 1]) == p.answer) == ((p.n - k) % 10 == 0)


def test_the_dataset_grades_the_answer_digit(tmp_path: Path) -> None:
    items = problems(5, seed=4)
    path = write_dataset(tmp_path / "d.jsonl", items)
    loaded = load_dataset(path)
    assert [i.answer for i in loaded] == [p.answer for p in items]
    assert all(grade(i, p.answer) and not grade(i, "x") for i, p in zip(loaded, items, strict=True))
    assert json.loads(path.read_text().splitlines()[0])["prompt"] == items[0].prompt()
