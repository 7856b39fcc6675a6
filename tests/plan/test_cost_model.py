"""The layer split and the hop cost model."""

from __future__ import annotations

import functools
import random

import pytest

from meshd.plan import PlannerConfig
from meshd.plan.cost_model import HopCosts, split_layers


def best_split_cost(layers: int, speeds: list[float], caps: list[int]) -> float:
    """Minimum Σ speed·count with 1 ≤ count ≤ cap, by dynamic programming (independent)."""

    @functools.cache
    def go(i: int, left: int) -> float:
        if i == len(speeds):
            return 0.0 if left == 0 else float("inf")
        return min(
            (speeds[i] * n + go(i + 1, left - n) for n in range(1, min(caps[i], left) + 1)),
            default=float("inf"),
        )

    return go(0, layers)


def test_split_is_optimal_without_ties() -> None:
    rng = random.Random(5)
    for _ in range(200):
        k = rng.randint(1, 5)
        speeds = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(k)]
        caps = [rng.randint(0, 12) for _ in range(k)]
        layers = rng.randint(1, 30)
        counts = split_layers(layers, speeds, caps, tie_fraction=0.0)
        best = best_split_cost(layers, speeds, caps)
        if best == float("inf"):
            assert counts is None
            continue
        assert counts is not None
        assert sum(counts) == layers
        assert all(1 <= n <= c for n, c in zip(counts, caps, strict=True))
        assert sum(s * n for s, n in zip(speeds, counts, strict=True)) == pytest.approx(best)


def test_ties_share_by_capacity_within_bounds() -> None:
    # Within 5 % of each other all three share 30 layers about 2:1:1, like their capacity.
    counts = split_layers(30, [1.0, 1.01, 1.0], [30, 15, 15], tie_fraction=0.05)
    assert counts in ([15, 8, 7], [15, 7, 8])
    # Without the allowance the slower node keeps its one layer; equal speeds still share.
    assert split_layers(30, [1.0, 1.01, 1.0], [30, 15, 15], tie_fraction=0.0) == [19, 1, 10]


def test_split_respects_caps_and_minimum_with_ties() -> None:
    rng = random.Random(9)
    for _ in range(200):
        k = rng.randint(1, 6)
        speeds = [rng.choice([1.0, 1.02, 1.04, 2.0]) for _ in range(k)]
        caps = [rng.randint(1, 10) for _ in range(k)]
        layers = rng.randint(k, sum(caps))
        counts = split_layers(layers, speeds, caps, tie_fraction=0.05)
        assert counts is not None
        assert sum(counts) == layers
        assert all(1 <= n <= c for n, c in zip(counts, caps, strict=True))
        # Sharing within a tie group costs at most the tie fraction over the optimum.
        cost = sum(s * n for s, n in zip(speeds, counts, strict=True))
        assert cost <= best_split_cost(layers, speeds, caps) * 1.05 + 1e-9


def test_hop_costs_are_symmetric_free_locally_and_pessimistic_when_unknown() -> None:
    config = PlannerConfig(hop_cost_s=0.001, unknown_rtt_s=0.3)
    hops = HopCosts({(b"a", b"b"): 0.010}, config)
    assert hops.cost(b"a", b"b") == pytest.approx(0.006)
    assert hops.cost(b"b", b"a") == pytest.approx(0.006)
    assert hops.cost(b"a", b"a") == 0.0
    assert hops.rtt(b"a", b"c") == (0.3, False)
    assert hops.cycle_s(b"a", [b"a", b"b"]) == pytest.approx(0.012)
