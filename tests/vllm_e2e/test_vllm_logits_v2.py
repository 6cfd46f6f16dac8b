# mypy: disable-error-code="import-not-found"
"""Meridian's V2 logits processor on vLLM's own V2 interface types, speculative decoding
included, without the V2 runner (it needs Triton, which no CPU build has).

The processor gets what the runner gives it: a ``LogitsProcRequestState`` over a real
``RequestState`` (CPU tensors) and one ``LogitsContext`` per step. :class:`Runner` fills them
as vLLM's V2 runner does (``model_runner.py``, ``input_batch.py``): a request's committed tokens
in ``all_token_ids`` up to ``total_len``; per step one row per request, at position
``total_len - 1`` with the last committed token as input, then one row per draft token (its
``expanded_local_pos`` 1, 2, ...); after sampling, greedy rejection (a draft is accepted while
it equals the row before's choice; the first other row's choice is the recovered or bonus
token) and the accepted tokens written back as ``post_update`` does.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.sampling_params")

from vllm.sampling_params import SamplingParams  # noqa: E402

from meridian.core.types import ForceReason, Phase  # noqa: E402
from meridian.vllm.logits import MeridianLogitsProcessorV2  # noqa: E402

pytestmark = pytest.mark.skipif(
    MeridianLogitsProcessorV2 is None, reason="no V2 runner in this vLLM"
)

START, END = 3, 4  # the tiny family's (conftest.py's tiny_runtime_env)
VOCAB = 32
PROMPT = [10, 11, START]
Logits = Callable[[tuple[int, ...]], Any]


@pytest.fixture
def vllm_config(tiny_runtime_env: Any) -> Any:
    """The tiny family with a floor of 2 think tokens and an EAT rule that fires now and then on
    random logits."""
    config = Path(os.environ["MERIDIAN_CONFIG"])
    config.write_text(
        config.read_text()
        + "[scheduler]\nmin_think_tokens = 2\nmax_think_tokens = 1000\n"
        + "[entropy]\nema_alpha = 0.5\neat_min_distance = 4\neat_probe_interval_tokens = 1\n"
        + "eat_ema_variance_threshold = 0.02\n"
    )
    return tiny_runtime_env


@pytest.fixture
def runner(vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runner]]:
    """``runner(logits)``: a :class:`Runner` with a fresh processor over a real RequestState."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import buffer_utils

    # Without an accelerator: no pinned memory (the runner's UVA buffers then fall back to
    # device memory, here the CPU), and the GPU wheel's platform names no device.
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    if not current_platform.device_type:
        monkeypatch.setattr(current_platform, "device_type", "cpu")
    yield lambda logits: Runner(vllm_config, logits)


def params(**extra: Any) -> Any:
    return SamplingParams(max_tokens=200, extra_args=extra or None)


def random_logits(seed: int) -> Logits:
    """The "model": logits that depend only on the context; it never opens or closes the
    think block by itself."""

    def logits(context: tuple[int, ...]) -> Any:
        gen = torch.Generator().manual_seed(hash((seed, context)) & 0xFFFF_FFFF)
        row = torch.randn(VOCAB, generator=gen) * 2.0
        row[[START, END]] = -50.0
        return row

    return logits


