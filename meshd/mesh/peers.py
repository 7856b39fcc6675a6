"""Lanes by node key: connect on demand, accept, and read every lane into one dispatcher.

The layers above address peers by their static key, never by socket address. `PeerTable`
keeps at most one open lane per peer (the newest wins), opens one on demand from an address
book, and runs a reader task per lane that decodes each message and hands it to `dispatch`.
Remote garbage is counted and dropped (`RemoteProtocolError`), never raised into the reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from meshd.net.endpoint import Address, Endpoint, LaneClosedError, PeerLane
from protocol import RemoteProtocolError
from protocol.messages import Message, decode, encode

log = logging.getLogger(__name__)

# Stream ids: pipeline traffic (windows, hidden states, replies) and control (gossip, ...).
PIPELINE_STREAM = 1
CONTROL_STREAM = 0

Dispatch = Callable[[Message, bytes], None]


class PeerUnreachable(Exception):
    """No lane to the peer could be opened (unknown address, handshake failed, or dead)."""


@dataclass
class PeerStats:
    """Counters for the operator."""

    malformed_messages: int = 0
    lanes_lost: int = 0


class PeerTable:
    """One open lane per peer key, opened on demand; every message goes to `dispatch`."""

    def __init__(
        self,
        endpoint: Endpoint,
        own_key: bytes,
        dispatch: Dispatch,
        *,
        on_lane_lost: Callable[[bytes, PeerLane], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.own_key = own_key
        self.dispatch = dispatch
        self.on_lane_lost = on_lane_lost
        self.addresses: dict[bytes, Address] = {}
        self.stats = PeerStats()
        self._lanes: dict[bytes, PeerLane] = {}
        self._connecting: dict[bytes, trio.Event] = {}
        self._nursery: trio.Nursery | None = None

    def lane(self, key: bytes) -> PeerLane | None:
        """The open lane to `key`, if any."""
        lane = self._lanes.get(key)
        return lane if lane is not None and lane.is_open else None

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
                self._adopt(lane)

    async def lane_to(self, key: bytes) -> PeerLane:
        """An open lane to `key`, connecting if needed (PeerUnreachable on failure)."""
        while True:
            lane = self.lane(key)
            if lane is not None:
                return lane
            pending = self._connecting.get(key)
            if pending is None:
                break
            await pending.wait()
        addr = self.addresses.get(key)
        if addr is None:
            raise PeerUnreachable(f"no address known for peer {key.hex()[:16]}")
        done = self._connecting[key] = trio.Event()
        try:
            lane = await self.endpoint.connect(addr, key)
        except LaneClosedError as exc:
            raise PeerUnreachable(f"peer {key.hex()[:16]} at {addr}: {exc}") from exc
        finally:
            del self._connecting[key]
            done.set()
        self._adopt(lane)
        return lane

    async def send(self, key: bytes, message: Message, stream: int = PIPELINE_STREAM) -> None:
        """Encode and send one message to a peer (PeerUnreachable if its lane is gone).

        A message to this node itself is dispatched locally, after a checkpoint, so a
        coordinator that also hosts a stage talks to it the same way as to any other.
        """
        if key == self.own_key:
            await trio.lowlevel.checkpoint()
            self.dispatch(message, key)
            return
        lane = await self.lane_to(key)
        try:
            await lane.send(stream, encode(message))
        except LaneClosedError as exc:
            raise PeerUnreachable(f"peer {key.hex()[:16]}: {exc}") from exc

    def _adopt(self, lane: PeerLane) -> None:
        key = lane.remote_static
        old = self._lanes.get(key)
        self._lanes[key] = lane
        if old is not None and old is not lane and old.is_open:
            old.close("replaced by a newer lane")
        assert self._nursery is not None, "PeerTable.run() must be started first"
        self._nursery.start_soon(self._read, key, lane)

    async def _read(self, key: bytes, lane: PeerLane) -> None:
        async for _stream, data in lane:
            try:
                message = decode(data)
            except RemoteProtocolError as exc:
                self.stats.malformed_messages += 1
                log.warning("malformed message from %s: %s", key.hex()[:16], exc)
                continue
            self.dispatch(message, key)
        if self._lanes.get(key) is lane:
            del self._lanes[key]
            self.stats.lanes_lost += 1
            if self.on_lane_lost is not None:
                self.on_lane_lost(key, lane)
