"""``ThinkForcer`` under speculative decoding: draft rows decided per row, accepted drafts
settled at the next step, so forcing is what one-token steps would do."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config.schema import SchedulerConfig
from meridian.core.budget import BudgetPolicy, RequestBudget
from meridian.core.forcing import ThinkForcer
from meridian.core.format import ReasoningFormat
from meridian.core.types import ForceReason, Phase
from test_budget import ENTROPY

START, END = 3, 4
# The "model": the greedy token and the entropy of the distribution after a context.
Model = Callable[[tuple[int, ...]], tuple[int, float]]


def make_model(seed: int) -> Model:
    """Deterministic in the context: think tokens 5-7, now and then a boundary token."""

    def model(context: tuple[int, ...]) -> tuple[int, float]:
        rng = random.Random(hash((seed, context)))
        token = rng.choice([5, 5, 6, 6, 7, 7, 7, START, END] if rng.random() < 0.1 else [5, 6, 7])
        return token, rng.choice([0.0, 1.0, 1.0, 2.9])

    return model


def new_forcer(think_end: tuple[int, ...], transition: tuple[int, ...], eat: int) -> ThinkForcer:
    entropy = ENTROPY.model_copy(update={"eat_min_distance": eat})
    policy = BudgetPolicy(SchedulerConfig(min_think_tokens=2, max_think_tokens=1000), entropy)
    model = ReasoningFormat(think_start=(START,), think_end=think_end)
    return ThinkForcer(model, policy, transition=transition)


def first_row(forcer: ThinkForcer, model: Model, out: list[int]) -> int:
    """A step's row of the last committed token, as the logits processor drives the forcer:
    sync, entropy if wanted, decision; the token the row samples."""
    forcer.prepare(["r"])
    token, entropy = model(tuple(out))
    if forcer.wants_entropy("r"):
        forcer.observe_entropy("r", entropy)
    forced = forcer.forced_tokens(["r"])
    return forced[0][1] if forced else token


def one_token_steps(forcer: ThinkForcer, model: Model, cap: int | None, n: int) -> list[int]:
    """The reference: one token per step, as without speculation."""
    out: list[int] = []
    forcer.add("r", prompt=[9, START], output=out, budget=RequestBudget(max_think_tokens=cap))
    while len(out) < n:
        out.append(first_row(forcer, model, out))
    forcer.prepare(["r"])
    return out


def speculative_steps(
    forcer: ThinkForcer,
    model: Model,
    cap: int | None,
    n: int,
    k: int,
    rng: random.Random,
    accuracy: float,
) -> list[int]:
    """Speculative decoding as vLLM's greedy rejection sampler does it: each step, ``k``
    drafts (the model's own guess with probability ``accuracy``, else a random token); row
    ``j``'s token is the forced one or the model's; drafts are accepted while they equal the
    row before's token, then that row's token (recovered, or the bonus) is committed."""
    out: list[int] = []
    forcer.add("r", prompt=[9, START], output=out, budget=RequestBudget(max_think_tokens=cap))
    while len(out) < n:
        targets = [first_row(forcer, model, out)]
        drafts: list[int] = []
        context = tuple(out)
        for _ in range(k):
            guess = model(context)[0] if rng.random() < accuracy else rng.choice([3, 4, 5, 6, 7])
            drafts.append(guess)
            context = (*context, guess)
        wants = forcer.wants_draft_entropy("r")
        entropies = [
            model(tuple(out) + tuple(drafts[: j + 1]))[1] if wants else math.nan for j in range(k)
        ]
        decided = forcer.speculate("r", drafts, entropies)
        for j, forced_token in enumerate(decided):
            own = model(tuple(out) + tuple(drafts[: j + 1]))[0]
            targets.append(own if forced_token is None else forced_token)
        accepted = 0
        while accepted < k and drafts[accepted] == targets[accepted]:
            accepted += 1
        out.extend([*drafts[:accepted], targets[accepted]])
    # The last step's accepted drafts are settled at the next sync.
    forcer.prepare(["r"])
    return out


def _counts(forcer: ThinkForcer) -> tuple[object, ...]:
    st = forcer.state("r")
    return (st.phase, st.forced, st.num_think_tokens, st.num_output_tokens,
            st.num_marker_tokens, st.num_generated_tokens, st.marker_progress)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cap=st.sampled_from([None, 1, 4, 9, 30]),
    k=st.integers(1, 4),
    accuracy=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    marker=st.sampled_from([((END,), ()), ((END, 8), ()), ((END,), (8, 9))]),
    eat=st.sampled_from([2, 50]),  # 50: EAT never fires, RPDI may
)
def test_speculation_forces_as_one_token_steps_do(
    seed: int,
    cap: int | None,
    k: int,
    accuracy: float,
    marker: tuple[tuple[int, ...], tuple[int, ...]],
    eat: int,
) -> None:
    """Whatever the drafts and which of them are accepted, the committed tokens, the forces
    (reason and think count) and the request's final state are those of one-token steps: each
    draft row saw the drafts before it, and rejected drafts left no trace."""
    n = 40
    model = make_model(seed)
    think_end, transition = marker
    reference, speculative = (new_forcer(think_end, transition, eat) for _ in range(2))
    got = speculative_steps(speculative, model, cap, n, k, random.Random(seed), accuracy)
    # The reference over exactly the tokens speculation committed (its last step may commit up
    # to k past n, and a force decided there is compared too).
    want = one_token_steps(reference, model, cap, len(got))
    assert got == want
    assert [(r.reason, r.num_think_tokens) for r in speculative.records] == [
        (r.reason, r.num_think_tokens) for r in reference.records
    ]
    assert _counts(speculative) == _counts(reference)  # the same tokens seen: the same state
    speculative.check_integrity()


def test_the_forced_row_is_the_one_at_the_cap() -> None:
    """Cap 3 with 2 think tokens committed: the draft row after one more think token is forced
    to ``</think>``, the row before it is free; the state is untouched until the next sync,
    which records the force only if that row's draft was accepted."""
    forcer = new_forcer((END,), (), eat=50)
    out = [5, 5]
    forcer.add("r", prompt=[9, START], output=out, budget=RequestBudget(max_think_tokens=3))
    assert forcer.prepare(["r"]) == [0] and forcer.forced_tokens(["r"]) == []
    # Row 0 samples the 3rd think token; the draft rows: after draft 6 (3 think tokens) forced,
    # the later ones moot (their drafts follow a 6 the engine replaces with </think>).
    assert forcer.speculate("r", [6, 7, 7], [1.0, 1.0, 1.0]) == [END, None, None]
    assert forcer.state("r").num_think_tokens == 2 and not forcer.records
    # The engine rejected draft 6 (row 0 sampled 7): no force; the next step forces itself.
    out.append(7)
    forcer.prepare(["r"])
    assert not forcer.records and forcer.phase("r") is Phase.THINK
    assert forcer.forced_tokens(["r"]) == [(0, END)]
    assert [r.num_think_tokens for r in forcer.records] == [3]


def test_accepted_drafts_are_settled_with_their_force() -> None:
    """Drafts 6, 7 accepted and row 2's forced ``</think>`` sampled: the next sync records the
    force at 3 think tokens (as one-token steps would have) and the request answers."""
    forcer = new_forcer((END,), (), eat=50)
    out = [5]
    forcer.add("r", prompt=[9, START], output=out, budget=RequestBudget(max_think_tokens=3))
    forcer.prepare(["r"])
    assert forcer.forced_tokens(["r"]) == []
    assert forcer.speculate("r", [6, 7, 8], [math.nan] * 3) == [None, END, None]
    out.extend([6, 7, END])  # drafts 6, 7 accepted; row 2 sampled the forced END
    forcer.prepare(["r"])
    assert [(r.reason, r.num_think_tokens) for r in forcer.records] == [(ForceReason.HARD_CAP, 3)]
    assert forcer.phase("r") is Phase.OUTPUT and forcer.state("r").forced
    forcer.check_integrity()


def test_speculate_refuses_unaligned_entropies() -> None:
    forcer = new_forcer((END,), (), eat=50)
    forcer.add("r", prompt=[9, START], output=[], budget=None)
    with pytest.raises(ValueError, match="2 draft tokens but 1 entropies"):
        forcer.speculate("r", [5, 5], [1.0])
