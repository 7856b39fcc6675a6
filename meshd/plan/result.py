"""What the planner returns: a `Plan` with its stages, hops, figures and the options weighed."""

from __future__ import annotations

from dataclasses import dataclass

from meshd.plan.route import Route, RouteStage


@dataclass(frozen=True, slots=True)
class Hop:
    """One hop of the cycle coordinator → stages → coordinator."""

    src: bytes
    dst: bytes
    rtt_s: float
    measured: bool
    # One-way latency plus the protocol cost P; 0 when src == dst (same node).
    cost_s: float

    @property
    def local(self) -> bool:
        """True when both ends are the same node (no network)."""
        return self.src == self.dst


@dataclass(frozen=True, slots=True)
class PlannedStage:
    """One stage with what it costs and needs."""

    node_key: bytes
    layer_start: int
    layer_end: int
    s_per_layer_token: float
    compute_s: float
    # Weights plus KV for the plan's context (weight_bytes: the weights alone).
    memory_bytes: int
    usable_bytes: int
    # Layers the node must load: 0 when it holds exactly this range, else all of them.
    reload_layers: int
    weight_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Alternative:
    """An option the planner weighed: its predicted time (None: infeasible) and verdict."""

    label: str
    predicted_s_per_token: float | None
    note: str


@dataclass(frozen=True, slots=True)
class Census:
    """How many offered nodes were usable, and why the others were not."""

    offered: int
    unhealthy: int
    excluded: int
    without_model: int
    too_small: int
    fixed_range: int
    usable: int


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered route with layer ranges and its predicted time per token."""

    model_id: str
    num_layers: int
    coordinator: bytes
    context_tokens: int
    stages: tuple[PlannedStage, ...]
    hops: tuple[Hop, ...]
    hop_cost_s: float
    min_stages: int
    min_stages_reason: str
    census: Census
    alternatives: tuple[Alternative, ...]
    # Hop cost of the same stages ordered by RTT to the coordinator alone.
    naive_order_network_s: float
    kept_stages: int
    # How every stage holds its weights ("none", "gguf", "q8_0", ...); the stages' memory is at it.
    quantization: str = "none"

    @property
    def compute_s(self) -> float:
        """Σ stage compute per token."""
        return sum(s.compute_s for s in self.stages)

    @property
    def latency_s(self) -> float:
        """Σ one-way latencies around the cycle."""
        return sum(h.rtt_s / 2.0 for h in self.hops if not h.local)

    @property
    def protocol_s(self) -> float:
        """P times the number of network hops."""
        return self.hop_cost_s * sum(1 for h in self.hops if not h.local)

    @property
    def network_s(self) -> float:
        """Latency plus protocol cost around the cycle."""
        return sum(h.cost_s for h in self.hops)

    @property
    def predicted_s_per_token(self) -> float:
        """compute + network: the time per token without speculation."""
        return self.compute_s + self.network_s

    @property
    def reload_layers(self) -> int:
        """Layers some node must load to serve this plan."""
        return sum(s.reload_layers for s in self.stages)

    @property
    def route(self) -> Route:
        """The route the coordinator drives."""
        return Route(
            self.model_id,
            tuple(RouteStage(s.node_key, s.layer_start, s.layer_end) for s in self.stages),
            self.quantization,
        )
