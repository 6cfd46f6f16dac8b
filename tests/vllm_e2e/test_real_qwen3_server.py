# mypy: disable-error-code="import-not-found"
"""``meridian serve`` on a tiny random-weight model built around the real Qwen3 tokenizer (from
npm) and its chat template, through vLLM's ``qwen3`` reasoning parser: with thinking on, off
(``enable_thinking``) and ``/no_think``, Meridian's phase tracking agrees with the parser's split
on every request. The per-request view of Meridian is the change of its counters on /metrics
across one request (requests run one at a time)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")
httpx = pytest.importorskip("httpx")

from conftest import meridian_server, phase_counters, post_counted  # noqa: E402
from npm_tokenizers import tokenizer_dir  # noqa: E402

MAX_THINK = 10
THINK_START, THINK_END = 151667, 151668


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from meridian.vllm.tiny_model import TinyModelSpec, build_tiny_model_with_tokenizer

    # Qwen3's embedding size (151,936 rows: the vocabulary padded); a small body.
    spec = TinyModelSpec(
        vocab_size=151_936,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    return build_tiny_model_with_tokenizer(
        tmp_path_factory.mktemp("qwen3-tiny"), tokenizer_dir("qwen3"), spec
    )


@pytest.fixture(scope="module")
def server(qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("qwen3-server")
    config = f"[scheduler]\nmax_think_tokens = {MAX_THINK}\nmin_think_tokens = 0\n"
    # --model-family qwen3 also passes --reasoning-parser qwen3 to vLLM.
    with meridian_server(qwen3_model, work, config, ["--model-family", "qwen3"]) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(qwen3_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_model))


def chat(url: str, model: Path, content: str, **extra: Any) -> tuple[dict[str, Any], dict]:
    """One request; (its choice and usage, the change of Meridian's counters it caused)."""
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_THINK + 8,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    return post_counted(url, "/v1/chat/completions", body)


def parser_split(data: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int]]:
    """The generated ids on each side of the parser's split, checked against its texts."""
    choice = data["choices"][0]
    ids: list[int] = choice["token_ids"]
    reasoning = choice["message"].get("reasoning") or choice["message"].get("reasoning_content")
    content = choice["message"].get("content") or ""
    if reasoning is None:
        return [], ids
    assert THINK_END in ids, "the parser split without a </think>"
    k = ids.index(THINK_END)
    think_ids = ids[1:k] if ids[:1] == [THINK_START] else ids[:k]
    assert reasoning == tokenizer.decode(think_ids)
    assert content == tokenizer.decode(ids[k + 1 :], skip_special_tokens=True)
    return think_ids, ids[k + 1 :]


def test_thinking_on_the_phases_match_the_parser(
    server: str, qwen3_model: Path, tokenizer: Any
) -> None:
    data, delta = chat(server, qwen3_model, "What is 17 * 3?")
    think_ids, answer_ids = parser_split(data, tokenizer)
    print(f"thinking on: {len(think_ids)} think, {len(answer_ids)} answer tokens; {delta}")
    # vLLM's parser reads reasoning from the first token; Meridian too, and forced </think>
    # at its cap, so the split exists although the random model never ends a thought.
    assert len(think_ids) == MAX_THINK and delta["forces"] == 1
    assert delta["think"] == len(think_ids) and delta["answer"] == len(answer_ids)
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(think_ids)
    assert delta["exits"] == 1 and delta["ttfvt"] == 1


def test_thinking_off_is_all_answer_for_both(
    server: str, qwen3_model: Path, tokenizer: Any
) -> None:
    data, delta = chat(
        server, qwen3_model, "What is 17 * 3?", chat_template_kwargs={"enable_thinking": False}
    )
    message = data["choices"][0]["message"]
    assert not (message.get("reasoning") or message.get("reasoning_content"))
    ids = data["choices"][0]["token_ids"]
    # The template closed the think block in the prompt: Meridian starts answering at once.
    assert delta["think"] == 0 and delta["exits"] == 0 and delta["forces"] == 0
    assert delta["answer"] == len(ids) - ids.count(THINK_END) - ids[:1].count(THINK_START)
    assert delta["ttfvt"] == 1  # a plain answer's first token: its TTFVT is its TTFT


def test_no_think_directive_matches_the_parser(
    server: str, qwen3_model: Path, tokenizer: Any
) -> None:
    # /no_think is the model's to obey (Qwen3 answers with an empty think block); the template
    # and vLLM's parser treat the request like any other, and so does Meridian.
    data, delta = chat(server, qwen3_model, "What is 17 * 3? /no_think")
    think_ids, answer_ids = parser_split(data, tokenizer)
    assert delta["think"] == len(think_ids) and delta["answer"] == len(answer_ids)
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(think_ids)


def test_streamed_deltas_carry_the_same_split(server: str, qwen3_model: Path) -> None:
    before = phase_counters(server)
    body = {
        "model": str(qwen3_model),
        "messages": [{"role": "user", "content": "Name three primes."}],
        "max_tokens": MAX_THINK + 8,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reasoning_chunks = content_chunks = 0
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            if not chunk["choices"]:
                continue
            delta = chunk["choices"][0]["delta"]
            reasoning_chunks += bool(delta.get("reasoning"))
            content_chunks += bool(delta.get("content"))
    delta_counts = {k: v - before[k] for k, v in phase_counters(server).items()}
    assert reasoning_chunks and content_chunks
    assert usage["completion_tokens_details"]["reasoning_tokens"] == delta_counts["think"]
    assert delta_counts["think"] == MAX_THINK
