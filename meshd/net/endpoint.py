"""The trio UDP endpoint: one socket serving many lanes.

A thin driver over the sans-IO `protocol.lane.Lane` (in the manner of hypercorn's trio UDP
server over its protocol core): it reads datagrams, routes them to lanes by receiver lane id,
answers initiations through one `protocol.handshake.Responder`, runs the lanes' timers, and
writes what the lanes want sent. The same socket carries NAT traversal (meshd/net/punch.py):
PROBE and RELAY datagrams go to handlers registered in `datagram_handlers` (each returns the
reason it dropped one, or None); RELAYED datagrams
from a registered `RelayPath` are unwrapped and routed like any other, with the path as their
address; and whatever a lane sends to a `RelayPath` leaves wrapped for the relay.

Layers above see `PeerLane` objects: `send(stream_id, data)`, `receive()`, `terminated()`.
When a lane dies, every task waiting on it gets `LaneClosedError` (never a hang).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import trio

from meshd.net.emulator import LinkEmulator, LinkProfile
from meshd.net.peer_lane import PeerLane
from protocol import PROTOCOL_VERSION, RemoteProtocolError, keyquery, punch
from protocol.config import LaneConfig
from protocol.datagram import (
    KIND_DATA,
    KIND_INITIATION,
    KIND_KEY_ANSWER,
    KIND_KEY_QUERY,
    KIND_PROBE,
    KIND_REFUSAL,
    KIND_RELAY,
    KIND_RELAYED,
    KIND_RESPONSE,
    peek_kind,
    peek_receiver_lane_id,
)
from protocol.errors import HandshakeRejected
from protocol.handshake import InitiationRefused, Responder
from protocol.lane import Lane

log = logging.getLogger(__name__)

Address = tuple[str, int]
# What a lane may be addressed by: a socket address, or a path through a relay.
LaneAddress = Address | punch.RelayPath
# A handler of an out-of-lane kind: (datagram, source, now) -> the drop reason, or None if taken.
DatagramHandler = Callable[[bytes, Address, float], str | None]
# Inner kinds a relay may carry: lane traffic only (no nested relaying, probes or key queries).
_RELAYABLE_KINDS = frozenset({KIND_INITIATION, KIND_RESPONSE, KIND_REFUSAL, KIND_DATA})

# Datagrams read per wake-up before the endpoint flushes replies (batches ACKs under load).
_RECV_BATCH = 64
_RECV_BUFFER_BYTES = 65536


# Why a datagram was dropped (`EndpointStats.dropped`). Every datagram the socket takes in is
# either used or counted under one of these, so forgeries of any kind show up:
# - it fails authentication (a forgery, another mesh's secret, a lane's discarded key);
# - a replay or duplicate of one already taken;
# - addressed to no lane we have, or to a lane that has just ended;
# - a genuine NAT probe for no punch in progress (late, or replayed after the punch);
# - a genuine key answer to no query we are waiting on (late, or a duplicate);
# - a key query while this endpoint has no node key to answer with;
# - a RELAY datagram our relay refuses (`protocol.punch.RELAY_DROP_REASONS`);
# - anything else (no known kind, a wrong length, a kind that cannot come this way);
# and one sent datagram: a send the kernel refused (full buffer, unreachable): loss.
DROP_REASONS: tuple[str, ...] = (
    "undecryptable", "replayed", "unknown_lane", "lane_closed", "unknown_probe",
    "unknown_key_answer", "key_query_unserved", *punch.RELAY_DROP_REASONS, "malformed",
    "send_failed",
)  # fmt: skip
# Why an initiation meant for us (its mac1 holds) was refused (`EndpointStats.refused`).
REFUSAL_REASONS: tuple[str, ...] = (
    "version", "not_admitted", "replayed", "clock_skew", "undecryptable", "malformed",
)  # fmt: skip


@dataclass
class EndpointStats:
    """Counters an operator can read (and metrics export).

    `datagrams_dropped` counts received datagrams dropped and sends the kernel refused;
    `dropped` splits them by reason (DROP_REASONS; `datagrams_dropped` is their sum),
    `refused` the refused handshakes (REFUSAL_REASONS; `handshakes_refused` is their sum).
    """

    datagrams_received: int = 0
    datagrams_dropped: int = 0
    handshakes_refused: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))

    def drop(self, reason: str) -> None:
        """One datagram dropped, for `reason`."""
        self.datagrams_dropped += 1
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def refuse(self, reason: str) -> None:
        """One handshake refused, for `reason`."""
        self.handshakes_refused += 1
        self.refused[reason] = self.refused.get(reason, 0) + 1


class Endpoint:
    """A UDP socket serving many lanes. Create with `open_endpoint`."""

    def __init__(
        self,
        *,
        static_private: bytes,
        psk: bytes,
        admit: Callable[[bytes], bool],
        lane_config: LaneConfig,
        versions: Sequence[int],
        capabilities: Sequence[str],
        egress: LinkProfile | None,
        send_buffer_limit_bytes: int,
        node_public_key: bytes | None = None,
    ) -> None:
        self.static_private = static_private
        self.node_public_key = node_public_key
        self._key_query_tag = keyquery.query_key(psk)
        self._key_queries: dict[bytes, trio.MemorySendChannel[bytes]] = {}
        self.psk = psk
        self.lane_config = lane_config
        self.versions = tuple(versions)
        self.capabilities = tuple(capabilities)
        self.send_buffer_limit_bytes = send_buffer_limit_bytes
        self.stats = EndpointStats()
        self._responder = Responder(
            static_private=static_private,
            psk=psk,
            admit=admit,
            versions=self.versions,
            capabilities=self.capabilities,
            max_message_bytes=lane_config.max_message_bytes,
        )
        self._egress = LinkEmulator(egress) if egress is not None and not egress.is_ideal else None
        self._sock: socket.socket | None = None
        self._lanes: dict[int, PeerLane] = {}
        self._incoming_send, self._incoming_recv = trio.open_memory_channel[PeerLane](64)
        self._wake = trio.Event()
        self._sleeping_until = float("inf")  # the timer task's current deadline
        self._dirty: set[PeerLane] = set()
        # NAT traversal hooks: handlers for PROBE/RELAY, and relay paths we accept RELAYED from.
        self.datagram_handlers: dict[int, DatagramHandler] = {}
        self.relay_paths: set[punch.RelayPath] = set()
        self._bulk_held = False

    @property
    def local_address(self) -> Address:
        """The (host, port) the socket is bound to."""
        assert self._sock is not None
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def lanes(self) -> list[PeerLane]:
        """Lanes currently registered (open or draining)."""
        return list(self._lanes.values())

    # -- public API ----------------------------------------------------------------------
    async def connect(self, addr: LaneAddress, remote_static: bytes) -> PeerLane:
        """Open a lane to `addr`, expecting the peer to hold `remote_static`.

        Raises LaneClosedError if the handshake times out or the peer refuses.
        """
        lane = Lane.connect(
            config=self.lane_config,
            static_private=self.static_private,
            remote_static=remote_static,
            psk=self.psk,
            local_lane_id=self._new_lane_id(),
            addr=addr,
            versions=self.versions,
            capabilities=self.capabilities,
            now=trio.current_time(),
            now_wall_ns=time.time_ns(),
        )
        peer = self._register(lane, incoming=False)
        self._after_activity(peer)
        try:
            await peer._established.wait()
        except BaseException:
            # Cancelled mid-handshake (a caller's deadline): leave no half-open lane behind.
            peer.close("connect abandoned")
            raise
        peer._raise_if_terminated()
        return peer

    async def query_key(self, addr: Address, *, timeout_s: float = 0.5, attempts: int = 4) -> bytes:
        """Ask `addr` for its node's Ed25519 public key (proven by the mesh secret).

        Raises TimeoutError if no mesh member answers there.
        """
        for _ in range(attempts):
            nonce = secrets.token_bytes(keyquery.NONCE_BYTES)
            send, receive = trio.open_memory_channel[bytes](1)
            self._key_queries[nonce] = send
            try:
                self._write([(keyquery.make_query(self._key_query_tag, nonce), addr)])
                with trio.move_on_after(timeout_s):
                    return await receive.receive()
            finally:
                del self._key_queries[nonce]
        raise TimeoutError(f"no mesh member answered a key query at {addr}")

    def send_datagram(self, data: bytes, addr: Address, *, ttl: int | None = None) -> None:
        """Send one datagram outside any lane (NAT probes, relayed datagrams).

        `ttl` sets the IP TTL of this datagram only (a punch's low-TTL opening probes).
        """
        if ttl is None:
            self._write([(data, addr)])
            return
        assert self._sock is not None
        default = self._sock.getsockopt(socket.IPPROTO_IP, socket.IP_TTL)
        self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
        try:
            self._write([(data, addr)])
        finally:
            self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, default)

    async def accept(self) -> PeerLane:
        """The next lane a peer opened to us (after its handshake was admitted)."""
        return await self._incoming_recv.receive()

    def hold_bulk(self, held: bool) -> None:
        """Hold (or release) bulk streams on every lane, present and future (`Lane.hold_bulk`):
        a `meshd.net.bulk.BulkGate` listener. Released, the lanes send what they queued on
        the timer task's next pass, after what the releasing task sends now."""
        if held == self._bulk_held:
            return
        self._bulk_held = held
        for peer in self._lanes.values():
            peer.lane.hold_bulk(held)
            if not held:
                self._dirty.add(peer)
        if not held:
            self._wake.set()

    # -- driver internals ----------------------------------------------------------------
    def _new_lane_id(self) -> int:
        while True:
            lane_id = secrets.randbits(32)
            if lane_id and lane_id not in self._lanes:
                return lane_id

    def _register(self, lane: Lane, *, incoming: bool) -> PeerLane:
        peer = PeerLane(self, lane, incoming=incoming)
        lane.hold_bulk(self._bulk_held)
        self._lanes[lane.local_lane_id] = peer
        return peer

    def _after_activity(self, peer: PeerLane) -> None:
        self._dirty.add(peer)
        self._wake.set()

    def _timer_moved(self, peer: PeerLane) -> None:
        """Wake the timer task only if this lane now needs it earlier than it sleeps."""
        timer = peer.lane.get_timer()
        if timer is not None and timer < self._sleeping_until:
            self._wake.set()

    def _handle_datagram(self, data: bytes, addr: LaneAddress, now: float) -> None:
        self.stats.datagrams_received += 1
        try:
            kind = peek_kind(data)
            if isinstance(addr, punch.RelayPath) and kind not in _RELAYABLE_KINDS:
                raise RemoteProtocolError(f"kind 0x{kind:02x} cannot arrive through a relay")
            if kind in (KIND_PROBE, KIND_RELAY, KIND_RELAYED):
                assert not isinstance(addr, punch.RelayPath)
                self._handle_nat_kind(kind, data, addr, now)
                return
            if kind == KIND_INITIATION:
                self._handle_initiation(data, addr, now)
                return
            if kind in (KIND_KEY_QUERY, KIND_KEY_ANSWER):
                assert not isinstance(addr, punch.RelayPath)
                self._handle_key_query(kind, data, addr)
                return
            peer = self._lanes.get(peek_receiver_lane_id(data))
            if peer is None:
                self.stats.drop("unknown_lane")
                return
            reason = peer.lane.receive_datagram(data, addr, now)
            if reason is not None:
                self.stats.drop(reason)
            self._dirty.add(peer)
        except HandshakeRejected as exc:
            self.stats.refuse(exc.refusal)
            log.debug("refused a handshake from %s: %s", addr, exc)
        except RemoteProtocolError as exc:
            self.stats.drop(exc.drop_reason)
            log.debug("dropped datagram from %s: %s", addr, exc)

    def _handle_nat_kind(self, kind: int, data: bytes, addr: Address, now: float) -> None:
        if kind == KIND_RELAYED:
            session_id, inner = punch.unwrap(data)
            path = punch.RelayPath(addr, session_id)
            if path not in self.relay_paths:
                # A session we never joined, or one whose lane has ended: no lane of ours.
                self.stats.drop("unknown_lane")
                return
            self.stats.datagrams_received -= 1  # the inner datagram counts itself
            self._handle_datagram(inner, path, now)
            return
        handler = self.datagram_handlers.get(kind)
        reason = "malformed" if handler is None else handler(data, addr, now)
        if reason is not None:
            self.stats.drop(reason)

    def _handle_key_query(self, kind: int, data: bytes, addr: Address) -> None:
        if kind == KIND_KEY_QUERY:
            if self.node_public_key is None:
                self.stats.drop("key_query_unserved")
                return
            answer = keyquery.answer_query(self._key_query_tag, data, self.node_public_key)
            self._write([(answer, addr)])
            return
        nonce, key = keyquery.read_answer(self._key_query_tag, data)
        waiter = self._key_queries.get(nonce)
        try:
            if waiter is None:
                raise trio.WouldBlock
            waiter.send_nowait(key)  # holds one: a second answer to the same query is a dup
        except trio.WouldBlock:
            self.stats.drop("unknown_key_answer")

    def _handle_initiation(self, data: bytes, addr: LaneAddress, now: float) -> None:
        lane_id = self._new_lane_id()
        try:
            response, result = self._responder.handle_initiation(
                data, local_lane_id=lane_id, now_wall_ns=time.time_ns()
            )
        except InitiationRefused as refused:
            self.stats.refuse(refused.refusal)
            self._send_now([(refused.datagram, addr)], now)
            return
        lane = Lane.accept(
            config=self.lane_config, result=result, local_lane_id=lane_id, addr=addr, now=now
        )
        peer = self._register(lane, incoming=True)
        self._send_now([(response, addr)], now)
        self._dirty.add(peer)

    def _flush(self, peer: PeerLane, now: float) -> None:
        """Send what one lane has queued and deliver its events."""
        self._send_now(peer.lane.datagrams_to_send(now), now)
        peer._drain_events()
        self._timer_moved(peer)

    def _service(self, now: float) -> None:
        """Run due timers, deliver events and send what every touched lane has queued."""
        for peer in list(self._lanes.values()):
            timer = peer.lane.get_timer()
            if timer is not None and timer <= now:
                peer.lane.handle_timer(now)
                self._dirty.add(peer)
        dirty, self._dirty = self._dirty, set()
        for peer in dirty:
            was_established = peer._established.is_set()
            self._send_now(peer.lane.datagrams_to_send(now), now)
            peer._drain_events()
            newly_open = not was_established and peer._established.is_set() and peer.is_open
            if newly_open and peer.incoming:
                try:
                    self._incoming_send.send_nowait(peer)
                except trio.WouldBlock:
                    peer.close("accept backlog full")
            self._timer_moved(peer)
            if peer.termination is not None and peer.lane.is_terminated:
                self._lanes.pop(peer.lane.local_lane_id, None)
        if self._egress is not None:
            self._write(self._egress.due(now))

    def _send_now(self, datagrams: list[tuple[bytes, Hashable]], now: float) -> None:
        if not datagrams:
            return
        if self._egress is not None:
            for data, addr in datagrams:
                self._egress.submit(data, addr, now)
            self._write(self._egress.due(now))
            deadline = self._egress.next_deadline()
            if deadline is not None and deadline < self._sleeping_until:
                self._wake.set()
        else:
            self._write(datagrams)

    def _write(self, datagrams: list[tuple[bytes, Hashable]]) -> None:
        assert self._sock is not None
        for data, addr in datagrams:
            if isinstance(addr, punch.RelayPath):
                data, addr = addr.wrap(data)
            try:
                self._sock.sendto(data, addr)  # type: ignore[call-overload]
            except BlockingIOError:
                # The kernel buffer is full: treat as loss; the lane's recovery resends.
                self.stats.drop("send_failed")
            except OSError as exc:
                # EMSGSIZE for an oversized PMTU probe, or an unreachable peer: both are loss.
                if exc.errno not in (errno.EMSGSIZE, errno.ECONNREFUSED, errno.ENETUNREACH):
                    log.debug("sendto %s failed: %s", addr, exc)
                self.stats.drop("send_failed")

    async def _receive_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            await trio.lowlevel.wait_readable(sock)
            now = trio.current_time()
            for _ in range(_RECV_BATCH):
                try:
                    data, addr = sock.recvfrom(_RECV_BUFFER_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except ConnectionRefusedError:
                    # ICMP port unreachable from an earlier send; the lane's timers handle it.
                    continue
                self._handle_datagram(data, addr, now)
            self._service(now)

    async def _timer_loop(self) -> None:
        while True:
            deadline = self._next_deadline()
            self._wake = trio.Event()
            if self._dirty:
                self._service(trio.current_time())
                continue
            self._sleeping_until = deadline if deadline is not None else float("inf")
            with trio.move_on_at(self._sleeping_until):
                await self._wake.wait()
            self._sleeping_until = float("-inf")  # awake: every change must be seen next loop
            self._service(trio.current_time())

    def _next_deadline(self) -> float | None:
        timers = [t for p in self._lanes.values() if (t := p.lane.get_timer()) is not None]
        if self._egress is not None and (d := self._egress.next_deadline()) is not None:
            timers.append(d)
        return min(timers) if timers else None

    async def aclose(self) -> None:
        """Close every lane gracefully and flush what can be sent now."""
        for peer in list(self._lanes.values()):
            peer.close("endpoint shutting down")
        if self._sock is not None:
            self._service(trio.current_time())


def _make_socket(bind: Address) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
    if family == socket.AF_INET and hasattr(socket, "IP_MTU_DISCOVER"):
        # Set DF so oversized PMTU probes are dropped, never fragmented.
        with contextlib.suppress(OSError):
            sock.setsockopt(
                socket.IPPROTO_IP, socket.IP_MTU_DISCOVER, getattr(socket, "IP_PMTUDISC_DO", 2)
            )
    sock.bind(bind)
    return sock


@contextlib.asynccontextmanager
async def open_endpoint(
    *,
    static_private: bytes,
    psk: bytes,
    bind: Address = ("127.0.0.1", 0),
    admit: Callable[[bytes], bool] | None = None,
    lane_config: LaneConfig | None = None,
    versions: Sequence[int] = (PROTOCOL_VERSION,),
    capabilities: Sequence[str] = (),
    egress: LinkProfile | None = None,
    send_buffer_limit_bytes: int = 8 * 1024 * 1024,
    node_public_key: bytes | None = None,
) -> AsyncIterator[Endpoint]:
    """Bind a UDP socket and serve lanes on it until the block exits.

    `admit` decides which initiator static keys may open a lane (all PSK holders by default);
    `egress` puts a userspace link emulator on this endpoint's send path.
    `node_public_key` (the node's Ed25519 key) is what this endpoint answers key queries with;
    without it, key queries go unanswered.
    """
    endpoint = Endpoint(
        static_private=static_private,
        psk=psk,
        admit=admit if admit is not None else (lambda _key: True),
        lane_config=lane_config if lane_config is not None else LaneConfig(),
        versions=versions,
        capabilities=capabilities,
        egress=egress,
        send_buffer_limit_bytes=send_buffer_limit_bytes,
        node_public_key=node_public_key,
    )
    endpoint._sock = _make_socket(bind)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(endpoint._receive_loop)
            nursery.start_soon(endpoint._timer_loop)
            try:
                yield endpoint
            finally:
                with trio.CancelScope(shield=True):
                    await endpoint.aclose()
                nursery.cancel_scope.cancel()
    finally:
        endpoint._sock.close()
