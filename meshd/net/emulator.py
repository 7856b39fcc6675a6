"""A userspace link emulator: delay, jitter, loss, duplication, reordering, bandwidth cap.

This kernel has no `tc netem`, so tests and benchmarks impair links in userspace. The core
(`LinkEmulator`) is a pure scheduler with `now` passed in: datagrams go in with `submit`, and
come out of `due(now)` when the emulated link would deliver them. The trio endpoint puts one
on its send path; `UdpImpairingProxy` puts one between two addresses for separate processes.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Hashable
from dataclasses import dataclass, field

import msgspec


class LinkProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One direction of an emulated link. All figures are per direction."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    # Probability that a datagram is held back by an extra delay so later ones overtake it.
    reorder: float = 0.0
    reorder_extra_s: float = 0.002
    bandwidth_bytes_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "reorder_extra_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("loss", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.bandwidth_bytes_s is not None and self.bandwidth_bytes_s <= 0:
            raise ValueError("bandwidth_bytes_s must be > 0")

    @property
    def is_ideal(self) -> bool:
        """True when the profile changes nothing (callers may bypass the emulator)."""
        return (
            self.delay_s == 0
            and self.jitter_s == 0
            and self.loss == 0
            and self.duplicate == 0
            and self.reorder == 0
            and self.bandwidth_bytes_s is None
        )


@dataclass(order=True)
class _Pending:
    deliver_at: float
    seq: int
    data: bytes = field(compare=False)
    dest: Hashable = field(compare=False)


class LinkEmulator:
    """Schedules datagrams as an impaired link would deliver them.

    Jitter never reorders on its own (a link's queue is FIFO): each datagram's delivery time is
    at least its predecessor's, unless `reorder` deliberately holds one back.
    """

    def __init__(self, profile: LinkProfile) -> None:
        self.profile = profile
        self._rng = random.Random(profile.seed)
        self._heap: list[_Pending] = []
        self._seq = 0
        self._last_in_order_s = float("-inf")
        self._link_free_at_s = float("-inf")

    def submit(self, data: bytes, dest: Hashable, now: float) -> None:
        """Hand a datagram to the link at time `now`."""
        p = self.profile
        if p.loss and self._rng.random() < p.loss:
            return
        copies = 1
        if p.duplicate and self._rng.random() < p.duplicate:
            copies = 2
        for _ in range(copies):
            self._schedule(data, dest, now)

    def _schedule(self, data: bytes, dest: Hashable, now: float) -> None:
        p = self.profile
        depart = now
        if p.bandwidth_bytes_s is not None:
            # Serialisation: the link sends one datagram at a time at the capped rate.
            depart = max(now, self._link_free_at_s) + len(data) / p.bandwidth_bytes_s
            self._link_free_at_s = depart
        at = depart + p.delay_s
        if p.jitter_s:
            at += self._rng.uniform(0.0, p.jitter_s)
        at = max(at, self._last_in_order_s)
        self._last_in_order_s = at
        if p.reorder and self._rng.random() < p.reorder:
            at += p.reorder_extra_s
        self._seq += 1
        heapq.heappush(self._heap, _Pending(at, self._seq, data, dest))

    def due(self, now: float) -> list[tuple[bytes, Hashable]]:
        """Datagrams the link delivers by `now`, in delivery order."""
        out: list[tuple[bytes, Hashable]] = []
        heap = self._heap
        while heap and heap[0].deliver_at <= now:
            item = heapq.heappop(heap)
            out.append((item.data, item.dest))
        return out

    def next_deadline(self) -> float | None:
        """When the next datagram is due, or None if the link is empty."""
        return self._heap[0].deliver_at if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
