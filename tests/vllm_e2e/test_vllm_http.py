# mypy: disable-error-code="import-not-found"
"""The knob-check middleware against vLLM's own request models, route by route: for every route
that takes ``vllm_xargs``, a body vLLM's model for that route accepts turns
``"meridian_max_think_tokens": true`` into a cap of 1, and the middleware answers that body
with HTTP 400. Runs on both lines (the 0.33 GPU wheel's request models import on this machine;
its routers need packages its --no-deps install lacks, so the route list is read on 0.32)."""

from __future__ import annotations

import importlib
import io
import json
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian.vllm.http import knob_error
from meridian.vllm.runtime import RequestArgsError, parse_request_budget

XARGS = {"meridian_max_think_tokens": True}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": XARGS}
COMPLETION = {"model": "m", "prompt": "hi", "vllm_xargs": XARGS}
MESSAGES = {"model": "m", "max_tokens": 8, **CHAT}
RESPONSES = {"model": "m", "input": "hi", "vllm_xargs": XARGS}
BATCH = {**CHAT, "messages": [CHAT["messages"], CHAT["messages"]]}


def _chat(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(body).vllm_xargs


def _completion(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest.model_validate(body).vllm_xargs


def _batch(body: dict[str, Any]) -> Any:
    """The batch model keeps vllm_xargs as an extra field; each conversation's request is
    validated from it."""
    from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest

    batch = BatchChatCompletionRequest.model_validate(body)
    return batch.to_chat_completion_request(body["messages"][0]).vllm_xargs


def _messages(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    return AnthropicMessagesRequest.model_validate(body).vllm_xargs


def _responses(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest.model_validate(body).vllm_xargs


def _audio(kind: str) -> Callable[[dict[str, Any]], Any]:
    def validate(form: dict[str, Any]) -> Any:
        from starlette.datastructures import UploadFile

        module = importlib.import_module(f"vllm.entrypoints.speech_to_text.{kind}.protocol")
        model = getattr(module, f"{kind.capitalize()}Request")
        upload = UploadFile(io.BytesIO(b"RIFF....WAVE"), filename="a.wav")
        return model.model_validate({**form, "file": upload}).vllm_xargs

    return validate


# (path, body, how vLLM's model for that route reads the body's vllm_xargs). /invocations
# (SageMaker) takes a chat or a completion body, by shape.
JSON_ROUTES: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], Any]]] = [
    ("/v1/chat/completions", CHAT, _chat),
    ("/v1/completions", COMPLETION, _completion),
    ("/v1/chat/completions/batch", BATCH, _batch),
    ("/v1/chat/completions/render", CHAT, _chat),
    ("/v1/completions/render", COMPLETION, _completion),
    ("/v1/messages", MESSAGES, _messages),
    ("/v1/messages/render", MESSAGES, _messages),
    ("/v1/responses", RESPONSES, _responses),
    ("/v1/responses/render", RESPONSES, _responses),
    ("/invocations", CHAT, _chat),
    ("/invocations", COMPLETION, _completion),
]
FORM_ROUTES = [
    ("/v1/audio/transcriptions", _audio("transcription")),
    ("/v1/audio/translations", _audio("translation")),
]


@pytest.mark.parametrize(
    ("path", "body", "read"), JSON_ROUTES, ids=[f"{p}:{b is CHAT}" for p, b, _ in JSON_ROUTES]
)
def test_a_bool_cap_is_refused_on_every_json_route(
    path: str, body: dict[str, Any], read: Callable[[dict[str, Any]], Any]
) -> None:
    # The hole: vLLM's model for the route accepts the body and makes the bool a cap of 1.
    assert read(body) == {"meridian_max_think_tokens": 1}
    assert read({**body, "vllm_xargs": {"meridian_max_think_tokens": 8}}) is not None
    raw = json.dumps(body).encode()
    assert (
        knob_error(raw)
        == "vllm_xargs.meridian_max_think_tokens must be a positive integer; got true"
    )


@pytest.mark.parametrize(("path", "read"), FORM_ROUTES, ids=[p for p, _ in FORM_ROUTES])
def test_a_bool_cap_is_refused_on_the_audio_routes(
    path: str, read: Callable[[dict[str, Any]], Any]
) -> None:
    import httpx

    form = {"model": "m", "vllm_xargs": json.dumps(XARGS)}
    assert read(form) == {"meridian_max_think_tokens": 1}
    request = httpx.Request(
        "POST", f"http://h{path}", data=form, files={"file": ("a.wav", b"RIFF....WAVE")}
    )
    assert knob_error(request.read(), request.headers["content-type"]) is not None


def test_the_generate_route_keeps_the_bool_for_validate_params() -> None:
    """/inference/v1/generate takes SamplingParams whole: extra_args keep a JSON bool, which
    the logits processor's validate_params refuses (HTTP 400); the middleware need not look."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    request = GenerateRequest.model_validate(
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "extra_args": XARGS}}
    )
    assert request.sampling_params.extra_args == XARGS
    with pytest.raises(RequestArgsError, match="must be a positive integer; got True"):
        parse_request_budget(request.sampling_params.extra_args)


def test_every_route_whose_model_takes_vllm_xargs_is_in_the_tables() -> None:
    """vLLM's routers, read: each POST route whose body model declares vllm_xargs has a body in
    the tables above (a later vLLM's new route fails here until one is added)."""
    import vllm.entrypoints as entrypoints
    from fastapi.routing import APIRoute

    declared: set[str] = set()
    for info in pkgutil.walk_packages(entrypoints.__path__, "vllm.entrypoints."):
        if not info.name.endswith(".api_router"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:
            pytest.skip(f"vLLM's routers do not import here ({exc}); read on the 0.32 line")
        routers = [v for v in vars(module).values() if type(v).__name__ == "APIRouter"]
        for route in (r for router in routers for r in router.routes):
            if not isinstance(route, APIRoute) or "POST" not in route.methods:
                continue
            for param in route.dependant.body_params:
                fields = getattr(param.field_info.annotation, "model_fields", {})
                if "vllm_xargs" in fields:
                    declared.add(route.path)
    covered = {path for path, _, _ in JSON_ROUTES} | {path for path, _ in FORM_ROUTES}
    assert declared, "no route found: vLLM's routers moved"
    assert declared <= covered, sorted(declared - covered)
