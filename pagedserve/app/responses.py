"""The JSON response every route answers with, and the OpenAI-format error response built from an
APIError: one place, so routes, the app's exception handlers and the auth middleware answer alike."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from pagedserve.app.errors import APIError


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: APIError) -> ORJSONResponse:
    return ORJSONResponse(err.body(), status_code=err.status, headers=err.headers)
