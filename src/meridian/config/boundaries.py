"""Think-boundary definitions per model family, and their resolution from a tokenizer.

Ids are resolved from the tokenizer by string; configured ids are only a cross-check.
A boundary is a *sequence* of token ids: one id for ``<think>``-style special tokens, several
for prose markers such as Granite's "Here is my thought process:".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meridian.config.files import MIB, read_user_file
from meridian.errors import BoundaryError

# The longest think marker: markers are a special token or a short prose line (Granite's "Here is
# my thought process:", gpt-oss's six-token channel switch); a forced think_end is emitted whole,
# a decode step a token, so its length is bounded like scheduler.force_transition_phrase's.
MAX_MARKER_CHARS = 256
MAX_MARKER_TOKENS = 64


class ModelDefinition(BaseModel):
    """``[model.<name>]``: how a model family marks its reasoning."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    think_start: str = Field(
        description="String that opens the think phase, e.g. <think>.",
        max_length=MAX_MARKER_CHARS,
    )
    think_end: str = Field(
        description="String that closes the think phase, e.g. </think> (forced whole when the "
        f"budget fires; at most {MAX_MARKER_CHARS} characters, as think_start).",
        max_length=MAX_MARKER_CHARS,
    )
    think_start_token_ids: list[int] | None = Field(
        default=None,
        description="Expected token-id sequence of think_start (a cross-check; at most "
        f"{MAX_MARKER_TOKENS} ids, as think_end_token_ids).",
        max_length=MAX_MARKER_TOKENS,
    )
    think_end_token_ids: list[int] | None = Field(
        default=None,
        description="Expected token-id sequence of think_end (a cross-check).",
        max_length=MAX_MARKER_TOKENS,
    )
    reasoning_parser: str = Field(description="vLLM reasoning parser, e.g. deepseek_r1, qwen3.")
    supports_think_disable: bool = Field(
        default=False, description="A /no_think directive in the prompt skips the think phase."
    )
    think_starts_in_prompt: bool = Field(
        default=False,
        description="Generation starts in the think phase: the chat template puts think_start "
        "into the prompt, or the reasoning parser reads output as reasoning until think_end.",
    )

    @property
    def markers(self) -> tuple[str, str]:
        """The strings that open and close the think phase."""
        return (self.think_start, self.think_end)

    @field_validator("think_start", "think_end")
    @classmethod
    def _marker_not_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("think_start_token_ids", "think_end_token_ids")
    @classmethod
    def _ids_in_range(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None:
            if not ids:
                raise ValueError("must list at least one token id (or be left out)")
            bad = [i for i in ids if not 0 <= i <= MAX_TOKEN_ID]
            if bad:
                raise ValueError(f"must hold token ids in [0, {MAX_TOKEN_ID}]; {bad[0]} is not")
        return ids

    @model_validator(mode="after")
    def _start_differs_from_end(self) -> ModelDefinition:
        if self.think_start == self.think_end:
            raise ValueError(
                f"think_end must differ from think_start (a phase needs two boundaries); got "
                f"{self.think_end!r} for both"
            )
        start, end = self.think_start_token_ids, self.think_end_token_ids
        if start is not None and start == end:
            raise ValueError(
                f"think_end_token_ids must differ from think_start_token_ids; got {end} for both"
            )
        return self


# The largest tokenizer.json in use is tens of MiB (gpt-oss's o200k: 27 MiB).
MAX_TOKENIZER_BYTES = 128 * MIB
# Token ids are int32 in vLLM's sampler and in every tokenizer vocabulary in use.
MAX_TOKEN_ID = 2**31 - 1

# The families' published ids; they are checked against a tokenizer when one is given (ADR-0006).
BUNDLED_MODELS: dict[str, ModelDefinition] = {
    "deepseek_r1": ModelDefinition(
        think_start="<think>",
        think_end="</think>",
        think_start_token_ids=[128798],
        think_end_token_ids=[128799],
        reasoning_parser="deepseek_r1",
        think_starts_in_prompt=True,
    ),
    "r1_distill_qwen": ModelDefinition(
        think_start="<think>",
        think_end="</think>",
        think_start_token_ids=[151648],
        think_end_token_ids=[151649],
        reasoning_parser="deepseek_r1",
        think_starts_in_prompt=True,
    ),
    "qwen3": ModelDefinition(
        think_start="<think>",
        think_end="</think>",
        think_start_token_ids=[151667],
        think_end_token_ids=[151668],
        reasoning_parser="qwen3",
        supports_think_disable=True,
        # vLLM's qwen3 parser starts in reasoning whether or not the model emits <think> (the
        # model does; Meridian takes that one as a marker); enable_thinking=False closes the
        # block in the prompt, which rule 4 of the initial phase reads as OUTPUT.
        think_starts_in_prompt=True,
    ),
    "qwq": ModelDefinition(
        think_start="<think>",
        think_end="</think>",
        think_start_token_ids=[151667],
        think_end_token_ids=[151668],
        reasoning_parser="deepseek_r1",
        think_starts_in_prompt=True,
    ),
    "granite_3_2": ModelDefinition(
        think_start="Here is my thought process:",
        think_end="Here is my response:",
        reasoning_parser="granite",
    ),
    # OpenAI's gpt-oss speaks harmony: the reasoning is the `analysis` channel's message, the
    # answer the `final` one's. The answer opens a new assistant message, so the end marker
    # closes the analysis message too (<|end|> 200007, <|start|> 200006, assistant 173781):
    # forced, it is a transition harmony's parser (vLLM's, for gpt-oss) accepts.
    "gpt_oss": ModelDefinition(
        think_start="<|channel|>analysis<|message|>",
        think_end="<|end|><|start|>assistant<|channel|>final<|message|>",
        think_start_token_ids=[200005, 35644, 200008],
        think_end_token_ids=[200007, 200006, 173781, 200005, 17196, 200008],
        reasoning_parser="openai_gptoss",
    ),
}


@runtime_checkable
class VocabTokenizer(Protocol):
    """Anything with a HF-style ``get_vocab()``."""

    def get_vocab(self) -> Mapping[str, int]: ...


@runtime_checkable
class EncodingTokenizer(Protocol):
    """Anything that can encode text to ids (needed for multi-token prose markers)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


TokenizerLike = VocabTokenizer | Mapping[str, int] | Any


@dataclass(frozen=True, slots=True)
class BoundaryIds:
    """Resolved boundary token-id sequences of one model."""

    think_start: tuple[int, ...]
    think_end: tuple[int, ...]
    newline_ids: frozenset[int] = frozenset()


def _vocab_of(tokenizer: TokenizerLike) -> Mapping[str, int] | None:
    if isinstance(tokenizer, Mapping):
        return tokenizer
    if isinstance(tokenizer, VocabTokenizer):
        return tokenizer.get_vocab()
    return None


def _resolve_one(
    text: str, vocab: Mapping[str, int], tokenizer: TokenizerLike, field: str, name: str
) -> tuple[int, ...]:
    if text in vocab:
        return (int(vocab[text]),)
    if isinstance(tokenizer, EncodingTokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids:
            return tuple(int(i) for i in ids)
    raise BoundaryError(
        f"model.{name}.{field}: the tokenizer has no token {text!r}; "
        f"check model.{name}.{field} or use a tokenizer of this model family"
    )


def resolve_boundary_ids(
    model: ModelDefinition, tokenizer: TokenizerLike, *, name: str = "model"
) -> BoundaryIds:
    """Resolve the think boundaries of ``model`` from ``tokenizer``.

    ``tokenizer`` may be a ``{token: id}`` mapping, an object with ``get_vocab()``, or one with
    ``encode()`` (needed when a boundary is a multi-token prose marker). Configured ids, when
    present, must agree with what the tokenizer says.

    >>> m = BUNDLED_MODELS["qwen3"]
    >>> resolve_boundary_ids(m, {"<think>": 151667, "</think>": 151668}).think_end
    (151668,)
    """
    # One get_vocab() call: a Hugging Face tokenizer builds a fresh vocab dict on every call.
    vocab = _vocab_of(tokenizer) or {}
    start = _resolve_one(model.think_start, vocab, tokenizer, "think_start", name)
    end = _resolve_one(model.think_end, vocab, tokenizer, "think_end", name)
    for field, got, want in (
        ("think_start_token_ids", start, model.think_start_token_ids),
        ("think_end_token_ids", end, model.think_end_token_ids),
    ):
        if want is not None and tuple(want) != got:
            raise BoundaryError(
                f"model.{name}.{field} is {list(want)} but the tokenizer maps it to {list(got)}; "
                f"remove the override or fix it"
            )
    if start == end:
        raise BoundaryError(
            f"model.{name}: think_start and think_end resolve to the same ids {list(start)}"
        )
    newlines = frozenset(int(vocab[t]) for t in ("\n", "Ċ", "\n\n", "ĊĊ") if t in vocab)
    return BoundaryIds(think_start=start, think_end=end, newline_ids=newlines)


def configured_boundary_ids(model: ModelDefinition, *, name: str = "model") -> BoundaryIds:
    """Boundary ids from the definition alone (when no tokenizer is at hand)."""
    if model.think_start_token_ids is None or model.think_end_token_ids is None:
        raise BoundaryError(
            f"model.{name} has no configured token ids for {model.think_start!r}/"
            f"{model.think_end!r}; pass a tokenizer so they can be resolved"
        )
    return BoundaryIds(tuple(model.think_start_token_ids), tuple(model.think_end_token_ids))


class TokenizerJsonVocab:
    """A ``get_vocab()`` view of a Hugging Face ``tokenizer.json`` read without transformers."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    @classmethod
    def from_dir(cls, directory: Path) -> TokenizerJsonVocab:
        """Read ``directory/tokenizer.json`` (its model vocab and added tokens)."""
        path = directory / "tokenizer.json" if directory.is_dir() else directory
        text = read_user_file(
            path, what="tokenizer.json", max_bytes=MAX_TOKENIZER_BYTES, error=BoundaryError
        )
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BoundaryError(f"--tokenizer: cannot read {path}: {exc}") from None
        vocab: dict[str, int] = {}
        try:
            model_vocab = data.get("model", {}).get("vocab", {})
            if isinstance(model_vocab, dict):
                vocab.update({str(k): int(v) for k, v in model_vocab.items()})
            elif isinstance(model_vocab, list):  # unigram: [[piece, score], ...]
                vocab.update({str(p[0]): i for i, p in enumerate(model_vocab)})
            for tok in data.get("added_tokens", []):
                vocab[str(tok["content"])] = int(tok["id"])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise BoundaryError(
                f"--tokenizer: {path} is not a Hugging Face tokenizer.json ({type(exc).__name__}: "
                f"{exc})"
            ) from None
        return cls(vocab)

    def get_vocab(self) -> Mapping[str, int]:
        return self._vocab
