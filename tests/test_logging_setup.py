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
    log = logging.getLogger("meshd.node.stage_slot")
    log.info("stage loaded: layers [%d, %d)", 0, 2, extra={"layers": (0, 2), "path": object()})
    log.debug("not shown at info")
    try:
        raise ValueError("bad frame")
    except ValueError:
        log.exception("lane failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["level"] == "info" and first["logger"] == "meshd.node.stage_slot"
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


def _record(msg: str, at_s: float, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    record = logging.LogRecord("meshd.api.openai", level, __file__, 1, msg, args, None)
    record.created = at_s
    return record


def test_repeated_errors_are_written_once_per_interval_with_the_count_left_out(
    restore_root: None,
) -> None:
    out = io.StringIO()
    handler = setup_logging("info", "text", out, repeat_interval_s=60.0)
    t0 = 1_000_000.0
    # 500 alike errors within a minute (arguments differ), then one more after it.
    for i in range(500):
        handler.handle(_record("internal error on %s", t0 + i * 0.1, f"/v1/path{i}"))
    handler.handle(_record("lane to %s died", t0 + 1.0, "peer-a"))  # another kind: its own
    handler.handle(_record("internal error on %s", t0 + 61.0, "/v1/late"))
    handler.handle(_record("internal error on %s", t0 + 62.0, "/v1/later"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].endswith("internal error on /v1/path0")
    assert lines[1].endswith("lane to peer-a died")
    assert lines[2].endswith(
        "internal error on /v1/late [499 more like this left out in the last 61 s]"
    )


def test_info_lines_are_never_rate_limited(restore_root: None) -> None:
    out = io.StringIO()
    handler = setup_logging("info", "json", out, repeat_interval_s=60.0)
    for i in range(50):
        handler.handle(
            _record("client %s went away", 5.0 + i, f"127.0.0.1:{i}", level=logging.INFO)
        )
    assert len(out.getvalue().splitlines()) == 50
