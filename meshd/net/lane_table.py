"""Lanes by node key: connect on demand, accept, and read every lane into one dispatcher.

The layers above address peers by their static key, never by socket address. `LaneTable`
keeps at most one open lane per peer (the newest wins), opens one on demand from an address
book, and runs a reader task per lane that decodes each message by its stream and hands it on:
pipeline messages (`PIPELINE_STREAM`, `protocol.messages`) to `dispatch`, and each other
registered stream (`GOSSIP_STREAM` carries `protocol.gossip`; ids in `protocol.streams`) to its
own handler. Remote garbage is counted and dropped (`RemoteProtocolError`), never raised into
the reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import trio

from meshd.net.endpoint import Address, Endpoint
from meshd.net.peer_lane import LaneClosedError, PeerLane
from protocol import RemoteProtocolError, gossip
from protocol.messages import Message, decode, encode
from protocol.streams import GOSSIP_STREAM, PIPELINE_STREAM

log = logging.getLogger(__name__)

Dispatch = Callable[[Message, bytes], None]
# A stream other than the pipeline's: how its bytes decode, and who gets (message, sender).
StreamHandler = tuple[Callable[[bytes], Any], Callable[[Any, bytes], None]]


class PeerUnreachable(Exception):
    """No lane to the peer could be opened (unknown address, handshake failed, or dead)."""


@dataclass
class _Attempt:
    """One dial in progress; callers that wait on it share its outcome."""

    done: trio.Event
    error: PeerUnreachable | None = None


class LaneTableOptions(TypedDict, total=False):
    """`LaneTable`'s optional keywords, for tables built on it to pass along."""

    on_lane_lost: Callable[[bytes, PeerLane], None] | None
    on_lane_up: Callable[[bytes, PeerLane], None] | None
    streams: Mapping[int, StreamHandler] | None


