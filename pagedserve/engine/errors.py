"""Typed errors of the engine. Errors a user can cause subclass ValueError (HTTP 400)."""
from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot go on with a request (a worker failure, a broken invariant)."""


class EngineDeadError(EngineError):
    """The engine loop stopped; nothing in flight can finish (HTTP 503)."""


# What a request still running when the server shuts down is told, streamed or not.
SHUTDOWN_ABORT_MESSAGE = "the server is shutting down; the request was aborted"


class EngineOverloadedError(EngineError):
    """Too many requests are waiting; the client should retry later (HTTP 503 + Retry-After)."""

    def __init__(self, message: str = "the engine is overloaded; retry shortly", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineRestartingError(EngineOverloadedError):
    """The worker pool failed and is being rebuilt (--restart-workers): 503 + Retry-After."""


class RequestRejectedError(ValueError):
    """A request that can never run (too long for the context or the KV cache, bad ids).
    ``param`` / ``code``: the request field and the error code the 400 names, where known."""

    param: str | None = None
    code: str | None = None


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. ``param`` names the field (for the HTTP layer)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
