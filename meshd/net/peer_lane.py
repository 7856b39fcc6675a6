"""One lane as the layers above see it (`PeerLane`: send, receive, wait for its end), and
`LaneClosedError`, what every task waiting on a lane gets once it dies. The `Endpoint` that
owns the socket drives it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import TYPE_CHECKING

import trio

from protocol.events import LaneEstablished, LaneTerminated, MessageReceived, TerminationReason
from protocol.lane import Lane

if TYPE_CHECKING:
    from meshd.net.endpoint import Endpoint


class LaneClosedError(Exception):
    """The lane is gone: closed by either side, its peer died, or it never opened."""

    def __init__(self, reason: TerminationReason, detail: str = "") -> None:
        super().__init__(f"lane {reason.name.lower()}" + (f": {detail}" if detail else ""))
        self.reason = reason
        self.detail = detail


class PeerLane:
    """One lane as the layers above see it."""

    def __init__(self, endpoint: Endpoint, lane: Lane, *, incoming: bool) -> None:
        self._endpoint = endpoint
        self.lane = lane
        self.incoming = incoming
        self._inbox: deque[tuple[int, bytes]] = deque()
        self._readable = trio.Event()
        self._established = trio.Event()
        self._terminated: LaneTerminated | None = None
        self._terminated_event = trio.Event()
        self._drained = trio.Event()
        # (bytes, event): set once at most that many bytes are unacknowledged (`wait_unacked`).
        self._unacked_waiters: list[tuple[int, trio.Event]] = []

    # -- what the layers above call ------------------------------------------------------
    @property
    def remote_static(self) -> bytes:
        """The peer's static (X25519) public key, proven by the handshake."""
        key = self.lane.remote_static
        assert key is not None, "an initiator's lane knows its peer's key from the start"
        return key

    @property
    def addr(self) -> Hashable:
        """Where the peer's datagrams come from now."""
        return self.lane.addr

    @property
    def is_open(self) -> bool:
        """True while the lane can carry messages."""
        return self._terminated is None

    @property
    def termination(self) -> LaneTerminated | None:
        """Why the lane ended, once it has."""
        return self._terminated

    async def send(self, stream_id: int, data: bytes) -> None:
        """Queue a message; waits while too much is unacknowledged (backpressure).

        Raises LaneClosedError once the lane is closing or over: a lane that is going away is
        a dead route to its callers, never a programming error.
        """
        self._raise_if_terminated()
        if not self.lane.is_established:
            raise LaneClosedError(TerminationReason.CLOSED_LOCALLY, "the lane is closing")
        self.lane.send_message(stream_id, data)
        # Send at once from this task: waking the timer task would cost a task switch per
        # message, which is most of a small message's round trip.
        self._endpoint._flush(self, trio.current_time())
        limit = self._endpoint.send_buffer_limit_bytes
        while self.lane.pending_send_bytes > limit:
            self._drained = trio.Event()
            await self._drained.wait()
            self._raise_if_terminated()

    async def wait_unacked(self, nbytes: int) -> None:
        """Return once at most `nbytes` sent on this lane are unacknowledged (at once if the
        lane is over: the caller's next send says so)."""
        while self.lane.pending_send_bytes > nbytes and self._terminated is None:
            event = trio.Event()
            self._unacked_waiters.append((nbytes, event))
            await event.wait()

    async def receive(self) -> tuple[int, bytes]:
        """The next message as (stream_id, data); raises LaneClosedError once the lane ends."""
        while not self._inbox:
            self._raise_if_terminated()
            self._readable = trio.Event()
            await self._readable.wait()
        return self._inbox.popleft()

    def __aiter__(self) -> AsyncIterator[tuple[int, bytes]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, bytes]]:
        while True:
            try:
                yield await self.receive()
            except LaneClosedError:
                return

    async def terminated(self) -> LaneTerminated:
        """Wait until the lane ends and say why."""
        await self._terminated_event.wait()
        assert self._terminated is not None
        return self._terminated

    def close(self, reason: str = "") -> None:
        """Close gracefully; the peer sees CLOSED_BY_PEER."""
        if self._terminated is None:
            self.lane.close(reason)
            self._endpoint._after_activity(self)

    # -- driven by the endpoint ----------------------------------------------------------
    def _raise_if_terminated(self) -> None:
        if self._terminated is not None:
            raise LaneClosedError(self._terminated.reason, self._terminated.detail)

    def _drain_events(self) -> None:
        while (event := self.lane.next_event()) is not None:
            if isinstance(event, MessageReceived):
                self._inbox.append((event.stream_id, event.data))
                self._readable.set()
            elif isinstance(event, LaneEstablished):
                self._established.set()
            elif isinstance(event, LaneTerminated):
                self._terminated = event
                # Wake everyone: receivers, senders under backpressure, connect().
                self._readable.set()
                self._drained.set()
                self._established.set()
                self._terminated_event.set()
        pending = self.lane.pending_send_bytes
        if pending <= self._endpoint.send_buffer_limit_bytes:
            self._drained.set()
        if self._unacked_waiters:
            over = self._terminated is not None
            waiting = []
            for nbytes, waiter in self._unacked_waiters:
                if over or pending <= nbytes:
                    waiter.set()
                else:
                    waiting.append((nbytes, waiter))
            self._unacked_waiters = waiting
