"""Segments: a run of layers between two nodes, the candidate pool for it, and its plans.

A *segment* is a run of layers [layer_start, layer_end) entered from node `before` and left
to node `after`. A whole-model plan is one segment from the coordinator back to it; when
re-planning around surviving stages, each gap between them is a segment between its
neighbours.

The pool pre-filter keeps the fastest, the largest, the closest to the segment's ends, and
the nearest neighbours of the fastest and largest (so co-located groups come in together),
`pool_per_criterion` of each, plus the fastest nodes that hold a fair share of the layers. Everything after it is independent of the mesh's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.plan.cost_model import Candidate, HopCosts
from meshd.plan.inputs import PlannerConfig

# Nearest neighbours are taken around this many of the fastest and of the largest nodes.
_NEIGHBOUR_SOURCES = 2


@dataclass(frozen=True, slots=True)
class Segment:
    """Layers [layer_start, layer_end) between node `before` and node `after`."""

    layer_start: int
    layer_end: int
    before: bytes
    after: bytes
    model_first: bool
    model_last: bool

    @property
    def layers(self) -> int:
        """How many layers the segment covers."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Nodes in pipeline order with their layer counts; compute and hop cost per token."""

    nodes: tuple[Candidate, ...]
    counts: tuple[int, ...]
    compute_s: float
    network_s: float

    @property
    def total_s(self) -> float:
        """Compute plus hop cost (including the hop out to `after`)."""
        return self.compute_s + self.network_s


@dataclass(slots=True)
class SegmentResult:
    """The chosen plan for a segment and what was tried."""

    best: SegmentPlan | None
    by_stages: dict[int, SegmentPlan | None] = field(default_factory=dict)
    # Fewest stages whose plain layer capacities cover the segment (before embedding/head).
    min_stages: int = 0

    @property
    def fewest_feasible(self) -> int | None:
        """Fewest stages of any plan found that fits memory."""
        return min((k for k, p in self.by_stages.items() if p is not None), default=None)


def select_pool(
    segment: Segment, candidates: Sequence[Candidate], hops: HopCosts, config: PlannerConfig
) -> list[Candidate]:
    """The candidates worth searching for this segment (bounded, independent of mesh size)."""
    per = config.pool_per_criterion
    usable = [c for c in candidates if c.cap_mid >= 1]
    if len(usable) <= 4 * per:
        return usable
    fastest = sorted(usable, key=lambda c: (c.s_per_layer, -c.cap_mid))
    largest = sorted(usable, key=lambda c: (-c.cap_mid, c.s_per_layer))
    stages_needed = min_stages(segment.layers, [c.cap_mid for c in largest], len(largest))
    ends = {
        c.key: hops.cost(segment.before, c.key) + hops.cost(c.key, segment.after) for c in usable
    }
    closest = sorted(usable, key=lambda c: ends[c.key])
    # Fast nodes that also hold a fair share: the likely backbone of a good plan.
    share = segment.layers // (stages_needed + 1)
    fast_big = [c for c in fastest if c.cap_mid >= share]
    chosen: dict[bytes, Candidate] = {}
    groups = (fastest[:per], fast_big[:per], largest[: max(per, stages_needed + 2)], closest[:per])
    for group in groups:
        for c in group:
            chosen.setdefault(c.key, c)
    for source in fastest[:_NEIGHBOUR_SOURCES] + largest[:_NEIGHBOUR_SOURCES]:
        near = sorted(usable, key=lambda c: hops.cost(source.key, c.key))
        for c in near[: per // 2 + 1]:
            chosen.setdefault(c.key, c)
    return list(chosen.values())


def min_stages(layers: int, caps_desc: Sequence[int], limit: int) -> int:
    """Fewest nodes (largest first) whose capacities cover `layers`; limit + 1 if none do."""
    total = 0
    for i, cap in enumerate(caps_desc[:limit]):
        total += cap
        if total >= layers:
            return i + 1
    return limit + 1
