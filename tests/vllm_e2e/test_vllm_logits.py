# mypy: disable-error-code="import-not-found"
"""Meridian's logits processors without an engine: entropy on torch, V1 batch handling (V2:
test_vllm_logits_v2.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.sampling_params")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from meridian.core.entropy import entropy_nats  # noqa: E402
from meridian.core.types import ForceReason, Phase  # noqa: E402
from meridian.vllm.logits import (  # noqa: E402
    MeridianLogitsProcessor,
    entropy_torch,
)
from meridian.vllm.runtime import RequestArgsError  # noqa: E402

START, END = 3, 4  # the tiny family's (conftest.py's tiny_runtime_env)
VOCAB = 32
PROMPT = [10, 11, START]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("vocab", [8, 1024, 151936])
def test_entropy_torch_matches_the_core_reference(dtype: str, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(4, vocab, generator=gen) * 3).to(getattr(torch, dtype))
    logits[1, : vocab // 2] = float("-inf")  # masked tokens
    logits[2] = float("-inf")
    logits[2, 5] = 1.0  # a one-hot row: entropy 0
    got = entropy_torch(logits).numpy()
    want = entropy_nats(logits.float().numpy())
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert got[2] == pytest.approx(0.0, abs=1e-6)


def test_entropy_torch_uniform_and_empty_rows() -> None:
    h = entropy_torch(torch.zeros(2, 16))
    assert h.tolist() == pytest.approx([math.log(16)] * 2, abs=1e-6)
    assert math.isnan(entropy_torch(torch.full((1, 4), float("-inf"))).item())


def params(**extra: Any) -> Any:
    return SamplingParams(max_tokens=50, extra_args=extra or None)


def step_v1(proc: MeridianLogitsProcessor, outputs: list[list[int]]) -> list[int | None]:
    """One step: apply on random logits, append each row's greedy choice; forced ids or None."""
    logits = torch.randn(len(outputs), VOCAB)
    # The model never ends thinking by itself here, nor opens it again (a generated think_start
    # right after the prompt's is a marker, not a think token: a cap would be met one later).
    logits[:, [START, END]] = -50.0
    out = proc.apply(logits)
    forced: list[int | None] = []
    for i, row in enumerate(out):
        finite = torch.isfinite(row)
        forced.append(int(row.argmax()) if int(finite.sum()) == 1 else None)
        outputs[i].append(int(row.argmax()))
    return forced


def test_v1_forces_each_row_at_its_cap(tiny_runtime_env: Any) -> None:
    proc = MeridianLogitsProcessor(tiny_runtime_env, torch.device("cpu"), False)
    assert not proc.is_argmax_invariant()
    outs: list[list[int]] = [[], [], []]
    proc.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[],
            added=[
                (0, params(meridian_max_think_tokens=2), PROMPT, outs[0]),
                (1, params(meridian_max_think_tokens=4), PROMPT, outs[1]),
                (2, params(meridian_forcing="off", meridian_max_think_tokens=1), PROMPT, outs[2]),
            ],
            moved=[],
        )
    )
    for _ in range(6):
        proc.update_state(None)
        step_v1(proc, outs)
    assert outs[0][2] == END and outs[1][4] == END and END not in outs[2]
    assert proc.forcer.num_forced[ForceReason.HARD_CAP] == 2
    assert proc.core.num_errors == 0
    proc.forcer.check_integrity()


def test_v1_batch_moves_and_removals(tiny_runtime_env: Any) -> None:
    proc = MeridianLogitsProcessor(tiny_runtime_env, torch.device("cpu"), False)
    a: list[int] = []
    b: list[int] = []
    proc.update_state(
        BatchUpdate(
            batch_size=2,
            removed=[],
            added=[
                (0, params(meridian_max_think_tokens=3), PROMPT, a),
                (1, params(meridian_max_think_tokens=1), PROMPT, b),
            ],
            moved=[],
        )
    )
    # Swap the rows: b is now row 0 and must be forced there.
    proc.update_state(
        BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)])
    )
    b.append(7)  # b has one think token: its cap is reached
    logits = torch.zeros(2, VOCAB)
    proc.apply(logits)
    assert torch.isfinite(logits[0]).sum() == 1 and logits[0, END] == 0
    assert torch.isfinite(logits[1]).all()
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert len(proc._keys) == 1 and len(proc._parked) == 1  # kept for its return
    # Preempted and re-added with its output so far: the phase is replayed.
    b.append(END)
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[]))
    proc.update_state(
        BatchUpdate(
            batch_size=1,
            removed=[],
            added=[(0, params(meridian_max_think_tokens=1), PROMPT, b)],
            moved=[],
        )
    )
    key = next(iter(proc._keys.values()))
    assert proc.forcer.phase(key) is Phase.OUTPUT
    proc.forcer.check_integrity()


