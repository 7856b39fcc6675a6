"""Stage order: the cheapest path start → (every stage once) → end over a hop-cost matrix.

For a whole route start = end = the coordinator, so this is a travelling-salesman cycle
through the coordinator. Exact by Held-Karp dynamic programming, O(2^k · k²) for k stages
(k = 8: about 16 000 steps); beyond `exact_order_max_stages` cheapest insertion followed by
2-opt and Or-opt moves (first improvement), O(k³) per pass. Indices are rows of `h`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

_INF = float("inf")


def path_cost(h: Sequence[Sequence[float]], start: int, end: int, order: Sequence[int]) -> float:
    """Hop cost of start → order[0] → … → order[-1] → end."""
    total = 0.0
    prev = start
    for node in order:
        total += h[prev][node]
        prev = node
    return total + h[prev][end]


def exact_paths(
    h: Sequence[Sequence[float]],
    start: int,
    end: int,
    nodes: Sequence[int],
    first: int | None = None,
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """For each possible last node: the cheapest (cost, order) visiting all `nodes`.

    With `first` set (an element of `nodes`), only orders starting there are considered.
    Ties break toward the lower position in `nodes`, so results are deterministic.
    """
    k = len(nodes)
    full = (1 << k) - 1
    dp = [[_INF] * k for _ in range(full + 1)]
    parent = [[-1] * k for _ in range(full + 1)]
    for i, node in enumerate(nodes):
        if first is None or node == first:
            dp[1 << i][i] = h[start][node]
    for mask in range(1, full + 1):
        row = dp[mask]
        for j in range(k):
            here = row[j]
            if here == _INF:
                continue
            hj = h[nodes[j]]
            for n in range(k):
                bit = 1 << n
                if mask & bit:
                    continue
                cost = here + hj[nodes[n]]
                nxt = mask | bit
                if cost < dp[nxt][n]:
                    dp[nxt][n] = cost
                    parent[nxt][n] = j
    result: dict[int, tuple[float, tuple[int, ...]]] = {}
    for j in range(k):
        if dp[full][j] == _INF:
            continue
        order: list[int] = []
        mask, at = full, j
        while at != -1:
            order.append(nodes[at])
            mask, at = mask ^ (1 << at), parent[mask][at]
        result[nodes[j]] = (dp[full][j] + h[nodes[j]][end], tuple(reversed(order)))
    return result


def exact_path(
    h: Sequence[Sequence[float]], start: int, end: int, nodes: Sequence[int]
) -> tuple[float, tuple[int, ...]]:
    """The cheapest (cost, order) visiting all `nodes` between start and end."""
    options = exact_paths(h, start, end, nodes)
    return min(options.values(), key=lambda item: item[0])


def heuristic_path(
    h: Sequence[Sequence[float]],
    start: int,
    end: int,
    nodes: Sequence[int],
    or_opt: bool = True,
) -> tuple[float, tuple[int, ...]]:
    """A good (cost, order): cheapest insertion, then 2-opt (and Or-opt) until none helps.

    Or-opt removes part of the excess 2-opt leaves at several times the cost (figures:
    docs/planner.md), so the set search, which runs it often, skips it.
    """
    order: list[int] = []
    for node in sorted(nodes, key=lambda n: h[start][n] + h[n][end]):
        best_at, best_delta = 0, _INF
        for at in range(len(order) + 1):
            before = start if at == 0 else order[at - 1]
            after = end if at == len(order) else order[at]
            delta = h[before][node] + h[node][after] - h[before][after]
            if delta < best_delta:
                best_at, best_delta = at, delta
        order.insert(best_at, node)
    cost = path_cost(h, start, end, order)
    improved = True
    while improved:
        improved = False
        moves = itertools.chain(_two_opt(order), _or_opt(order) if or_opt else ())
        for candidate in moves:
            candidate_cost = path_cost(h, start, end, candidate)
            if candidate_cost < cost - 1e-12:
                order, cost, improved = candidate, candidate_cost, True
                break
    return cost, tuple(order)


def _two_opt(order: list[int]) -> Iterator[list[int]]:
    """Every order with one run reversed."""
    for i in range(len(order) - 1):
        for j in range(i + 1, len(order)):
            yield order[:i] + order[i : j + 1][::-1] + order[j + 1 :]


def _or_opt(order: list[int]) -> Iterator[list[int]]:
    """Every order with a run of up to three stages moved elsewhere (either way round)."""
    for length in (1, 2, 3):
        for i in range(len(order) - length + 1):
            run, rest = order[i : i + length], order[:i] + order[i + length :]
            for at in range(len(rest) + 1):
                if at != i:
                    yield rest[:at] + run + rest[at:]
                    if length > 1:
                        yield rest[:at] + run[::-1] + rest[at:]
