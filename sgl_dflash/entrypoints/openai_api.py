"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Requests map onto the same `GenerateRequest`s as /generate. OpenAI fields this server does not
implement are accepted only at their neutral value and refused by name otherwise; unknown
fields are refused. Response and chunk shapes follow OpenAI (and SGLang's `matched_stop`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from sgl_dflash.entrypoints.protocol import is_neutral, to_sampling_params
from sgl_dflash.entrypoints.streaming import SSE_DONE, error_chunk, merge_streams, parse_body, run_to_completion, sse
from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.managers.tokenizer_manager import TokenizerManager
from sgl_dflash.sampling_params import SamplingParams

# OpenAI fields that are accepted only when they ask for nothing (value -> allowed values).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None,),
    "seed": (None,),
    "logit_bias": (None,),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "response_format": (None,),
    "continue_final_message": (None, False),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat: OpenAI's plus SGLang's sampling extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    rid: str | None = None

    def check_unsupported(self) -> None:
        for name, allowed in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name, None)
            if not is_neutral(value, allowed):
                raise InvalidRequestError(f"'{name}'={value!r} is not supported by this server")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        params = {
            "max_new_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "min_new_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        try:
            return to_sampling_params(params, where="request")
        except InvalidRequestError as e:  # name the OpenAI field, not its SGLang counterpart
            message = str(e).replace("request.max_new_tokens", "max_tokens")
            raise InvalidRequestError(message.replace("request.min_new_tokens", "min_tokens").replace("request.", "")) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False


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


def add_openai_routes(app: FastAPI, tm: TokenizerManager) -> None:
    server_args = tm.server_args

    def prompt_room_params(req_fields: _SamplingFields, max_tokens: int | None) -> SamplingParams:
        # No limit given: generate until the context is full (admission clips to the room left).
        limit = max_tokens if max_tokens is not None else tm.scheduler.max_req_len
        return req_fields.sampling_params(limit)

    def require_tokenizer(what: str) -> None:
        if tm.tokenizer is None:
            raise InvalidRequestError(f"{what} needs a tokenizer; this server runs with --skip-tokenizer-init")

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
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        body.check_unsupported()
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("the prompt is empty")
        params = prompt_room_params(body, body.max_tokens)
        requests = []
        base_rid = body.rid or uuid.uuid4().hex
        for i, prompt in enumerate(prompts):
            r = GenerateRequest(rid=base_rid if len(prompts) == 1 else f"{base_rid}-{i}",
                                sampling_params=SamplingParams(**params.to_dict()), stream=body.stream)
            if isinstance(prompt, str):
                require_tokenizer("a text prompt")
                r.text = prompt
            else:
                r.input_ids = list(prompt)
            requests.append(r)
        reqs = [tm.prepare(r) for r in requests]
        response_id = f"cmpl-{base_rid}"
        created = int(time.time())

        if not body.stream:
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
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({"id": response_id, "object": "text_completion", "created": created,
                                "model": body.model, "choices": [], "usage": _usage(finals)})
            except (InvalidRequestError, GenerationError) as e:
                yield sse(error_chunk(e))
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    # -- chat completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        body.check_unsupported()
        require_tokenizer("chat completion")
        if not body.messages:
            raise InvalidRequestError("'messages' is empty")
        if getattr(tm.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the tokenizer has no chat template; use /v1/completions")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tm.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **(body.chat_template_kwargs or {})
            )
        except Exception as e:  # jinja errors (e.g. a role the template refuses)
            raise InvalidRequestError(f"could not apply the chat template: {e}") from None
        # The template already holds BOS etc.: do not add special tokens a second time.
        input_ids = tm.tokenizer.encode(prompt, add_special_tokens=False)
        rid = body.rid or uuid.uuid4().hex
        r = GenerateRequest(rid=rid, sampling_params=prompt_room_params(body, max_tokens),
                            input_ids=input_ids, stream=body.stream)
        req = tm.prepare(r)
        response_id = f"chatcmpl-{rid}"
        created = int(time.time())

        if not body.stream:
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
                        if body.stream_options and body.stream_options.include_usage:
                            yield sse({"id": response_id, "object": "chat.completion.chunk",
                                        "created": created, "model": body.model, "choices": [],
                                        "usage": _usage([out])})
            except (InvalidRequestError, GenerationError) as e:
                yield sse(error_chunk(e))
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")
