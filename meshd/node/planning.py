"""Leaderless, deterministic planning over the membership view.

Every node runs the planner on its own view. The stage assignment must come out the same on
every node that sees the same view, so nothing node-local goes in: the inputs are the healthy
members holding the model (sorted by id), their signed capacity records (memory, measured
compute, the layers they have loaded now, which the planner prefers to keep), the gossiped RTT
matrix, and a coordinator every node agrees on (the lowest member id). Planner keys are
Ed25519 node ids; the route the coordinator drives uses lane (X25519) keys.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from meshd.coord.route import Route, RouteStage
from meshd.mesh.member import MemberInfo
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import kv_bytes_per_token, layer_bytes
from meshd.plan import ModelShape, NodeCapacity, NoFeasiblePlan, Plan, PlannerConfig, plan
from protocol.gossip import ModelHolding
from protocol.noise import x25519_public_from_ed25519_public


def model_shape(checkpoint: Checkpoint, dtype: torch.dtype) -> ModelShape:
    """The model as the planner sees it, for weights held as `dtype`."""
    config = checkpoint.config
    item = torch.empty(0, dtype=dtype).element_size()
    embedding = config.vocab_size * config.hidden_size * item
    head = 0 if config.tie_word_embeddings else embedding
    # Each MTP depth is about one decoder layer plus its projections; the last stage holds them.
    head += config.num_mtp_layers * layer_bytes(config, dtype)
    return ModelShape(
        model_id=checkpoint.model_id,
        num_layers=config.num_layers,
        bytes_per_layer=layer_bytes(config, dtype),
        kv_bytes_per_token_per_layer=kv_bytes_per_token(config, 1, dtype),
        embedding_bytes=embedding,
        head_bytes=head,
    )


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the planner is given, derived only from the shared view."""

    nodes: tuple[NodeCapacity, ...]
    held: Mapping[bytes, tuple[int, int]]
    coordinator: bytes


def holding_of(info: MemberInfo, model_id: str) -> ModelHolding | None:
    """The member's holding of `model_id` in its capacity record, if it offers it."""
    if info.capacity is None:
        return None
    for holding in info.capacity.models:
        if holding.model_id == model_id:
            return holding
    return None


def plan_inputs(
    view: Mapping[bytes, MemberInfo], model_id: str, exclude: Collection[bytes] = frozenset()
) -> PlanInputs:
    """Healthy members offering `model_id` (not excluded), in id order, and their loaded layers."""
    nodes: list[NodeCapacity] = []
    held: dict[bytes, tuple[int, int]] = {}
    for node_id in sorted(view):
        info = view[node_id]
        holding = holding_of(info, model_id)
        if not info.healthy or holding is None or info.capacity is None or node_id in exclude:
            continue
        compute_s = max(1, holding.compute_ns_per_layer_token) / 1e9
        nodes.append(NodeCapacity(node_id, info.capacity.memory_budget_bytes, compute_s))
        if holding.loaded:
            held[node_id] = (holding.layer_start, holding.layer_end)
    coordinator = nodes[0].key if nodes else b""
    return PlanInputs(tuple(nodes), held, coordinator)


def plan_view(
    view: Mapping[bytes, MemberInfo],
    shape: ModelShape,
    rtt_s: Mapping[tuple[bytes, bytes], float],
    *,
    context_tokens: int,
    exclude: Collection[bytes] = frozenset(),
    config: PlannerConfig | None = None,
) -> Plan:
    """The mesh's plan for the model as this view shows it (NoFeasiblePlan if none fits)."""
    inputs = plan_inputs(view, shape.model_id, exclude)
    if not inputs.nodes:
        raise NoFeasiblePlan("no healthy member offers the model")
    return plan(
        shape,
        inputs.nodes,
        rtt_s,
        inputs.coordinator,
        context_tokens=context_tokens,
        prefer=dict(inputs.held),
        config=config,
    )


def assignment(p: Plan, node_id: bytes) -> tuple[int, int] | None:
    """The layers `node_id` serves in the plan (None: it is a spare)."""
    for stage in p.stages:
        if stage.node_key == node_id:
            return stage.layer_start, stage.layer_end
    return None


def lane_route(p: Plan) -> Route:
    """The plan's route with lane (X25519) keys, as the coordinator and stages address peers."""
    return Route(
        p.model_id,
        tuple(
            RouteStage(x25519_public_from_ed25519_public(s.node_key), s.layer_start, s.layer_end)
            for s in p.stages
        ),
    )
