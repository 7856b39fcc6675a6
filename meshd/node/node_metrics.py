"""What the daemon exports on `/metrics` beyond the API's own figures.

Two kinds of feed, each where the figure is known:
- gauges and running counts are read at each scrape from one `NodeStatus` (the snapshot
  `meshctl status` prints), by `NodeCollector`: members by health, each lane's RTT and loss,
  sessions hosted and coordinated, KV bytes held and budget, the draft model's sessions and
  KV bytes, each model's plan, the fetch's progress, datagrams dropped and handshakes refused
  by reason, sessions expired by cause, trio tasks. So `/metrics` and `meshctl status` never
  disagree, and a gauge is never stale;
- events are counted as they happen (`export_metrics` subscribes the API's counters to them):
  a lane whose peer stopped answering (`meshd_lane_deaths_total`), a stage's forward pass
  (`meshd_stage_compute_seconds`).

`node_families` is the pure part (a status in, metric families out), so it is tested without a
daemon; `NodeCollector` only calls it on a fresh status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from meshd.mesh.identity import node_id_of
from meshd.node.status import NodeStatus, status_of
from protocol.gossip import Status

if TYPE_CHECKING:
    from meshd.api.metrics import ApiMetrics
    from meshd.node.generation import NodeBackend
    from meshd.node.node import MeshNode

log = logging.getLogger(__name__)

# Every health a member can have (membership's states), each exported, 0 included, so a
# query for dead members finds a sample before the first one dies.
MEMBER_HEALTH: tuple[str, ...] = tuple(s.name.lower() for s in Status)
# Every state of `FetchStatus.state`, and "none" before any fetch (a node holding its files).
FETCH_STATES: tuple[str, ...] = ("none", "waiting", "fetching", "done", "failed", "stopped")


def node_families(status: NodeStatus) -> list[Metric]:
    """The metric families of the node's state in `status` (see the module's docstring)."""
    families = _Families()
    _mesh_families(families, status)
    _load_families(families, status)
    _fetch_families(families, status)
    _drop_families(families, status)
    return families.out


class _Families:
    """Metric families as they are added: one value, or one per label value."""

    def __init__(self) -> None:
        self.out: list[Metric] = []

    def gauge(self, name: str, documentation: str, value: float) -> None:
        family = GaugeMetricFamily(name, documentation)
        family.add_metric([], value)
        self.out.append(family)

    def by(
        self,
        kind: type[GaugeMetricFamily | CounterMetricFamily],
        name: str,
        documentation: str,
        label: str,
        values: dict[str, float],
    ) -> None:
        family = kind(name, documentation, labels=[label])
        for key, value in values.items():
            family.add_metric([key], value)
        self.out.append(family)


def _mesh_families(f: _Families, status: NodeStatus) -> None:
    """Members by health, and each lane's round trip and loss."""
    health = dict.fromkeys(MEMBER_HEALTH, 0.0)
    for member in status.members:
        health[member.status] = health.get(member.status, 0.0) + 1
    f.by(
        GaugeMetricFamily,
        "meshd_members",
        "Members in this node's view (itself included), by health",
        "health",
        health,
    )
    lanes = [m for m in status.members if m.lane_up]
    f.by(
        GaugeMetricFamily,
        "meshd_lane_rtt_seconds",
        "Smoothed round-trip time of the lane to a member, by peer (node id)",
        "peer",
        {m.name: m.rtt_ms / 1000 for m in lanes if m.rtt_ms is not None},
    )
    f.by(
        GaugeMetricFamily,
        "meshd_lane_loss_ratio",
        "Packets lost / packets sent on the lane to a member since it opened (0..1), by peer",
        "peer",
        {m.name: m.packets_lost / m.packets_sent if m.packets_sent else 0.0 for m in lanes},
    )


