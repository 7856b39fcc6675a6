"""A deterministic virtual-clock network for lanes: seeded loss, duplication, reordering, delay.

Nodes hold a real `Responder` and real `Lane`s; the simulator plays the driver's part (route
datagrams by kind and lane id, run timers at their deadlines, drain events), with time that
only moves when the simulator says so. Nothing here is mocked: it is the code we ship, pumped.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from protocol.config import LaneConfig
from protocol.datagram import KIND_INITIATION, peek_kind, peek_receiver_lane_id
from protocol.errors import RemoteProtocolError
from protocol.handshake import InitiationRefused, Responder
from protocol.lane import Lane, LaneEvent, LaneTerminated, MessageReceived
from protocol.noise import x25519_public

PSK = bytes(range(32))
VERSIONS = (1,)
CAPABILITIES = ("stage",)
WALL_ORIGIN_NS = 1_700_000_000 * 10**9


@dataclass(frozen=True)
class LinkProfile:
    """How the simulated path treats each datagram (probabilities per datagram)."""

    delay_s: float = 0.001
    jitter_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # chance of an extra delay of reorder_delay_s
    reorder_delay_s: float = 0.003
    mtu_bytes: int = 65507  # datagrams larger than this are dropped (as IP_PMTUDISC_DO would)


@dataclass
class Node:
    """One endpoint: a static key, a responder and the lanes it holds, by local lane id."""

    name: str
    static_private: bytes
    config: LaneConfig
    responder: Responder
    lanes: dict[int, Lane] = field(default_factory=dict)
    events: list[tuple[int, LaneEvent]] = field(default_factory=list)
    garbage: int = 0
    next_lane_id: int = 1

    @property
    def static_public(self) -> bytes:
        return x25519_public(self.static_private)

    def new_lane_id(self) -> int:
        self.next_lane_id += 1
        return self.next_lane_id * 7919 % (2**32)


class Network:
    """Two or more nodes over a seeded lossy link, on a virtual clock starting at 0."""

    def __init__(self, *, seed: int = 0, link: LinkProfile | None = None) -> None:
        self.rng = random.Random(seed)
        self.link = link or LinkProfile()
        self.now = 0.0
        self.nodes: dict[str, Node] = {}
        self._in_flight: list[tuple[float, int, str, bytes, str]] = []
        self._seq = 0
        self.blackholed: set[str] = set()  # nodes whose outgoing datagrams vanish
        self.delivered = 0
        self.sent = 0
        self.tap: Callable[[str, str, bytes], None] | None = None
        # Return True to drop a datagram (src, dst, data) on the way.
        self.drop_if: Callable[[str, str, bytes], bool] | None = None

    def add_node(self, name: str, config: LaneConfig | None = None) -> Node:
        config = config or LaneConfig()
        private = bytes([len(self.nodes) + 1]) * 32
        responder = Responder(
            static_private=private,
            psk=PSK,
            admit=lambda _key: True,
            versions=VERSIONS,
            capabilities=CAPABILITIES,
            max_message_bytes=config.max_message_bytes,
        )
        node = Node(name, private, config, responder)
        self.nodes[name] = node
        return node

    def connect(self, src: str, dst: str) -> Lane:
        """Start a lane from `src` to `dst`; returns the initiator's lane."""
        node, peer = self.nodes[src], self.nodes[dst]
        lane = Lane.connect(
            config=node.config,
            static_private=node.static_private,
            remote_static=peer.static_public,
            psk=PSK,
            local_lane_id=node.new_lane_id(),
            addr=dst,
            versions=VERSIONS,
            capabilities=CAPABILITIES,
            now=self.now,
            now_wall_ns=self.wall_ns(),
        )
        node.lanes[lane.local_lane_id] = lane
        return lane

    def wall_ns(self) -> int:
        return WALL_ORIGIN_NS + int(self.now * 1e9)

    # --- the pump ---------------------------------------------------------------------

    def flush(self) -> None:
        """Collect every lane's outgoing datagrams and events at the current time."""
        for node in self.nodes.values():
            for lane_id, lane in list(node.lanes.items()):
                for data, addr in lane.datagrams_to_send(self.now):
                    self._transmit(node.name, str(addr), data)
                while (event := lane.next_event()) is not None:
                    node.events.append((lane_id, event))

    def _transmit(self, src: str, dst: str, data: bytes) -> None:
        self.sent += 1
        if self.tap is not None:
            self.tap(src, dst, data)
        link, rng = self.link, self.rng
        if src in self.blackholed or len(data) > link.mtu_bytes or rng.random() < link.loss:
            return
        if self.drop_if is not None and self.drop_if(src, dst, data):
            return
        copies = 2 if rng.random() < link.duplicate else 1
        for _ in range(copies):
            delay = link.delay_s + rng.random() * link.jitter_s
            if rng.random() < link.reorder:
                delay += link.reorder_delay_s
            self._seq += 1
            heapq.heappush(self._in_flight, (self.now + delay, self._seq, dst, data, src))

    def next_time(self) -> float | None:
        """The earliest pending delivery or lane timer."""
        times = [self._in_flight[0][0]] if self._in_flight else []
        for node in self.nodes.values():
            for lane in node.lanes.values():
                timer = lane.get_timer()
                if timer is not None:
                    times.append(timer)
        return min(times) if times else None

    def step(self, until: float) -> bool:
        """Advance to the next thing that happens (not past `until`); False if nothing did."""
        self.flush()
        when = self.next_time()
        if when is None or when > until:
            self.now = max(self.now, until)
            return False
        self.now = max(self.now, when)
        while self._in_flight and self._in_flight[0][0] <= self.now:
            _, _, dst, data, src = heapq.heappop(self._in_flight)
            self.deliver(dst, data, src)
        for node in self.nodes.values():
            for lane in list(node.lanes.values()):
                timer = lane.get_timer()
                if timer is not None and timer <= self.now:
                    lane.handle_timer(self.now)
                    after = lane.get_timer()
                    assert after is None or after > self.now, (after, self.now)
        self.flush()
        return True

    def deliver(self, dst: str, data: bytes, src: Hashable) -> None:
        """Hand one datagram to node `dst` as its driver would."""
        node = self.nodes[dst]
        self.delivered += 1
        try:
            if peek_kind(data) == KIND_INITIATION:
                self._answer_initiation(node, data, str(src))
                return
            lane = node.lanes.get(peek_receiver_lane_id(data))
            if lane is None:
                node.garbage += 1
                return
            lane.receive_datagram(data, src, self.now)
        except RemoteProtocolError:
            node.garbage += 1

    def _answer_initiation(self, node: Node, data: bytes, src: str) -> None:
        lane_id = node.new_lane_id()
        try:
            response, result = node.responder.handle_initiation(
                data, local_lane_id=lane_id, now_wall_ns=self.wall_ns()
            )
        except InitiationRefused as refused:
            self._transmit(node.name, src, refused.datagram)
            return
        lane = Lane.accept(
            config=node.config, result=result, local_lane_id=lane_id, addr=src, now=self.now
        )
        node.lanes[lane_id] = lane
        self._transmit(node.name, src, response)

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run until virtual time `until`, or until `stop()` holds (checked after each step)."""
        for _ in range(10_000_000):
            if stop is not None and stop():
                return
            if not self.step(until):
                return
        raise AssertionError("simulation did not settle")

    # --- what tests look at -----------------------------------------------------------

    def messages(self, name: str) -> list[tuple[int, int, bytes]]:
        """(local lane id, stream id, data) of every message node `name` received."""
        return [
            (lane_id, e.stream_id, e.data)
            for lane_id, e in self.nodes[name].events
            if isinstance(e, MessageReceived)
        ]

    def terminations(self, name: str) -> list[LaneTerminated]:
        """Every LaneTerminated node `name` saw."""
        return [e for _, e in self.nodes[name].events if isinstance(e, LaneTerminated)]

    def established_lane(self, name: str) -> Lane | None:
        """The first established lane of node `name`."""
        for lane in self.nodes[name].lanes.values():
            if lane.is_established:
                return lane
        return None


def pair(
    *,
    seed: int = 0,
    link: LinkProfile | None = None,
    config_a: LaneConfig | None = None,
    config_b: LaneConfig | None = None,
) -> tuple[Network, Lane, Lane]:
    """Two nodes a and b with an established lane between them (a initiated)."""
    net = Network(seed=seed, link=link)
    net.add_node("a", config_a)
    net.add_node("b", config_b)
    lane_a = net.connect("a", "b")
    net.run(
        until=30.0, stop=lambda: lane_a.is_established and net.established_lane("b") is not None
    )
    lane_b = net.established_lane("b")
    assert lane_a.is_established and lane_b is not None, "handshake did not complete"
    return net, lane_a, lane_b
