"""How good is a plan? A lower bound, and the best of many random feasible plans.

Both are computed here from the documented cost model and memory rule (docs/planner.md),
independently of the planner's own search, so they can judge it:

- `lower_bound_s`: no route can be faster. Compute: the fastest usable nodes filled to
  their middle-stage capacity (embedding and head ignored, which only loosens the bound).
  Network: the fewest stages that could hold the layers, each needing at least one hop at
  the shortest round trip any path has, plus P; nothing when one node could hold it all.
- `best_random_plan_s`: random node sets of the planner's stage counts, in random order,
  each split optimally for that order (one layer each, then the fastest filled first),
  memory checked per role; the fastest feasible one wins.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshd.plan.inputs import ModelShape, NodeCapacity, PlannerConfig


@dataclass(frozen=True, slots=True)
class Offer:
    """A usable node's speed and its layer capacity in each role."""

    key: bytes
    s_per_layer: float
    cap_mid: int
    cap_first: int
    cap_last: int
    cap_only: int

    def cap(self, first: bool, last: bool) -> int:
        """Layers it holds as the first and/or last stage, or as a middle one."""
        if first and last:
            return self.cap_only
        return self.cap_first if first else self.cap_last if last else self.cap_mid


def offers(
    model: ModelShape, nodes: Sequence[NodeCapacity], context_tokens: int, config: PlannerConfig
) -> list[Offer]:
    """The usable nodes (healthy, holding the model, room for a layer) with their capacities."""
    per_layer = model.layer_bytes(context_tokens)
    out = []
    for node in nodes:
        if not (node.healthy and node.holds_model) or node.fixed_layers is not None:
            continue
        usable = int(node.memory_budget_bytes * (1.0 - config.memory_margin_fraction))
        usable = max(0, usable - config.memory_reserve_bytes)

        def layers(extra: int, usable: int = usable) -> int:
            return max(0, (usable - extra) // per_layer)

        offer = Offer(
            node.key,
            node.effective_s_per_layer_token,
            layers(0),
            layers(model.extra_bytes(True, False, context_tokens)),
            layers(model.extra_bytes(False, True, context_tokens)),
            layers(model.extra_bytes(True, True, context_tokens)),
        )
        if offer.cap_mid >= 1:
            out.append(offer)
    return out


def fewest_stages(num_layers: int, usable: Sequence[Offer]) -> int | None:
    """The fewest nodes whose middle-stage capacities add up to the layers (None: never)."""
    held = 0
    for k, cap in enumerate(sorted((o.cap_mid for o in usable), reverse=True), start=1):
        held += cap
        if held >= num_layers:
            return k
    return None


def lower_bound_s(
    num_layers: int, usable: Sequence[Offer], min_rtt_s: float, config: PlannerConfig
) -> float:
    """A time per token no route over `usable` can beat (see the module docstring)."""
    left, compute = num_layers, 0.0
    for offer in sorted(usable, key=lambda o: o.s_per_layer):
        take = min(left, offer.cap_mid)
        compute += take * offer.s_per_layer
        left -= take
        if left == 0:
            break
    stages = fewest_stages(num_layers, usable) or 1
    network = 0.0 if stages == 1 else stages * (min_rtt_s / 2.0 + config.hop_cost_s)
    return compute + network


def route_cost_s(
    stages: Sequence[tuple[Offer, int]],
    rtt_s: Mapping[tuple[bytes, bytes], float],
    coordinator: bytes,
    config: PlannerConfig,
) -> float:
    """Predicted time per token of (node, layers) stages in order, from the coordinator."""
    compute = sum(offer.s_per_layer * count for offer, count in stages)
    keys = [coordinator, *(offer.key for offer, _ in stages), coordinator]
    network = 0.0
    for a, b in itertools.pairwise(keys):
        if a != b:
            rtt = rtt_s.get((a, b), rtt_s.get((b, a), config.unknown_rtt_s))
            network += rtt / 2.0 + config.hop_cost_s
    return compute + network


def split(order: Sequence[Offer], num_layers: int) -> list[int] | None:
    """The cheapest layer counts for nodes in this order (None: they cannot hold the model)."""
    last = len(order) - 1
    caps = [o.cap(i == 0, i == last) for i, o in enumerate(order)]
    if min(caps) < 1 or sum(caps) < num_layers or len(order) > num_layers:
        return None
    counts = [1] * len(order)
    left = num_layers - len(order)
    for i in sorted(range(len(order)), key=lambda i: order[i].s_per_layer):
        take = min(left, caps[i] - 1)
        counts[i] += take
        left -= take
    return counts


@dataclass(frozen=True, slots=True)
class RandomSearch:
    """The best of `samples` random plans: its time (None: none feasible) and how many fit."""

    best_s: float | None
    feasible: int
    samples: int


def best_random_plan_s(
    num_layers: int,
    usable: Sequence[Offer],
    rtt_s: Mapping[tuple[bytes, bytes], float],
    coordinator: bytes,
    stage_counts: Sequence[int],
    *,
    samples: int,
    rng: random.Random,
    config: PlannerConfig,
) -> RandomSearch:
    """Draw `samples` random ordered node sets (sizes from `stage_counts`); keep the best."""
    best: float | None = None
    feasible = 0
    counts_allowed = [k for k in stage_counts if 1 <= k <= len(usable)]
    for _ in range(samples if counts_allowed else 0):
        order = rng.sample(list(usable), rng.choice(counts_allowed))
        counts = split(order, num_layers)
        if counts is None:
            continue
        feasible += 1
        cost = route_cost_s(list(zip(order, counts, strict=True)), rtt_s, coordinator, config)
        best = cost if best is None else min(best, cost)
    return RandomSearch(best, feasible, samples)
