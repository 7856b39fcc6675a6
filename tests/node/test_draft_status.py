"""The draft model in the node's status: read from the draft's own KV table, so a session a
request left open shows (and `/metrics`, `meshctl status` show what the status holds)."""

from __future__ import annotations

import msgspec
import pytest

from meshd.cli.meshctl_status import render
from meshd.model.builtin import builtin_draft_dir
from meshd.node.node_metrics import node_families
from meshd.node.status import draft_status
from meshd.speculative.draft import DraftModel
from tests.node.statuses import a_status


def gauges(draft: DraftModel | None) -> dict[str, float]:
    families = node_families(a_status(draft=draft_status(draft)))
    return {f.name: f.samples[0].value for f in families if f.name.startswith("meshd_draft_")}


def test_the_drafts_sessions_and_kv_are_what_its_kv_table_holds() -> None:
    draft = DraftModel.load(builtin_draft_dir())
    idle = draft_status(draft)
    assert idle is not None
    assert (idle.model, idle.path) == ("builtin_draft", str(builtin_draft_dir()))
    assert idle.weight_bytes == draft.stage.weight_bytes > 0
    assert (idle.sessions, idle.kv_used_bytes) == (0, 0)
    per_position = draft.stage.kv_bytes_per_token
    first, second = draft.open(64), draft.open(32)
    held = draft_status(draft)
    assert held is not None and (held.sessions, held.kv_used_bytes) == (2, 96 * per_position)
    assert gauges(draft) == {
        "meshd_draft_sessions": 2,
        "meshd_draft_kv_used_bytes": 96 * per_position,
        "meshd_draft_prefix_cache_bytes": 0,
    }
    draft.close(first)
    draft.close(second)
    closed = msgspec.to_builtins(draft_status(draft))
    assert closed["sessions"] == 0 and closed["kv_used_bytes"] == 0
    assert set(closed) == {
        "model",
        "path",
        "weight_bytes",
        "sessions",
        "kv_used_bytes",
        "prefix_cache_bytes",
    }


def test_no_draft_model_is_null_in_the_status_and_0_in_the_gauges() -> None:
    assert draft_status(None) is None
    assert msgspec.to_builtins(a_status(draft=None))["draft"] is None
    assert gauges(None) == {
        "meshd_draft_sessions": 0,
        "meshd_draft_kv_used_bytes": 0,
        "meshd_draft_prefix_cache_bytes": 0,
    }


def test_meshctl_status_prints_the_drafts_sessions(capsys: pytest.CaptureFixture[str]) -> None:
    status = msgspec.to_builtins(a_status())
    render(status, 0)
    out = capsys.readouterr().out
    assert "draft draft: weights 3.0 MiB, sessions 1 (KV 1.0 MiB), prompt cache 2.0 MiB" in out, out
    render({**status, "draft": None}, 0)
    assert "draft draft" not in capsys.readouterr().out


def test_the_status_counts_what_the_draft_keeps_for_later_requests() -> None:
    draft = DraftModel.load(builtin_draft_dir(), prefix_cache_bytes=1 << 20)
    session = draft.open(64)
    log = list(range(40, 60))
    draft.rows(session, 0, log, 1)
    draft.close(session, log)  # the request ended: its 20 positions are kept
    kept = draft_status(draft)
    assert kept is not None
    assert (kept.sessions, kept.kv_used_bytes) == (0, 0)
    assert kept.prefix_cache_bytes == 20 * draft.stage.kv_bytes_per_token
    assert gauges(draft)["meshd_draft_prefix_cache_bytes"] == kept.prefix_cache_bytes
