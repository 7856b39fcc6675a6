"""Membership at scale: one scripted run of n real state machines over a seeded geography.

The script (`run_membership`), on `meshd.sim.simnet.Sim` with lanes and a `Geography`:

1. n − 1 nodes start `stagger_s` apart, each joining through node 0; wait until everyone
   sees everyone alive (the mass-join time).
2. Run `settle_s` (probes open lanes and fill RTT rows, records settle).
3. Window of `window_s`: every node's load changes every `churn_interval_s` (so records are
   re-signed as often as the rate limit allows: the worst case for gossip bytes); count the
   bytes sent. From here to the end, every suspicion or death of a node that is up is false.
4. The last node starts and joins through a random member: time until every other node has
   seen it join.
5. `kills` times, a random member crashes: time until every live node holds it dead.

Times come from the events' own timestamps, so they do not depend on how often we look.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from meshd.mesh.member import EventKind, LocalCapacity, MemberEvent
from meshd.sim.geography import Geography, GeographyConfig
from meshd.sim.simnet import Sim
from protocol.gossip import ModelHolding

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MembershipScale:
    """What one run measured (times in seconds, bytes per node per second)."""

    n: int
    seed: int
    mass_join_s: float  # from the first start to everyone alive everywhere (inf: never)
    window_s: float
    bytes_per_node_s: float  # mean over nodes, during the window
    max_bytes_per_node_s: float  # the busiest node
    messages_per_node_s: float
    # From the window's start to the end of the run (observed_s), every node up then:
    observed_s: float
    false_suspicions: int  # distinct (member, incarnation) accusations of live nodes
    false_suspicion_events: int  # the same, counted at every observer
    false_deaths: int  # distinct live members declared dead by anyone
    join_converge_s: float  # the late joiner seen by every other node (inf: not in time)
    death_known_s: tuple[float, ...]  # per crash: dead in every live node's view
    simulated_s: float
    cpu_s: float


@dataclass
class _Watch:
    """Collects the events the script needs, without keeping a million of them."""

    live: set[bytes] = field(default_factory=set)
    suspicions: set[tuple[bytes, int]] = field(default_factory=set)
    suspicion_events: int = 0
    false_deaths: set[bytes] = field(default_factory=set)
    joined_at: dict[int, float] = field(default_factory=dict)  # observer -> when
    joiner: bytes = b""
    died_at: dict[int, float] = field(default_factory=dict)
    victim: bytes = b""

    def __call__(self, observer: int, event: MemberEvent) -> None:
        if event.kind is EventKind.SUSPECTED and event.node_id in self.live:
            self.suspicions.add((event.node_id, event.incarnation))
            self.suspicion_events += 1
        elif event.kind is EventKind.DIED:
            if event.node_id == self.victim:
                self.died_at.setdefault(observer, event.at)
            elif event.node_id in self.live:
                self.false_deaths.add(event.node_id)
        elif event.kind is EventKind.JOINED and event.node_id == self.joiner:
            self.joined_at.setdefault(observer, event.at)


def node_capacity(rng: random.Random) -> LocalCapacity:
    """A plausible record: a memory budget and one model it can host, with its speed."""
    return LocalCapacity(
        memory_budget_bytes=rng.choice((16, 24, 32, 64)) * GiB,
        models=(ModelHolding("llama-3-70b-q4", 0, 80, False, rng.randrange(200_000, 3_000_000)),),
    )


def run_membership(
    n: int,
    *,
    seed: int,
    settle_s: float,
    window_s: float,
    kills: int,
    stagger_s: float = 0.01,
    churn_interval_s: float = 1.0,
    geography: GeographyConfig | None = None,
) -> MembershipScale:
    """Run the script above on n simulated nodes; see the module docstring."""
    started_cpu = time.process_time()
    rng = random.Random(seed)
    sim = Sim(
        n, seed=seed, link=Geography(n, seed=seed, config=geography), shared_verify_cache=True
    )
    watch = _Watch()
    sim.event_sink = watch
    capacities = {i: node_capacity(rng) for i in range(n)}
    mass_join_s = _bootstrap(sim, capacities, n - 1, stagger_s)

    sim.run_for(settle_s)
    watch.live = {node.node_id for node in sim.up_nodes()}
    observed_from = sim.now
    sim.reset_counters()
    _churn(sim, capacities, sim.now + window_s, churn_interval_s)
    sim.run_for(window_s)
    sent = [node.bytes_sent / window_s for node in sim.up_nodes()]
    messages = sum(node.messages_sent for node in sim.up_nodes()) / len(sent) / window_s

    join_s = _late_join(sim, rng, watch, capacities[n - 1], n - 1)
    deaths = tuple(_crash(sim, rng, watch) for _ in range(kills))
    return MembershipScale(
        n=n,
        seed=seed,
        mass_join_s=mass_join_s,
        window_s=window_s,
        bytes_per_node_s=statistics.fmean(sent),
        max_bytes_per_node_s=max(sent),
        messages_per_node_s=messages,
        observed_s=sim.now - observed_from,
        false_suspicions=len(watch.suspicions),
        false_suspicion_events=watch.suspicion_events,
        false_deaths=len(watch.false_deaths),
        join_converge_s=join_s,
        death_known_s=deaths,
        simulated_s=sim.now,
        cpu_s=time.process_time() - started_cpu,
    )


def _bootstrap(
    sim: Sim, capacities: dict[int, LocalCapacity], count: int, stagger_s: float
) -> float:
    """Start nodes 0..count-1, each joining through node 0; seconds until converged."""
    sim.start(0, capacity=capacities[0])
    for i in range(1, count):
        sim.run_for(stagger_s)
        sim.start(i, capacity=capacities[i])
        sim.join(i, 0)
    # Checking convergence is O(n²): look once a second at 1000 nodes, more often below.
    step_s = 0.05 if count <= 100 else 1.0
    waited = sim.wait_for(sim.converged, timeout_s=max(60.0, 0.2 * count), step_s=step_s)
    return waited + (count - 1) * stagger_s


def _churn(sim: Sim, capacities: dict[int, LocalCapacity], until: float, interval_s: float) -> None:
    """Change every live node's load every interval_s until `until`."""
    rng = random.Random(int(until))

    def change() -> None:
        for node in sim.up_nodes():
            capacity = dataclasses.replace(capacities[node.index], sessions=rng.randrange(8))
            node.m.set_capacity(capacity, sim.now)
        if sim.now + interval_s < until:
            sim.at(sim.now + interval_s, change)

    change()


