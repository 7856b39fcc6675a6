"""Datagram packetization-layer path MTU discovery (RFC 8899 in spirit, search upwards only).

The lane starts at a size every path carries and sends one padded PING probe at a time, of the
next size on a ladder. An acknowledged probe raises the size every later packet may use; a
probe lost `attempts` times ends the search at the last size that worked. Probe losses never
count as congestion (the driver sets IP_PMTUDISC_DO, so an oversized probe is simply dropped).
"""

from __future__ import annotations


class PathMtu:
    """The largest datagram the lane may send now, and the probe to send next."""

    __slots__ = ("_attempts", "_attempts_left", "_ladder", "current_bytes", "probe_in_flight")

    def __init__(self, *, base_bytes: int, ladder: tuple[int, ...], attempts: int) -> None:
        self.current_bytes = base_bytes
        self._ladder = [size for size in ladder if size > base_bytes]
        self._attempts = attempts
        self._attempts_left = attempts
        self.probe_in_flight = False

    @property
    def searching(self) -> bool:
        """Whether larger sizes remain to be tried."""
        return bool(self._ladder)

    def next_probe_bytes(self) -> int | None:
        """The size of the probe to send now, or None (one in flight, or search over)."""
        if self.probe_in_flight or not self._ladder:
            return None
        return self._ladder[0]

    def on_probe_sent(self) -> None:
        """A probe of `next_probe_bytes()` went out."""
        self.probe_in_flight = True

    def on_probe_acked(self, size: int) -> bool:
        """A probe of `size` bytes arrived; returns whether the usable size grew."""
        self.probe_in_flight = False
        self._attempts_left = self._attempts
        self._ladder = [s for s in self._ladder if s > size]
        if size > self.current_bytes:
            self.current_bytes = size
            return True
        return False

    def on_probe_lost(self, size: int) -> None:
        """A probe of `size` bytes was lost: retry it, or stop searching after enough tries."""
        self.probe_in_flight = False
        if not self._ladder or self._ladder[0] != size:
            return
        self._attempts_left -= 1
        if self._attempts_left <= 0:
            # Every bigger rung would fail the same way on a path that dropped this one.
            self._ladder.clear()
