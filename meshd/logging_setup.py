"""Logging for the daemon: readable text for people, or one JSON object per line for collectors.

`log_format = "json"` (NodeConfig) gives lines like

    {"ts": "2025-01-01T12:00:00.123456Z", "level": "info", "logger": "meshd.node.node",
     "msg": "stage loaded: layers [0, 2) in 0.03 s", "layers": [0, 2]}

with every `extra=` field of the call as a top-level key, and `exc` (the formatted
traceback) when an exception was logged. Values JSON cannot hold are written as their str().
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: ts, level, logger, msg, extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single line of JSON."""
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, Any] = {
            "ts": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, default=str, ensure_ascii=False)


class _MeshdHandler(logging.StreamHandler[TextIO]):
    """The handler setup_logging installs (so a second call can find and replace it).

    Without an explicit stream it writes to whatever `sys.stderr` is at each record, so a
    rich progress display that redirects stderr keeps log lines above its bar.
    """

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        """Write one record (to the current sys.stderr when following it)."""
        if self._follow_stderr:
            self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str, log_format: str, stream: TextIO | None = None) -> logging.Handler:
    """Route the root logger to `stream` (stderr) as `text` or `json`; returns the handler.

    Replaces handlers installed by an earlier call, so calling it twice does not double lines.
    """
    handler = _MeshdHandler(stream)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    else:
        raise ValueError(f"log format must be text or json, not {log_format!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _MeshdHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