def _late_join(
    sim: Sim, rng: random.Random, watch: _Watch, capacity: LocalCapacity, index: int
) -> float:
    """Start node `index`, join it through a random member; seconds until all saw it."""
    watch.joiner = sim.nodes[index].node_id
    seed = rng.choice([node.index for node in sim.up_nodes()])
    sim.start(index, capacity=capacity)
    sim.join(index, seed)
    started = sim.now
    others = {node.index for node in sim.up_nodes()} - {index}
    sim.wait_for(lambda: others <= watch.joined_at.keys(), timeout_s=60.0, step_s=0.1)
    if not others <= watch.joined_at.keys():
        return math.inf
    watch.live.add(watch.joiner)
    return max(watch.joined_at[i] for i in others) - started


def _crash(sim: Sim, rng: random.Random, watch: _Watch) -> float:
    """Crash a random live node; seconds until every live node holds it dead."""
    victim = rng.choice([node.index for node in sim.up_nodes()])
    watch.victim = sim.nodes[victim].node_id
    watch.live.discard(watch.victim)
    watch.died_at.clear()
    sim.kill(victim)
    killed_at = sim.now
    others = {node.index for node in sim.up_nodes()}
    sim.wait_for(lambda: others <= watch.died_at.keys(), timeout_s=30.0, step_s=0.1)
    took = math.inf
    if others <= watch.died_at.keys():
        took = max(watch.died_at[i] for i in others) - killed_at
    sim.run_for(2.0)  # let the news settle before the next crash
    return took
