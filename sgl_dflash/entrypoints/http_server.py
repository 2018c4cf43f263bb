"""The HTTP server: SGLang's native endpoints and (via `openai_api`) the OpenAI-compatible ones.

`create_app(tokenizer_manager)` builds the FastAPI app; `launch_server(server_args)` loads the
model and serves it with uvicorn. Response and stream shapes follow SGLang's http_server:
/generate returns {"text", "output_ids", "meta_info"} (a list for a batch) and streams
`data: {...}` events with cumulative text, ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_dflash.entrypoints.http_errors import (
    error_chunk,
    error_response,
    exception_response,
    is_openai_path,
    validation_error,
)
from sgl_dflash.entrypoints.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from sgl_dflash.entrypoints.protocol import AbortReqInput, GenerateReqInput, json_body, normalize
from sgl_dflash.entrypoints.streaming import SSE_DONE, merge_streams, parse_body, run_to_completion, sse
from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.managers.tokenizer_manager import TokenizerManager
from sgl_dflash.model_config import read_model_config
from sgl_dflash.sampling_params import SamplingParams
from sgl_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


# -- app ------------------------------------------------------------------------------------
def create_app(tokenizer_manager: TokenizerManager) -> FastAPI:
    tm = tokenizer_manager
    server_args = tm.server_args

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm.start()
        try:
            yield
        finally:
            tm.shutdown()

    app = FastAPI(title="sgl-dflash", lifespan=lifespan)
    app.state.tokenizer_manager = tm
    # Added last = runs first: oversized bodies are refused before the key is even checked.
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server_args.max_request_body_bytes)

    # Every error answers in the format of its API: SGLang's natively, OpenAI's on /v1/*.
    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return exception_response(validation_error(exc.errors(), openai=is_openai_path(request.url.path)),
                                  request.url.path)

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(GenerationError)
    async def _request_error(request: Request, exc: InvalidRequestError | GenerationError) -> JSONResponse:
        return exception_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, openai=is_openai_path(request.url.path))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500,
                              openai=is_openai_path(request.url.path))

    # -- native API ---------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if tm.is_alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy when a one-token generation completes."""
        if not tm.is_alive:
            return Response(status_code=503)
        request = GenerateRequest(
            rid=f"HEALTH_CHECK_{secrets.token_hex(8)}",
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            input_ids=[0],
        )
        try:
            req = tm.prepare(request)
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for _ in tm.generate(request, req):
                    pass
        except (TimeoutError, InvalidRequestError, GenerationError):
            logger.exception("health_generate failed")
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        config = read_model_config(server_args.model_path, "--model-path")
        return {
            "model_path": server_args.model_path,
            "served_model_name": tm.served_model_name,
            "tokenizer_path": None if server_args.skip_tokenizer_init else server_args.resolved_tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "speculative_algorithm": server_args.speculative_algorithm,
            "speculative_draft_model_path": server_args.speculative_draft_model_path,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        args = dataclasses.asdict(server_args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return {
            **args,
            "internal_states": [tm.get_internal_state()],
            "num_pending_http_requests": tm.num_pending(),
            "startup_time": tm.startup_time,
            "version": _version(),
        }

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if await tm.flush_cache():
            return Response(content="Cache flushed.\n", status_code=200)
        return error_response("Cache not flushed: requests are running or waiting.", 400)

    @app.post("/freeze_gc")
    async def freeze_gc() -> Response:
        frozen = await tm.freeze_gc()
        return Response(content=f"Froze {frozen} Python objects out of garbage collection.\n", status_code=200)

    @app.post("/abort_request", openapi_extra=json_body(AbortReqInput))
    async def abort_request(request: Request) -> Response:
        body = await parse_body(request, AbortReqInput)
        tm.abort(body.rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        tm.metrics.update_scheduler_gauges(tm.get_internal_state(), server_args.page_size)
        return Response(content=tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate", openapi_extra=json_body(GenerateReqInput))
    @app.put("/generate", openapi_extra=json_body(GenerateReqInput))
    async def generate(request: Request) -> Response:
        obj = await parse_body(request, GenerateReqInput)
        requests, is_batch = normalize(obj)
        reqs = [tm.prepare(r) for r in requests]  # all validated before any is scheduled
        if obj.stream:
            return StreamingResponse(_stream(tm, requests, reqs, is_batch), media_type="text/event-stream")
        outputs = await run_to_completion(tm, requests, reqs, request)
        return JSONResponse(outputs if is_batch else outputs[0])

    from sgl_dflash.entrypoints.openai_api import add_openai_routes
    from sgl_dflash.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

    add_openai_routes(app, tm)
    publish_body_schemas(app, [GenerateReqInput, AbortReqInput, CompletionRequest, ChatCompletionRequest])
    return app


# -- OpenAPI --------------------------------------------------------------------------------
# Routes parse their bodies themselves (`parse_body`: any content type, SGLang's or OpenAI's
# error format), so FastAPI does not see the body models: they are published here, so that
# /openapi.json (and clients or fuzzers generated from it) carry the same rules.
def publish_body_schemas(app: FastAPI, models: list[type]) -> None:
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _stream(
    tm: TokenizerManager, requests: list[GenerateRequest], reqs: list[Any], is_batch: bool
) -> AsyncIterator[bytes]:
    try:
        async for index, out in merge_streams(tm, requests, reqs):
            if is_batch:
                out = {**out, "index": index}
            yield sse(out)
    except (InvalidRequestError, GenerationError) as e:
        yield sse(error_chunk(e))
    yield SSE_DONE


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sgl-dflash")
    except PackageNotFoundError:
        return "unknown"


# -- serving --------------------------------------------------------------------------------
def launch_server(server_args: ServerArgs, tokenizer_manager: TokenizerManager | None = None) -> None:
    """Serve until interrupted (blocking); loads the model(s) unless a manager is given."""
    tm = tokenizer_manager if tokenizer_manager is not None else TokenizerManager(server_args)
    app = create_app(tm)
    logger.info("serving %s on http://%s:%d", server_args.model_path, server_args.host, server_args.port)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                timeout_keep_alive=5)
