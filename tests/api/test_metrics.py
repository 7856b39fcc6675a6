"""The metrics hooks the daemon feeds, and one registry per app."""

from __future__ import annotations

import pytest
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.metrics import ApiMetrics


def samples(metrics: ApiMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_each_app_has_its_own_registry() -> None:
    a, b = ApiMetrics(), ApiMetrics()  # the global registry would refuse the second
    a.request_done("/v1/models", 200, 0.01)
    assert (
        samples(a)[("meshd_api_requests_total", (("route", "/v1/models"), ("status", "200")))] == 1
    )
    assert (
        "meshd_api_requests_total",
        (("route", "/v1/models"), ("status", "200")),
    ) not in samples(b)


def test_lane_deaths_and_stage_passes_count_as_they_happen() -> None:
    m = ApiMetrics()
    m.lane_died("ab12")
    m.lane_died("ab12")
    m.observe_stage_compute("builtin", "0-4", 0.003)
    m.observe_stage_compute("builtin", "0-4", 0.020)
    got = samples(m)
    assert got[("meshd_lane_deaths_total", (("peer", "ab12"),))] == 2
    stage = (("layers", "0-4"), ("model", "builtin"))
    assert got[("meshd_stage_compute_seconds_count", stage)] == 2
    assert got[("meshd_stage_compute_seconds_sum", stage)] == pytest.approx(0.023)
    fast = tuple(sorted((("le", "0.005"), *stage)))
    assert got[("meshd_stage_compute_seconds_bucket", fast)] == 1


def test_scrape_hooks_refresh_gauges_and_a_broken_one_is_contained() -> None:
    m = ApiMetrics()
    gauge = Gauge("meshd_test_level", "a level read at scrape time", registry=m.registry)
    level = [0.010]

    def refresh() -> None:
        gauge.set(level[0])

    def broken() -> None:
        raise RuntimeError("lane table gone")

    m.on_scrape(broken)
    m.on_scrape(refresh)
    assert samples(m)[("meshd_test_level", ())] == 0.010
    level[0] = 0.020
    assert samples(m)[("meshd_test_level", ())] == 0.020


def test_counts_kept_elsewhere_are_read_at_each_scrape_by_label() -> None:
    m = ApiMetrics()
    dropped = {"undecryptable": 0, "replayed": 2}
    m.count_by("meshd_datagrams_dropped", "dropped, by reason", "reason", lambda: dropped)
    got = samples(m)
    assert got[("meshd_datagrams_dropped_total", (("reason", "replayed"),))] == 2
    assert got[("meshd_datagrams_dropped_total", (("reason", "undecryptable"),))] == 0
    dropped["undecryptable"] = 7
    assert samples(m)[("meshd_datagrams_dropped_total", (("reason", "undecryptable"),))] == 7

    def gone() -> dict[str, int]:
        raise RuntimeError("endpoint closed")

    m.count_by("meshd_handshakes_refused", "refused, by reason", "reason", gone)
    got = samples(m)  # a broken reader leaves its counter empty, the page intact
    assert got[("meshd_datagrams_dropped_total", (("reason", "replayed"),))] == 2
    assert not [k for k in got if k[0] == "meshd_handshakes_refused_total"]


def test_expired_sessions_follow_the_node_totals_by_cause() -> None:
    m = ApiMetrics()
    totals = {"coordinator_lost": 0, "lease_lapsed": 0}
    m.count_by("meshd_stage_sessions_expired", "expired, by cause", "cause", lambda: totals)

    def expired(cause: str) -> float:
        return samples(m)[("meshd_stage_sessions_expired_total", (("cause", cause),))]

    assert expired("coordinator_lost") == 0 and expired("lease_lapsed") == 0
    totals["coordinator_lost"] = 4
    assert expired("coordinator_lost") == 4
    totals["coordinator_lost"], totals["lease_lapsed"] = 6, 1
    assert expired("coordinator_lost") == 6 and expired("lease_lapsed") == 1
    assert expired("coordinator_lost") == 6  # a scrape without news adds nothing
