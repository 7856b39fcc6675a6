"""Logging for the daemon: readable text for people, or one JSON object per line for collectors.

`log_format = "json"` (NodeConfig) gives lines like

    {"ts": "2025-01-01T12:00:00.123456Z", "level": "info", "logger": "meshd.node.node",
     "msg": "stage loaded: layers [0, 2) in 0.03 s", "layers": [0, 2]}

with every `extra=` field of the call as a top-level key, and `exc` (the formatted
traceback) when an exception was logged. Values JSON cannot hold are written as their str().

Warnings and errors that repeat are rate-limited (`RepeatFilter`): the first is written, then at
most one per `repeat_interval_s`, which says how many like it were left out meanwhile.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REPEAT_INTERVAL_S = 60.0

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


class RepeatFilter(logging.Filter):
    """Writes a repeated warning or error at most once per `interval_s`, with a count.

    Records are alike when they come from the same logger at the same level with the same
    message template (its arguments may differ: a client's address, a path) and the same
    exception type. The first of a kind passes; alike ones within `interval_s` of it are left
    out and counted; the first after the interval passes with `[N more like this left out in
    the last S s]` appended, and opens the next interval. Records below `level` always pass:
    one line per event is their contract (e.g. each client hang-up). The clock is the
    record's own creation time, so the filter needs no timer of its own.
    """

    def __init__(
        self,
        interval_s: float = REPEAT_INTERVAL_S,
        level: int = logging.WARNING,
        max_kinds: int = 1024,
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.level = level
        self.max_kinds = max_kinds
        # kind -> [start of its interval, records left out since]
        self._kinds: dict[tuple[str, int, str, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a record to leave out; amends the first one after an interval."""
        if record.levelno < self.level:
            return True
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        kind = (record.name, record.levelno, str(record.msg), exc_type)
        now = record.created
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            record.msg = (
                f"{record.msg} [{int(seen[1])} more like this left out in the last "
                f"{now - seen[0]:.0f} s]"
            )
        self._kinds.pop(kind, None)
        self._kinds[kind] = [now, 0]  # last in order: the oldest kinds are forgotten first
        if len(self._kinds) > self.max_kinds:
            for old in list(self._kinds)[: len(self._kinds) - self.max_kinds]:
                del self._kinds[old]
        return True


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


def setup_logging(
    level: str,
    log_format: str,
    stream: TextIO | None = None,
    *,
    repeat_interval_s: float = REPEAT_INTERVAL_S,
) -> logging.Handler:
    """Route the root logger to `stream` (stderr) as `text` or `json`; returns the handler.

    Repeated warnings and errors are rate-limited to one per `repeat_interval_s`
    (`RepeatFilter`). Replaces handlers installed by an earlier call, so calling it twice does
    not double lines.
    """
    handler = _MeshdHandler(stream)
    handler.addFilter(RepeatFilter(repeat_interval_s))
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
