"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Requests (schemas and their rules: `openai_protocol.py`) map onto the same `GenerateRequest`s as
/generate. `model` must name the served model (or `default`), else 404 `model_not_found`.
Errors answer in OpenAI's format, naming the OpenAI field (`max_tokens`, `prompt`, `messages`).
Response and chunk shapes follow OpenAI (and SGLang's `matched_stop`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sgl_dflash.entrypoints.http_errors import error_chunk
from sgl_dflash.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from sgl_dflash.entrypoints.protocol import json_body, new_request_id
from sgl_dflash.entrypoints.streaming import SSE_DONE, merge_streams, parse_body, run_to_completion, sse
from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.managers.schedule_batch import Req
from sgl_dflash.managers.tokenizer_manager import TokenizerManager

# Model names every server answers to besides its own: SGLang's and OpenAI examples use "default".
MODEL_ALIASES = ("default",)
# Chat template arguments this server sets itself.
RESERVED_TEMPLATE_KWARGS = ("tokenize", "add_generation_prompt", "return_dict", "continue_final_message")


# -- helpers --------------------------------------------------------------------------------
def _finish_reason(meta_info: dict[str, Any]) -> tuple[str | None, Any]:
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None, None
    return reason.get("type"), reason.get("matched")


def _usage(outputs: list[dict[str, Any]]) -> dict[str, int]:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _delta(previous: str, text: str) -> str:
    """New text since `previous` (streamed text only grows; see TokenizerManager)."""
    if text.startswith(previous):
        return text[len(previous):]
    common = 0
    for a, b in zip(previous, text):
        if a != b:
            break
        common += 1
    return text[common:]


def _openai_names(e: InvalidRequestError, prompt_field: str, max_tokens_field: str) -> InvalidRequestError:
    """An admission error with the runtime's field names -> the same with the OpenAI request's."""
    param = e.param
    if param in ("input_ids", "text"):
        param = prompt_field
    elif param == "sampling_params.max_new_tokens":
        param = max_tokens_field
    elif param is not None and param.startswith("sampling_params."):
        param = param.removeprefix("sampling_params.")
    message = str(e).replace("sampling_params.max_new_tokens", max_tokens_field).replace("sampling_params.", "")
    return InvalidRequestError(message, e.status_code, param=param, code=e.code)


def add_openai_routes(app: FastAPI, tm: TokenizerManager) -> None:
    server_args = tm.server_args
    model_names = {tm.served_model_name, server_args.model_path, *MODEL_ALIASES}

    def check_model(body: _SamplingFields) -> None:
        if body.model not in model_names:
            raise InvalidRequestError(
                f"The model `{body.model}` does not exist (this server serves `{tm.served_model_name}`).",
                404, param="model", code="model_not_found")

    def make_request(body: _SamplingFields, rid: str, max_tokens: int | None) -> GenerateRequest:
        # No limit given: generate until the context is full (admission clips to the room left).
        limit = max_tokens if max_tokens is not None else tm.scheduler.max_req_len
        return GenerateRequest(rid=rid, sampling_params=body.sampling_params(limit), stream=body.is_stream,
                               max_new_tokens_explicit=max_tokens is not None)

    def prepare(requests: list[GenerateRequest], prompt_field: str, max_tokens_field: str) -> list[Req]:
        try:
            return [tm.prepare(r) for r in requests]  # all validated before any is scheduled
        except InvalidRequestError as e:
            raise _openai_names(e, prompt_field, max_tokens_field) from None

    def require_tokenizer(what: str, param: str) -> None:
        if tm.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer; this server runs with --skip-tokenizer-init",
                                      param=param)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": tm.served_model_name,
                "object": "model",
                "created": int(tm.startup_time),
                "owned_by": "sgl-dflash",
                "root": server_args.model_path,
                "max_model_len": tm.scheduler.max_req_len,
            }],
        }

    # -- completions ------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        check_model(body)
        body.check_unsupported()
        prompts = body.prompt
        if isinstance(prompts, str) or isinstance(prompts[0], int):
            prompts = [prompts]
        requests = []
        base_rid = body.rid or new_request_id()
        for i, prompt in enumerate(prompts):
            r = make_request(body, base_rid if len(prompts) == 1 else f"{base_rid}-{i}", body.max_tokens)
            if isinstance(prompt, str):
                require_tokenizer("a text prompt", "prompt")
                r.text = prompt
            else:
                r.input_ids = list(prompt)
            requests.append(r)
        reqs = prepare(requests, "prompt", "max_tokens")
        response_id = f"cmpl-{base_rid}"
        created = int(time.time())

        if not body.is_stream:
            outputs = await run_to_completion(tm, requests, reqs, request)
            choices = []
            for i, out in enumerate(outputs):
                reason, matched = _finish_reason(out["meta_info"])
                choices.append({"index": i, "text": out.get("text", ""), "logprobs": None,
                                "finish_reason": reason, "matched_stop": matched})
            return JSONResponse({"id": response_id, "object": "text_completion", "created": created,
                                 "model": body.model, "choices": choices, "usage": _usage(outputs)})

        async def stream() -> AsyncIterator[bytes]:
            sent = [""] * len(requests)
            finals: list[dict[str, Any]] = []
            try:
                async for i, out in merge_streams(tm, requests, reqs):
                    text = out.get("text", "")
                    delta, sent[i] = _delta(sent[i], text), text
                    reason, matched = _finish_reason(out["meta_info"])
                    if not delta and reason is None:
                        continue
                    choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
                    if reason is not None:
                        choice["matched_stop"] = matched
                        finals.append(out)
                    yield sse({"id": response_id, "object": "text_completion", "created": created,
                                "model": body.model, "choices": [choice]})
                if body.include_usage:
                    yield sse({"id": response_id, "object": "text_completion", "created": created,
                                "model": body.model, "choices": [], "usage": _usage(finals)})
            except (InvalidRequestError, GenerationError) as e:
                yield sse(error_chunk(e, openai=True))
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- chat completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        check_model(body)
        body.check_unsupported()
        require_tokenizer("chat completion", "messages")
        if getattr(tm.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the tokenizer has no chat template; use /v1/completions", param="messages")
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, max_tokens_field)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
        try:
            prompt = tm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
            if not isinstance(prompt, str):
                raise TypeError(f"the template returned {type(prompt).__name__}, not text")
            # The template already holds BOS etc.: do not add special tokens a second time.
            input_ids = tm.tokenizer.encode(prompt, add_special_tokens=False)
        except Exception as e:  # jinja errors (e.g. a role the template refuses), odd kwargs
            raise InvalidRequestError(f"could not apply the chat template: {type(e).__name__}: {e}",
                                      param="messages") from None
        rid = body.rid or new_request_id()
        r = make_request(body, rid, max_tokens)
        r.input_ids = input_ids
        (req,) = prepare([r], "messages", max_tokens_field)
        response_id = f"chatcmpl-{rid}"
        created = int(time.time())

        if not body.is_stream:
            (out,) = await run_to_completion(tm, [r], [req], request)
            reason, matched = _finish_reason(out["meta_info"])
            choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                      "logprobs": None, "finish_reason": reason, "matched_stop": matched}
            return JSONResponse({"id": response_id, "object": "chat.completion", "created": created,
                                 "model": body.model, "choices": [choice], "usage": _usage([out])})

        def chunk(delta: dict[str, Any], reason: str | None = None, **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, **extra}
            return sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                         "model": body.model, "choices": [choice]})

        async def stream() -> AsyncIterator[bytes]:
            sent = ""
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for _, out in merge_streams(tm, [r], [req]):
                    delta, sent = _delta(sent, out["text"]), out["text"]
                    if delta:
                        yield chunk({"content": delta})
                    reason, matched = _finish_reason(out["meta_info"])
                    if reason is not None:
                        yield chunk({}, reason, matched_stop=matched)
                        if body.include_usage:
                            yield sse({"id": response_id, "object": "chat.completion.chunk",
                                        "created": created, "model": body.model, "choices": [],
                                        "usage": _usage([out])})
            except (InvalidRequestError, GenerationError) as e:
                yield sse(error_chunk(e, openai=True))
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")
