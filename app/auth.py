"""Bearer-token check for the API routes, as a pure ASGI middleware (no per-request overhead
from BaseHTTPMiddleware, and streaming responses pass through untouched)."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import APIError

PROTECTED_PREFIXES = ("/v1/",)
PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/score"})


def is_protected(path: str) -> bool:
    return path in PROTECTED_PATHS or path.startswith(PROTECTED_PREFIXES)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        from app.responses import error_response

        await error_response(APIError.unauthorized())(scope, receive, send)
