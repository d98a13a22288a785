"""Anthropic's error shape, apart from the route so the auth middleware can answer in it."""
from __future__ import annotations

from typing import Any

from starlette.responses import Response

from pagedserve.app.errors import APIError
from pagedserve.app.responses import ORJSONResponse

# APIError status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# Chat field names in an error message, as the Messages request names them.
_PARAM_NAMES = {"'stop'": "'stop_sequences'", "max_completion_tokens": "max_tokens"}


def error_body(err: APIError) -> dict[str, Any]:
    message = err.message
    for chat, ours in _PARAM_NAMES.items():
        message = message.replace(chat, ours)
    kind = "api_error" if err.code == "engine_dead" else _ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: APIError) -> Response:
    return ORJSONResponse(error_body(err), status_code=err.status, headers=err.headers)