class LaneTable:
    """One open lane per peer key, opened on demand; every message goes to `dispatch`."""

    def __init__(
        self,
        endpoint: Endpoint,
        own_key: bytes,
        dispatch: Dispatch,
        *,
        on_lane_lost: Callable[[bytes, PeerLane], None] | None = None,
        on_lane_up: Callable[[bytes, PeerLane], None] | None = None,
        streams: Mapping[int, StreamHandler] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.own_key = own_key
        self.dispatch = dispatch
        self.on_lane_lost = on_lane_lost
        self.on_lane_up = on_lane_up
        self.streams: dict[int, StreamHandler] = {PIPELINE_STREAM: (decode, dispatch)}
        # Without other handlers, every stream carries pipeline messages (the old contract).
        self._default: StreamHandler | None = (decode, dispatch) if not streams else None
        self.streams.update(streams or {})
        self.addresses: dict[bytes, Address] = {}
        self._lanes: dict[bytes, PeerLane] = {}
        self._connecting: dict[bytes, _Attempt] = {}
        self._arrivals: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None

    def lane(self, key: bytes) -> PeerLane | None:
        """The open lane to `key`, if any."""
        lane = self._lanes.get(key)
        return lane if lane is not None and lane.is_open else None

    async def wait_for_lane(self, key: bytes) -> PeerLane:
        """The open lane to `key`, once there is one (dialed, accepted or punched by anyone)."""
        while (lane := self.lane(key)) is None:
            await self._arrivals.setdefault(key, trio.Event()).wait()
        return lane

    @property
    def connected(self) -> dict[bytes, PeerLane]:
        """Open lanes by peer key."""
        return {k: v for k, v in self._lanes.items() if v.is_open}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept incoming lanes and read every lane until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                lane = await self.endpoint.accept()
                self.adopt(lane)

    async def lane_to(self, key: bytes) -> PeerLane:
        """An open lane to `key`, opening one if needed (PeerUnreachable on failure).

        Callers that need the same peer at once share one attempt: the first opens the lane
        (`_open_lane`), the others wait for it and then take the lane it left open, or its
        PeerUnreachable. A failure is shared, not retried by each waiter in turn: N messages
        queued for a dead peer would otherwise cost N dials one after another (each a
        handshake timeout plus introductions), and hold N tasks that long.
        """
        while True:
            lane = self.lane(key)
            if lane is not None:
                return lane
            pending = self._connecting.get(key)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None and self.lane(key) is None:
                raise PeerUnreachable(str(pending.error))
        attempt = self._connecting[key] = _Attempt(trio.Event())
        try:
            return await self._open_lane(key)
        except PeerUnreachable as exc:
            attempt.error = exc
            raise
        finally:
            del self._connecting[key]
            attempt.done.set()

    async def _open_lane(self, key: bytes) -> PeerLane:
        """Open a lane to `key` (none is open, no other attempt runs): dial its address."""
        return await self._dial_address(key)

    async def _dial_address(self, key: bytes) -> PeerLane:
        """Dial `key` at its address in the book and adopt the lane (PeerUnreachable)."""
        addr = self.addresses.get(key)
        if addr is None:
            raise PeerUnreachable(f"no address known for peer {key.hex()[:16]}")
        try:
            lane = await self.endpoint.connect(addr, key)
        except LaneClosedError as exc:
            raise PeerUnreachable(f"peer {key.hex()[:16]} at {addr}: {exc}") from exc
        return self.adopt(lane)

    async def send(self, key: bytes, message: Message, stream: int = PIPELINE_STREAM) -> None:
        """Encode and send one message to a peer (PeerUnreachable if its lane is gone).

        A message to this node itself is dispatched locally, after a checkpoint, so a
        coordinator that also hosts a stage talks to it the same way as to any other.
        """
        if key == self.own_key:
            await trio.lowlevel.checkpoint()
            self.dispatch(message, key)
            return
        await self.send_bytes(key, stream, encode(message))

    async def send_gossip(self, key: bytes, message: gossip.GossipMessage) -> None:
        """Send one membership message on the gossip stream (never to this node itself)."""
        await self.send_bytes(key, GOSSIP_STREAM, gossip.encode(message))

    async def send_bytes(self, key: bytes, stream: int, data: bytes) -> None:
        """Send encoded bytes on `stream` to a peer (PeerUnreachable if its lane is gone)."""
        lane = await self.lane_to(key)
        try:
            await lane.send(stream, data)
        except LaneClosedError as exc:
            raise PeerUnreachable(f"peer {key.hex()[:16]}: {exc}") from exc

    def adopt(self, lane: PeerLane) -> PeerLane:
        """Take a new lane (accepted, dialed, or opened by NAT traversal); returns the lane kept for its peer (it or the one already open).

        Two nodes that dial each other at once open two lanes. Both sides keep the one opened
        by the smaller key, so they agree without a message; a lane opened by the same side as
        the open one (a reconnect) replaces it.
        """
        key = lane.remote_static
        old = self._lanes.get(key)
        if old is not None and old is not lane and old.is_open:
            preferred = min(self.own_key, key)
            if self._initiator(old) == preferred != self._initiator(lane):
                lane.close("a lane to this peer is already open")
                return old
            old.close("replaced by a newer lane")
        self._lanes[key] = lane
        assert self._nursery is not None, "LaneTable.run() must be started first"
        self._nursery.start_soon(self._read, key, lane)
        arrived = self._arrivals.pop(key, None)
        if arrived is not None:
            arrived.set()  # wakes `wait_for_lane`
        if self.on_lane_up is not None:
            self.on_lane_up(key, lane)
        return lane

    def _initiator(self, lane: PeerLane) -> bytes:
        return lane.remote_static if lane.incoming else self.own_key

    async def _read(self, key: bytes, lane: PeerLane) -> None:
        async for stream, data in lane:
            handler = self.streams.get(stream, self._default)
            if handler is None:
                log.warning("message on unknown stream %d from %s", stream, key.hex()[:16])
                continue
            decoder, deliver = handler
            try:
                message = decoder(data)
            except RemoteProtocolError as exc:
                log.warning("malformed message from %s: %s", key.hex()[:16], exc)
                continue
            deliver(message, key)
        if self._lanes.get(key) is lane:
            del self._lanes[key]
            if self.on_lane_lost is not None:
                self.on_lane_lost(key, lane)
