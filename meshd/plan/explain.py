"""`explain(plan)`: the plan in words for `meshctl plan`, with the figures that decided it."""

from __future__ import annotations

from collections.abc import Mapping

from meshd.plan.result import Plan
from meshd.plan.units import format_bytes, format_ms, short_key


def explain(plan: Plan, names: Mapping[bytes, str] | None = None) -> str:
    """A readable multi-line explanation: nodes, stage count, time split, options rejected.

    `names` maps node keys to names the operator knows (hostnames); others show short keys.
    """

    def name(key: bytes) -> str:
        if names is not None and key in names:
            return names[key]
        return short_key(key)

    n = len(plan.stages)
    lines = [
        f"Plan for {plan.model_id} ({plan.num_layers} layers, quantization "
        f"{plan.quantization}, context {plan.context_tokens} tokens): "
        f"{n} stage{'s' if n != 1 else ''}, predicted "
        f"{format_ms(plan.predicted_s_per_token)}/token = compute {format_ms(plan.compute_s)} "
        f"+ network {format_ms(plan.network_s)}",
        f"Why {n} stage{'s' if n != 1 else ''}: {plan.min_stages_reason}"
        + (
            f"; {n - plan.min_stages} more than the fewest because that lowers the predicted time"
            if n > plan.min_stages
            else ""
        )
        + ".",
        _census_line(plan),
    ]
    if plan.kept_stages:
        lines.append(f"Re-plan: kept {plan.kept_stages} stage(s) on nodes that hold their layers.")
    lines.append("Stages in pipeline order:")
    for i, s in enumerate(plan.stages):
        load = f", loads {s.reload_layers} layer(s)" if s.reload_layers else ", layers already held"
        lines.append(
            f"  s{i} {name(s.node_key)}: layers {s.layer_start}-{s.layer_end - 1} "
            f"({s.layer_end - s.layer_start}) at {format_ms(s.s_per_layer_token)}/layer = "
            f"{format_ms(s.compute_s)}; memory {format_bytes(s.memory_bytes)} (weights "
            f"{format_bytes(s.weight_bytes)} + KV {format_bytes(s.memory_bytes - s.weight_bytes)}"
            f") of {format_bytes(s.usable_bytes)} usable{load}"
        )
    lines.append(
        f"Network cycle (one-way latency = RTT/2, plus P = {format_ms(plan.hop_cost_s)} per "
        "network hop):"
    )
    for hop in plan.hops:
        route = f"{name(hop.src)} -> {name(hop.dst)}"
        if hop.local:
            lines.append(f"  {route}: same node, 0 ms")
            continue
        assumed = "" if hop.measured else " (not measured: pessimistic default)"
        lines.append(f"  {route}: RTT {format_ms(hop.rtt_s)}{assumed} -> {format_ms(hop.cost_s)}")
    network_hops = sum(1 for h in plan.hops if not h.local)
    lines.append(
        f"  total {format_ms(plan.network_s)} = latency {format_ms(plan.latency_s)} + "
        f"protocol {format_ms(plan.protocol_s)} over {network_hops} network hop(s)"
    )
    if n > 1:
        lines.append(
            f"Order: chosen by pairwise RTT, {format_ms(plan.network_s)} around the cycle; "
            f"ordering by RTT to the coordinator alone would cost "
            f"{format_ms(plan.naive_order_network_s)}."
        )
    if plan.alternatives:
        lines.append("Alternatives weighed:")
        for alt in plan.alternatives:
            t = (
                "infeasible"
                if alt.predicted_s_per_token is None
                else format_ms(alt.predicted_s_per_token)
            )
            if alt.label.startswith("fastest unused"):
                t = "not used"
            lines.append(f"  {alt.label}: {t} - {alt.note}")
    lines.append(
        "Model: time/token = sum of stage compute + sum over hops of (RTT/2 + P); a verify "
        "window that commits E tokens divides the network part by E."
    )
    return "\n".join(lines)


def _census_line(plan: Plan) -> str:
    c = plan.census
    parts = [
        f"{count} {what}"
        for count, what in (
            (c.unhealthy, "unhealthy"),
            (c.excluded, "excluded"),
            (c.without_model, "without the model"),
            (c.too_small, "too small"),
            (c.fixed_range, "with a fixed layer range"),
        )
        if count
    ]
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"Candidates: {c.offered} offered, {c.usable} usable{detail}."
