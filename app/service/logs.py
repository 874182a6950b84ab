"""Structured logs: one JSON object per line on stderr, tagged with the current request id.

    {"ts": "2026-11-29T10:40:00.123Z", "level": "info", "logger": "hypic.access",
     "msg": "request", "request_id": "9f0c...", "method": "POST", "path": "/query", "status": 200, ...}

`request_id` comes from a context variable set by the request-id middleware, so it is present on
every line logged while a request is handled, the engine thread included.
Fields passed as `extra={...}` are added to the object.

`configure` makes this the process's one log stream: the gateway's loggers (`hypic.*`), the
engine's (`hypic_core.*`), retrieval's and uvicorn's at the configured level; other libraries'
warnings and errors, `warnings.warn` included; transformers' records, which it otherwise
writes as plain text, with its weight-loading progress bars turned off.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import TextIO

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id.get()
        if rid is not None:
            out["request_id"] = rid
        out.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


OWN_LOGGERS = ("hypic", "hypic_core", "retrieval", "uvicorn", "uvicorn.error")


def configure(level: str = "info", stream: TextIO | None = None) -> None:
    """Send every log record to `stream` (default stderr) as JSON lines: `OWN_LOGGERS` from
    `level` up, other libraries' from warning up (idempotent)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.setLevel(level.upper())
        logger.propagate = True
    logging.captureWarnings(True)
    _quiet_transformers()


def _quiet_transformers() -> None:
    """transformers writes its records through a handler of its own and draws tqdm bars while
    loading weights: hand its records to the root logger and turn the bars off."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