class Runner:
    """vLLM's V2 model runner as far as a logits processor sees it (module docstring)."""

    def __init__(self, vllm_config: Any, logits: Logits) -> None:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState
        from vllm.v1.worker.gpu.states import RequestState

        self.states = RequestState(
            max_num_reqs=8,
            max_model_len=256,
            max_num_batched_tokens=256,
            num_speculative_steps=4,
            vocab_size=VOCAB,
            device=torch.device("cpu"),
        )
        self.proc = MeridianLogitsProcessorV2(
            vllm_config, LogitsProcRequestState.from_request_state(self.states)
        )
        self.logits = logits
        self.slots: dict[str, int] = {}
        self.num_accepted = self.num_rejected = 0

    def admit(self, req_id: str, sampling: Any, tokens: list[int], prompt_len: int) -> int:
        """``add_request`` (``tokens``: the prompt, and the output so far when resumed) with
        its staged writes applied."""
        states = self.states
        states.add_request(req_id, prompt_len, tokens, 0, 200)
        slot = self.slots[req_id] = states.req_id_to_index[req_id]
        states.all_token_ids.gpu[slot, : len(tokens)] = torch.tensor(tokens)
        states.total_len.gpu[slot] = len(tokens)
        assert self.proc.add_request(slot, sampling)
        return slot

    def committed(self, req_id: str) -> list[int]:
        slot = self.slots[req_id]
        plen = int(self.states.prompt_len.np[slot])
        return self.states.all_token_ids.gpu[slot, plen : self.total(slot)].tolist()

    def total(self, slot: int) -> int:
        return int(self.states.total_len.gpu[slot])

    def step(self, drafts: dict[str, list[int]] | None = None) -> dict[str, list[int | None]]:
        """One step of every admitted request (``drafts``: each one's draft tokens); returns
        per request the token each of its rows was forced to (``None``: free)."""
        drafts = drafts or {}
        ids, local, pos, inputs, contexts = [], [], [], [], []
        for req_id, slot in self.slots.items():
            total = self.total(slot)
            history = self.states.all_token_ids.gpu[slot, :total].tolist()
            row_inputs = [history[-1], *drafts.get(req_id, [])]
            for k, token in enumerate(row_inputs):
                ids.append(slot)
                local.append(k)
                pos.append(total - 1 + k)
                inputs.append(token)
                contexts.append((req_id, tuple(history) + tuple(row_inputs[1 : k + 1])))
        logits = torch.stack([self.logits(context) for _, context in contexts])
        processed = self.proc.apply(logits.clone(), self.context(ids, local, pos, inputs))
        forced: dict[str, list[int | None]] = {}
        chosen: dict[str, list[int]] = {}
        for row, (req_id, _) in enumerate(contexts):
            one_hot = int(torch.isfinite(processed[row]).sum()) == 1
            forced.setdefault(req_id, []).append(int(processed[row].argmax()) if one_hot else None)
            chosen.setdefault(req_id, []).append(int(processed[row].argmax()))
        for req_id, choices in chosen.items():
            proposed = drafts.get(req_id, [])
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == choices[accepted]:
                accepted += 1
            self.num_accepted += accepted
            self.num_rejected += len(proposed) - accepted
            self.commit(req_id, [*proposed[:accepted], choices[accepted]])
        return forced

    def commit(self, req_id: str, tokens: list[int]) -> None:
        """``post_update``: the sampled tokens after the committed ones; ``total_len`` grows."""
        slot = self.slots[req_id]
        total = self.total(slot)
        self.states.all_token_ids.gpu[slot, total : total + len(tokens)] = torch.tensor(tokens)
        self.states.total_len.gpu[slot] = total + len(tokens)

    def context(self, ids: list[int], local: list[int], pos: list[int], inputs: list[int]) -> Any:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        batch = list(dict.fromkeys(ids))
        return LogitsContext(
            expanded_idx_mapping=torch.tensor(ids, dtype=torch.int64),
            idx_mapping=torch.tensor(batch, dtype=torch.int64),
            idx_mapping_np=np.array(batch, dtype=np.int32),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32),
            input_ids=torch.tensor(inputs, dtype=torch.int32),
            pos=torch.tensor(pos, dtype=torch.int64),
            seq_lens_upper_bound_np=np.array([p + 1 for p in pos], dtype=np.int32),
        )

    def next_tokens(self, req_id: str) -> tuple[int, int]:
        """The model's next two tokens for the request (unforced greedy)."""
        slot = self.slots[req_id]
        context = tuple(self.states.all_token_ids.gpu[slot, : self.total(slot)].tolist())
        first = int(self.logits(context).argmax())
        return first, int(self.logits((*context, first)).argmax())

    def guess(self, req_id: str, k: int, rng: random.Random, accuracy: float) -> list[int]:
        """``k`` drafts: the model's own next token with probability ``accuracy`` (an n-gram
        match), else a random one."""
        slot = self.slots[req_id]
        context = tuple(self.states.all_token_ids.gpu[slot, : self.total(slot)].tolist())
        out: list[int] = []
        for _ in range(k):
            own = int(self.logits(context).argmax())
            token = own if rng.random() < accuracy else rng.randrange(5, VOCAB)
            out.append(token)
            context = (*context, token)
        return out


def test_v2_forces_from_device_token_history(runner: Callable[..., Runner]) -> None:
    """One row per request: the cap is met at the right token, and a request resumed after
    preemption with output tokens reads them from the device once."""
    run = runner(random_logits(0))
    run.admit("a", params(meridian_max_think_tokens=3), PROMPT, len(PROMPT))
    for _ in range(6):
        run.step()
    output = run.committed("a")
    assert output[3] == END and output.count(END) == 1
    assert run.proc.forcer.num_forced[ForceReason.HARD_CAP] == 1
    # Resumed after preemption with 2 output tokens already: its cap of 2 is met at once.
    run.admit("b", params(meridian_max_think_tokens=2), [*PROMPT, 7, 7], len(PROMPT))
    forced = run.step()
    assert forced["b"] == [END] and run.committed("b") == [7, 7, END]
    assert run.proc.core.num_errors == 0
    run.proc.forcer.check_integrity()


