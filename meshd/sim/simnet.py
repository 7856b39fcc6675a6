"""A deterministic network of membership state machines on one virtual clock.

N `Membership` instances talk through encoded bytes (so every message also crosses the real
codec and every capacity record the real Ed25519 signature) over a seeded path model: a
one-way delay per message and independent per-message loss. That loss is harsher than a real
lane, which retransmits and turns loss into delay; it stands for gossip over a lossy path and
tests SWIM's own defences. Two path models: `SimLink` (every path alike) and `Geography`
(nodes in sites, sites in metros, metros across a continent; see meshd/sim/geography.py).

Lanes are modelled the way `meshd.net` behaves: the first message between two nodes opens a
lane (both ends get `on_lane_up`); a lane to a node that crashes, or across a pair that gets
blocked, dies `lane_dead_after_s` later on each surviving end (`on_lane_dead`); a lane that
cannot be opened (peer down or blocked) fails after `connect_timeout_s`. With `lanes=False`
no lane events happen at all and membership must rely on its own probes (plain SWIM).

Used by the membership tests (tests/mesh), `meshd.sim.gossip_load` and `meshd bench scale`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from meshd.mesh.membership import LocalCapacity, MemberEvent, Membership, MembershipConfig
from protocol.config import LaneConfig
from protocol.gossip import GossipMessage, Status, decode, encode


class Paths(Protocol):
    """How the simulated network treats a message from node src to node dst."""

    @property
    def loss(self) -> float:
        """Probability that one message is dropped."""
        ...

    def delay_s(self, src: int, dst: int, rng: random.Random) -> float:
        """One-way delay of one message (seconds), drawn from `rng`."""
        ...


@dataclass(frozen=True)
class SimLink:
    """Every path's behaviour: one-way latency_s + uniform(0, jitter_s), drop with `loss`."""

    latency_s: float = 0.002
    jitter_s: float = 0.002
    loss: float = 0.0

    def delay_s(self, src: int, dst: int, rng: random.Random) -> float:
        """latency_s plus uniform jitter, the same on every path."""
        return self.latency_s + rng.uniform(0.0, self.jitter_s)


def signer(key: SigningKey) -> Callable[[bytes], bytes]:
    """The signer a daemon passes to Membership (PyNaCl Ed25519, detached signature)."""

    def sign(data: bytes) -> bytes:
        return key.sign(data).signature

    return sign


