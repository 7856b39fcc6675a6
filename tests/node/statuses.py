"""Node statuses to feed the metrics collector in tests: plain `NodeStatus` values."""

from __future__ import annotations

from typing import Any

from meshd.net.endpoint import DROP_REASONS, REFUSAL_REASONS
from meshd.node.fetch_run import FetchStatus
from meshd.node.status import (
    DraftStatus,
    MemberStatus,
    ModelStatus,
    NatStatus,
    NodeStatus,
    StageStatus,
)


def member(name: str, status: str, *, lane: bool, rtt_ms: float | None = None,
           lost: int = 0, sent: int = 0, is_self: bool = False) -> MemberStatus:  # fmt: skip
    return MemberStatus(
        key=name * 8, name=name, status=status, address="127.0.0.1:1", is_self=is_self,
        offers_model=True, quantization="none", loaded_layers=None, weight_bytes=0,
        kv_bytes_per_token=0, memory_budget_bytes=0, compute_ns_per_layer_token=0, sessions=0,
        lane_up=lane, lane_path="direct" if lane else None, lane_via=None,
        lane_remote="127.0.0.1:1" if lane else None, rtt_ms=rtt_ms, packets_lost=lost,
        packets_sent=sent,
    )  # fmt: skip


def model(name: str, stages: int, predicted_ms: float | None) -> ModelStatus:
    plan = [StageStatus(key="k", layers=[i, i + 1], weight_bytes=1, memory_bytes=2)
            for i in range(stages)]  # fmt: skip
    return ModelStatus(
        name=name, model_id="ab" * 32, held=True, stage_layers=[0, 1], sessions_hosted=1,
        kv_used_bytes=64, holders=[], plan=plan, plan_quantization="none", plan_error="",
        predicted_ms_per_token=predicted_ms,
    )  # fmt: skip


def a_status(**changes: Any) -> NodeStatus:
    """A node that sees itself, one live member over a lossy lane, one suspect and one dead
    member, hosts and coordinates sessions, fetches a stage, and drafts in one session."""
    fields: dict[str, Any] = dict(
        key="aa" * 32, name="self0001", model_id="ab" * 32, quantization="none",
        kv_dtype="float32", threads=1, disabled=False, draining=False, stage_layers=[0, 2],
        sessions_hosted=2, kv_used_bytes=4096, kv_budget_bytes=1 << 20,
        sessions_expired={"coordinator_lost": 1, "lease_lapsed": 0}, stopping=False,
        weight_bytes=10, kv_bytes_per_token=8, sessions_coordinated=3, recoveries=0,
        uptime_s=5.0,
        members=[
            member("self0001", "alive", lane=False, is_self=True),
            member("peer0002", "alive", lane=True, rtt_ms=2.5, lost=1, sent=40),
            member("peer0003", "suspect", lane=True, rtt_ms=None),
            member("peer0004", "dead", lane=False),
        ],
        plan=[], plan_quantization="none", plan_error="", predicted_ms_per_token=12.0,
        events=[],
        nat=NatStatus(punches_direct=0, punches_relayed=0, introductions_made=0,
                      introductions_refused=0, relay_sessions_opened=0,
                      relay_forwarded_datagrams=0, relay_forwarded_bytes=0),
        datagrams_dropped={**dict.fromkeys(DROP_REASONS, 0), "unknown_probe": 3},
        handshakes_refused={**dict.fromkeys(REFUSAL_REASONS, 0), "version": 1},
        models=[model("builtin", 2, 12.0), model("other", 0, None)],
        fetch=FetchStatus(model_id="ab" * 32, state="fetching", what="layers [0, 2)",
                          done_bytes=300, total_bytes=1000, rate_bytes_s=1.0, eta_s=1.0),
        tasks=42, tasks_by_name={"x": 42},
        draft=DraftStatus(model="draft", path="/m/draft.gguf", weight_bytes=3 << 20,
                          sessions=1, kv_used_bytes=1 << 20, prefix_cache_bytes=2 << 20),
    )  # fmt: skip
    fields.update(changes)
    return NodeStatus(**fields)
