"""On small meshes the planner's choice is the optimum of its cost model.

The reference here is independent of the planner's code: it tries every ordered tuple of
nodes, sizes each stage from bytes (embedding on the first, head on the last), finds the
cheapest layer split by dynamic programming and adds the hop costs around the cycle.
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from meshd.plan import ModelShape, NodeCapacity, NoFeasiblePlan, PlannerConfig, plan

MiB = 1 << 20
CONFIG = PlannerConfig(speed_tie_fraction=0.0, extra_stage_min_gain_fraction=0.0)


@functools.cache
def best_fill(caps: tuple[int, ...], speeds: tuple[float, ...], layers: int) -> float:
    """Minimum Σ speed·count over splits with 1 ≤ count ≤ cap (inf if none)."""
    if not caps:
        return 0.0 if layers == 0 else float("inf")
    return min(
        (
            speeds[0] * c + best_fill(caps[1:], speeds[1:], layers - c)
            for c in range(1, min(caps[0], layers) + 1)
        ),
        default=float("inf"),
    )


def reference(
    model: ModelShape,
    nodes: list[NodeCapacity],
    rtt: dict[tuple[bytes, bytes], float],
    coord: bytes,
) -> float | None:
    """The lowest predicted time per token over every ordered node tuple and split."""
    config = CONFIG

    def rtt_of(a: bytes, b: bytes) -> float:
        if a == b:
            return 0.0
        return rtt.get((a, b), rtt.get((b, a), config.unknown_rtt_s))

    def hop(a: bytes, b: bytes) -> float:
        return 0.0 if a == b else rtt_of(a, b) / 2 + config.hop_cost_s

    def usable(n: NodeCapacity) -> int:
        return int(n.memory_budget_bytes * (1 - config.memory_margin_fraction))

    best: float | None = None
    usable_nodes = [n for n in nodes if n.healthy]
    for k in range(1, min(len(usable_nodes), model.num_layers) + 1):
        for order in itertools.permutations(usable_nodes, k):
            caps = []
            for i, n in enumerate(order):
                extra = (model.embedding_bytes if i == 0 else 0) + (
                    model.head_bytes if i == k - 1 else 0
                )
                caps.append(max(0, (usable(n) - extra) // model.bytes_per_layer))
            speeds = [n.compute_s_per_layer_token for n in order]

            compute = best_fill(tuple(caps), tuple(speeds), model.num_layers)
            if compute == float("inf"):
                continue
            path = [coord, *(n.key for n in order), coord]
            total = compute + sum(hop(a, b) for a, b in itertools.pairwise(path))
            if best is None or total < best:
                best = total
    return best


def random_case(
    seed: int,
) -> tuple[ModelShape, list[NodeCapacity], dict[tuple[bytes, bytes], float]]:
    rng = random.Random(seed)
    model = ModelShape(
        "m",
        rng.randint(6, 12),
        100 * MiB,
        0,
        embedding_bytes=rng.choice([0, 100 * MiB, 250 * MiB]),
        head_bytes=rng.choice([0, 150 * MiB]),
    )
    nodes = [
        NodeCapacity(
            key=f"n{i}".encode(),
            memory_budget_bytes=rng.randint(2, 12) * 100 * MiB,
            compute_s_per_layer_token=rng.choice([0.0005, 0.001, 0.002, 0.004]),
            healthy=rng.random() > 0.15,
        )
        for i in range(5)
    ]
    keys = [b"coord"] + [n.key for n in nodes]
    rtt = {
        (a, b): rng.choice([0.0002, 0.001, 0.005, 0.02, 0.06])
        for a, b in itertools.combinations(keys, 2)
        if rng.random() > 0.1  # a few unmeasured pairs
    }
    return model, nodes, rtt


@pytest.mark.parametrize("seed", range(24))
def test_planner_matches_exhaustive_reference(seed: int) -> None:
    model, nodes, rtt = random_case(seed)
    # Half the cases let the coordinator host a stage too.
    coord = nodes[0].key if seed % 2 else b"coord"
    best = reference(model, nodes, rtt, coord)
    if best is None:
        with pytest.raises(NoFeasiblePlan):
            plan(model, nodes, rtt, coord, context_tokens=0, config=CONFIG)
        return
    got = plan(model, nodes, rtt, coord, context_tokens=0, config=CONFIG)
    assert got.predicted_s_per_token == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(24))
def test_local_search_stays_close_to_the_reference(seed: int) -> None:
    # Force the heuristic path (used on meshes too large to try every set).
    model, nodes, rtt = random_case(seed)
    coord = nodes[0].key if seed % 2 else b"coord"
    best = reference(model, nodes, rtt, coord)
    if best is None:
        return
    config = PlannerConfig(
        speed_tie_fraction=0.0, extra_stage_min_gain_fraction=0.0, exhaustive_max_sets=0
    )
    got = plan(model, nodes, rtt, coord, context_tokens=0, config=config)
    assert got.predicted_s_per_token <= best * 1.05
