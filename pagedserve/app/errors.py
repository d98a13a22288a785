"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can see goes through ``APIError``; engine exceptions are mapped to it by
``to_api_error`` so routes, streams and the catch-all handler answer the same way.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> "APIError":
        return cls(400, message, "invalid_request_error", param, code)

    @classmethod
    def unsupported(cls, param: str, message: str) -> "APIError":
        return cls(400, f"{message} by this server", "invalid_request_error", param, "unsupported")

    @classmethod
    def model_not_found(cls, model: str) -> "APIError":
        return cls(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                   "model_not_found")

    @classmethod
    def unauthorized(cls) -> "APIError":
        return cls(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                   "invalid_request_error", None, "invalid_api_key",
                   headers={"WWW-Authenticate": "Bearer"})

    @classmethod
    def too_large(cls, limit: int, flag: str = "--max-body-bytes") -> "APIError":
        return cls(413, f"The request body is larger than the limit of {limit} bytes ({flag}).",
                   "invalid_request_error", None, "request_too_large")

    @classmethod
    def unsupported_media_type(cls) -> "APIError":
        """vLLM's answer to a body that is not JSON (what a web page may send without a preflight)."""
        return cls(415, "Unsupported Media Type: Only 'application/json' is allowed (send the body with "
                        "Content-Type: application/json).", "invalid_request_error", None, "unsupported_media_type")

    @classmethod
    def overloaded(cls, message: str = "The server is overloaded; retry later.") -> "APIError":
        return cls(503, message, "server_error", None, "overloaded",
                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @classmethod
    def engine_dead(cls, message: str = "The engine has stopped; the server cannot serve requests.") -> "APIError":
        return cls(503, message, "server_error", None, "engine_dead")

    @classmethod
    def internal(cls) -> "APIError":
        return cls(500, "The server had an internal error while processing the request.",
                   "server_error", None, "internal_error")


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees; unexpected ones are logged with their trace."""
    from pagedserve.engine.errors import EngineDeadError, EngineOverloadedError, RequestRejectedError, SamplingParamsError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError.overloaded(str(exc) or "The server is overloaded; retry later.")
    if isinstance(exc, EngineDeadError):
        return APIError.engine_dead(str(exc) or "The engine has stopped.")
    if isinstance(exc, RequestRejectedError):
        return APIError.bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, SamplingParamsError):
        return APIError.bad_request(str(exc), param=exc.param)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError.internal()
