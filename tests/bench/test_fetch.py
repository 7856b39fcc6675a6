"""`meshd bench fetch` end to end: a small synthetic checkpoint fetched over loopback lanes
while verify windows run, with the quiet ahead of every other window (`--quiet-ab`)."""

from __future__ import annotations

import json
import math

import pytest

from meshd.cli.main import main


def test_bench_fetch_reports_the_rate_and_the_window_with_and_without_a_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "fetch", "--synthetic-mb", "60", "--rounds", "1", "--pings", "40"]
    assert main([*argv, "--quiet-ab", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fetch_mb_s"] > 0 and out["fetch_verify_mb_s"] > 0 and out["model_bytes"] > 50e6
    # The holder learned the windows' cadence while idle and paused bulk ahead of them.
    assert out["bulk_quiet_ms"] == 1.5 and out["quiets"][0] > 0
    for field in ("verify_rtt_idle_ms", "verify_rtt_busy_ms", "verify_rtt_ratio"):
        assert math.isfinite(out[field]) and out[field] > 0
    assert {"verify_rtt_busy_quiet_ms", "verify_rtt_busy_plain_ms"} <= out.keys()
