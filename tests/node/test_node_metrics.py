"""The node's families on `/metrics`: read from a status at each scrape, in the API's registry."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.metrics import ApiMetrics
from meshd.net.endpoint import DROP_REASONS
from meshd.node.fetch_run import FetchStatus
from meshd.node.node_metrics import FETCH_STATES, MEMBER_HEALTH, NodeCollector, node_families
from meshd.node.status import NodeStatus
from meshd.stage.host import EXPIRY_CAUSES
from tests.node.statuses import a_status, member, model

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics: ApiMetrics) -> Samples:
    text, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def with_node(read: Any) -> ApiMetrics:
    metrics = ApiMetrics()
    metrics.registry.register(NodeCollector(read))
    return metrics


def test_every_figure_of_the_status_is_exported() -> None:
    got = scrape(with_node(a_status))
    health = {h: got[("meshd_members", (("health", h),))] for h in MEMBER_HEALTH}
    assert health == {"alive": 2, "suspect": 1, "dead": 1, "left": 0}
    # Lanes: only members with a lane up; RTT once measured, loss = lost / sent.
    assert got[("meshd_lane_rtt_seconds", (("peer", "peer0002"),))] == pytest.approx(0.0025)
    assert ("meshd_lane_rtt_seconds", (("peer", "peer0003"),)) not in got
    assert got[("meshd_lane_loss_ratio", (("peer", "peer0002"),))] == pytest.approx(1 / 40)
    assert got[("meshd_lane_loss_ratio", (("peer", "peer0003"),))] == 0
    assert not [k for k in got if k[1] in ((("peer", "peer0004"),), (("peer", "self0001"),))]
    assert got[("meshd_sessions_hosted", ())] == 2
    assert got[("meshd_sessions_coordinated", ())] == 3
    assert got[("meshd_kv_used_bytes", ())] == 4096
    assert got[("meshd_kv_budget_bytes", ())] == 1 << 20
    assert got[("meshd_draft_sessions", ())] == 1
    assert got[("meshd_draft_kv_used_bytes", ())] == 1 << 20
    assert got[("meshd_plan_stages", (("model", "builtin"),))] == 2
    assert got[("meshd_plan_stages", (("model", "other"),))] == 0
    assert got[("meshd_plan_predicted_seconds_per_token", (("model", "builtin"),))] == 0.012
    assert ("meshd_plan_predicted_seconds_per_token", (("model", "other"),)) not in got
    assert got[("meshd_fetch_done_bytes", ())] == 300
    assert got[("meshd_fetch_total_bytes", ())] == 1000
    states = {s: got[("meshd_fetch_state", (("state", s),))] for s in FETCH_STATES}
    assert states == {**dict.fromkeys(FETCH_STATES, 0.0), "fetching": 1.0}
    dropped = {r: got[("meshd_datagrams_dropped_total", (("reason", r),))] for r in DROP_REASONS}
    assert dropped == {**dict.fromkeys(DROP_REASONS, 0.0), "unknown_probe": 3.0}
    assert got[("meshd_handshakes_refused_total", (("reason", "version"),))] == 1
    expired = {c: got[("meshd_stage_sessions_expired_total", (("cause", c),))]
               for c in EXPIRY_CAUSES}  # fmt: skip
    assert expired == {"coordinator_lost": 1, "lease_lapsed": 0}
    assert got[("meshd_trio_tasks", ())] == 42


def test_gauges_follow_the_node_at_each_scrape() -> None:
    status = [a_status()]
    metrics = with_node(lambda: status[0])
    assert scrape(metrics)[("meshd_members", (("health", "dead"),))] == 1
    status[0] = a_status(
        members=[member("self0001", "alive", lane=False, is_self=True)],
        sessions_hosted=0, kv_used_bytes=0, fetch=None, models=[model("builtin", 0, None)],
        draft=None,
    )  # fmt: skip
    got = scrape(metrics)
    assert got[("meshd_members", (("health", "dead"),))] == 0
    assert got[("meshd_members", (("health", "alive"),))] == 1
    assert not [k for k in got if k[0] in ("meshd_lane_rtt_seconds", "meshd_lane_loss_ratio")]
    assert got[("meshd_sessions_hosted", ())] == 0 and got[("meshd_kv_used_bytes", ())] == 0
    # No draft model: its gauges read 0, so a query finds a sample on every node.
    assert got[("meshd_draft_sessions", ())] == got[("meshd_draft_kv_used_bytes", ())] == 0
    assert got[("meshd_plan_stages", (("model", "builtin"),))] == 0
    # Never fetched (a node holding its files): state "none", no bytes.
    assert got[("meshd_fetch_state", (("state", "none"),))] == 1
    assert got[("meshd_fetch_done_bytes", ())] == got[("meshd_fetch_total_bytes", ())] == 0


def test_an_unreadable_node_leaves_the_rest_of_the_page() -> None:
    def gone() -> NodeStatus:
        raise RuntimeError("node stopped")

    metrics = with_node(gone)
    metrics.request_done("/metrics", 200, 0.01)
    got = scrape(metrics)
    assert got[("meshd_api_requests_total", (("route", "/metrics"), ("status", "200")))] == 1
    assert not [k for k in got if k[0].startswith(("meshd_members", "meshd_lane_rtt"))]


def test_a_state_the_fetch_names_is_exported_even_if_new() -> None:
    fetch = FetchStatus(model_id="ab", state="verifying", what="x", done_bytes=1,
                        total_bytes=2, rate_bytes_s=0.0, eta_s=None)  # fmt: skip
    families = {f.name: f for f in node_families(a_status(fetch=fetch))}
    states = {s.labels["state"]: s.value for s in families["meshd_fetch_state"].samples}
    assert states["verifying"] == 1 and sum(states.values()) == 1
