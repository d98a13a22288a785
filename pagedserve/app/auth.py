"""Bearer-token check for the API routes, as a pure ASGI middleware (no per-request overhead
from BaseHTTPMiddleware, and streaming responses pass through untouched). Anthropic's clients send
the key as ``x-api-key``: accepted alike. The 401 is written in the shape of the API the path
belongs to (OpenAI's, Anthropic's under /v1/messages, Ollama's under /api/)."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.app.errors import APIError

PROTECTED_PREFIXES = ("/v1/", "/api/")
PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/score"})


def is_protected(path: str) -> bool:
    return path in PROTECTED_PATHS or path.startswith(PROTECTED_PREFIXES)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode("utf-8")
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        given, x_api_key = b"", None
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
            elif name == b"x-api-key":
                x_api_key = value
        if hmac.compare_digest(given, self._expected) or (
                x_api_key is not None and hmac.compare_digest(x_api_key, self._key)):
            await self.app(scope, receive, send)
            return
        await unauthorized_response(scope["path"])(scope, receive, send)


def unauthorized_response(path: str):
    from pagedserve.app.responses import error_response

    err = APIError.unauthorized()
    if path.startswith("/v1/messages"):
        from pagedserve.app.anthropic_api.errors import error_response as anthropic_error

        err.message = "Incorrect or missing API key. Send it as 'x-api-key: <key>' or 'Authorization: Bearer <key>'."
        return anthropic_error(err)
    if path.startswith("/api/"):
        from pagedserve.app.ollama_api.errors import error_response as ollama_error

        return ollama_error(err)
    return error_response(err)
