"""Helpers shared by the native and OpenAI routes: running prepared requests to completion,
interleaving several streams, SSE framing and the error body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.managers.tokenizer_manager import TokenizerManager


def error_response(message: str, status_code: int) -> JSONResponse:
    """SGLang's ErrorResponse shape (also what OpenAI clients read `message` from)."""
    phrase = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 500: "InternalServerError",
              503: "ServiceUnavailable"}.get(status_code, str(status_code))
    return JSONResponse(
        status_code=status_code,
        content={"object": "error", "message": message, "type": phrase, "param": None, "code": status_code},
    )


def error_chunk(e: InvalidRequestError | GenerationError) -> dict[str, Any]:
    """The error event a stream ends with when its request fails after the response started."""
    kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
    return {"error": {"message": str(e), "type": kind, "code": e.status_code}}


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """Pydantic errors -> one readable line naming each offending field once."""
    messages: dict[str, str] = {}
    for err in errors:
        # Union members add a type name to the path ("input_ids.list[int]"): drop those.
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_name(x)]
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            messages.setdefault(".".join(loc), f"unknown field '{'.'.join(loc)}'")
        elif kind == "missing":
            messages.setdefault(".".join(loc), f"missing required field '{'.'.join(loc)}'")
        elif not loc:
            messages.setdefault("", f"invalid request body ({err.get('msg', '')})")
        else:
            field = loc[0]  # unions report one error per member type: keep the first
            messages.setdefault(field, f"field '{'.'.join(loc)}': {err.get('msg', '')}")
    return "; ".join(messages.values()) or "invalid request"


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "ContentPart")
    )


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as `model` (whatever the content-type); `InvalidRequestError` names the
    problem: empty or malformed JSON, not an object, unknown / missing / mistyped fields."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("the request body is empty (expected a JSON object)")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"malformed JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise InvalidRequestError(describe_validation_errors(e.errors())) from None


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def run_to_completion(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any], request: Request | None
) -> list[dict[str, Any]]:
    """Final outputs of prepared requests run concurrently; on any failure the rest are aborted."""
    is_disconnected = request.is_disconnected if request is not None else None

    async def last(r: GenerateRequest, req: Any) -> dict[str, Any]:
        out = None
        async for out in tm.generate(r, req, is_disconnected):
            pass
        if out is None:
            raise GenerationError("the client disconnected", 499)
        return out

    tasks = [asyncio.ensure_future(last(r, req)) for r, req in zip(requests, reqs)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def merge_streams(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any]
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave the output streams of several requests as (index, output)."""
    if len(requests) == 1:
        async for out in tm.generate(requests[0], reqs[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int) -> None:
        try:
            async for out in tm.generate(requests[i], reqs[i]):
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(requests))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
