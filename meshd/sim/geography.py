"""A seeded geography for simulated meshes: nodes in sites, sites in metros, metros far apart.

Round trips follow three typical tiers (assumptions, not measurements of ours; the sources
are in docs/scale.md):

- LAN, inside a site (a home, a lab, a rack): 0.2–1 ms. Each node gets an access delay
  drawn from half that range; a pair's LAN round trip is the sum of the two.
- metro, between sites in one metro area: 2–10 ms, drawn once per site pair.
- continental, between metros: 30–80 ms, drawn once per metro pair.

A path between sites costs the tier's round trip plus both nodes' access delays. Every
message's one-way delay is half the pair's round trip times (1 + jitter_fraction · u),
u uniform in [0, 1); every message is lost with probability `loss`, whatever the path.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping

import msgspec


class GeographyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a simulated mesh is laid out and how its paths behave (round trips in seconds)."""

    nodes_per_site: int = 10
    sites_per_metro: int = 5
    lan_rtt_min_s: float = 0.0002
    lan_rtt_max_s: float = 0.001
    metro_rtt_min_s: float = 0.002
    metro_rtt_max_s: float = 0.010
    continental_rtt_min_s: float = 0.030
    continental_rtt_max_s: float = 0.080
    jitter_fraction: float = 0.1
    loss: float = 0.01

    def __post_init__(self) -> None:
        if self.nodes_per_site < 1 or self.sites_per_metro < 1:
            raise ValueError("nodes_per_site and sites_per_metro must be at least 1")
        tiers = (
            (self.lan_rtt_min_s, self.lan_rtt_max_s),
            (self.metro_rtt_min_s, self.metro_rtt_max_s),
            (self.continental_rtt_min_s, self.continental_rtt_max_s),
        )
        if any(not 0.0 <= low <= high < math.inf for low, high in tiers):
            raise ValueError("each round-trip range needs 0 <= min <= max")
        if self.jitter_fraction < 0 or not 0.0 <= self.loss < 1.0:
            raise ValueError("jitter_fraction must be >= 0 and loss in [0, 1)")


class Geography:
    """n nodes placed in sites and metros; a `Paths` for `meshd.sim.simnet.Sim`."""

    def __init__(self, n: int, *, seed: int, config: GeographyConfig | None = None) -> None:
        self.config = config or GeographyConfig()
        cfg = self.config
        rng = random.Random(seed)
        self.n = n
        self.sites = max(1, math.ceil(n / cfg.nodes_per_site))
        self.metros = max(1, math.ceil(self.sites / cfg.sites_per_metro))
        # Round-robin over a shuffled order: sites differ in size by at most one node.
        order = list(range(n))
        rng.shuffle(order)
        self.site_of = [0] * n
        for rank, node in enumerate(order):
            self.site_of[node] = rank % self.sites
        self.metro_of_site = [site // cfg.sites_per_metro for site in range(self.sites)]
        self.access_s = [rng.uniform(cfg.lan_rtt_min_s, cfg.lan_rtt_max_s) / 2.0 for _ in range(n)]
        self._site_rtt_s = [[0.0] * self.sites for _ in range(self.sites)]
        metro_rtt_s = [[0.0] * self.metros for _ in range(self.metros)]
        for a in range(self.metros):
            for b in range(a + 1, self.metros):
                rtt = rng.uniform(cfg.continental_rtt_min_s, cfg.continental_rtt_max_s)
                metro_rtt_s[a][b] = metro_rtt_s[b][a] = rtt
        for a in range(self.sites):
            for b in range(a + 1, self.sites):
                ma, mb = self.metro_of_site[a], self.metro_of_site[b]
                if ma == mb:
                    rtt = rng.uniform(cfg.metro_rtt_min_s, cfg.metro_rtt_max_s)
                else:
                    rtt = metro_rtt_s[ma][mb]
                self._site_rtt_s[a][b] = self._site_rtt_s[b][a] = rtt

    @property
    def loss(self) -> float:
        """Probability that one message is dropped, on any path."""
        return self.config.loss

    def rtt_s(self, a: int, b: int) -> float:
        """The round trip between nodes a and b (0 for a node to itself)."""
        if a == b:
            return 0.0
        if a > b:
            a, b = b, a  # the same float sum either way round
        sa, sb = self.site_of[a], self.site_of[b]
        return self._site_rtt_s[sa][sb] + self.access_s[a] + self.access_s[b]

    def tier(self, a: int, b: int) -> str:
        """ "lan", "metro" or "continental": which tier the path a-b crosses."""
        sa, sb = self.site_of[a], self.site_of[b]
        if sa == sb:
            return "lan"
        return "metro" if self.metro_of_site[sa] == self.metro_of_site[sb] else "continental"

    def delay_s(self, src: int, dst: int, rng: random.Random) -> float:
        """One message's one-way delay: half the round trip, plus jitter."""
        return self.rtt_s(src, dst) / 2.0 * (1.0 + self.config.jitter_fraction * rng.random())

    def rtt_mapping(self, keys: list[bytes]) -> KeyedRtt:
        """The round trips by node key (keys[i] is node i), computed on demand."""
        return KeyedRtt(self, keys)


class KeyedRtt(Mapping[tuple[bytes, bytes], float]):
    """A geography's full RTT matrix by node key, without n² entries (the planner's input)."""

    def __init__(self, geography: Geography, keys: list[bytes]) -> None:
        self._geography = geography
        self._index = {key: i for i, key in enumerate(keys)}
        self.lookups = 0

    def __getitem__(self, pair: tuple[bytes, bytes]) -> float:
        self.lookups += 1
        a, b = pair
        if a not in self._index or b not in self._index:
            raise KeyError(pair)
        return self._geography.rtt_s(self._index[a], self._index[b])

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return ((a, b) for a in self._index for b in self._index)

    def __len__(self) -> int:
        return len(self._index) ** 2