def _load_families(f: _Families, status: NodeStatus) -> None:
    """Sessions, KV cache (the stages' and the draft model's), and each model's plan."""
    f.gauge("meshd_sessions_hosted", "Sessions open on this node's stages", status.sessions_hosted)
    f.gauge(
        "meshd_sessions_coordinated",
        "Sessions this node coordinates now",
        status.sessions_coordinated,
    )
    f.gauge("meshd_kv_used_bytes", "KV cache bytes this node's stages hold", status.kv_used_bytes)
    f.gauge(
        "meshd_kv_budget_bytes",
        "Memory budget left for KV cache once this node's stages hold their weights (0: no stage)",
        status.kv_budget_bytes,
    )
    draft = status.draft
    f.gauge(
        "meshd_draft_sessions",
        "Sessions open on the coordinators' draft model, one per request drafting (0: none)",
        draft.sessions if draft is not None else 0,
    )
    f.gauge(
        "meshd_draft_kv_used_bytes",
        "KV cache bytes the draft model's sessions hold (0: none)",
        draft.kv_used_bytes if draft is not None else 0,
    )
    f.gauge(
        "meshd_draft_prefix_cache_bytes",
        "KV bytes the draft model keeps from finished requests for later ones (0: none)",
        draft.prefix_cache_bytes if draft is not None else 0,
    )
    f.by(
        GaugeMetricFamily,
        "meshd_plan_stages",
        "Stages of each model's plan (0: no plan), by model",
        "model",
        {_model(m.name, m.model_id): len(m.plan) for m in status.models},
    )
    f.by(
        GaugeMetricFamily,
        "meshd_plan_predicted_seconds_per_token",
        "The planner's predicted time per generated token of each plan this node makes, by model",
        "model",
        {
            _model(m.name, m.model_id): m.predicted_ms_per_token / 1000
            for m in status.models
            if m.predicted_ms_per_token is not None
        },
    )


def _fetch_families(f: _Families, status: NodeStatus) -> None:
    """The last stage fetch's bytes and state."""
    fetch = status.fetch
    f.gauge(
        "meshd_fetch_done_bytes",
        "Bytes of the last stage fetch stored and verified",
        fetch.done_bytes if fetch is not None else 0,
    )
    f.gauge(
        "meshd_fetch_total_bytes",
        "Bytes the last stage fetch needs in all",
        fetch.total_bytes if fetch is not None else 0,
    )
    state = fetch.state if fetch is not None else "none"
    states = {s: float(s == state) for s in (*FETCH_STATES, state)}
    f.by(
        GaugeMetricFamily,
        "meshd_fetch_state",
        "The last stage fetch's state: 1 for the state it is in, 0 for the others",
        "state",
        states,
    )


def _drop_families(f: _Families, status: NodeStatus) -> None:
    """What the lane port dropped and refused, sessions freed unclosed, tasks alive."""
    f.by(
        CounterMetricFamily,
        "meshd_datagrams_dropped",
        "Datagrams the lane port dropped, by reason",
        "reason",
        dict(status.datagrams_dropped),
    )
    f.by(
        CounterMetricFamily,
        "meshd_handshakes_refused",
        "Lane handshakes refused, by reason",
        "reason",
        dict(status.handshakes_refused),
    )
    f.by(
        CounterMetricFamily,
        "meshd_stage_sessions_expired",
        "Sessions a local stage freed without an explicit close, by cause",
        "cause",
        dict(status.sessions_expired),
    )
    f.gauge(
        "meshd_trio_tasks", "Trio tasks alive in the daemon (a leak shows as growth)", status.tasks
    )


def _model(name: str, model_id: str) -> str:
    return name or model_id[:16]


class NodeCollector(Collector):
    """The node's families, from a status read at each scrape (`read`)."""

    def __init__(self, read: Callable[[], NodeStatus]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        """Nothing: registering must not read the node (its names cannot clash, a test
        checks every exported name once)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        """The families as the node's state is now (none if it cannot be read: the rest of the
        page still serves)."""
        try:
            status = self._read()
        except Exception:
            log.exception("the node's status could not be read for /metrics")
            return
        yield from node_families(status)


def export_metrics(metrics: ApiMetrics, node: MeshNode, backend: NodeBackend) -> None:
    """Export `node`'s figures on `metrics`: its state at each scrape, its events as they
    happen."""
    metrics.registry.register(NodeCollector(lambda: status_of(node, backend)))
    node.on_lane_death = lambda node_id: metrics.lane_died(node_id_of(node_id))
    for model in node.models:
        model.slot.on_pass = _stage_observer(metrics, model.files.name or model.model_id[:16])


def _stage_observer(metrics: ApiMetrics, model: str) -> Callable[[tuple[int, int], float], None]:
    def observe(layers: tuple[int, int], seconds: float) -> None:
        metrics.observe_stage_compute(model, f"{layers[0]}-{layers[1]}", seconds)

    return observe
