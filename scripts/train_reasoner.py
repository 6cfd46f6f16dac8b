# mypy: disable-error-code="import-not-found"
"""Train the small reasoner: a Qwen3-architecture model that really reasons, on CPU.

The task is ``meridian.bench.reasoner_task`` (a running sum mod 10, stepped in
the reasoning, counted down to 00, then the answer). The tokenizer is character-level (its own,
with ``<think>``/``</think>`` as special tokens and a Qwen-style chat template whose generation
prompt opens the think block, as DeepSeek-R1's does). Training is deterministic for a seed (one
thread order: ``torch.use_deterministic_algorithms``), takes about 10-20 minutes on 2 cores, and
writes the model, its tokenizer and ``training-log.txt`` (the provenance) to ``--out``.

Run: ``.venv-vllm/bin/python scripts/train_reasoner.py --out models/sum-reasoner``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from meridian.bench.reasoner_task import MAX_STEPS, Problem, problems  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz =;:,.?!+-*/()\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
VOCAB_SIZE = 512  # embedding rows (the tokenizer uses the first ~60)
SETTINGS: dict[str, Any] = {
    "seed": 0,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "batch_size": 32,
    "learning_rate": 3e-3,
    "warmup_steps": 100,
    "max_steps": 1500,
    "eval_every": 250,
    "eval_problems": 256,
    "stop_at_exact": 0.995,
}


def build_tokenizer(out: Path) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_bytes = _byte_level_map()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in ALPHABET:
        vocab[to_bytes[ch]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # The think markers are added tokens but not special ones (as in Qwen3's tokenizer): vLLM
    # detokenizes with skip_special_tokens, and a special </think> would vanish from the text
    # its reasoning parser splits (the whole reply would read as reasoning).
    markers = ("<think>", "</think>")
    tok.add_special_tokens([t for t in SPECIALS if t not in markers])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def _byte_level_map() -> dict[str, str]:
    """GPT-2's byte-level characters (what ``ByteLevel`` turns each byte into), for the
    characters of the alphabet (all ASCII: one byte each)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return {ch: table[ord(ch)] for ch in ALPHABET}


def encode(tokenizer: Any, problem: Problem) -> tuple[list[int], int]:
    """Token ids of the whole conversation, and where the assistant's generation starts."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.prompt()}], tokenize=False, add_generation_prompt=True
    )
    completion = f"{problem.reasoning()}\n</think>\n\n{problem.answer}<|im_end|>"
    head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return head + tail, len(head)


def main() -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "sum-reasoner")
    parser.add_argument("--max-steps", type=int, default=SETTINGS["max_steps"])
    args = parser.parse_args()
    settings = {**SETTINGS, "max_steps": args.max_steps}
    out: Path = args.out
    torch.manual_seed(settings["seed"])
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    tokenizer = build_tokenizer(out)
    pad = tokenizer.pad_token_id
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=settings["hidden_size"],
        intermediate_size=settings["intermediate_size"],
        num_hidden_layers=settings["num_hidden_layers"],
        num_attention_heads=settings["num_attention_heads"],
        num_key_value_heads=settings["num_key_value_heads"],
        head_dim=settings["head_dim"],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["learning_rate"],
                                  weight_decay=0.01, betas=(0.9, 0.98))  # fmt: skip
    held_out = problems(settings["eval_problems"], seed=10_000 + settings["seed"])

    def batch(items: list[Problem]) -> tuple[Any, Any, Any]:
        encoded = [encode(tokenizer, p) for p in items]
        width = max(len(ids) for ids, _ in encoded)
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        labels = torch.full((len(items), width), -100, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, (seq, start) in enumerate(encoded):
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, start : len(seq)] = torch.tensor(seq[start:])
            mask[row, : len(seq)] = 1
        return ids, labels, mask

    def evaluate() -> tuple[float, float]:
        """Teacher-forced: the share of assistant tokens predicted right, and of problems whose
        every assistant token is right (greedy decoding then reproduces them exactly)."""
        model.eval()
        right = total = exact = 0
        with torch.no_grad():
            for i in range(0, len(held_out), 64):
                ids, labels, mask = batch(held_out[i : i + 64])
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                target = labels[:, 1:]
                hit = (logits.argmax(-1) == target) | (target == -100)
                right += int(((logits.argmax(-1) == target) & (target != -100)).sum())
                total += int((target != -100).sum())
                exact += int(hit.all(dim=1).sum())
        model.train()
        return right / total, exact / len(held_out)

    log_lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        log_lines.append(line)

    log(f"settings: {json.dumps(settings, sort_keys=True)}")
    log(f"parameters: {sum(p.numel() for p in model.parameters()):,}; torch {torch.__version__}")
    start = time.perf_counter()
    step_seed = settings["seed"] * 1_000_003
    for step in range(1, settings["max_steps"] + 1):
        lr_scale = (
            min(1.0, step / settings["warmup_steps"])
            * 0.5
            * (1 + math.cos(math.pi * step / settings["max_steps"]))
        )
        for group in optimizer.param_groups:
            group["lr"] = settings["learning_rate"] * max(lr_scale, 0.02)
        ids, labels, mask = batch(problems(settings["batch_size"], seed=step_seed + step))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            log(f"step {step} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)")
        if step % settings["eval_every"] == 0 or step == settings["max_steps"]:
            token_acc, exact = evaluate()
            log(f"eval step {step}: token accuracy {token_acc:.4f}, exact {exact:.4f}")
            if exact >= settings["stop_at_exact"]:
                log(f"stopped at step {step}: exact {exact:.4f} >= {settings['stop_at_exact']}")
                break
    log(f"trained in {time.perf_counter() - start:.0f} s; max steps of a problem {MAX_STEPS}")
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "training-log.txt").write_text("\n".join(log_lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
