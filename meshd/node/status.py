"""What `meshctl status` and `meshctl plan` show: the node's view as typed, JSON-ready values.

Every model the mesh serves is listed with its plan (`ModelStatus`). A model this node holds is
planned here (its plan, the stage it hosts here, its sessions). A model only other members hold
is shown as they report it: the stages their signed records say they have loaded, in layer
order (this node cannot plan a model it has no shape of).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import trio

from meshd.mesh.identity import node_id_of
from meshd.model.files import model_name
from meshd.node.fetch_run import FetchStatus
from meshd.node.planning import holding_of
from meshd.node.prefix_status import PrefixCacheStatus, prefix_cache_status
from meshd.plan import Plan, explain
from protocol.punch import RelayPath

if TYPE_CHECKING:
    from meshd.node.generation import NodeBackend
    from meshd.node.held_model import HeldModel
    from meshd.node.node import MeshNode
    from meshd.speculative.draft import DraftModel

log = logging.getLogger(__name__)

# Events the node keeps for `meshctl status` (the latest).
_EVENT_LOG = 200


class MemberStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One member as this node sees it, with this node's lane to it."""

    key: str  # Ed25519 node key, hex (meshctl's NODE is a prefix of it)
    name: str  # short node id (fingerprint prefix)
    status: str
    address: str
    is_self: bool
    offers_model: bool
    # The quantization it holds the model at (None: it offers no model); only members at this
    # node's quantization serve this node's plan.
    quantization: str | None
    loaded_layers: list[int] | None
    # Bytes its loaded stage holds: weights, and KV cache per position (0: no stage).
    weight_bytes: int
    kv_bytes_per_token: int
    memory_budget_bytes: int
    compute_ns_per_layer_token: int
    sessions: int
    lane_up: bool
    # How the lane travels: "direct", "punched" (direct after an introduction) or "relayed";
    # lane_via is the introducer's (or relay's) node key, hex, when one took part.
    lane_path: str | None
    lane_via: str | None
    lane_remote: str | None  # host:port the lane's datagrams go to (the relay's, if relayed)
    rtt_ms: float | None
    packets_lost: int
    packets_sent: int


class EventStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One recent event (wall-clock time, so processes compare)."""

    at_unix_s: float
    kind: str
    node: str
    detail: str


class EventLog(collections.deque[EventStatus]):
    """The recent events `meshctl status` shows, oldest first."""

    def __init__(self) -> None:
        super().__init__(maxlen=_EVENT_LOG)

    def note(self, kind: str, node_id: bytes | str = b"", detail: str = "") -> None:
        """Add an event about `node_id` (a node key, or a name), and log it."""
        name = node_id.hex()[:16] if isinstance(node_id, bytes) else node_id
        self.append(EventStatus(at_unix_s=time.time(), kind=kind, node=name, detail=detail))
        log.info("%s %s %s", kind, name, detail)


class NatStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What this node did for NAT traversal: as requester, and as introducer and relay."""

    punches_direct: int
    punches_relayed: int
    introductions_made: int
    introductions_refused: int
    relay_sessions_opened: int
    relay_forwarded_datagrams: int
    relay_forwarded_bytes: int


class DraftStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The coordinators' draft model (`spec.draft_model`) and what its sessions hold now."""

    model: str  # display name: the file's stem, or the directory's name
    path: str  # as configured
    weight_bytes: int
    # Read from the draft's own KV table: each request drafting with it holds one session
    # until it ends, however it ends; both are 0 whenever no request is drafting.
    sessions: int
    kv_used_bytes: int
    # KV kept from finished requests for later ones that start with the same tokens (a
    # chat's next turn), within `stage.prefix_cache_bytes`; it stays when no request drafts.
    prefix_cache_bytes: int = 0


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The whole status reply."""

    key: str
    name: str
    model_id: str
    quantization: str  # how this node holds the weights ("none", "gguf", "q8_0", ...)
    kv_dtype: str  # the KV cache's element type
    threads: int  # torch threads this node computes with
    disabled: bool
    draining: bool  # `meshctl kill --drain`: serving open sessions, then the stage stops
    stage_layers: list[int] | None
    sessions_hosted: int
    kv_used_bytes: int  # KV cache held by this node's stage; back to 0 when sessions close
    # The memory budget left for KV cache once this node's stages hold their weights (what the
    # planner sizes a stage's context against); 0 while it holds no stage.
    kv_budget_bytes: int
    # Sessions this node's stages freed without an explicit close, since start, by cause:
    # "coordinator_lost" (its lane died, or membership declared it dead) and "lease_lapsed".
    sessions_expired: dict[str, int]
    stopping: bool  # SIGTERM: admits no request, lets those in flight finish, then exits
    weight_bytes: int  # weights held by this node's stage (0: no stage)
    kv_bytes_per_token: int  # KV bytes this node's stage adds per position of a session
    sessions_coordinated: int
    recoveries: int
    uptime_s: float
    members: list[MemberStatus]
    plan: list[StageStatus]
    plan_quantization: str | None  # the plan's quantization (every stage holds it)
    plan_error: str
    predicted_ms_per_token: float | None
    events: list[EventStatus]
    nat: NatStatus
    # What the lane port dropped, by reason, every reason listed (0 included): received
    # datagrams (undecryptable, replayed, unknown_lane, malformed) and handshakes refused
    # (version, not_admitted, replayed, clock_skew, undecryptable, malformed). See
    # docs/operations.md; /metrics has the same counts (`meshd/node/node_metrics.py`).
    datagrams_dropped: dict[str, int]
    handshakes_refused: dict[str, int]
    # Every model the mesh serves, with its plan (`ModelStatus`); the fields
    # above are about this node's first model, except sessions_hosted and kv_used_bytes (all).
    models: list[ModelStatus]
    # The last fetch of this node's stage tensors over the mesh (`mesh:ID` nodes; None: none).
    fetch: FetchStatus | None = None
    # Trio tasks alive in this daemon, and by task name (the function each runs): what a lost
    # peer or a finished session started must not stay behind (docs/operations.md).
    tasks: int = 0
    tasks_by_name: dict[str, int] = {}
    # The prefix cache's counters (`meshd/node/prefix_status.py`).
    prefix_cache: PrefixCacheStatus | None = None
    # The coordinators' draft model (None: the node loaded none).
    draft: DraftStatus | None = None


class StageStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One stage of a plan, with the bytes the planner counts for it."""

    key: str
    layers: list[int]
    weight_bytes: int
    memory_bytes: int  # weights plus KV for the plan's context (as reported: weights only)


class ModelStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One model the mesh serves, and its plan."""

    name: str
    model_id: str
    held: bool  # this node holds the model's files (and plans and coordinates it)
    stage_layers: list[int] | None  # the layers this node serves of it
    sessions_hosted: int
    kv_used_bytes: int
    holders: list[str]  # node keys (hex) of the healthy members offering it
    plan: list[StageStatus]
    plan_quantization: str | None
    plan_error: str
    predicted_ms_per_token: float | None


def plan_stages(plan: Plan | None) -> list[StageStatus]:
    return [
        StageStatus(
            key=s.node_key.hex(),
            layers=[s.layer_start, s.layer_end],
            weight_bytes=s.weight_bytes,
            memory_bytes=s.memory_bytes,
        )
        for s in (plan.stages if plan is not None else ())
    ]


def _held(node: MeshNode, model: HeldModel) -> ModelStatus:
    layers, plan = model.slot.layers, model.plan
    return ModelStatus(
        name=model.files.name,
        model_id=model.model_id,
        held=True,
        stage_layers=list(layers) if layers is not None else None,
        sessions_hosted=model.slot.sessions,
        kv_used_bytes=model.slot.kv_used_bytes,
        holders=_holders(node, model.model_id),
        plan=plan_stages(plan),
        plan_quantization=plan.quantization if plan is not None else None,
        plan_error=model.plan_error,
        predicted_ms_per_token=plan.predicted_s_per_token * 1000 if plan is not None else None,
    )


def _holders(node: MeshNode, model_id: str) -> list[str]:
    out = []
    for key, info in sorted(node.membership.view().items()):
        models = info.capacity.models if info.healthy and info.capacity is not None else []
        if any(h.model_id == model_id for h in models):
            out.append(key.hex())
    return out


def model_statuses(node: MeshNode) -> list[ModelStatus]:
    """Every model the mesh serves: this node's, in order, then the rest by id."""
    out = [_held(node, model) for model in node.models]
    known = {m.model_id for m in out}
    reported: dict[str, tuple[str, list[StageStatus], str | None]] = {}
    for key, info in sorted(node.membership.view().items()):
        if not info.healthy or info.capacity is None:
            continue
        for h in info.capacity.models:
            if h.model_id in known:
                continue
            name, stages, quantization = reported.setdefault(h.model_id, (h.name, [], None))
            if h.loaded:
                stages.append(
                    StageStatus(
                        key=key.hex(),
                        layers=[h.layer_start, h.layer_end],
                        weight_bytes=h.weight_bytes,
                        memory_bytes=h.weight_bytes,
                    )
                )
                reported[h.model_id] = (name or h.name, stages, h.quantization)
    for model_id, (name, stages, quantization) in sorted(reported.items()):
        stages.sort(key=lambda s: s.layers)
        out.append(
            ModelStatus(
                name=name or model_id,
                model_id=model_id,
                held=False,
                stage_layers=None,
                sessions_hosted=0,
                kv_used_bytes=0,
                holders=_holders(node, model_id),
                plan=stages,
                plan_quantization=quantization,
                plan_error="" if stages else "no member reports a loaded stage of it",
                predicted_ms_per_token=None,
            )
        )
    return out


