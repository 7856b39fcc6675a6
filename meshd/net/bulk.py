"""The bulk gate: while a stage on this node computes a window, this node's bulk work waits.

A weight transfer (`ARTIFACT_STREAM`) costs the node that serves it CPU in the trio loop:
reading chunks, encrypting and sending datagrams, taking ACKs. Done while the stage's thread
computes a window, that work takes the CPU and the GIL from the forward pass, and the window's
latency grows (docs/benchmarks.md, "Fetch"). So the stage host holds the gate from the moment
it takes a window until its result is sent; meanwhile the artifact service serves no chunk,
and every lane of the endpoint sends no bulk bytes (`Lane.hold_bulk`). The transfer runs in
the gaps between windows.

A burst sent just before a window still costs that window: the peer decrypts, hashes and
acknowledges it while the window computes, and this node reads those ACKs and requests. Windows
come at a cadence (a coordinator's decode loop), so the gate also learns the interval between
windows (`WindowCadence`) and closes a little before the next one is due (a quiet), when the
windows are regular; the transfer keeps at least `min_open_share` of every gap.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio


@dataclass(frozen=True, slots=True)
class CadenceConfig:
    """How far ahead of an expected window bulk work pauses.

    `quiet_s`: the gate closes this long before the earliest expected arrival of the next
    window, and stays closed until it arrives or this long after its latest expected arrival.
    Windows count as regular when the spread of the last `history` intervals between them
    (upper minus lower quartile) is within `tolerance` of their median; otherwise no quiet.
    However regular, a quiet takes at most `1 - min_open_share` of the gap between windows.
    """

    quiet_s: float = 0.0015
    history: int = 8
    tolerance: float = 0.3
    min_open_share: float = 0.6

    def __post_init__(self) -> None:
        if self.quiet_s < 0 or self.history < 4 or self.tolerance < 0:
            raise ValueError("quiet_s and tolerance must be >= 0, history >= 4")
        if not 0 < self.min_open_share <= 1:
            raise ValueError("min_open_share must be in (0, 1]")


class WindowCadence:
    """(sans-IO) The interval between windows, and the quiet ahead of the next one.

    Fed the start and end of every window's hold (`window_started`, `window_ended`, with
    `now`); `quiet()` says when bulk work should pause before the next window, or None when
    the windows so far are too few or too irregular to predict. One quiet per window: after
    `quiet_spent` (the window did not come), none until the next window starts.
    """

    def __init__(self, config: CadenceConfig | None = None) -> None:
        self.config = config or CadenceConfig()
        self._intervals: deque[float] = deque(maxlen=self.config.history)
        self._holds: deque[float] = deque(maxlen=self.config.history)
        self._last_start: float | None = None
        self._spent = True

    def window_started(self, now: float) -> None:
        """A window's hold began (the stage took a window while idle)."""
        if self._last_start is not None:
            self._intervals.append(now - self._last_start)
        self._last_start = now
        self._spent = False

    def window_ended(self, now: float) -> None:
        """The hold that began at the last `window_started` ended (its result is out)."""
        if self._last_start is not None:
            self._holds.append(now - self._last_start)

    def quiet_spent(self) -> None:
        """The quiet ran out without a window: none more until the next window starts."""
        self._spent = True

    def quiet(self) -> tuple[float, float] | None:
        """(start, end) of the quiet ahead of the next window, or None (no quiet now)."""
        config = self.config
        if self._spent or self._last_start is None or len(self._intervals) < config.history:
            return None
        if not self._holds or config.quiet_s == 0:
            return None
        low, mid, high = statistics.quantiles(self._intervals, n=4)
        if high - low > config.tolerance * mid:
            return None  # irregular: the gate holds only for windows themselves
        gap = mid - statistics.median(self._holds)
        # The quiet spans [earliest - quiet_s, latest + quiet_s], bounded to its share of a gap.
        span = min((high - low) + 2 * config.quiet_s, (1 - config.min_open_share) * gap)
        if span <= 0:
            return None
        end = self._last_start + high + config.quiet_s
        return end - span, end


class BulkGate:
    """Held while any window is being computed or delivered here (holds nest), and during a
    quiet ahead of an expected window while `run` drives the cadence."""

    def __init__(self, cadence: CadenceConfig | None = None) -> None:
        self._holds = 0  # windows' holds, plus one during a quiet
        self._windows = 0  # windows' holds only
        self._open = trio.Event()
        self._open.set()
        self._listeners: list[Callable[[bool], None]] = []
        self.cadence = WindowCadence(cadence)
        self._window_began = trio.Event()
        self.holds_total = 0  # times a window closed the gate (a counter for tests and status)
        self.quiets_total = 0  # quiets begun ahead of an expected window
        self.quiets_missed = 0  # of those, quiets that ran out without a window

    @property
    def held(self) -> bool:
        """Whether bulk work waits now."""
        return self._holds > 0

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(held)` each time the gate closes (True) or opens (False)."""
        self._listeners.append(listener)

    def _close(self) -> None:
        self._holds += 1
        if self._holds == 1:
            self._open = trio.Event()
            for listener in self._listeners:
                listener(True)

    def _release(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            self._open.set()
            for listener in self._listeners:
                listener(False)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Bulk work waits until the block (and every other hold) ends, and then one pass of
        the trio loop more: what arrived meanwhile (the next window, a reply for a coordinator
        on this node, ACKs) is read before the transfer's first chunk is sent."""
        self._windows += 1
        if self._windows == 1:
            self.holds_total += 1
            self.cadence.window_started(trio.current_time())
            self._window_began.set()
        self._close()
        try:
            yield
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._windows -= 1
            if self._windows == 0:
                self.cadence.window_ended(trio.current_time())
            self._release()

    async def wait_open(self) -> None:
        """Return once the gate is open (at once if it is)."""
        while self._holds:
            await self._open.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close the gate for the quiet ahead of each expected window, until cancelled."""
        task_status.started()
        while True:
            began = self._window_began = trio.Event()
            quiet = self.cadence.quiet()
            if quiet is None:
                await began.wait()
                continue
            start, end = quiet
            with trio.move_on_at(start):
                await began.wait()
            if began.is_set():
                continue  # the window came first (the gate closed for it)
            self.quiets_total += 1
            self._close()
            try:
                with trio.move_on_at(end):
                    await began.wait()
            finally:
                self._release()  # a window that came holds the gate itself
            if not began.is_set():
                self.quiets_missed += 1
                self.cadence.quiet_spent()
