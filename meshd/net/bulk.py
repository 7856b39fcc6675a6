"""The bulk gate: while a stage on this node computes a window, this node's bulk work waits.

A weight transfer (`ARTIFACT_STREAM`) costs the node that serves it CPU in the trio loop:
reading chunks, encrypting and sending datagrams, taking ACKs. Done while the stage's thread
computes a window, that work takes the CPU and the GIL from the forward pass, and the window's
latency grows (docs/benchmarks.md, "Fetch"). So the stage host holds the gate from the moment
it takes a window until its result is sent; meanwhile the artifact service serves no chunk,
and every lane of the endpoint sends no bulk bytes (`Lane.hold_bulk`). The transfer runs in
the gaps between windows.

A burst sent just before a window still costs that window: the peer decrypts, writes and
acknowledges it while the window computes, and this node reads those ACKs and requests. Windows
come at a cadence (a coordinator's decode loop), so the gate also learns the gap from one
window's end to the next one's start (`WindowCadence`) and, while the gaps are regular, closes
a little before the next window is due (a quiet, driven by `BulkGate.run`); the transfer keeps
at least `min_open_share` of every gap.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque
from collections.abc import AsyncIterator, Callable

import msgspec
import trio


class CadenceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How far ahead of an expected window bulk work pauses (the daemon's `[bulk]` table).

    The gap is the time from one window's end (its result sent) to the next window's start:
    the rest of the pipeline and the coordinator's turn, steadier than the windows' own
    compute. `quiet_s`: the gate closes this long before the earliest usual end of the gap,
    and stays closed until the window comes or this long after the latest usual end.
    Windows count as regular when the spread of the last `history` gaps (upper minus lower
    quartile) is within `tolerance` of their median; otherwise no quiet. However regular, a
    quiet takes at most `1 - min_open_share` of the median gap: transfers keep the rest.
    """

    quiet_s: float = 0.0015
    history: int = 8
    tolerance: float = 0.3
    min_open_share: float = 0.6

    def __post_init__(self) -> None:
        if not 0 <= self.quiet_s < math.inf:
            raise ValueError("quiet_s must be >= 0 seconds")
        if self.history < 4:
            raise ValueError("history must be >= 4")
        if not 0 <= self.tolerance < math.inf:
            raise ValueError("tolerance must be >= 0")
        if not 0 < self.min_open_share <= 1:
            raise ValueError("min_open_share must be in (0, 1]")


class WindowCadence:
    """(sans-IO) The gap between windows, and the quiet ahead of the next window.

    Fed the start and end of every window's hold (`window_started`, `window_ended`, with
    `now`); `quiet()` says when bulk work should pause before the next window, or None while
    a window is on, or the gaps so far are too few or too irregular to predict. One quiet per
    gap: after `quiet_spent` (the window did not come), none until the next window.
    """

    def __init__(self, config: CadenceConfig | None = None) -> None:
        self.config = config or CadenceConfig()
        self._gaps: deque[float] = deque(maxlen=self.config.history)
        self._last_end: float | None = None
        self._on = False
        self._spent = True

    def window_started(self, now: float) -> None:
        """A window's hold began (the stage took a window while idle)."""
        if self._last_end is not None and not self._on:
            self._gaps.append(now - self._last_end)
        self._on = True
        self._spent = False

    def window_ended(self, now: float) -> None:
        """The window's hold ended (its result is out)."""
        self._last_end = now
        self._on = False

    def quiet_spent(self) -> None:
        """The quiet ran out without a window: none more until the next window starts."""
        self._spent = True

    def quiet(self) -> tuple[float, float] | None:
        """(start, end) of the quiet ahead of the next window, or None (no quiet now)."""
        config = self.config
        if self._spent or self._on or self._last_end is None or config.quiet_s == 0:
            return None
        if len(self._gaps) < config.history:
            return None
        low, mid, high = statistics.quantiles(self._gaps, n=4)
        if high - low > config.tolerance * mid:
            return None  # irregular: the gate holds only for windows themselves
        bound = (1 - config.min_open_share) * mid
        # From `quiet_s` before the earliest usual arrival to `quiet_s` after the latest; when
        # that is more than its share of the gap, the part before the median arrival comes first.
        start = self._last_end + mid - min(config.quiet_s + (mid - low), bound)
        end = min(self._last_end + high + config.quiet_s, start + bound)
        return start, end


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
        self._windows_changed = trio.Event()  # set when a window starts or ends
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
            self._windows_changed.set()
        self._close()
        try:
            yield
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._windows -= 1
            if self._windows == 0:
                self.cadence.window_ended(trio.current_time())
                self._windows_changed.set()
            self._release()

    async def wait_open(self) -> None:
        """Return once the gate is open (at once if it is)."""
        while self._holds:
            await self._open.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close the gate for the quiet ahead of each expected window, until cancelled."""
        task_status.started()
        while True:
            changed = self._windows_changed = trio.Event()
            quiet = self.cadence.quiet()
            if quiet is None:
                await changed.wait()
                continue
            start, end = quiet
            with trio.move_on_at(start):
                await changed.wait()
            if changed.is_set():
                continue  # the window came first (the gate closed for it)
            self.quiets_total += 1
            self._close()
            try:
                with trio.move_on_at(end):
                    await changed.wait()
            finally:
                self._release()  # a window that came holds the gate itself
            if not changed.is_set():
                self.quiets_missed += 1
                self.cadence.quiet_spent()
