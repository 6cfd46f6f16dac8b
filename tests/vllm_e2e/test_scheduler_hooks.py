# mypy: disable-error-code="import-not-found"
"""MeridianScheduler's hooks on vLLM's own ``Scheduler`` (either line, no model needed): how it
sizes admission against vLLM's other queues, and requests that reach it without add_request.

Built as the simulator builds it (:mod:`meridian.sim.vllm_engine`), with the simulator's
reasoning model (ids from :mod:`meridian.sim.streams`); the peer suite (``tests/vllm_peer``)
runs vLLM's own scheduler tests the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from meridian.config import MeridianConfig
from meridian.core.types import Phase
from meridian.sim.engine import EngineConfig
from meridian.sim.streams import EOS_ID, SIM_FORMAT, THINK_START_ID
from meridian.sim.vllm_engine import (
    build_vllm_config,
    kv_cache_config,
    model_directory,
)
from meridian.vllm.runtime import MeridianRuntime
from meridian.vllm.scheduler import MeridianScheduler

THINK_PROMPT = [11, 12, THINK_START_ID]


def scheduler(tmp_path: Path, **engine: Any) -> MeridianScheduler:
    config = EngineConfig(**{"num_kv_blocks": 64, **engine})
    vllm_config = build_vllm_config(config, model_directory(tmp_path), priority=False)
    runtime = MeridianRuntime(MeridianConfig(), None, "sim", SIM_FORMAT, None, "test")
    return MeridianScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config(config),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size_tokens,
        log_stats=False,
        meridian_runtime=runtime,
    )


def request(rid: str, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_ID)
    return Request(rid, THINK_PROMPT, params, None)


def test_paused_streaming_sessions_do_not_use_up_what_headroom_admits(tmp_path: Path) -> None:
    # Four short requests fit the cache at their bounds: Meridian admits them all. vLLM counts
    # its paused streaming sessions with the running requests against max_num_active_reqs; the
    # cap Meridian sets for the step must count them too, or two sessions would keep two of the
    # four out.
    sched = scheduler(tmp_path)
    for i in range(4):
        sched.add_request(request(f"r{i}"))
    sched.num_waiting_for_streaming_input = 2
    output = sched.schedule()
    assert sorted(output.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]
    assert sched.meridian_policy_errors == 0


def _by_hand(sched: MeridianScheduler) -> Request:
    """A running request put into the scheduler by hand, as vLLM's own tests do, after one step
    of output for it."""
    req = request("r")
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    sched.requests[req.request_id] = req
    sched.running.append(req)
    step = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"r": 1},
        total_num_scheduled_tokens=1,
        scheduled_encoder_inputs={},
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    sched.update_from_output(
        step, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]])
    )
    return req


def test_a_request_that_skipped_add_request_is_tracked_at_its_first_tokens(
    tmp_path: Path,
) -> None:
    # vLLM adds requests only through add_request, but its own tests put them into `requests`
    # and `running` by hand. Meridian tracks such a request when it first gets tokens, its
    # output so far included; nothing fails open.
    sched = scheduler(tmp_path)
    _by_hand(sched)
    assert sched.meridian_policy_errors == 0
    assert sched.meridian_num_tracked == 1 and sched.meridian_policy.phase("r") is Phase.THINK
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.meridian_num_tracked == 0


def test_a_fault_while_tracking_such_a_request_fails_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tracking it happens while the step's tokens are handled: a fault there (here the policy's
    # clock) is counted, and vLLM's step goes on.
    sched = scheduler(tmp_path)

    def broken() -> float:
        raise RuntimeError("clock")

    monkeypatch.setattr(sched.meridian_policy, "clock", broken)
    _by_hand(sched)
    assert sched.meridian_policy_errors >= 1 and sched.meridian_num_tracked == 0


def test_a_request_whose_tracking_fails_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The requests added since the last step are tracked in one batch under one guard; when one
    # fails, the error names it, and the others, before and after it, are tracked.
    sched = scheduler(tmp_path)
    track = sched.meridian_policy.track

    def track_but_r2(request_id: str, *args: Any) -> None:
        if request_id == "r2":
            raise RuntimeError("broken request")
        track(request_id, *args)

    monkeypatch.setattr(sched.meridian_policy, "track", track_but_r2)
    for i in range(5):
        sched.add_request(request(f"r{i}"))
    with caplog.at_level("ERROR", logger="meridian"):
        sched.schedule()
    assert sched.meridian_policy_errors == 1
    assert "request=r2" in caplog.text
    assert sched.meridian_num_tracked == 4
    assert [sched.meridian_policy.phase(f"r{i}") for i in (0, 1, 3, 4)] == [Phase.THINK] * 4
