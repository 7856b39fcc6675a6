"""Stage order: Held-Karp is exact, the heuristic is valid and close."""

from __future__ import annotations

import itertools
import random

import pytest

from meshd.plan.order import exact_path, exact_paths, heuristic_path, path_cost


def matrix(n: int, rng: random.Random, symmetric: bool) -> list[list[float]]:
    h = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                h[i][j] = h[j][i] if symmetric and j < i else rng.uniform(0.1, 50.0)
    return h


def plane(n: int, rng: random.Random) -> list[list[float]]:
    """Round trips proportional to distances between random points (a metric)."""
    pts = [(rng.uniform(0, 100), rng.uniform(0, 100)) for _ in range(n)]
    return [[((ax - bx) ** 2 + (ay - by) ** 2) ** 0.5 for bx, by in pts] for ax, ay in pts]


def brute(h: list[list[float]], start: int, end: int, nodes: list[int]) -> float:
    return min(path_cost(h, start, end, order) for order in itertools.permutations(nodes))


@pytest.mark.parametrize("symmetric", [True, False])
def test_held_karp_matches_brute_force(symmetric: bool) -> None:
    rng = random.Random(7)
    for trial in range(40):
        k = 1 + trial % 7
        h = matrix(k + 2, rng, symmetric)
        nodes = list(range(k))
        start, end = k, (k if trial % 2 else k + 1)  # a cycle, or a path between two nodes
        cost, order = exact_path(h, start, end, nodes)
        assert sorted(order) == nodes
        assert cost == pytest.approx(path_cost(h, start, end, order))
        assert cost == pytest.approx(brute(h, start, end, nodes))


def test_first_fixed_paths_match_brute_force() -> None:
    rng = random.Random(11)
    h = matrix(7, rng, symmetric=False)
    nodes = [0, 1, 2, 3, 4]
    for first in nodes:
        got = exact_paths(h, 5, 6, nodes, first=first)
        for last, (cost, order) in got.items():
            assert order[0] == first and order[-1] == last
            best = min(
                path_cost(h, 5, 6, o)
                for o in itertools.permutations(nodes)
                if o[0] == first and o[-1] == last
            )
            assert cost == pytest.approx(best)


def test_heuristic_is_a_valid_order_close_to_optimal() -> None:
    rng = random.Random(3)
    worst = 0.0
    for _ in range(20):
        h = plane(9, rng)
        nodes = list(range(8))
        cost, order = heuristic_path(h, 8, 8, nodes)
        assert sorted(order) == nodes
        assert cost == pytest.approx(path_cost(h, 8, 8, order))
        best = exact_path(h, 8, 8, nodes)[0]
        assert cost >= best - 1e-9
        worst = max(worst, cost / best - 1)
    # Insertion + 2-opt on 8 random points in a plane stays within a few percent.
    assert worst < 0.05
