"""Sites: groups of co-located nodes (round trips under `colocated_rtt_s`).

The set search uses sites twice: a greedy step may add a node together with its fastest
site-mates (the first node in a remote site pays the whole detour alone), and a swap skips
outsiders a site-mate beats on both speed and capacity (site-mates are equally far from
everything, within the co-location threshold).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def group_sites(h: Sequence[Sequence[float]], n: int, near_cost: float) -> list[list[int]]:
    """Nodes 0..n-1 grouped by single linkage: hop cost both ways at most `near_cost`."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if h[i][j] <= near_cost and h[j][i] <= near_cost:
                parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def site_mates(
    sites: Sequence[Sequence[int]], speeds: Sequence[float], caps: Sequence[int], count: int
) -> list[tuple[int, ...]]:
    """For each node, its `count` fastest site-mates (larger first among equals)."""
    mates: list[tuple[int, ...]] = [() for _ in speeds]
    for site in sites:
        ranked = sorted(site, key=lambda i: (speeds[i], -caps[i], i))
        for i in site:
            mates[i] = tuple(j for j in ranked if j != i)[:count]
    return mates


def pareto_outsiders(
    sites: Sequence[Sequence[int]],
    inside: Collection[int],
    speeds: Sequence[float],
    caps: Sequence[int],
) -> list[int]:
    """Nodes not `inside` that no other outsider of their site beats on speed and capacity."""
    out: list[int] = []
    for site in sites:
        free = [i for i in site if i not in inside]
        for i in free:
            if not any(_beats(j, i, speeds, caps) for j in free if j != i):
                out.append(i)
    return sorted(out)


def _beats(j: int, i: int, speeds: Sequence[float], caps: Sequence[int]) -> bool:
    """j is at least as fast and as large as i and better in one (or identical, lower index)."""
    if speeds[j] > speeds[i] or caps[j] < caps[i]:
        return False
    return speeds[j] < speeds[i] or caps[j] > caps[i] or j < i
