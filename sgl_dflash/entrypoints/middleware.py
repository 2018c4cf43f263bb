"""ASGI middleware in front of every route: the API key and the request size limit.

Both are pure ASGI (not Starlette's BaseHTTPMiddleware) so that client disconnects still reach
streaming responses; both answer in the error format of the path (OpenAI's on /v1/*).
"""

from __future__ import annotations

import hmac
from typing import Any

from sgl_dflash.entrypoints.http_errors import error_response, is_openai_path

# Open without an API key, like SGLang (probes and Prometheus scrapes carry no secrets).
UNAUTHENTICATED_PREFIXES = ("/health", "/ready", "/metrics")


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but health/metrics. The key is compared in
    constant time (hmac.compare_digest on bytes: any header byte is allowed, none raises)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key.encode("utf-8")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(
            UNAUTHENTICATED_PREFIXES
        ):
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            problem = "missing API key" if not auth else "invalid API key"
            openai = is_openai_path(scope["path"])
            response = error_response(f"Unauthorized: {problem} (send 'Authorization: Bearer <key>')", 401,
                                      openai=openai, code="invalid_api_key" if openai else None)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413 (--max-request-body-bytes): at once when
    Content-Length says so, else as soon as the received bytes pass the limit. The body is read
    here (routes read it whole anyway) and handed on; later `receive` calls (disconnects) pass."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the body ended
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        response = error_response(f"the request body is larger than the server's limit of {self.max_bytes} "
                                  "bytes (--max-request-body-bytes)", 413, openai=is_openai_path(scope["path"]),
                                  code="request_too_large" if is_openai_path(scope["path"]) else None)
        await response(scope, receive, send)


def _replay(messages: list[dict], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
