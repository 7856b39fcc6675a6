"""NAT traversal on the trio side: introduce, punch, and fall back to a relay.

Every node installs one `NatTraversal` on its lane table. It plays three roles:
- introducer: on an `IntroduceRequest` from A naming B (both with open lanes here), it opens a
  relay session and sends both an `Introduction` back to back (B first, so B's NAT mapping
  tends to exist before A's probes arrive);
- requester (`connect_via`): probes B's observed address; on the first genuine probe from B it
  opens a lane to where that probe came from (direct); otherwise it opens the lane through the
  introducer's relay. Either way the lane is an ordinary Noise lane between A and B;
- responder: probes A's observed address until A's lane arrives or the punch time ends.

Probes first go out with a low IP TTL: they cross our own NAT, creating its mapping, and die
before reaching the peer's NAT. An unsolicited probe reaching a Linux NAT first would create a
conntrack entry there that makes the peer's own outgoing flow take a different port.
Keepalives: lanes PING after `ping_interval_s` (0.25 s) of silence, far below the 30 s UDP
mapping lifetime, so an open lane (direct, relayed, or to the introducer) holds its mappings.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from meshd.net.endpoint import Address, LaneAddress
from meshd.net.lane_table import LaneTable, PeerUnreachable
from meshd.net.peer_lane import LaneClosedError, PeerLane
from meshd.net.relay import Relay
from protocol import punch
from protocol.datagram import KIND_PROBE
from protocol.streams import NAT_STREAM

log = logging.getLogger(__name__)


class Path(enum.Enum):
    """How a lane opened through an introducer travels."""

    DIRECT = "direct"
    RELAYED = "relayed"


@dataclass(frozen=True)
class PunchResult:
    """The lane `connect_via` opened, which path it took, and how long that took."""

    lane: PeerLane
    path: Path
    took_s: float


@dataclass
class NatStats:
    """Counters for the operator (and tests)."""

    introductions_made: int = 0
    introductions_refused: int = 0
    punches_direct: int = 0
    punches_relayed: int = 0


@dataclass
class _Punch:
    found: trio.Event = field(default_factory=trio.Event)
    source: Address | None = None


class NatTraversal:
    """Introductions, hole punching and relaying for one lane table. Start `run()` first."""

    def __init__(self, peers: LaneTable, config: punch.PunchConfig | None = None) -> None:
        self.peers = peers
        self.endpoint = peers.endpoint
        self.config = config if config is not None else punch.PunchConfig()
        self.relay = Relay(self.endpoint, self.config)
        self.stats = NatStats()
        self._probe_key = punch.probe_key(self.endpoint.psk)
        self._punches: dict[bytes, _Punch] = {}
        self._waiting: dict[bytes, trio.MemorySendChannel[punch.NatMessage]] = {}
        self._answering = 0
        self._nursery: trio.Nursery | None = None
        self.endpoint.datagram_handlers[KIND_PROBE] = self._on_probe
        peers.streams[NAT_STREAM] = (punch.decode, self._on_message)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve introductions and punches until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def connect_via(self, introducer: bytes, target: bytes) -> PunchResult | None:
        """A lane to `target` through `introducer`: direct if the punch works, else relayed.

        Both must hold open lanes to the introducer. Raises PeerUnreachable if the introducer
        refuses or does not answer, or if neither path opens a lane. None: the target's own
        lane arrived meanwhile (both sides dialed each other and its punch won). Its side
        stops answering our probes once it holds that lane, so going on would only probe
        until the punch time ends and then handshake through the relay for nothing.
        """
        start = trio.current_time()
        intro = await self._request_introduction(introducer, target)
        via = self._lane_address(introducer)
        relay_path = punch.RelayPath(via, intro.relay_session)
        self.endpoint.relay_paths.add(relay_path)
        arrived = functools.partial(self._has_lane, target)
        source = await self._probe(intro, until_found=True, stop=arrived)
        if source is not None and not arrived():
            lane = await self._connect(source, target, self.config.direct_handshake_timeout_s)
            if lane is not None:
                self.endpoint.relay_paths.discard(relay_path)
                self.stats.punches_direct += 1
                return PunchResult(self.peers.adopt(lane), Path.DIRECT, trio.current_time() - start)
        lane = None
        if not arrived():
            timeout_s = self.endpoint.lane_config.handshake_timeout_s
            lane = await self._connect_unless_arrived(relay_path, target, timeout_s)
        if lane is None:
            self.endpoint.relay_paths.discard(relay_path)
            if arrived():
                return None
            raise PeerUnreachable(f"peer {target.hex()[:16]}: neither punch nor relay opened")
        self.stats.punches_relayed += 1
        self._spawn(self._forget_path_when_closed, relay_path, lane)
        return PunchResult(self.peers.adopt(lane), Path.RELAYED, trio.current_time() - start)

    # -- requester ------------------------------------------------------------------------
    async def _request_introduction(self, introducer: bytes, target: bytes) -> punch.Introduction:
        if target in self._waiting:
            raise PeerUnreachable(f"an introduction to {target.hex()[:16]} is already pending")
        send, receive = trio.open_memory_channel[punch.NatMessage](1)
        self._waiting[target] = send
        try:
            request = punch.encode(punch.IntroduceRequest(target))
            await self.peers.send_bytes(introducer, NAT_STREAM, request)
            with trio.move_on_after(self.config.introduction_timeout_s):
                reply = await receive.receive()
                if isinstance(reply, punch.Introduction):
                    return reply
                assert isinstance(reply, punch.IntroductionRefused)
                raise PeerUnreachable(f"introduction refused: {reply.reason}")
            raise PeerUnreachable(f"introducer {introducer.hex()[:16]} did not answer")
        finally:
            del self._waiting[target]

    async def _connect_unless_arrived(
        self, addr: LaneAddress, key: bytes, timeout_s: float
    ) -> PeerLane | None:
        """`_connect`, abandoned (None) as soon as a lane to `key` opens some other way."""
        opened: list[PeerLane | None] = [None]
        async with trio.open_nursery() as nursery:

            async def dial() -> None:
                opened[0] = await self._connect(addr, key, timeout_s)
                nursery.cancel_scope.cancel()

            nursery.start_soon(dial)
            await self.peers.wait_for_lane(key)
            nursery.cancel_scope.cancel()
        return opened[0]

    async def _connect(self, addr: LaneAddress, key: bytes, timeout_s: float) -> PeerLane | None:
        with trio.move_on_after(timeout_s):
            try:
                return await self.endpoint.connect(addr, key)
            except LaneClosedError as exc:
                log.debug("lane to %s via %s failed: %s", key.hex()[:16], addr, exc)
        return None

    # -- probing (both sides) -------------------------------------------------------------
    async def _probe(
        self, intro: punch.Introduction, *, until_found: bool, stop: Callable[[], bool]
    ) -> Address | None:
        """Probe the peer for up to punch_duration_s; the address its first probe came from."""
        config = self.config
        state = self._punches[intro.nonce] = _Punch()
        probe = punch.make_probe(self._probe_key, intro.nonce)
        target = (intro.peer_host, intro.peer_port)
        start = trio.current_time()
        try:
            while (elapsed := trio.current_time() - start) < config.punch_duration_s:
                if stop() or (until_found and state.found.is_set()):
                    break
                ttl = config.open_ttl if elapsed < config.open_phase_s else None
                self.endpoint.send_datagram(probe, target, ttl=ttl)
                if until_found:
                    with trio.move_on_after(config.probe_interval_s):
                        await state.found.wait()
                else:
                    await trio.sleep(config.probe_interval_s)
        finally:
            del self._punches[intro.nonce]
        return state.source

    def _on_probe(self, data: bytes, addr: Address, now: float) -> str | None:
        """A PROBE datagram (the endpoint's handler): the drop reason, or None if it counted.

        Its tag is checked first, so a forgery counts as undecryptable (UndecryptableError)
        and a genuine probe for no punch in progress (late, or replayed) as unknown_probe."""
        state = self._punches.get(punch.verify_probe(self._probe_key, data))
        if state is None:
            return "unknown_probe"
        if state.source is None:
            state.source = addr
            state.found.set()
        return None

    # -- messages on the NAT stream -------------------------------------------------------
    def _on_message(self, message: punch.NatMessage, sender: bytes) -> None:
        if isinstance(message, punch.IntroduceRequest):
            self._spawn(self._introduce, sender, message.target)
        elif isinstance(message, punch.IntroductionRefused) or message.initiator:
            key = message.target if isinstance(message, punch.IntroductionRefused) else message.peer
            waiter = self._waiting.get(key)
            if waiter is not None:
                waiter.send_nowait(message)
        elif self._answering < self.config.max_concurrent_punches:
            self._spawn(self._answer, message, sender)

    async def _introduce(self, requester: bytes, target: bytes) -> None:
        if self.peers.lane(target) is None or target == requester:
            await self._refuse(requester, target, "the introducer has no lane to the target")
            return
        addr_a, addr_b = _direct_address(self.peers, requester), _direct_address(self.peers, target)
        if addr_a is None or addr_b is None:
            await self._refuse(requester, target, "the introducer reaches a side only by relay")
            return
        (host_a, port_a), (host_b, port_b) = addr_a, addr_b
        session = self.relay.open_session(((host_a, port_a), (host_b, port_b)), (requester, target))
        if session is None:
            await self._refuse(requester, target, "the introducer's relay is full")
            return
        nonce = secrets.token_bytes(punch.NONCE_BYTES)
        to_b = punch.Introduction(requester, host_a, port_a, host_b, port_b, nonce, session, False)
        to_a = punch.Introduction(target, host_b, port_b, host_a, port_a, nonce, session, True)
        self.stats.introductions_made += 1
        try:
            await self.peers.send_bytes(target, NAT_STREAM, punch.encode(to_b))
            await self.peers.send_bytes(requester, NAT_STREAM, punch.encode(to_a))
        except PeerUnreachable as exc:
            log.info("introduction of %s failed: %s", target.hex()[:16], exc)

    async def _refuse(self, requester: bytes, target: bytes, reason: str) -> None:
        self.stats.introductions_refused += 1
        refusal = punch.encode(punch.IntroductionRefused(target, reason))
        with contextlib.suppress(PeerUnreachable):
            await self.peers.send_bytes(requester, NAT_STREAM, refusal)

    async def _answer(self, intro: punch.Introduction, introducer: bytes) -> None:
        """The responder's half: probe the requester and accept its lane, direct or relayed."""
        self._answering += 1
        try:
            relay_path = punch.RelayPath(self._lane_address(introducer), intro.relay_session)
            self.endpoint.relay_paths.add(relay_path)
            await self._probe(intro, until_found=False, stop=lambda: self._has_lane(intro.peer))
        finally:
            self._answering -= 1
        # The requester may still open its lane through the relay: accept that for a while.
        lane_timeout_s = self.endpoint.lane_config.handshake_timeout_s
        deadline = trio.current_time() + self.config.direct_handshake_timeout_s + lane_timeout_s
        while trio.current_time() < deadline:
            lane = self.peers.lane(intro.peer)
            if lane is not None and lane.addr == relay_path:
                await self._forget_path_when_closed(relay_path, lane)
                return
            if lane is not None:
                break  # a direct lane: the relay path is not needed
            await trio.sleep(0.05)
        self.endpoint.relay_paths.discard(relay_path)

    def _has_lane(self, key: bytes) -> bool:
        return self.peers.lane(key) is not None

    async def _forget_path_when_closed(self, path: punch.RelayPath, lane: PeerLane) -> None:
        await lane.terminated()
        self.endpoint.relay_paths.discard(path)

    def _lane_address(self, key: bytes) -> Address:
        addr = _direct_address(self.peers, key)
        if addr is None:
            raise PeerUnreachable(f"no direct lane to introducer {key.hex()[:16]}")
        return addr

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        assert self._nursery is not None, "NatTraversal.run() must be started first"
        self._nursery.start_soon(fn, *args)


def _direct_address(peers: LaneTable, key: bytes) -> Address | None:
    """Where the open lane to `key` reaches it (its observed address), unless relayed."""
    lane = peers.lane(key)
    if lane is None or not isinstance(lane.addr, tuple):
        return None
    return (str(lane.addr[0]), int(lane.addr[1]))
