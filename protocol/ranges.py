"""A sorted set of disjoint half-open integer ranges (packet numbers, stream offsets)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator


class RangeSet:
    """Disjoint, non-adjacent `[start, stop)` ranges kept in ascending order.

    Stored as two parallel lists so lookups are a bisect, not a scan. Adjacent or overlapping
    additions merge, so a contiguous run costs one entry however it arrived.
    """

    __slots__ = ("_starts", "_stops")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in ranges:
            self.add(start, stop)

    def add(self, start: int, stop: int) -> int:
        """Add `[start, stop)`; returns how many integers were not in the set before."""
        if stop <= start:
            return 0
        starts, stops = self._starts, self._stops
        # Fast path: appending at or just past the top, as in-order arrivals do.
        if not stops or start > stops[-1]:
            starts.append(start)
            stops.append(stop)
            return stop - start
        if start == stops[-1]:
            stops[-1] = stop
            return stop - start
        # First range that could touch [start, stop): its stop >= start.
        i = bisect_left(stops, start)
        # Last range that could touch: its start <= stop.
        j = bisect_right(starts, stop)
        if i >= j:
            starts.insert(i, start)
            stops.insert(i, stop)
            return stop - start
        covered = 0
        for k in range(i, j):
            covered += min(stops[k], stop) - max(starts[k], start)
        new_start = min(start, starts[i])
        new_stop = max(stop, stops[j - 1])
        starts[i:j] = [new_start]
        stops[i:j] = [new_stop]
        return (stop - start) - covered

    def subtract(self, start: int, stop: int) -> None:
        """Remove `[start, stop)` from the set."""
        if stop <= start or not self._starts:
            return
        starts, stops = self._starts, self._stops
        i = bisect_right(stops, start)
        j = bisect_left(starts, stop)
        if i >= j:
            return
        new_starts: list[int] = []
        new_stops: list[int] = []
        if starts[i] < start:
            new_starts.append(starts[i])
            new_stops.append(start)
        if stops[j - 1] > stop:
            new_starts.append(stop)
            new_stops.append(stops[j - 1])
        starts[i:j] = new_starts
        stops[i:j] = new_stops

    def drop_lowest(self, keep: int) -> None:
        """Keep only the `keep` highest ranges (bounds the size of an ACK frame)."""
        excess = len(self._starts) - keep
        if excess > 0:
            del self._starts[:excess]
            del self._stops[:excess]

    def shift(self) -> tuple[int, int]:
        """Remove and return the lowest range."""
        return self._starts.pop(0), self._stops.pop(0)

    def bounds(self) -> tuple[int, int]:
        """`(lowest start, highest stop)`; the set must not be empty."""
        return self._starts[0], self._stops[-1]

    def descending(self) -> list[tuple[int, int]]:
        """The ranges, highest first (the order ACK frames carry them in)."""
        return list(zip(reversed(self._starts), reversed(self._stops), strict=True))

    def covers(self, start: int, stop: int) -> bool:
        """Whether every integer of `[start, stop)` is in the set."""
        i = bisect_right(self._starts, start) - 1
        return i >= 0 and stop <= self._stops[i]

    def __contains__(self, value: int) -> bool:
        i = bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._stops[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self._starts, self._stops, strict=True)

    def __len__(self) -> int:
        return len(self._starts)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RangeSet):
            return NotImplemented
        return self._starts == other._starts and self._stops == other._stops

    def __repr__(self) -> str:
        return f"RangeSet({list(self)!r})"
