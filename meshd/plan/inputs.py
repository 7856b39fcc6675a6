"""What the planner is given: the model's shape, each node's capacity, and its tuning.

All sizes are bytes, all times seconds. Node capacities come from membership gossip (memory
budget, measured compute speed, health, current load); the RTT matrix from lane pings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec


class PlannerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Numbers that tune the planner (units in the names); the daemon's `[planner]` table.

    Validated on construction (ValueError naming the field).
    """

    # Protocol cost P of one network hop: encode, encrypt, send, receive, decrypt, decode.
    hop_cost_s: float = 0.0005
    # Round trip assumed for a pair not measured yet (the first plan is made before any pair
    # is measured): a LAN's, so that the first plan may use every node.
    unknown_rtt_s: float = 0.01
    # Share of each node's reported memory kept free (allocator slack, activations).
    memory_margin_fraction: float = 0.10
    # Bytes kept free on every node on top of the margin.
    memory_reserve_bytes: int = 0
    # A plan never has more stages than this.
    max_stages: int = 16
    # Stage order is searched exactly (Held-Karp) up to this many stages, heuristically beyond.
    exact_order_max_stages: int = 8
    # A stage beyond the fewest that fit must cut predicted time per token by this share.
    extra_stage_min_gain_fraction: float = 0.02
    # Nodes whose speeds differ by less than this share split their layers by capacity.
    speed_tie_fraction: float = 0.05
    # A plan that reloads fewer layers wins if it is at most this share slower than the best.
    # Infinite (plans are sticky): a membership change moves only the stages it took away,
    # since every move reloads a stage and fails the sessions on it, and predictions of a
    # small model on a busy machine swing more than any finite share with round-trip noise.
    reuse_tolerance_fraction: float = math.inf
    # Candidates kept for the set search after pre-filtering (per criterion, see search.py).
    pool_per_criterion: int = 10
    # Below this many node sets of one size, every set is tried (exact for small meshes).
    exhaustive_max_sets: int = 120
    # Rounds of swap improvement per seed in the heuristic set search.
    search_max_rounds: int = 6
    # Nodes closer than this round trip count as one site when seeding the set search.
    colocated_rtt_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("hop_cost_s", "unknown_rtt_s", "memory_reserve_bytes", "colocated_rtt_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "memory_margin_fraction",
            "extra_stage_min_gain_fraction",
            "speed_tie_fraction",
        ):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1)")
        for name in ("max_stages", "exact_order_max_stages", "pool_per_criterion"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.exact_order_max_stages > 12:
            raise ValueError("exact_order_max_stages above 12 makes Held-Karp too slow")
        for name in ("reuse_tolerance_fraction", "search_max_rounds", "exhaustive_max_sets"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The model as the planner sees it: layers and their memory."""

    model_id: str
    num_layers: int
    bytes_per_layer: int
    kv_bytes_per_token_per_layer: int
    # Extra weights on the first stage (token embedding).
    embedding_bytes: int = 0
    # Extra weights on the last stage (final norm, LM head, MTP heads).
    head_bytes: int = 0
    # Bytes counted in both embedding_bytes and head_bytes that a stage holding the whole model
    # holds once (a tied head is the embedding table).
    shared_bytes: int = 0
    # KV bytes per position the last stage holds beyond its layers' (its MTP depths).
    head_kv_bytes_per_token: int = 0
    # How the stages hold their weights ("none", "gguf", "q8_0", ...): every stage of a plan agrees,
    # and the figures above are at this quantization.
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("a model needs at least one layer")
        if self.bytes_per_layer < 1:
            raise ValueError("bytes_per_layer must be positive")
        if (
            min(
                self.kv_bytes_per_token_per_layer,
                self.embedding_bytes,
                self.head_bytes,
                self.head_kv_bytes_per_token,
            )
            < 0
        ):
            raise ValueError("KV, embedding and head bytes must be >= 0")
        if not 0 <= self.shared_bytes <= min(self.embedding_bytes, self.head_bytes):
            raise ValueError("shared_bytes must be in [0, min(embedding_bytes, head_bytes)]")

    def layer_bytes(self, context_tokens: int) -> int:
        """Memory one layer needs: its weights plus KV for `context_tokens` positions."""
        return self.bytes_per_layer + self.kv_bytes_per_token_per_layer * context_tokens

    def extra_bytes(self, first: bool, last: bool, context_tokens: int) -> int:
        """Memory beyond the layers' on the model's first and/or last stage: embedding, head
        and MTP weights, and the MTP depths' KV for `context_tokens` positions."""
        extra = (self.embedding_bytes if first else 0) + (self.head_bytes if last else 0)
        if last:
            extra += self.head_kv_bytes_per_token * context_tokens
        return extra - (self.shared_bytes if first and last else 0)


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One node's offer to the planner."""

    key: bytes
    memory_budget_bytes: int
    # Measured seconds to run one layer for one decode token on this node.
    compute_s_per_layer_token: float
    healthy: bool = True
    # False when the node lacks the model's weights (it cannot load layers).
    holds_model: bool = True
    # When set, the node serves exactly these layers [start, end) or nothing.
    fixed_layers: tuple[int, int] | None = None
    # Sessions already decoding on the node; they time-share its compute, so each token
    # costs compute_s_per_layer_token * (1 + load) per layer.
    load: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        if not self.compute_s_per_layer_token > 0:
            raise ValueError("compute_s_per_layer_token must be positive")
        if self.load < 0:
            raise ValueError("load must be >= 0")
        if self.fixed_layers is not None and not 0 <= self.fixed_layers[0] < self.fixed_layers[1]:
            raise ValueError(f"fixed_layers {self.fixed_layers} is not a non-empty range")

    @property
    def effective_s_per_layer_token(self) -> float:
        """Per-layer time per token for one more session, given the current load."""
        return self.compute_s_per_layer_token * (1.0 + self.load)


class NoFeasiblePlan(Exception):
    """No route fits: the message says why (memory short by how much, nodes filtered out)."""

    def __init__(
        self,
        reason: str,
        *,
        needed_bytes: int = 0,
        usable_bytes: int = 0,
        shortfall_bytes: int = 0,
        usable_nodes: int = 0,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.needed_bytes = needed_bytes
        self.usable_bytes = usable_bytes
        self.shortfall_bytes = shortfall_bytes
        self.usable_nodes = usable_nodes
