"""Each model's plan as `meshctl status` and `meshctl plan` show it, for a mesh serving several.

A model this node holds is planned here (its plan, the stage it hosts here, its sessions). A
model only other members hold is shown as they report it: the stages their signed records say
they have loaded, in layer order (this node cannot plan a model it has no shape of).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from meshd.plan import Plan, explain

if TYPE_CHECKING:
    from meshd.node.node import MeshNode


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


def _held(
    node: MeshNode, name: str, model_id: str, plan: Plan | None, error: str, slot: Any
) -> ModelStatus:
    layers = slot.layers
    return ModelStatus(
        name=name,
        model_id=model_id,
        held=True,
        stage_layers=list(layers) if layers is not None else None,
        sessions_hosted=slot.sessions,
        kv_used_bytes=slot.kv_used_bytes,
        holders=_holders(node, model_id),
        plan=plan_stages(plan),
        plan_quantization=plan.quantization if plan is not None else None,
        plan_error=error,
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
    """Every model the mesh serves: this node's first, then its others, then the rest by id."""
    first = node.shape.model_id
    out = [_held(node, node.basis.name, first, node.plan, node.plan_error, node.slot)]
    for held in node.models:
        out.append(
            _held(node, held.files.name, held.model_id, held.plan, held.plan_error, held.slot)
        )
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
    plans = {node.shape.model_id: (node.plan, node.plan_error)}
    plans.update({h.model_id: (h.plan, h.plan_error) for h in node.models})
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