def test_v2_speculative_rows_are_forced_on_the_right_row(runner: Callable[..., Runner]) -> None:
    """Several rows per request: the row that reaches the cap through the drafts before it is
    the one forced; a draft the engine rejects leaves no trace (the next step counts from the
    committed tokens); a request answering is left alone."""
    run = runner(random_logits(1))
    run.admit("think", params(meridian_max_think_tokens=4), PROMPT, len(PROMPT))
    run.admit("answer", params(), [10, 11, START, 9, END], 5)  # answering from the start
    run.step()  # the prefills: 1 think token
    key = run.proc._keys[run.slots["think"]]
    own, _ = run.next_tokens("think")
    # Rows see 1, 2, 3, 4 think tokens: the 4th is forced. The first draft is not the model's
    # token: rejected, so one token is committed and the drafts leave no trace.
    forced = run.step({"think": [other(own), 5, 5], "answer": [6, 6, 6]})
    assert forced["think"] == [None, None, None, END]
    assert forced["answer"] == [None] * 4
    assert not run.proc.forcer.records  # decided on a copy: nothing recorded
    assert len(run.committed("think")) == 2
    # Rows see 2, 3, 4 think tokens: the third is forced. The first draft is the model's
    # token (accepted), the second is not: 4 tokens committed, none of them </think>.
    own, then = run.next_tokens("think")
    forced = run.step({"think": [own, other(then)]})
    assert forced["think"] == [None, None, END]
    assert run.proc.forcer.state(key).num_think_tokens == 2  # not settled yet
    assert len(run.committed("think")) == 4 and END not in run.committed("think")
    # The accepted draft's row is settled (3 think tokens), then the 4th: forced now.
    forced = run.step()
    assert forced["think"] == [END]
    records = [(r.reason, r.num_think_tokens) for r in run.proc.forcer.records]
    assert records == [(ForceReason.HARD_CAP, 4)]
    run.step()
    assert run.proc.forcer.phase(key) is Phase.OUTPUT
    assert run.committed("think")[4] == END
    assert run.proc.core.num_errors == 0
    run.proc.forcer.check_integrity()


def other(token: int) -> int:
    """A think token that is not ``token``."""
    return 5 if token != 5 else 6


@pytest.mark.parametrize("seed", range(6))
def test_v2_speculation_forces_as_one_row_steps_do(
    runner: Callable[..., Runner], seed: int
) -> None:
    """The same requests, greedy, with and without speculation (drafts the model's own
    tokens or random ones, several per step): the same committed tokens and the same forces
    (hard caps and EAT), so speculation neither turns forcing off nor moves it."""
    rng = random.Random(seed)
    caps = [None, 3, 7, 12]
    outputs, records = [], []
    for k in (0, rng.randint(1, 4)):
        run = runner(random_logits(seed))
        for i, cap in enumerate(caps):
            knobs = {} if cap is None else {"meridian_max_think_tokens": cap}
            run.admit(f"r{i}", params(**knobs), [*PROMPT[:-1], 20 + i, START], len(PROMPT) + 1)
        while min(len(run.committed(f"r{i}")) for i in range(len(caps))) < 24:
            drafts = {r: run.guess(r, k, rng, accuracy=0.7) for r in run.slots} if k else None
            run.step(drafts)
        run.step()  # the last accepted drafts settle
        outputs.append([run.committed(f"r{i}")[:24] for i in range(len(caps))])
        # The forces within those 24 tokens (a request may run further with speculation).
        records.append(
            sorted(
                (r.reason.value, r.num_think_tokens)
                for r in run.proc.forcer.records
                if r.num_think_tokens < 20
            )
        )
        assert run.proc.core.num_errors == 0
        run.proc.forcer.check_integrity()
        if k:
            assert run.num_accepted > 0 and run.num_rejected > 0
    assert outputs[1] == outputs[0]
    assert records[1] == records[0]
    assert {ForceReason.HARD_CAP.value, ForceReason.CONVERGED.value} <= {r for r, _ in records[0]}


def test_v2_rows_that_sample_nothing_are_left_alone(runner: Callable[..., Runner]) -> None:
    """A prefill chunk that does not end the prompt samples no token: its row is untouched
    and its request is read once its prefill is done. Placeholder drafts (-1) end a request's
    draft rows."""
    run = runner(random_logits(2))
    slot = run.admit("a", params(meridian_max_think_tokens=1), PROMPT, len(PROMPT))
    logits = torch.zeros(1, VOCAB)
    # A first chunk of the prompt: row at position 1 of 3.
    run.proc.apply(logits, run.context([slot], [0], [1], [PROMPT[1]]))
    assert torch.equal(logits, torch.zeros(1, VOCAB)) and not len(run.proc.forcer)
    # The last chunk, with placeholder draft rows (a padded first step): cap 1 is not met yet.
    logits = torch.zeros(3, VOCAB)
    run.proc.apply(logits, run.context([slot] * 3, [0, 1, 2], [2, 3, 4], [START, -1, -1]))
    assert torch.equal(logits, torch.zeros(3, VOCAB))
    assert len(run.proc.forcer) == 1 and run.proc.core.num_errors == 0
