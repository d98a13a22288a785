"""Ollama's error shape, apart from the route so the auth middleware can answer in it."""
from __future__ import annotations

from starlette.responses import Response

from pagedserve.app.errors import APIError
from pagedserve.app.responses import ORJSONResponse


def error_response(err: APIError) -> Response:
    return ORJSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)