def verify_ed25519(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """The verifier a daemon passes to Membership (PyNaCl Ed25519)."""
    try:
        VerifyKey(public_key).verify(data, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


def _cached_verifier() -> Callable[[bytes, bytes, bytes], bool]:
    """verify_ed25519, run once per distinct input and remembered."""
    results: dict[tuple[bytes, bytes, bytes], bool] = {}

    def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
        key = (public_key, data, signature)
        result = results.get(key)
        if result is None:
            result = results[key] = verify_ed25519(public_key, data, signature)
        return result

    return verify


@dataclass
class SimNode:
    """One simulated daemon: its key, its state machine (None while down) and its counters."""

    index: int
    key: SigningKey
    membership: Membership | None = None
    lanes: dict[int, int] = field(default_factory=dict)  # peer index -> lane id
    connecting: set[int] = field(default_factory=set)
    tick_at: float = math.inf
    bytes_sent: int = 0
    messages_sent: int = 0
    events: list[MemberEvent] = field(default_factory=list)
    # Stopped (SIGSTOP, a closed lid): no tick, nothing delivered, no lane opens to it; the
    # peers whose lanes it held when it froze.
    frozen: set[int] | None = None

    @property
    def node_id(self) -> bytes:
        return bytes(self.key.verify_key)

    @property
    def up(self) -> bool:
        return self.membership is not None

    @property
    def m(self) -> Membership:
        assert self.membership is not None, f"node {self.index} is down"
        return self.membership


class Sim:
    """N nodes, a virtual clock and a seeded network; drive it with run_until / run_for."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        link: Paths | None = None,
        config: MembershipConfig | None = None,
        lanes: bool = True,
        lane_dead_after_s: float = LaneConfig().dead_after_s,
        shared_verify_cache: bool = False,
        connect_timeout_s: float = 3.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.link: Paths = link or SimLink()
        self.config = config or MembershipConfig()
        self.lanes = lanes
        self.lane_dead_after_s = lane_dead_after_s
        self.connect_timeout_s = connect_timeout_s
        # Every node verifies every record version it fetches: n checks of the same signature.
        # The cache runs the real check once per distinct (key, data, signature) and hands
        # every node that result; it saves a fifth of a 1000-node run's CPU time.
        self._verify: Callable[[bytes, bytes, bytes], bool] = verify_ed25519
        if shared_verify_cache:
            self._verify = _cached_verifier()
        self.now = 0.0
        self.nodes = [SimNode(i, SigningKey(self.rng.randbytes(32))) for i in range(n)]
        self.index_of = {node.node_id: node.index for node in self.nodes}
        self.blocked: set[frozenset[int]] = set()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._lane_ids = itertools.count(1)
        self._ticks_at_now = 0
        # When set, events go here (observer index, event) instead of into `SimNode.events`:
        # a 1000-node join makes a million events, too many to keep.
        self.event_sink: Callable[[int, MemberEvent], None] | None = None

    # ---- scripting --------------------------------------------------------------------

    def start(self, i: int, *, capacity: LocalCapacity | None = None) -> Membership:
        """Boot node i now (alone; `join` it to someone). A restart keeps its key only."""
        node = self.nodes[i]
        node.membership = Membership(
            node.node_id,
            address=f"127.0.0.1:{7000 + i}",
            sign=signer(node.key),
            verify=self._verify,
            now=self.now,
            config=self.config,
            capacity=capacity,
            seed=self.rng.randrange(1 << 30),
        )
        node.lanes.clear()
        node.connecting.clear()
        self._flush(node)
        return node.membership

    def join(self, i: int, seed: int) -> None:
        """Node i joins through node `seed` (as after mDNS or `--join`)."""
        self.nodes[i].m.join(self.nodes[seed].node_id, self.now)
        self._flush(self.nodes[i])

    def start_all(self, *, stagger_s: float = 0.01, seed: int = 0) -> None:
        """Boot every node; each but `seed` joins through `seed`, stagger_s apart."""
        self.start(seed)
        for node in self.nodes:
            if node.index != seed:
                self.run_for(stagger_s)
                self.start(node.index)
                self.join(node.index, seed)

    def leave(self, i: int) -> None:
        """Node i leaves gracefully (it keeps running to spread the news)."""
        self.nodes[i].m.leave(self.now)
        self._flush(self.nodes[i])

    def kill(self, i: int) -> None:
        """Crash node i now: it stops; lanes to it die lane_dead_after_s later on the far side."""
        node = self.nodes[i]
        node.membership = None
        node.tick_at = math.inf
        for peer in list(node.lanes):
            self._lane_dies_later(peer, i)
        node.lanes.clear()

    def freeze(self, i: int) -> None:
        """Stop node i without killing it (SIGSTOP, a closed lid): it ticks and hears nothing;
        its lanes die lane_dead_after_s later on the far side."""
        node = self.nodes[i]
        node.frozen = set(node.lanes)
        for peer in list(node.lanes):
            self._lane_dies_later(peer, i)

    def thaw(self, i: int) -> None:
        """Wake node i. Its timers run first, as a woken process's do: what it sends at once
        goes out on lanes the far side closed meanwhile (lost); then those lanes die here, of
        the silence it slept through."""
        node = self.nodes[i]
        old, node.frozen = node.frozen or set(), None
        node.m.tick(self.now)
        node.m.outgoing(self.now)  # on the old lanes: the far side closed them
        for peer in old:
            node.lanes.pop(peer, None)
            node.m.on_lane_dead(self.nodes[peer].node_id, self.now)
        node.tick_at = math.inf
        self._flush(node)

    def block(self, i: int, j: int) -> None:
        """Cut the path between i and j (both ways); an open lane dies on both ends."""
        self.blocked.add(frozenset((i, j)))
        self._lane_dies_later(i, j)
        self._lane_dies_later(j, i)

    def unblock(self, i: int, j: int) -> None:
        """Restore the path between i and j."""
        self.blocked.discard(frozenset((i, j)))

    def inject(self, dst: int, src: int, message: GossipMessage) -> None:
        """Deliver `message` to node dst now as if node src had sent it (a lying peer)."""
        self.nodes[dst].m.on_message(self.nodes[src].node_id, message, self.now)
        self._flush(self.nodes[dst])

    def set_capacity(self, i: int, capacity: LocalCapacity, *, urgent: bool = False) -> None:
        """Node i offers `capacity` from now on (its record re-signs as the daemon's would)."""
        self.nodes[i].m.set_capacity(capacity, self.now, urgent=urgent)
        self._flush(self.nodes[i])

    def at(self, t: float, action: Callable[[], None]) -> None:
        """Run `action` at virtual time t."""
        heapq.heappush(self._heap, (t, next(self._order), action))

    def run_until(self, t: float) -> None:
        """Process every event up to virtual time t."""
        while self._heap and self._heap[0][0] <= t:
            when, _, action = heapq.heappop(self._heap)
            if when > self.now:
                self.now, self._ticks_at_now = when, 0
            action()
        self.now = max(self.now, t)

    def run_for(self, dt: float) -> None:
        """Advance the clock by dt."""
        self.run_until(self.now + dt)

    def wait_for(
        self, predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05
    ) -> float:
        """Run until predicate() holds (checked every step_s); seconds taken, or inf."""
        start = self.now
        while self.now - start <= timeout_s:
            if predicate():
                return self.now - start
            self.run_for(step_s)
        return math.inf

    # ---- observations -----------------------------------------------------------------

    def up_nodes(self) -> list[SimNode]:
        """The nodes running now."""
        return [node for node in self.nodes if node.up]

    def status_seen(self, observer: int, subject: int) -> Status | None:
        """What node `observer` believes about node `subject` (None: unknown)."""
        return self.nodes[observer].m.statuses().get(self.nodes[subject].node_id)

    def all_see(self, subject: int, statuses: tuple[Status, ...]) -> bool:
        """Whether every up node other than `subject` sees it in one of `statuses`."""
        return all(
            self.status_seen(node.index, subject) in statuses
            for node in self.up_nodes()
            if node.index != subject
        )

    def converged(self) -> bool:
        """Whether every up node sees exactly the up nodes as alive."""
        alive = {node.node_id for node in self.up_nodes()}
        for node in self.up_nodes():
            seen = {nid for nid, st in node.m.statuses().items() if st is Status.ALIVE}
            if seen != alive:
                return False
        return True

    def events_of(self, kind: str) -> list[tuple[int, MemberEvent]]:
        """Every event of that kind so far, as (observer index, event)."""
        return [(n.index, e) for n in self.nodes for e in n.events if e.kind == kind]

    def reset_counters(self) -> None:
        """Zero every node's bytes and messages sent."""
        for node in self.nodes:
            node.bytes_sent = node.messages_sent = 0

    # ---- plumbing ---------------------------------------------------------------------

    def _flush(self, node: SimNode) -> None:
        m = node.membership
        if m is None:
            return
        # Opening a lane is an input too (on_lane_up), which may queue more messages.
        while out := m.outgoing(self.now):
            for peer_id, message in out:
                data = encode(message)
                node.bytes_sent += len(data)
                node.messages_sent += 1
                self._route(node, self.index_of[peer_id], data)
        if self.event_sink is None:
            node.events.extend(m.events())
        else:
            for event in m.events():
                self.event_sink(node.index, event)
        deadline = m.next_deadline()
        if deadline is None:
            return
        when = max(deadline, self.now)
        if when < node.tick_at or node.tick_at < self.now:
            node.tick_at = when
            self.at(when, lambda: self._tick(node))

    def _tick(self, node: SimNode) -> None:
        if node.membership is None or node.tick_at > self.now or node.frozen is not None:
            return  # superseded by an earlier tick, or the node is down or frozen
        self._ticks_at_now += 1
        assert self._ticks_at_now < 10_000, "a node keeps asking for a tick at the same time"
        node.tick_at = math.inf
        node.membership.tick(self.now)
        self._flush(node)

    def _route(self, src: SimNode, dst_index: int, data: bytes) -> None:
        dst = self.nodes[dst_index]
        reachable = (
            dst.up and dst.frozen is None and frozenset((src.index, dst_index)) not in self.blocked
        )
        if self.lanes and dst_index not in src.lanes:
            if not reachable:
                self._connect_fails_later(src, dst_index)
                return
            lane = next(self._lane_ids)
            src.lanes[dst_index] = dst.lanes[src.index] = lane
            src.m.on_lane_up(dst.node_id, self.now)
            self.at(self.now, lambda: self._lane_up(dst, src.index, lane))
        if self.rng.random() < self.link.loss:
            return
        delay = self.link.delay_s(src.index, dst_index, self.rng)
        self.at(self.now + delay, lambda: self._deliver(src.index, dst, data))

    def _lane_up(self, node: SimNode, peer: int, lane: int) -> None:
        if node.membership is not None and node.lanes.get(peer) == lane:
            node.membership.on_lane_up(self.nodes[peer].node_id, self.now)
            self._flush(node)

    def _deliver(self, src: int, dst: SimNode, data: bytes) -> None:
        if dst.membership is None or dst.frozen is not None:
            return
        if frozenset((src, dst.index)) in self.blocked:
            return
        dst.membership.on_message(self.nodes[src].node_id, decode(data), self.now)
        self._flush(dst)

    def _lane_dies_later(self, holder: int, peer: int) -> None:
        lane = self.nodes[holder].lanes.get(peer)
        if lane is not None:
            self.at(self.now + self.lane_dead_after_s, lambda: self._lane_dead(holder, peer, lane))

    def _lane_dead(self, holder: int, peer: int, lane: int) -> None:
        node = self.nodes[holder]
        if node.membership is None or node.lanes.get(peer) != lane:
            return
        del node.lanes[peer]
        if self.nodes[peer].lanes.get(holder) == lane:
            del self.nodes[peer].lanes[holder]
        node.membership.on_lane_dead(self.nodes[peer].node_id, self.now)
        self._flush(node)

    def _connect_fails_later(self, src: SimNode, peer: int) -> None:
        if peer in src.connecting:
            return
        src.connecting.add(peer)

        def fail() -> None:
            src.connecting.discard(peer)
            if src.membership is not None and peer not in src.lanes:
                src.membership.on_lane_dead(self.nodes[peer].node_id, self.now)
                self._flush(src)

        self.at(self.now + self.connect_timeout_s, fail)
