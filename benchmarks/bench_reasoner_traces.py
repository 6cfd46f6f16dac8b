# mypy: disable-error-code="import-not-found"
"""Per-token think-entropy traces of the small trained reasoner, next to the simulator's.

For problems of ``meridian.bench.reasoner_task`` drawn with seed 777 (a seed training never drew),
``models/sum-reasoner`` reasons greedily under transformers (torch, CPU) and every think token's
entropy is computed from the full logits row with the core's ``entropy_nats``: the vocabulary is
512 entries, so this is the exact entropy of the distribution the token was drawn from, the one
Meridian's logits processor sees (vLLM's logits before temperature). Also the paper's EAT signal
(arXiv:2509.26522): the entropy of the answer token after cutting the reasoning at a step boundary
and appending ``\\n</think>\\n\\n`` (the training format), whether that answer is right, and
whether it is the value of the last step done.

Printed and written to ``--out`` (default ``meridian-out/reasoner-traces``): ``traces.json``
(every chain's think text and entropies), ``traces.md`` (the statistics of
:func:`meridian.bench.entropy_traces.trace_stats` for the model's traces and for the simulator's
entropy model at the same chain lengths, and the after-``</think>`` probe).

Run: ``.venv-vllm/bin/python benchmarks/bench_reasoner_traces.py [--problems 100]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meridian.bench.entropy_traces import comparison_markdown, simulated_traces, trace_stats
from meridian.bench.reasoner_task import Problem, problems
from meridian.core.entropy import entropy_nats

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sum-reasoner"
SEED = 777
STEP_TOKENS = 5  # "CC X;": two countdown digits, a space, the value, ";"


def _prompt_ids(tokenizer: Any, problem: Problem) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.prompt()}], tokenize=False, add_generation_prompt=True
    )
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def record_chain(model: Any, tokenizer: Any, problem: Problem, end_id: int) -> dict[str, Any]:
    """Greedy reasoning of one problem: think tokens, their entropies, the answer."""
    prompt = _prompt_ids(tokenizer, problem)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=400, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    generated = out.sequences[0, len(prompt) :].tolist()
    entropy = entropy_nats(torch.cat(out.logits).float().numpy())
    n = generated.index(end_id) if end_id in generated else len(generated)
    answer = tokenizer.decode(generated[n + 1 :], skip_special_tokens=True).strip()
    return {
        "problem": problem.prompt(),
        "steps": problem.n,
        "prompt_ids": prompt,
        "think_ids": generated[:n],
        "think_tokens": [tokenizer.decode([t]) for t in generated[:n]],
        "entropy": [float(h) for h in entropy[:n]],
        "answer": answer,
        "correct": answer == problem.answer,
    }


def after_think_probe(model: Any, tokenizer: Any, chain: dict[str, Any], problem: Problem) -> Any:
    """At every step boundary k (k of n steps done): the entropy of the answer token after
    ``\\n</think>\\n\\n``, and whether the model's answer there is right (one padded batch)."""
    suffix = tokenizer("\n</think>\n\n", add_special_tokens=False)["input_ids"]
    cuts = range(1, problem.n)
    rows = [chain["prompt_ids"] + chain["think_ids"][: STEP_TOKENS * k] + suffix for k in cuts]
    if not rows:
        return []
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    last = torch.tensor([len(r) - 1 for r in rows])
    answer_logits = logits[torch.arange(len(rows)), last].float().numpy()
    entropy = entropy_nats(answer_logits)
    picks = answer_logits.argmax(axis=1).tolist()
    values = problem.values()
    return [
        {
            "steps_done": k,
            "entropy": float(h),
            "right": tokenizer.decode([t]) == problem.answer,
            "last_value": tokenizer.decode([t]) == str(values[k - 1]),
        }
        for k, h, t in zip(cuts, entropy.tolist(), picks, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("meridian-out/reasoner-traces"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL)).eval()
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    print(f"vocabulary: {model.config.vocab_size} logits per token (the entropy is exact)")
    start = time.perf_counter()
    items = problems(args.problems, seed=SEED)
    chains, probes = [], []
    for problem in items:
        chain = record_chain(model, tokenizer, problem, end_id)
        chains.append(chain)
        probes += after_think_probe(model, tokenizer, chain, problem)
    print(f"{len(chains)} chains recorded in {time.perf_counter() - start:.0f} s; "
          f"{sum(c['correct'] for c in chains)} answered right")  # fmt: skip

    traces = [np.array(c["entropy"], dtype=np.float32) for c in chains]
    recorded = trace_stats(traces, tokens=[c["think_tokens"] for c in chains])
    simulated = trace_stats(simulated_traces([len(t) for t in traces], seed=SEED))
    table = comparison_markdown(
        [("sum-reasoner (recorded)", recorded), ("entropy model, same lengths", simulated)]
    )
    right = [p["entropy"] for p in probes if p["right"]]
    wrong = [p["entropy"] for p in probes if not p["right"]]

    def spread(values: list[float]) -> str:
        if not values:
            return "none"
        return (f"{len(values)} cuts, mean {np.mean(values):.3g}, max {np.max(values):.3g} nats; "
                f"{sum(v < 0.001 for v in values) / len(values):.1%} under 0.001 nats")  # fmt: skip

    last = sum(p["last_value"] for p in probes) / max(len(probes), 1)
    probe_text = (
        "After-</think> probe (the paper's EAT signal) at every step boundary:\n"
        f"- answer right there: {spread(right)}\n- answer wrong there: {spread(wrong)}\n"
        f"- the answer is the value of the last step done at {last:.1%} of the cuts\n"
    )
    print(table)
    print(probe_text)
    args.out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in c.items() if k not in ("prompt_ids", "think_ids")} for c in chains]
    data = {"model": str(MODEL), "seed": SEED, "chains": slim, "after_think": probes}
    (args.out / "traces.json").write_text(json.dumps(data) + "\n", encoding="utf-8")
    (args.out / "traces.md").write_text(
        f"# Think-entropy traces: {MODEL.name}, seed {SEED}\n\n{table}\n{probe_text}",
        encoding="utf-8",
    )
    if any(math.isnan(v) for v in (recorded.mean, simulated.mean)):
        raise SystemExit("no think tokens recorded")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
