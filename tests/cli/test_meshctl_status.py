"""`meshctl status`'s table keeps what an operator types whole: each member's node id and key
prefix (`meshctl kill NODE`) appear uncut however wide the other columns grow."""

from __future__ import annotations

from typing import Any

import pytest

from meshd.cli.meshctl_status import render


def _member(i: int, packets_sent: int) -> dict[str, Any]:
    return {
        "key": f"{i:02x}" + "5f1de10fc475eb9a" * 4, "name": f"{i:02x}e9a95a0615a247",
        "status": "alive", "address": f"127.0.0.{i}:4123{i}", "is_self": i == 2,
        "offers_model": True, "quantization": "none", "loaded_layers": [0, 2],
        "weight_bytes": 8_800_000, "kv_bytes_per_token": 3072, "lane_up": i != 2,
        "rtt_ms": 0.123, "packets_lost": 12, "packets_sent": packets_sent,
    }  # fmt: skip


@pytest.mark.parametrize("packets_sent", [999, 9_999_999_999])
def test_every_member_key_and_node_id_is_printed_whole(
    capsys: pytest.CaptureFixture[str], packets_sent: int
) -> None:
    # Five members and a long-running lane's packet counts: before, the key column was the
    # one shrunk to an ellipsis once the row grew past the console's 120 columns.
    members = [_member(i, packets_sent) for i in range(2, 7)]
    status = {
        "name": "02e9a95a0615a247", "key": members[0]["key"], "model_id": "9" * 32,
        "quantization": "none", "stage_layers": [0, 2], "disabled": False, "weight_bytes": 1,
        "kv_bytes_per_token": 1, "kv_dtype": "float32", "threads": 1, "sessions_hosted": 0,
        "kv_used_bytes": 0, "sessions_coordinated": 0, "recoveries": 0, "uptime_s": 1.0,
        "tasks": 38, "datagrams_dropped": {}, "handshakes_refused": {},
        "sessions_expired": {}, "members": members, "plan": [], "plan_error": "none yet",
        "events": [],
    }  # fmt: skip
    render(status, 0)
    out = capsys.readouterr().out
    for m in members:
        assert m["key"][:16] in out and m["name"] in out, out
    assert "38 trio tasks" in out
