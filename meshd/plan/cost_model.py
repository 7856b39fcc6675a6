"""The cost model: what a node can hold, what a hop costs, how layers split over nodes.

Predicted time per token of a route coordinator → s0 → … → s_last → coordinator:

    T = Σ_i c_i · n_i  +  Σ_hops (rtt(u, v) / 2 + P)

with c_i the node's per-layer time per token (scaled by its load), n_i its layer count, and
the hop sum over the cycle's hops between distinct nodes (a stage on the coordinator itself
costs nothing to reach). The split that minimises Σ c_i · n_i for a fixed node set fills the
fastest nodes first (each stage keeps at least one layer); nodes within `speed_tie_fraction`
of each other share their part in proportion to capacity, which leaves every node the same
share of headroom for other sessions' KV at a cost of at most that fraction of compute.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshd.plan.inputs import ModelShape, NodeCapacity, PlannerConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    """A usable node with its capacity in whole layers for each role it may take."""

    key: bytes
    s_per_layer: float
    usable_bytes: int
    # Layers it holds as a middle stage, as the first stage (embedding), as the last (head),
    # and as the only stage (both).
    cap_mid: int
    cap_first: int
    cap_last: int
    cap_only: int
    fixed_layers: tuple[int, int] | None

    def cap(self, first: bool, last: bool) -> int:
        """Layers this node holds when it is (or is not) the model's first and last stage."""
        if first and last:
            return self.cap_only
        if first:
            return self.cap_first
        if last:
            return self.cap_last
        return self.cap_mid


def usable_bytes(node: NodeCapacity, config: PlannerConfig) -> int:
    """The part of a node's memory budget the planner may fill."""
    kept = int(node.memory_budget_bytes * (1.0 - config.memory_margin_fraction))
    return max(0, kept - config.memory_reserve_bytes)


def make_candidate(
    node: NodeCapacity, model: ModelShape, context_tokens: int, config: PlannerConfig
) -> Candidate:
    """A node's capacities in layers for this model and context length."""
    usable = usable_bytes(node, config)
    per_layer = model.layer_bytes(context_tokens)

    def cap(extra: int) -> int:
        return min(model.num_layers, max(0, (usable - extra) // per_layer))

    return Candidate(
        key=node.key,
        s_per_layer=node.effective_s_per_layer_token,
        usable_bytes=usable,
        cap_mid=cap(0),
        cap_first=cap(model.extra_bytes(True, False, context_tokens)),
        cap_last=cap(model.extra_bytes(False, True, context_tokens)),
        cap_only=cap(model.extra_bytes(True, True, context_tokens)),
        fixed_layers=node.fixed_layers,
    )


def stage_bytes(model: ModelShape, context_tokens: int, layer_start: int, layer_end: int) -> int:
    """Memory a stage serving [layer_start, layer_end) needs (weights, KV, embedding, head)."""
    need = (layer_end - layer_start) * model.layer_bytes(context_tokens)
    return need + model.extra_bytes(layer_start == 0, layer_end == model.num_layers, context_tokens)


class HopCosts:
    """One-way latency and protocol cost of hops between node keys, from the RTT matrix."""

    def __init__(self, rtt_s: Mapping[tuple[bytes, bytes], float], config: PlannerConfig) -> None:
        self.rtt_s = rtt_s
        self.config = config

    def rtt(self, a: bytes, b: bytes) -> tuple[float, bool]:
        """(round trip seconds, measured?) between two nodes; symmetric if one side is known."""
        if a == b:
            return 0.0, True
        value = self.rtt_s.get((a, b))
        if value is None:
            value = self.rtt_s.get((b, a))
        if value is None:
            return self.config.unknown_rtt_s, False
        return max(0.0, value), True

    def cost(self, a: bytes, b: bytes) -> float:
        """Seconds a message spends going from a to b: one-way latency plus P (0 if a == b)."""
        if a == b:
            return 0.0
        return self.rtt(a, b)[0] / 2.0 + self.config.hop_cost_s

    def cycle_s(self, coordinator: bytes, keys: Sequence[bytes]) -> float:
        """Hop cost of coordinator → keys[0] → … → keys[-1] → coordinator."""
        path = [coordinator, *keys, coordinator]
        return sum(self.cost(a, b) for a, b in itertools.pairwise(path))

    def matrix(self, keys: Sequence[bytes]) -> list[list[float]]:
        """Dense hop-cost matrix over `keys` (row = from, column = to)."""
        return [[self.cost(a, b) for b in keys] for a in keys]


def split_layers(
    layers: int, speeds: Sequence[float], caps: Sequence[int], tie_fraction: float
) -> list[int] | None:
    """Layer counts per node minimising Σ speed·count, each ≥ 1 and ≤ cap; None if impossible.

    Fastest first; a group of nodes within `tie_fraction` of the group's fastest shares its
    part in proportion to capacity. (Hot in the search: kept free of per-call allocations.)
    """
    k = len(speeds)
    if k == 0 or layers < k or min(caps) < 1 or sum(caps) < layers:
        return None
    counts = [1] * k
    remaining = layers - k
    # Stable sort: equal speeds keep input order, and always share one tie group.
    order = sorted(range(k), key=speeds.__getitem__)
    idx = 0
    while remaining > 0:
        first = order[idx]
        limit = speeds[first] * (1.0 + tie_fraction)
        end = idx + 1
        while end < k and speeds[order[end]] <= limit:
            end += 1
        if end == idx + 1:
            take = min(remaining, caps[first] - 1)
            counts[first] += take
        else:
            group = order[idx:end]
            room = [caps[i] - 1 for i in group]
            take = min(remaining, sum(room))
            for i, share in zip(group, _proportional(take, room), strict=True):
                counts[i] += share
        remaining -= take
        idx = end
    return counts


def _proportional(total: int, weights: Sequence[int]) -> list[int]:
    """Integers summing to `total` (≤ Σ weights), in proportion to `weights`, none above its weight."""
    weight_sum = sum(weights)
    if total == 0 or weight_sum == 0:
        return [0] * len(weights)
    ideal = [total * w / weight_sum for w in weights]
    shares = [int(x) for x in ideal]
    short = total - sum(shares)
    # Largest remainders first; a positive remainder means floor < ideal ≤ weight, so +1 fits.
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - ideal[i], i))
    for i in by_remainder[:short]:
        shares[i] += 1
    return shares


def compute_s(counts: Sequence[int], speeds: Sequence[float]) -> float:
    """Σ per-stage compute per token."""
    return sum(n * s for n, s in zip(counts, speeds, strict=True))
