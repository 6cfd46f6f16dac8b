"""What Meridian's router reads of an OpenAI request (``meridian.ray.requests``; no Ray needed):
the kind agrees with the phase router's rule on the prompt's tokens, and the size and bound are
the request's."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.cli import main
from meridian.config.boundaries import BUNDLED_MODELS, BoundaryIds
from meridian.core.format import ReasoningFormat
from meridian.core.types import Phase
from meridian.ray.requests import CHARS_PER_TOKEN, describe_request, prompt_phase
from meridian.vllm.runtime import GENERIC_THINK_TAGS

# A toy tokenizer: the markers and newlines are single tokens, every other character one too.
SPECIAL = {"<think>": 1, "</think>": 2, "\n": 3}
PIECE = re.compile("|".join(re.escape(s) for s in SPECIAL) + "|.", re.DOTALL)


def tokenize(text: str) -> list[int]:
    return [SPECIAL[p] if p in SPECIAL else 100 + ord(p) for p in PIECE.findall(text)]


pieces = st.lists(st.sampled_from(["<think>", "</think>", "\n", " ", "a", "Q:"]), max_size=8)


@settings(max_examples=400, deadline=None)
@given(pieces, st.sampled_from(["generic", "deepseek_r1"]))
def test_the_kind_of_a_prompt_is_the_phase_routers_on_its_tokens(
    parts: list[str], family: str
) -> None:
    definition = GENERIC_THINK_TAGS if family == "generic" else BUNDLED_MODELS[family]
    ids = BoundaryIds(think_start=(1,), think_end=(2,), newline_ids=frozenset({3}))
    model = ReasoningFormat.from_boundaries(definition, ids)
    text = "".join(parts)
    assert prompt_phase(text, definition) is model.initial_phase(tokenize(text))


# Stand-in ids for the families' tokens that are not markers: "/no_think" is several tokens.
NO_THINK_IDS, NEWLINE_ID = (901, 902, 903), 10
_WORDS: dict[str, int] = {}


def family_rules(name: str) -> tuple[ReasoningFormat, re.Pattern[str], dict[str, tuple[int, ...]]]:
    """The family's phase router (its marker ids; a prose marker's words get ids, as in
    test_kind.py) and a toy tokenizer's pieces: markers, "/no_think" and newlines as their ids,
    every other character one id."""
    definition = BUNDLED_MODELS[name]

    def ids_of(marker: str, configured: list[int] | None) -> tuple[int, ...]:
        if configured is not None:
            return tuple(configured)
        return tuple(_WORDS.setdefault(w, 1000 + len(_WORDS)) for w in marker.split())

    start = ids_of(definition.think_start, definition.think_start_token_ids)
    end = ids_of(definition.think_end, definition.think_end_token_ids)
    boundaries = BoundaryIds(start, end, frozenset({NEWLINE_ID}))
    model = ReasoningFormat.from_boundaries(definition, boundaries, NO_THINK_IDS)
    special = {
        definition.think_start: start,
        definition.think_end: end,
        "/no_think": NO_THINK_IDS,
        "\n": (NEWLINE_ID,),
    }
    longest_first = sorted(special, key=len, reverse=True)
    piece = re.compile("|".join(re.escape(s) for s in longest_first) + "|.", re.DOTALL)
    return model, piece, special


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "gpt_oss", "granite_3_2"])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_kind_of_a_text_prompt_is_core_initial_phase_on_its_tokens(
    name: str, data: st.DataObject
) -> None:
    definition = BUNDLED_MODELS[name]
    model, piece, special = family_rules(name)
    start, end = definition.think_start, definition.think_end
    words = [start, end, start[:4], end[-4:], "\n", "\n\n", " ", "a", "Q:", "/no_think"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), max_size=8)))
    tokens = [i for p in piece.findall(text) for i in special.get(p, (100_000 + ord(p[0]),))]
    assert prompt_phase(text, definition) is model.initial_phase(tokens)


def test_each_rule_of_the_kind_on_text() -> None:
    qwen3, gpt_oss = BUNDLED_MODELS["qwen3"], BUNDLED_MODELS["gpt_oss"]
    assert prompt_phase("Q: hi /no_think<think>", qwen3) is Phase.OUTPUT  # qwen3 supports it
    assert prompt_phase("Q: hi", qwen3) is Phase.THINK  # the template opens the block
    assert prompt_phase("Q: hi", gpt_oss) is Phase.PREFILL  # the model may open one
    analysis = gpt_oss.think_start
    assert prompt_phase(f"Q{analysis}\n", gpt_oss) is Phase.THINK
    assert prompt_phase(f"Q{analysis}half an idea", gpt_oss) is Phase.THINK  # started in prompt
    assert prompt_phase(f"Q{analysis}x{gpt_oss.think_end}\n", gpt_oss) is Phase.OUTPUT
    assert prompt_phase(f"Q{analysis}x{gpt_oss.think_end}more", gpt_oss) is Phase.PREFILL


def test_chat_and_completion_bodies() -> None:
    qwen3 = BUNDLED_MODELS["qwen3"]
    chat = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 64}
    assert describe_request(chat, qwen3).phase is Phase.THINK
    assert describe_request(chat, qwen3).num_prompt_tokens == 400 // CHARS_PER_TOKEN
    assert describe_request(chat, qwen3).max_tokens == 64
    closed = {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    assert describe_request(closed, qwen3).phase is Phase.OUTPUT
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab" * 10}]}]}
    assert describe_request(parts, GENERIC_THINK_TAGS).num_prompt_tokens == 5
    assert describe_request(parts, GENERIC_THINK_TAGS).phase is Phase.PREFILL
    answer = {"prompt": "question</think>\n\n", "max_completion_tokens": 9}
    assert describe_request(answer, GENERIC_THINK_TAGS) == describe_request(
        {"prompt": ["question</think>\n\n"], "max_tokens": 9}, GENERIC_THINK_TAGS
    )
    assert describe_request(answer, GENERIC_THINK_TAGS).phase is Phase.OUTPUT
    ids = describe_request({"prompt": [5, 6, 7]}, GENERIC_THINK_TAGS)
    assert (ids.phase, ids.num_prompt_tokens, ids.max_tokens) == (Phase.PREFILL, 3, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", " "], "--host is empty"),
        (["--replicas", "0"], "--replicas must be in [1, 1024]"),
        (["--engine-kwargs", "{not json"], "--engine-kwargs is not JSON"),
        (["--engine-kwargs", "[1]"], "--engine-kwargs must be a JSON object"),
    ],
)
def test_serve_cluster_refuses_bad_arguments_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve-cluster", "some/model", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
