"""Boundary ids resolved from tokenizers, and the bundled model definitions."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from meridian.config import (
    BUNDLED_MODELS,
    TokenizerJsonVocab,
    configured_boundary_ids,
    resolve_boundary_ids,
)
from meridian.errors import BoundaryError

# DESIGN.md, "Verified facts".
VERIFIED = {
    "deepseek_r1": (128798, 128799),
    "r1_distill_qwen": (151648, 151649),
    "qwen3": (151667, 151668),
    "qwq": (151667, 151668),
}


def test_bundled_families() -> None:
    assert set(BUNDLED_MODELS) == {*VERIFIED, "granite_3_2", "gpt_oss"}
    # Harmony's channel markers: configured ids, checked on the real tokenizer in the vLLM group.
    harmony = configured_boundary_ids(BUNDLED_MODELS["gpt_oss"], name="gpt_oss")
    assert harmony.think_start == (200005, 35644, 200008)
    assert harmony.think_end == (200007, 200006, 173781, 200005, 17196, 200008)
    for name, (start, end) in VERIFIED.items():
        ids = configured_boundary_ids(BUNDLED_MODELS[name], name=name)
        assert (ids.think_start, ids.think_end) == ((start,), (end,))
    granite = BUNDLED_MODELS["granite_3_2"]
    assert granite.think_start == "Here is my thought process:"
    assert granite.think_end == "Here is my response:"
    with pytest.raises(BoundaryError, match="pass a tokenizer"):
        configured_boundary_ids(granite, name="granite_3_2")


def test_resolve_from_a_mapping_and_from_get_vocab() -> None:
    vocab = {"<think>": 151667, "</think>": 151668, "Ċ": 198}
    ids = resolve_boundary_ids(BUNDLED_MODELS["qwen3"], vocab, name="qwen3")
    assert ids.think_start == (151667,) and ids.think_end == (151668,)
    assert ids.newline_ids == frozenset({198})

    class HfLike:
        def get_vocab(self) -> Mapping[str, int]:
            return vocab

    assert resolve_boundary_ids(BUNDLED_MODELS["qwen3"], HfLike()).think_end == (151668,)


def test_tokenizer_that_disagrees_with_configured_ids() -> None:
    # Qwen3's tokenizer maps 151648/151649 to <|box_start|>/<|box_end|>; a distill config on a
    # Qwen3 tokenizer must be caught.
    qwen3_vocab = {"<think>": 151667, "</think>": 151668}
    with pytest.raises(BoundaryError, match=r"r1_distill_qwen.think_start_token_ids is \[151648\]"):
        resolve_boundary_ids(BUNDLED_MODELS["r1_distill_qwen"], qwen3_vocab, name="r1_distill_qwen")


def test_tokenizer_without_the_tokens() -> None:
    with pytest.raises(BoundaryError, match=r"model.qwen3.think_start: the tokenizer has no token"):
        resolve_boundary_ids(BUNDLED_MODELS["qwen3"], {"hello": 1}, name="qwen3")


def test_prose_markers_resolve_through_encode() -> None:
    class Encoder:
        def get_vocab(self) -> Mapping[str, int]:
            return {}

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [sum(map(ord, word)) for word in text.split()]

    ids = resolve_boundary_ids(BUNDLED_MODELS["granite_3_2"], Encoder(), name="granite_3_2")
    assert len(ids.think_start) == 5 and len(ids.think_end) == 4


def test_tokenizer_json_directory(tmp_path: Path) -> None:
    data = {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ċ": 2}},
        "added_tokens": [{"id": 3, "content": "<think>"}, {"id": 4, "content": "</think>"}],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    vocab = TokenizerJsonVocab.from_dir(tmp_path)
    model = BUNDLED_MODELS["qwen3"].model_copy(
        update={"think_start_token_ids": None, "think_end_token_ids": None}
    )
    ids = resolve_boundary_ids(model, vocab)
    assert (ids.think_start, ids.think_end, ids.newline_ids) == ((3,), (4,), frozenset({2}))
    with pytest.raises(BoundaryError, match=r"tokenizer\.json not found"):
        TokenizerJsonVocab.from_dir(tmp_path / "missing")