def model_plans(node: MeshNode) -> list[dict[str, Any]]:
    """`meshctl plan`'s reply per model: the explanation of each plan this node makes, and
    for a model it does not hold, the stages its holders report."""
    names = {k: k.hex()[:16] for k in node.membership.view()}
    out: list[dict[str, Any]] = []
    plans = {m.model_id: (m.plan, m.plan_error) for m in node.models}
    for m in model_statuses(node):
        if m.model_id in plans:
            plan, error = plans[m.model_id]
            text = explain(plan, names=names) if plan is not None else None
        else:
            stages = ", ".join(f"{s.key[:16]} [{s.layers[0]}, {s.layers[1]})" for s in m.plan)
            text = (
                f"held elsewhere; stages as reported by their nodes: {stages}" if stages else None
            )
            error = m.plan_error
        out.append({"name": m.name, "model_id": m.model_id, "plan": text, "error": error})
    return out


def trio_tasks() -> dict[str, int]:
    """Every task of the running trio program, counted by name ({} outside one): the tree
    from the root task down through every nursery."""
    try:
        todo = [trio.lowlevel.current_root_task()]
    except RuntimeError:
        return {}
    counts: dict[str, int] = {}
    while todo:
        task = todo.pop()
        if task is None:
            continue
        counts[task.name] = counts.get(task.name, 0) + 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return counts


def node_status(node: MeshNode, backend: NodeBackend) -> dict[str, Any]:
    """The status reply for `node` (builtins, ready for JSON)."""
    out: dict[str, Any] = msgspec.to_builtins(status_of(node, backend))
    return out


def _members(node: MeshNode) -> list[MemberStatus]:
    """Every member as this node sees it; what each offers of this node's first model."""
    members = []
    for key, info in sorted(node.membership.view().items()):
        holding = holding_of(info, node.models[0].model_id)
        lane = node.peers.lane(node.keys.x_of(key)) if key != node.node_key else None
        stats = lane.lane.stats if lane is not None else None
        path = node.peers.path_of(node.keys.x_of(key)) if lane is not None else None
        via = node.keys.ed_of(path.via) if path is not None and path.via is not None else None
        cap = info.capacity
        members.append(
            MemberStatus(
                key=key.hex(),
                name=node_id_of(key),
                status=info.status.name.lower(),
                address=info.address,
                is_self=key == node.node_key,
                offers_model=holding is not None,
                quantization=holding.quantization if holding is not None else None,
                loaded_layers=[holding.layer_start, holding.layer_end]
                if holding is not None and holding.loaded
                else None,
                weight_bytes=holding.weight_bytes if holding is not None else 0,
                kv_bytes_per_token=holding.kv_bytes_per_token if holding is not None else 0,
                memory_budget_bytes=cap.memory_budget_bytes if cap else 0,
                compute_ns_per_layer_token=holding.compute_ns_per_layer_token if holding else 0,
                sessions=cap.sessions if cap else 0,
                lane_up=lane is not None,
                lane_path=path.kind.value if path is not None else None,
                lane_via=via.hex() if via is not None else None,
                lane_remote=_remote(lane.addr) if lane is not None else None,
                rtt_ms=stats.smoothed_rtt_s * 1000 if stats is not None else None,
                packets_lost=stats.packets_lost if stats else 0,
                packets_sent=stats.packets_sent if stats else 0,
            )
        )
    return members


def status_of(node: MeshNode, backend: NodeBackend) -> NodeStatus:
    """The node's view now: what `meshctl status` prints and `/metrics` exports. Its stage
    and plan fields are about the node's first model; the counts add up every model's."""
    first = node.models[0]
    plan = first.plan
    layers = first.slot.layers
    tasks = trio_tasks()
    status = NodeStatus(
        key=node.node_key.hex(),
        name=node.identity.node_id,
        model_id=first.model_id,
        quantization=node.basis.quantization,
        kv_dtype=str(node.basis.kv_dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        disabled=node.commands.disabled,
        draining=node.commands.draining,
        stage_layers=list(layers) if layers is not None else None,
        sessions_hosted=sum(m.slot.sessions for m in node.models),
        kv_used_bytes=sum(m.slot.kv_used_bytes for m in node.models),
        kv_budget_bytes=_kv_budget_bytes(node),
        sessions_expired=first.slot.sessions_expired,
        stopping=node.commands.stopping,
        weight_bytes=first.slot.weight_bytes,
        kv_bytes_per_token=first.slot.kv_bytes_per_token,
        sessions_coordinated=sum(m.coordinator.sessions_in_flight for m in node.models),
        recoveries=backend.recoveries,
        uptime_s=time.time() - node.started_unix_s,
        members=_members(node),
        plan=plan_stages(plan),
        plan_quantization=plan.quantization if plan is not None else None,
        plan_error=first.plan_error,
        predicted_ms_per_token=plan.predicted_s_per_token * 1000 if plan is not None else None,
        events=list(node.events),
        nat=_nat_status(node),
        datagrams_dropped=dict(node.endpoint.stats.dropped),
        handshakes_refused=dict(node.endpoint.stats.refused),
        models=model_statuses(node),
        fetch=node.artifacts.status(),
        tasks=sum(tasks.values()),
        tasks_by_name=tasks,
        prefix_cache=prefix_cache_status(node),
        draft=draft_status(node.basis.draft),
    )
    return status


def draft_status(draft: DraftModel | None) -> DraftStatus | None:
    """What `draft` holds now (None: no draft model)."""
    if draft is None:
        return None
    return DraftStatus(
        model=model_name(draft.path),
        path=draft.path,
        weight_bytes=draft.stage.weight_bytes,
        sessions=draft.sessions,
        kv_used_bytes=draft.kv_used_bytes,
        prefix_cache_bytes=draft.cache_bytes,
    )


def _kv_budget_bytes(node: MeshNode) -> int:
    slots = [m.slot for m in node.models]
    if all(slot.layers is None for slot in slots):
        return 0
    weights = sum(slot.weight_bytes for slot in slots)
    return max(0, node.capacity().memory_budget_bytes - weights)


def _remote(addr: Hashable) -> str:
    if isinstance(addr, RelayPath):
        addr = addr.via
    if isinstance(addr, tuple):
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


def _nat_status(node: MeshNode) -> NatStatus:
    nat, relay = node.peers.nat.stats, node.peers.nat.relay.stats
    return NatStatus(
        punches_direct=nat.punches_direct,
        punches_relayed=nat.punches_relayed,
        introductions_made=nat.introductions_made,
        introductions_refused=nat.introductions_refused,
        relay_sessions_opened=relay.sessions_opened,
        relay_forwarded_datagrams=relay.forwarded_datagrams,
        relay_forwarded_bytes=relay.forwarded_bytes,
    )
