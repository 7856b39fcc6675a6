"""A coordinator's window-loop steps: one at a time, off the event loop where a model runs them.

A step is a `WindowLoop` call that may reach the proposer (`start`, `on_reply`, `on_streamed`,
`think_ahead`). Steps of all the coordinator's requests share the draft model, the route costs
and the acceptance books, none of them thread-safe, so one runs at a time (`Steps.run`). Where
the proposer runs a draft model its passes take seconds (a long prompt's prefill): the step
then runs on a worker thread, so the node's lanes keep answering keep-alives meanwhile (peers
would otherwise declare it dead past `dead_after_s`) and its other work goes on.

While a request waits for its reply (`Steps.receive`), the proposer may run passes ahead
(`WindowLoop.think_ahead`), one step each, so another request's step or the reply waits for one
pass at most; the reply's time is read when it arrives, not when that pass ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, TypeVar

import trio

from meshd.speculative.proposer import Proposer

T = TypeVar("T")


class _Thinker(Protocol):
    @property
    def timer(self) -> float | None: ...

    @property
    def thinks_ahead(self) -> bool: ...

    def think_ahead(self) -> bool: ...


class Steps:
    """The lock every step of one coordinator takes, and the waits that think ahead."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def run(self, proposer: Proposer, step: Callable[..., T], *args: object) -> T:
        """`step(*args)` once no other step runs; on a worker thread where `proposer` runs a
        model."""
        async with self._lock:
            if proposer.runs_a_model:
                return await trio.to_thread.run_sync(step, *args)
            return step(*args)

    async def close(self, proposer: Proposer) -> None:
        """Free what `proposer` holds, between steps (another request's step may be running
        the same draft model), even while the request is being cancelled."""
        with trio.CancelScope(shield=True):
            async with self._lock:
                proposer.close()

    async def receive(
        self, inbox: trio.MemoryReceiveChannel[T], loop: _Thinker, proposer: Proposer
    ) -> tuple[T | None, float]:
        """The next item of `inbox` (None once `loop.timer` passed) and when it came; the
        proposer thinks ahead meanwhile where it runs a model."""
        item: T | None = None
        async with trio.open_nursery() as nursery:
            if proposer.runs_a_model and loop.thinks_ahead:  # else no thread hop per wait
                nursery.start_soon(self._think, loop, proposer)
            timer = loop.timer
            with trio.move_on_at(math.inf if timer is None else timer):
                item = await inbox.receive()
            now = trio.current_time()
            # A pass under way finishes (a thread is not interrupted); none starts after it.
            nursery.cancel_scope.cancel()
        return item, now

    async def _think(self, loop: _Thinker, proposer: Proposer) -> None:
        while await self.run(proposer, loop.think_ahead):
            await trio.lowlevel.checkpoint()
