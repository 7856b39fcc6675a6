"""Daemon logs: text for people, one JSON object per line for collectors."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from meshd.logging_setup import setup_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_ts_level_logger_msg_extra_fields_and_tracebacks(
    restore_root: None,
) -> None:
    out = io.StringIO()
    setup_logging("info", "json", out)
    log = logging.getLogger("meshd.node.stages")
    log.info("stage loaded: layers [%d, %d)", 0, 2, extra={"layers": (0, 2), "path": object()})
    log.debug("not shown at info")
    try:
        raise ValueError("bad frame")
    except ValueError:
        log.exception("lane failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["level"] == "info" and first["logger"] == "meshd.node.stages"
    assert first["msg"] == "stage loaded: layers [0, 2)"
    assert first["layers"] == [0, 2] and first["path"].startswith("<object object")
    assert first["ts"].endswith("Z") and first["ts"][:2] == "20"
    assert "lineno" not in first and "args" not in first  # no LogRecord internals
    assert second["level"] == "error" and "ValueError: bad frame" in second["exc"]


def test_text_format_and_a_second_setup_does_not_double_lines(restore_root: None) -> None:
    first, out = io.StringIO(), io.StringIO()
    setup_logging("info", "json", first)
    setup_logging("warning", "text", out)
    log = logging.getLogger("meshd.api")
    log.info("hidden")
    log.warning("slow client %s", "10.0.0.2")
    assert first.getvalue() == ""
    assert out.getvalue().count("slow client") == 1
    assert out.getvalue().rstrip().endswith("WARNING meshd.api: slow client 10.0.0.2")
    with pytest.raises(ValueError, match="text or json"):
        setup_logging("info", "yaml", out)
