"""``X-Request-Id``: taken from the client (header, or vLLM's body field ``request_id``) or made
here, and sent back on every response, errors and streams included, so a client's logs and
the server's name the same request. A pure ASGI middleware: streams pass through untouched.
"""
from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request

from pagedserve.contracts.log_format import REQUEST_ID

HEADER = b"x-request-id"
MAX_LEN = 256  # longer or non-printable client ids are replaced by a fresh one


def usable(value: str | None) -> bool:
    return bool(value) and len(value) <= MAX_LEN and all("!" <= ch <= "~" for ch in value)


class RequestIdMiddleware:
    """Outermost middleware: every response (401s and 404s too) carries the request's id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == HEADER:
                given = value.decode("latin-1")
                break
        state = scope.setdefault("state", {})
        state["client_request_id"] = given if usable(given) else None
        state["request_id"] = state["client_request_id"] or uuid.uuid4().hex
        # Records logged while serving it carry its id (contracts/log_format.py). Left set when the
        # app raises: the error middleware outside this one logs in the same task.
        token = REQUEST_ID.set(state["request_id"])

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                rid = state["request_id"].encode("latin-1")  # a route may have taken the body's
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": headers + [(HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
        REQUEST_ID.reset(token)


def response_and_engine_ids(request: Request, prefix: str, body_request_id: str | None = None) -> tuple[str, str]:
    """The response's ``id`` (``prefix-<request id>``, as vLLM) and the engine's request id. A
    client's id need not be unique, so the engine's gets a random suffix then: two requests
    with the same X-Request-Id must never share engine state."""
    state = request.scope.setdefault("state", {})
    if state.get("client_request_id") is None and usable(body_request_id):
        state["client_request_id"] = state["request_id"] = body_request_id
        REQUEST_ID.set(body_request_id)
    rid = state.get("request_id") or uuid.uuid4().hex
    response_id = f"{prefix}-{rid}"
    if state.get("client_request_id") is None:
        return response_id, response_id
    return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"
