"""Helpers shared by the native and OpenAI routes: parsing and validating a JSON body, running
prepared requests to completion, interleaving several streams (both under --request-timeout),
SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from sgl_dflash.entrypoints.http_errors import is_openai_path, validation_error
from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.managers.tokenizer_manager import TokenizerManager


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as `model` (whatever the content-type); `InvalidRequestError` names the
    problem: empty or malformed JSON (NaN and Infinity are not JSON), not an object, text that is not
    valid Unicode, unknown / missing / mistyped / out-of-range fields."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("the request body is empty (expected a JSON object)")
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise InvalidRequestError(f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise InvalidRequestError("malformed JSON in the request body: nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    bad = _lone_surrogate(data, "")
    if bad is not None:
        # Such text cannot be tokenized nor written back as UTF-8.
        raise InvalidRequestError(f"{bad or 'the body'}: the text contains an unpaired UTF-16 surrogate "
                                  "(not valid Unicode)", param=bad or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(), openai=is_openai_path(request.url.path)) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding an unpaired surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, path) if isinstance(key, str) else None
            if found is None:
                found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _timeout_error(timeout: float) -> GenerationError:
    # SGLang answers its request timeouts (SGLANG_REQ_WAITING/RUNNING_TIMEOUT) with 503.
    return GenerationError(f"Request timeout reached: not finished within {timeout:g} s "
                           "(--request-timeout)", 503)


async def run_to_completion(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any], request: Request | None
) -> list[dict[str, Any]]:
    """Final outputs of prepared requests run concurrently; on any failure, when the client
    disconnects, or when --request-timeout runs out, the rest are aborted."""
    timeout = tm.server_args.request_timeout

    async def last(r: GenerateRequest, req: Any) -> dict[str, Any]:
        out = None
        async for out in tm.generate(r, req):
            pass
        return out

    tasks = [asyncio.ensure_future(last(r, req)) for r, req in zip(requests, reqs)]
    outputs = asyncio.gather(*tasks)
    outputs.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
    # The body is read; the next ASGI message is the disconnect (event-driven, not polled).
    gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
    try:
        async with asyncio.timeout(timeout):  # None: no limit
            done, _ = await asyncio.wait([f for f in (outputs, gone) if f is not None],
                                         return_when=asyncio.FIRST_COMPLETED)
    except TimeoutError:
        raise _timeout_error(timeout) from None
    finally:
        for t in [*tasks, *([gone] if gone is not None else [])]:
            t.cancel()  # cancelling a request's task aborts it (TokenizerManager.generate)
    if outputs not in done:
        raise GenerationError("the client disconnected", 499)
    return list(outputs.result())


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def merge_streams(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any]
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave the output streams of several requests as (index, output); raises
    `GenerationError` (503) when --request-timeout runs out, after aborting them."""
    timeout = tm.server_args.request_timeout
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    if len(requests) == 1:
        return _one_stream(tm, requests[0], reqs[0], deadline, timeout)
    return _several_streams(tm, requests, reqs, deadline, timeout)


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - asyncio.get_running_loop().time()


async def _one_stream(
    tm: TokenizerManager, request: GenerateRequest, req: Any, deadline: float | None, timeout: float | None
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    # Driven by the consumer: a consumer that stops (the client went away) leaves the request
    # unfinished here, and closing this stream closes the request's, which aborts it.
    stream = tm.generate(request, req)
    try:
        while True:
            try:
                out = await asyncio.wait_for(anext(stream), _time_left(deadline))
            except StopAsyncIteration:
                return
            except TimeoutError:  # wait_for cancelled the request's stream: it was aborted
                raise _timeout_error(timeout) from None
            yield 0, out
    finally:
        await stream.aclose()


async def _several_streams(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any], deadline: float | None,
    timeout: float | None,
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
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
            try:
                i, item = await asyncio.wait_for(queue.get(), _time_left(deadline))
            except TimeoutError:
                raise _timeout_error(timeout) from None
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:  # cancelling a request's task aborts it (TokenizerManager.generate)
            t.cancel()
