"""Log configuration: JSON lines (python-json-logger) or plain text, each record carrying
the trial id and request id of the HTTP request it was logged under.

The ids live in context variables that the request middleware sets; asyncio copies the
context into tasks a handler starts, so the pool's and the service's records carry them too.
Records logged outside a request (a worker joining, shutdown) have them as null.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

trial_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trial_id", default=None)
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)

# The fields every JSON line starts with; anything given as ``extra=`` follows.
JSON_FIELDS = ("asctime", "levelname", "name", "message", "trial_id", "request_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s %(message)s"


class LogFormat(enum.Enum):
    JSON = "json"
    TEXT = "text"


class RequestContextFilter(logging.Filter):
    """Stamps ``trial_id`` and ``request_id`` (and a ``context`` string for text) on a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        trial_id = trial_id_var.get()
        request_id = request_id_var.get()
        record.trial_id = trial_id
        record.request_id = request_id
        parts = [f"trial={trial_id}" if trial_id else "", f"req={request_id}" if request_id else ""]
        joined = " ".join(p for p in parts if p)
        record.context = f" [{joined}]" if joined else ""
        return True


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt is LogFormat.JSON:
        return JsonFormatter(
            list(JSON_FIELDS),
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            datefmt="%Y-%m-%dT%H:%M:%S%z",
        )
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(
    level: str | int = "INFO", fmt: LogFormat | str = LogFormat.TEXT, stream: TextIO | None = None
) -> logging.Handler:
    """Replace the root logger's handlers with one that writes ``fmt`` lines to ``stream``
    (stderr by default). Returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(LogFormat(fmt)))
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # aiohttp's own access log would duplicate the proxy's request lines.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler
