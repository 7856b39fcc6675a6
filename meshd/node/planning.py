"""Leaderless, deterministic planning over the membership view.

Every node runs the planner on its own view. The stage assignment must come out the same on
every node that sees the same view, so nothing node-local goes in: the inputs are the healthy
members holding the model at the planning node's own quantization (sorted by id; stages of
one plan must compute the same tokens, so each quantization gets its own plan and a node is
only ever in its own quantization's), their signed capacity records (memory, measured
compute, the layers they have loaded or are loading now, which the planner prefers to keep),
the gossiped RTT matrix, and a coordinator every node agrees on (the lowest member id).
Planner keys are Ed25519 node ids; the route the coordinator drives uses lane (X25519) keys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from meshd.mesh.member import MemberInfo
from meshd.model.checkpoint import Checkpoint
from meshd.model.config import ModelConfig
from meshd.model.gguf_checkpoint import GGUFCheckpoint
from meshd.model.llama import decoder_layer_shapes
from meshd.model.quant import check_quantization
from meshd.model.stage import kv_bytes_per_token, layer_bytes, stage_weight_bytes
from meshd.plan import ModelShape, NodeCapacity, NoFeasiblePlan, Plan, PlannerConfig, plan
from meshd.plan.route import Route, RouteStage
from protocol.gossip import ModelHolding
from protocol.noise import x25519_public_from_ed25519_public


def model_shape(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    quantization: str = "none",
    kv_dtype: torch.dtype | None = None,
) -> ModelShape:
    """The model as the planner sees it: the bytes a stage holds at `quantization`.

    Layer, embedding and head bytes are `stage_weight_bytes`'s (what `StageModel.weight_bytes`
    counts once loaded); KV per token is at `kv_dtype` (default: `dtype`), the last stage's
    MTP depths included (`StageModel.kv_bytes_per_token`).
    """
    quantization = check_quantization(quantization)  # an alias under the name it stands for
    if quantization == "gguf":
        return stored_shape(checkpoint, dtype, kv_dtype)
    return config_shape(checkpoint.config, checkpoint.model_id, dtype, quantization, kv_dtype)


def stored_shape(
    checkpoint: Checkpoint, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> ModelShape:
    """`model_shape` of a GGUF file run as stored: its tensors' bytes in the file.

    A K-quant file mixes types across layers (Q4_K_M holds some layers' down and v matrices
    in Q6_K), so a layer counts as the largest layer of the file: the planner never gives a
    node more layers than fit.
    """
    if not isinstance(checkpoint, GGUFCheckpoint):
        raise ValueError(f"quantization gguf runs GGUF files: {checkpoint.directory} is not one")
    config, tensors = checkpoint.config, checkpoint.file_tensors
    n = config.num_layers

    def held(names: list[str]) -> int:
        return sum(tensors[name].nbytes for name in names if name in tensors)

    per_layer = max(
        held([f"model.layers.{i}.{name}" for name in decoder_layer_shapes(config)])
        for i in range(n)
    )
    embed = held(["model.embed_tokens.weight"])
    tied = config.tie_word_embeddings

    def extra(start: int, end: int) -> int:
        first, last = start == 0, end == n
        total = embed if first else 0
        if last:
            total += held(["model.norm.weight"])
            total += (0 if first else embed) if tied else held(["lm_head.weight"])
        return total

    return _shape(config, checkpoint.model_id, per_layer, extra, kv_dtype or dtype, "gguf")


def config_shape(
    config: ModelConfig,
    model_id: str,
    dtype: torch.dtype,
    quantization: str = "none",
    kv_dtype: torch.dtype | None = None,
) -> ModelShape:
    """`model_shape` from a model's config and id alone (no weights needed)."""
    quantization = check_quantization(quantization)
    per_layer = layer_bytes(config, dtype, quantization)

    def extra(start: int, end: int) -> int:
        return stage_weight_bytes(config, start, end, dtype, quantization) - (
            (end - start) * per_layer
        )

    return _shape(config, model_id, per_layer, extra, kv_dtype or dtype, quantization)


def _shape(
    config: ModelConfig,
    model_id: str,
    per_layer: int,
    extra: Callable[[int, int], int],
    kv_dtype: torch.dtype,
    quantization: str,
) -> ModelShape:
    """The shape from a layer's bytes and `extra(start, end)`, the bytes a stage of those
    layers holds besides its layers (embedding, norm, head)."""
    n = config.num_layers
    only = extra(0, n)
    # With one layer the first stage is the last: only the whole-model figure exists.
    first, last = (extra(0, 1), extra(n - 1, n)) if n > 1 else (only, only)
    return ModelShape(
        model_id=model_id,
        num_layers=n,
        bytes_per_layer=per_layer,
        kv_bytes_per_token_per_layer=kv_bytes_per_token(config, 1, kv_dtype),
        head_kv_bytes_per_token=kv_bytes_per_token(config, config.num_mtp_layers, kv_dtype),
        embedding_bytes=first,
        head_bytes=last,
        shared_bytes=max(0, first + last - only),
        quantization=quantization,
    )


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the planner is given, derived only from the shared view."""

    nodes: tuple[NodeCapacity, ...]
    held: Mapping[bytes, tuple[int, int]]
    coordinator: bytes


def holding_of(
    info: MemberInfo, model_id: str, quantization: str | None = None
) -> ModelHolding | None:
    """The member's holding of `model_id` (at `quantization` when given), if it offers it."""
    if info.capacity is None:
        return None
    for holding in info.capacity.models:
        if holding.model_id == model_id and quantization in (None, holding.quantization):
            return holding
    return None


def plan_inputs(
    view: Mapping[bytes, MemberInfo],
    model_id: str,
    quantization: str,
    exclude: Collection[bytes] = frozenset(),
) -> PlanInputs:
    """Healthy members offering `model_id` at `quantization` (not excluded), in id order, and
    the layers they have loaded or are loading (a load in flight is kept like a loaded stage:
    otherwise a plan made while stages load, such as a joining node's, starts other loads of
    the same layers). Members holding the model at another quantization are left out: the
    stages of one plan must compute the same tokens."""
    nodes: list[NodeCapacity] = []
    held: dict[bytes, tuple[int, int]] = {}
    for node_id in sorted(view):
        info = view[node_id]
        holding = holding_of(info, model_id, quantization)
        if not info.healthy or holding is None or info.capacity is None or node_id in exclude:
            continue
        compute_s = max(1, holding.compute_ns_per_layer_token) / 1e9
        # A node holding several models offers each its share (`ModelHolding`).
        budget = holding.memory_budget_bytes or info.capacity.memory_budget_bytes
        nodes.append(NodeCapacity(node_id, budget, compute_s))
        if holding.loaded or holding.loading:
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
    inputs = plan_inputs(view, shape.model_id, shape.quantization, exclude)
    if not inputs.nodes:
        raise NoFeasiblePlan(
            f"no healthy member offers the model at quantization {shape.quantization}"
        )
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
        p.quantization,
    )


def route_served(
    route: Route, view: Mapping[bytes, MemberInfo], exclude: Collection[bytes] = frozenset()
) -> bool:
    """True while every stage of `route` (lane keys) is a healthy member of `view`, not in
    `exclude`, holding exactly that stage's layers of the route's model loaded."""
    lanes = {x25519_public_from_ed25519_public(node_id): node_id for node_id in view}
    for stage in route.stages:
        node_id = lanes.get(stage.node_key)
        if node_id is None or node_id in exclude or not view[node_id].healthy:
            return False
        holding = holding_of(view[node_id], route.model_id, route.quantization or None)
        if holding is None or not holding.loaded:
            return False
        if (holding.layer_start, holding.layer_end) != (stage.layer_start, stage.layer_end):
            return False
    return True
