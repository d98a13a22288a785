"""How every pagedserve process logs: `serve`'s --log-format (text, or json: one JSON object per
line) and --log-level, set up once in the server and again in each worker process from the values
the server passed on (``configure_logging``, ``current_format``).

A record that concerns a request carries its id: ``extra={"request_id": ...}``, or, inside an HTTP
request's task, the id the server put in ``REQUEST_ID`` (app/request_id.py), which a filter copies
onto every record logged there. The json lines hold time, level, logger, message, the request id
when there is one, the process (``worker 0`` ...), the access log's fields, and an exception's
traceback; the text lines are the ``TEXT_FORMAT`` the start-up benchmark reads."""
from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys

__all__ = ["LOG_FORMATS", "REQUEST_ID", "JsonFormatter", "configure_logging", "current_format"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pagedserve_request_id", default=None)
# Fields a record may carry (``extra=``) that the json line keeps, in this order.
EXTRA_FIELDS = ("request_id", "method", "path", "status", "duration_ms", "client")

_state = {"format": "text"}


class _RequestIdFilter(logging.Filter):
    """Gives a record logged inside a request's task that request's id, unless it names one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            rid = REQUEST_ID.get()
            if rid is not None:
                record.request_id = rid
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``process``: the worker's name in a worker process."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        line = {"time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in EXTRA_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if self.process is not None:
            line["process"] = self.process
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: int | str, fmt: str = "text", process: str | None = None) -> None:
    """The root logger writes to stderr in ``fmt`` at ``level``; uvicorn's loggers go through it
    (uvicorn is then started with ``log_config=None``). ``process``: this worker's name (text
    lines show it in brackets, json lines as ``process``)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(LOG_FORMATS)}")
    if isinstance(level, str):
        level = level.upper()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        text = TEXT_FORMAT if process is None else TEXT_FORMAT.replace("%(name)s", f"[{process}] %(name)s")
        handler.setFormatter(logging.Formatter(text))
    handler.addFilter(_RequestIdFilter())
    handler._pagedserve = True  # replaced by a later call; handlers others added (pytest's) stay
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pagedserve", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn's text as records: a json line, not loose lines
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        log = logging.getLogger(name)
        log.handlers.clear()
        log.propagate = True
    _state["format"] = fmt


def current_format() -> str:
    """The format ``configure_logging`` set in this process ("text" if it was never called)."""
    return _state["format"]
