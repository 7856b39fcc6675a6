"""Drives the sans-IO `Membership` over lanes: ticks, sends, lane events and RTTs.

Membership names nodes by Ed25519 id; lanes by X25519 key. `KeyBook` maps between the two:
ed → x is a local computation; x → ed is learned (a key query, a `NodeHello` on a lane, a
member in the view). Gossip that arrives on a lane before its hello is held briefly.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable

import trio

from meshd.mesh.jointoken import AddressError, parse_peer_address
from meshd.mesh.member import MemberEvent
from meshd.mesh.membership import Membership
from meshd.net.lane_table import LaneTable, PeerUnreachable
from protocol import RemoteProtocolError
from protocol.gossip import GossipMessage
from protocol.messages import NodeHello
from protocol.noise import x25519_public_from_ed25519_public

log = logging.getLogger(__name__)

# Gossip messages held per lane key while its NodeHello is awaited.
_HELD_PER_PEER = 32


class KeyBook:
    """Ed25519 node ids ↔ X25519 lane keys."""

    def __init__(self) -> None:
        self._x_to_ed: dict[bytes, bytes] = {}
        self._ed_to_x: dict[bytes, bytes] = {}

    def x_of(self, node_id: bytes) -> bytes:
        """The lane key of a node id (and remember the pair)."""
        x = self._ed_to_x.get(node_id)
        if x is None:
            x = x25519_public_from_ed25519_public(node_id)
            self._ed_to_x[node_id] = x
            self._x_to_ed[x] = node_id
        return x

    def ed_of(self, lane_key: bytes) -> bytes | None:
        """The node id behind a lane key, once learned."""
        return self._x_to_ed.get(lane_key)

    def learn(self, node_id: bytes, lane_key: bytes) -> bool:
        """Record a claimed pair; False (and nothing recorded) unless it is consistent."""
        try:
            if x25519_public_from_ed25519_public(node_id) != lane_key:
                return False
        except RemoteProtocolError:
            return False
        self.x_of(node_id)
        return True


class GossipDriver:
    """Runs `membership` until cancelled; `on_events` gets each batch of member events."""

    def __init__(
        self,
        membership: Membership,
        peers: LaneTable,
        keys: KeyBook,
        on_events: Callable[[list[MemberEvent]], None],
        *,
        rtt_report_interval_s: float,
    ) -> None:
        self.membership = membership
        self.peers = peers
        self.keys = keys
        self.on_events = on_events
        self.rtt_report_interval_s = rtt_report_interval_s
        self._wake = trio.Event()
        self._held: defaultdict[bytes, list[GossipMessage]] = defaultdict(list)
        self._nursery: trio.Nursery | None = None

    # ---- inputs (synchronous; each wakes the loop) -------------------------------------
    def on_gossip(self, message: GossipMessage, lane_key: bytes) -> None:
        """A decoded gossip message from a lane."""
        node_id = self.keys.ed_of(lane_key)
        if node_id is None:
            held = self._held[lane_key]
            if len(held) < _HELD_PER_PEER:
                held.append(message)
            return
        self.membership.on_message(node_id, message, trio.current_time())
        self._after_input()

    def on_hello(self, node_id: bytes, lane_key: bytes) -> None:
        """A peer proved its node id on a lane: release gossip held for it."""
        if not self.keys.learn(node_id, lane_key):
            log.warning("hello with a key that does not match the lane's: dropped")
            return
        self.membership.on_lane_up(node_id, trio.current_time())
        for message in self._held.pop(lane_key, []):
            self.membership.on_message(node_id, message, trio.current_time())
        self._after_input()

    async def say_hello(self, lane_key: bytes) -> None:
        """Prove our node id on a new lane (`NodeHello`): the peer's `on_hello`."""
        with contextlib.suppress(Exception):  # a lane that died at once is handled elsewhere
            await self.peers.send(lane_key, NodeHello(self.membership.node_id))

    def on_lane_up(self, lane_key: bytes) -> None:
        """A lane opened to a peer whose node id may already be known."""
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None:
            self.membership.on_lane_up(node_id, trio.current_time())
            self._after_input()

    def on_lane_dead(self, lane_key: bytes) -> None:
        """A lane died (or never opened)."""
        self._held.pop(lane_key, None)
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None:
            self.membership.on_lane_dead(node_id, trio.current_time())
            self._after_input()

    def join(self, node_id: bytes) -> None:
        """Sync with a seed peer (from mDNS or --join)."""
        self.membership.join(node_id, trio.current_time())
        self._after_input()

    def poke(self) -> None:
        """Something changed outside (capacity): run the loop now."""
        self._wake.set()

    def _after_input(self) -> None:
        self._flush()
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick at each deadline, send what membership wants sent, report events."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                nursery.start_soon(self._report_rtts)
                task_status.started()
                await self._loop()
            finally:
                # Stopping: gossip a lane reader still delivers is dropped from here on. Not
                # after the nursery block: the nursery closes to new tasks when its last child
                # ends, and a lane reader can run before this task resumes past the block; a
                # send spawned then raised RuntimeError in the reader and failed the exit
                # (a SIGTERMed stage exited with status 1).
                self._nursery = None

    async def _loop(self) -> None:
        while True:
            now = trio.current_time()
            deadline = self.membership.next_deadline()
            if deadline is not None and deadline <= now:
                self.membership.tick(now)
            self._flush()
            deadline = self.membership.next_deadline()
            self._wake = trio.Event()
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                await self._wake.wait()

    def _flush(self) -> None:
        if self._nursery is None:
            return
        now = trio.current_time()
        for node_id, message in self.membership.outgoing(now):
            self._nursery.start_soon(self._send, node_id, message)
        events = self.membership.events()
        if events:
            self.on_events(events)

    async def _send(self, node_id: bytes, message: GossipMessage) -> None:
        lane_key = self.keys.x_of(node_id)
        if lane_key not in self.peers.addresses:
            address = self.membership.view().get(node_id)
            if address is not None and address.address:
                with contextlib.suppress(AddressError):
                    self.peers.addresses[lane_key] = parse_peer_address(address.address, 0)
        try:
            await self.peers.send_gossip(lane_key, message)
        except PeerUnreachable as exc:
            log.debug("gossip to %s failed: %s", node_id.hex()[:16], exc)
            self.membership.on_lane_dead(node_id, trio.current_time())
            self._after_input()

    async def _report_rtts(self) -> None:
        while True:
            await trio.sleep(self.rtt_report_interval_s)
            now = trio.current_time()
            for lane_key, lane in self.peers.connected.items():
                node_id = self.keys.ed_of(lane_key)
                # The planner wants the path's latency. The smoothed RTT also holds the time a
                # busy node takes to answer (a stage loading, a CPU shared with compute), which
                # comes and goes and would move stages back and forth; the lane's minimum does
                # not. Before its first sample a lane has none (0): nothing to report yet.
                min_rtt_s = lane.lane.stats.min_rtt_s
                if node_id is not None and min_rtt_s > 0:
                    self.membership.on_rtt(node_id, min_rtt_s, now)
            self._wake.set()
