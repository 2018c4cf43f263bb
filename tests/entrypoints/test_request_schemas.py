"""The request rules without a server (fast lane): the pydantic schemas, how their errors are
worded and located, the sampling-parameter mapping, the ASGI middleware (API key, body size
limit) and the new flags."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sgl_dflash.entrypoints.http_errors import field_path, validation_error
from sgl_dflash.entrypoints.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from sgl_dflash.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from sgl_dflash.entrypoints.protocol import GenerateReqInput, normalize
from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.launch_server import prepare_server_args


def refusal(model, body, *, openai=False):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value.errors(), openai=openai)


def test_field_paths_drop_union_member_tags():
    assert field_path(("messages", 0, "content", "list[ContentPart]", 1, "text")) == "messages[0].content[1].text"
    assert field_path(("body", "sampling_params", "SamplingParamsInput", "top_p")) == "sampling_params.top_p"
    assert field_path(("stop", "list[constrained-str]", 0)) == "stop[0]"


@pytest.mark.parametrize("body,param,needle", [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "greater than"),
    ({"text": "hi", "sampling_params": {"temperature": "0.5"}}, "sampling_params.temperature", "valid number"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens", "integer"),
    ({"text": "hi", "sampling_params": {"stop": ["a"] * 33}}, "sampling_params.stop", "at most 32"),
    ({"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus", "unknown field"),
    ({"input_ids": [1, -5]}, "input_ids[1]", "greater than"),
    ({"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num", "greater than"),
])
def test_native_schema_refusals_name_the_field(body, param, needle):
    error = refusal(GenerateReqInput, body)
    assert error.param == param and needle in str(error) and error.code is None
    assert "should be a valid list" not in str(error)  # the other union member's complaint is noise


@pytest.mark.parametrize("body,param,code", [
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 2.01}, "temperature",
     "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5},
     "frequency_penalty", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": True}, "n", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "extra": 1}, "extra", "unknown_parameter"),
])
def test_openai_schema_refusals_name_the_field(body, param, code):
    error = refusal(ChatCompletionRequest, body, openai=True)
    assert (error.param, error.code) == (param, code), str(error)


def test_missing_content_is_worded_like_openai():
    error = refusal(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}]}, openai=True)
    assert str(error) == "Missing required parameter: 'messages[0].content'."


def test_valid_bodies_and_sampling_params():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
        "temperature": 0, "top_p": 1, "stop": "x", "max_tokens": 5})
    assert chat.messages[0].text() == "ab"
    params = chat.sampling_params(5)
    assert (params.temperature, params.top_p, params.stop, params.max_new_tokens) == (0, 1, "x", 5)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    assert completion.max_tokens == 16 and completion.prompt == [[1, 2], [3]]


def test_sglang_frontend_defaults_pass_and_explicit_max_new_tokens_is_recorded():
    frontend = {"max_new_tokens": 16, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [],
                "stop_regex": [], "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
                "json_schema": None}
    (request,), is_batch = normalize(GenerateReqInput.model_validate({"text": "hi", "sampling_params": frontend}))
    assert not is_batch and request.max_new_tokens_explicit and request.sampling_params.max_new_tokens == 16
    (request,), _ = normalize(GenerateReqInput.model_validate({"text": "hi"}))
    assert not request.max_new_tokens_explicit and request.sampling_params.max_new_tokens == 128
    with pytest.raises(InvalidRequestError, match="min_p") as info:
        normalize(GenerateReqInput.model_validate({"text": "hi", "sampling_params": {"min_p": 0.2}}))
    assert info.value.param == "sampling_params.min_p"


# -- middleware -----------------------------------------------------------------------------
async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def _client(limit: int = 100, key: str = "sk-é") -> httpx.AsyncClient:
    app = Starlette(routes=[Route("/generate", _echo, methods=["POST"]), Route("/v1/completions", _echo,
                                                                                methods=["POST"])])
    wrapped = BodySizeLimitMiddleware(ApiKeyMiddleware(app, key), limit)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://test")


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("auth,status", [
    ("Bearer sk-é".encode(), 200), (b"Bearer sk-e", 401), (b"Bearer \xff\xfe", 401), (b"", 401),
    (b"sk-\xc3\xa9", 401), (b"bearer   sk-\xc3\xa9", 200),
])
def test_api_key_compared_as_bytes(auth, status):
    async def go():
        async with _client() as client:
            headers = {"Authorization": auth} if auth else {}
            return await client.post("/generate", content=b"{}", headers=headers)

    r = _run(go())
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["object"] == "error" and "API key" in r.json()["message"]


def test_body_size_limit_by_header_and_by_stream():
    async def chunks(n):
        for _ in range(n):
            yield b"x" * 30

    async def go():
        async with _client(limit=100) as client:
            auth = {"Authorization": "Bearer sk-é".encode()}
            small = await client.post("/generate", content=b"y" * 100, headers=auth)
            by_length = await client.post("/v1/completions", content=b"y" * 101, headers=auth)
            by_stream = await client.post("/generate", content=chunks(4), headers=auth)  # chunked, 120 bytes
            streamed_ok = await client.post("/generate", content=chunks(3), headers=auth)
            return small, by_length, by_stream, streamed_ok

    small, by_length, by_stream, streamed_ok = _run(go())
    assert small.status_code == 200 and small.json() == {"size": 100}
    assert by_length.status_code == 413 and by_length.json()["error"]["code"] == "request_too_large"
    assert by_stream.status_code == 413 and "--max-request-body-bytes" in by_stream.json()["message"]
    assert streamed_ok.status_code == 200 and streamed_ok.json() == {"size": 90}


def test_new_flags():
    args = prepare_server_args(["--model-path", "m", "--allow-auto-truncate", "--max-request-body-bytes", "1000",
                                "--request-timeout", "2.5"])
    assert (args.allow_auto_truncate, args.max_request_body_bytes, args.request_timeout) == (True, 1000, 2.5)
    defaults = prepare_server_args(["--model-path", "m"])
    assert not defaults.allow_auto_truncate and defaults.request_timeout is None
    assert json.loads(json.dumps(defaults.max_request_body_bytes)) == 32 * 1024 * 1024