def test_v1_a_row_back_in_the_batch_keeps_its_state(tiny_runtime_env: Any) -> None:
    """vLLM's V1 runner drops a request it does not schedule from the batch and adds it back
    with the same output list: its entropy probe goes on. An index freed and filled in one
    update is not in ``removed``; a request back with another list starts afresh; a finished
    request's row goes with vLLM's list, others beyond the bound (oldest first)."""
    config = Path(os.environ["MERIDIAN_CONFIG"])
    config.write_text(
        config.read_text() + "[entropy]\neat_probe_interval_tokens = 1\neat_min_distance = 5\n"
    )
    proc = MeridianLogitsProcessor(tiny_runtime_env, torch.device("cpu"), False)

    def update(size: int, removed: Any = (), added: Any = (), moved: Any = ()) -> None:
        adds = [(index, params(), PROMPT, out) for index, out in added]
        proc.update_state(BatchUpdate(size, list(removed), list(adds), list(moved)))

    def samples(key: str) -> int:
        probe = proc.forcer._rows[key].probe
        assert probe is not None
        return probe.num_eat_samples

    a: list[int] = []
    b: list[int] = []
    update(2, added=[(0, a), (1, b)])
    for _ in range(3):
        step_v1(proc, [a, b])
    key_a = proc._keys[0]
    assert samples(key_a) == 3
    # a is not scheduled: b moves down to its index; then a comes back at index 1 ...
    update(1, removed=[0], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)])
    step_v1(proc, [b])
    update(2, added=[(1, a)])
    assert proc._keys[1] == key_a  # the same state, its samples kept
    step_v1(proc, [b, a])
    assert samples(key_a) == 4
    # ... and b's index is filled by a new request in the same update that drops b.
    key_b = proc._keys[0]
    update(2, added=[(0, [])])
    assert proc._keys[0] not in (key_a, key_b) and key_b in proc.forcer
    update(3, added=[(2, b)])
    assert proc._keys[2] == key_b
    # Back with another list (vLLM rebuilt it): a fresh state (the old one kept until dropped).
    update(2, removed=[2])
    update(3, added=[(2, list(b))])
    assert proc._keys[2] != key_b
    # A finished request: vLLM drops its state, and so its list (as the one added at index 0
    # above, which nothing else holds): its row is not kept.
    done = proc._keys[0]
    update(2, removed=[0])
    assert done not in proc.forcer and key_b in proc.forcer
    # Requests vLLM still holds but does not add back: at most the bound stays kept.
    proc._max_parked = 1
    update(1, removed=[1])
    assert key_a in proc.forcer and key_b not in proc.forcer
    proc.forcer.check_integrity()
    assert proc.core.num_errors == 0


def test_v1_validate_params_rejects_bad_knobs() -> None:
    with pytest.raises(RequestArgsError, match="meridian_forcing"):
        MeridianLogitsProcessor.validate_params(params(meridian_forcing="sometimes"))
    MeridianLogitsProcessor.validate_params(params(meridian_max_think_tokens=8))
    MeridianLogitsProcessor.validate_params(SamplingParams())


def test_v1_fails_open(tiny_runtime_env: Any) -> None:
    proc = MeridianLogitsProcessor(tiny_runtime_env, torch.device("cpu"), False)
    out: list[int] = []
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[], added=[(0, params(), PROMPT, out)], moved=[])
    )
    out.append(-5)  # a corrupt token id: the router rejects it... or not; either way no crash
    proc.core.forcer.prepare = None  # type: ignore[assignment,method-assign]
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    assert torch.equal(proc.apply(logits), before)
    assert proc.core.num_errors == 1


def test_v1_entropy_convergence_forces_and_is_counted(tiny_runtime_env: Any) -> None:
    config = Path(os.environ["MERIDIAN_CONFIG"])
    config.write_text(
        config.read_text()
        + "[scheduler]\nmin_think_tokens = 3\nmax_think_tokens = 1000\n"
        + "[entropy]\nema_alpha = 0.5\neat_min_distance = 2\neat_probe_interval_tokens = 1\n"
    )
    proc = MeridianLogitsProcessor(tiny_runtime_env, torch.device("cpu"), False)
    out: list[int] = []
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[], added=[(0, params(), PROMPT, out)], moved=[])
    )
    for _ in range(6):
        logits = torch.zeros(1, VOCAB)  # flat entropy: EAT converges at once
        logits[0, 7] = 0.5
        out.append(int(proc.apply(logits)[0].argmax()))
    assert out.index(END) == 3
    sample = proc.core.metrics.registry.get_sample_value
    assert sample("meridian_budget_forces_total", {"reason": "converged"}) == 1
    assert sample("meridian_budget_forces_total", {"reason": "hard_cap"}) == 0
