"""A request's kind (reasoning or chat) is decided once: ordering, admission and routing agree.

``gpt_oss`` and ``granite_3_2`` start every request whose prompt holds no marker in ``PREFILL``
(undecided: the model may open a think block itself); those count as reasoning everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from meridian.config import SchedulerConfig
from meridian.config.boundaries import BUNDLED_MODELS, BoundaryIds
from meridian.core.format import ReasoningFormat, expects_reasoning
from meridian.core.headroom import Kind
from meridian.core.policy import MeridianPolicy
from meridian.core.routing import NewRequest
from meridian.core.types import Phase

# Granite's markers are prose; a stand-in tokenizer gives each word an id.
_WORDS: dict[str, int] = {}


def _encode(text: str) -> tuple[int, ...]:
    return tuple(_WORDS.setdefault(word, 1000 + len(_WORDS)) for word in text.split())


def _format(name: str) -> ReasoningFormat:
    definition = BUNDLED_MODELS[name]
    if definition.think_start_token_ids is not None:
        start = tuple(definition.think_start_token_ids)
        end = tuple(definition.think_end_token_ids or ())
    else:
        start, end = _encode(definition.think_start), _encode(definition.think_end)
    return ReasoningFormat.from_boundaries(definition, BoundaryIds(start, end))


@dataclass
class Waiting:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0


def _prompts(fmt: ReasoningFormat) -> dict[str, list[int]]:
    """Prompts that start a request in each phase: plain (PREFILL), opened (THINK), closed
    (OUTPUT: thinking disabled in the prompt)."""
    return {
        "plain": [1, 2, 3],
        "opened": [1, 2, *fmt.think_start],
        "closed": [1, *fmt.think_start, 5, *fmt.think_end],
    }


@pytest.mark.parametrize("name", ["gpt_oss", "granite_3_2"])
def test_ordering_admission_and_routing_agree_on_every_requests_kind(name: str) -> None:
    fmt = _format(name)
    prompts = _prompts(fmt)
    phases = {label: fmt.initial_phase(p) for label, p in prompts.items()}
    assert phases == {"plain": Phase.PREFILL, "opened": Phase.THINK, "closed": Phase.OUTPUT}

    config = SchedulerConfig(admission_order="reasoning-first")
    policy = MeridianPolicy(fmt, config, block_size=4, capacity=8, clock=lambda: 0.0)
    for label, prompt in prompts.items():
        policy.track(label, prompt)
    waiting = {label: Waiting(label, len(p)) for label, p in prompts.items()}

    # Ordering (reasoning first): a request moves ahead of a chat request iff it is reasoning.
    chat = waiting["closed"]
    ordering = {label: policy.waiting_order([chat, w]) is not None for label, w in waiting.items()}
    # Admission: the kind its length model projects a running request by.
    kinds, _, _ = policy.admission.progress(list(waiting.values()))
    admission = {label: kind is Kind.THINKING for label, kind in zip(waiting, kinds, strict=True)}
    # Routing: the router's view of the same prompts.
    routing = {
        label: NewRequest(fmt.initial_phase(p), len(p)).reasoning for label, p in prompts.items()
    }

    expected = {label: expects_reasoning(phase) for label, phase in phases.items()}
    assert expected == {"plain": True, "opened": True, "closed": False}
    assert ordering == admission == routing == expected


def test_chat_first_puts_a_prefill_request_behind_a_chat_one() -> None:
    fmt = _format("gpt_oss")
    prompts = _prompts(fmt)
    config = SchedulerConfig(admission_order="chat-first")
    policy = MeridianPolicy(fmt, config, block_size=4, capacity=8, clock=lambda: 0.0)
    policy.track("plain", prompts["plain"])
    policy.track("closed", prompts["closed"])
    plain, closed = Waiting("plain", 3), Waiting("closed", len(prompts["closed"]))
    assert policy.waiting_order([plain, closed]) == [closed, plain]
    assert policy.waiting_order([closed, plain]) is None
