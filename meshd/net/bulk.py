"""The bulk gate: while a stage on this node computes a window, this node's bulk work waits.

A weight transfer (`ARTIFACT_STREAM`) costs the node that serves it CPU in the trio loop:
reading chunks, encrypting and sending datagrams, taking ACKs. Done while the stage's thread
computes a window, that work takes the CPU and the GIL from the forward pass, and the window's
latency grows (docs/benchmarks.md, "Fetch"). So the stage host holds the gate from the moment
it takes a window until its result is sent; meanwhile the artifact service serves no chunk,
and every lane of the endpoint sends no bulk bytes (`Lane.hold_bulk`). The transfer runs in
the gaps between windows.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import trio


class BulkGate:
    """Held while any window is being computed or delivered here (holds nest)."""

    def __init__(self) -> None:
        self._holds = 0
        self._open = trio.Event()
        self._open.set()
        self._listeners: list[Callable[[bool], None]] = []
        self.holds_total = 0  # times the gate closed (a counter for tests and status)

    @property
    def held(self) -> bool:
        """Whether bulk work waits now."""
        return self._holds > 0

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(held)` each time the gate closes (True) or opens (False)."""
        self._listeners.append(listener)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Bulk work waits until the block (and every other hold) ends, and then one pass of
        the trio loop more: what arrived meanwhile (the next window, a reply for a coordinator
        on this node, ACKs) is read before the transfer's first chunk is sent."""
        self._holds += 1
        if self._holds == 1:
            self.holds_total += 1
            self._open = trio.Event()
            for listener in self._listeners:
                listener(True)
        try:
            yield
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._holds -= 1
            if self._holds == 0:
                self._open.set()
                for listener in self._listeners:
                    listener(False)

    async def wait_open(self) -> None:
        """Return once the gate is open (at once if it is)."""
        while self._holds:
            await self._open.wait()
