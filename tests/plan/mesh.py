"""Synthetic meshes for planner tests: nodes grouped in sites, RTT from site distances."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from meshd.plan import NodeCapacity

GiB = 1 << 30


class SiteRtt(Mapping[tuple[bytes, bytes], float]):
    """A full pairwise RTT matrix without n² entries: RTT depends on the two nodes' sites."""

    def __init__(
        self, site_of: Mapping[bytes, int], between_s: list[list[float]], within_s: float
    ) -> None:
        self.site_of = dict(site_of)
        self.between_s = between_s
        self.within_s = within_s
        self.lookups = 0

    def __getitem__(self, pair: tuple[bytes, bytes]) -> float:
        self.lookups += 1
        a, b = pair
        if a not in self.site_of or b not in self.site_of:
            raise KeyError(pair)
        sa, sb = self.site_of[a], self.site_of[b]
        return self.within_s if sa == sb else self.between_s[sa][sb]

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return ((a, b) for a in self.site_of for b in self.site_of)

    def __len__(self) -> int:
        return len(self.site_of) ** 2


@dataclass(frozen=True)
class Mesh:
    nodes: list[NodeCapacity]
    rtt: SiteRtt
    coordinator: bytes


def random_mesh(n: int, sites: int, seed: int) -> Mesh:
    """`n` nodes spread over `sites` sites; node 0 (site 0) coordinates."""
    rng = random.Random(seed)
    between = [[0.0] * sites for _ in range(sites)]
    for i in range(sites):
        for j in range(i + 1, sites):
            between[i][j] = between[j][i] = rng.uniform(0.005, 0.08)
    nodes, site_of = [], {}
    for i in range(n):
        key = f"n{i:04d}".encode()
        site_of[key] = 0 if i == 0 else rng.randrange(sites)
        nodes.append(
            NodeCapacity(
                key=key,
                memory_budget_bytes=rng.choice([4, 8, 16, 24]) * GiB,
                compute_s_per_layer_token=rng.uniform(0.0002, 0.003),
                healthy=rng.random() > 0.05,
                holds_model=rng.random() > 0.05,
                load=rng.choice([0.0, 0.0, 1.0]),
            )
        )
    return Mesh(nodes, SiteRtt(site_of, between, 0.0004), b"n0000")
