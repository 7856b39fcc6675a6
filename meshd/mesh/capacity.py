"""This node's signed capacity record, and reading the RTT rows of others' records.

The record is re-signed only when something in it changed, and at most once per
`MembershipConfig.capacity_interval_s(n)`: every version costs each node in the mesh a
piggybacked version number and one fetch of the record, so the rate is what bounds the
capacity share of the gossip bytes as the mesh grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from meshd.mesh.member import LocalCapacity
from protocol.gossip import (
    MAX_U63,
    RTT_PREFIX_BYTES,
    CapacityRecord,
    RttEntry,
    SignedRecord,
    sign_record,
)


class OwnRecord:
    """What this node offers, the signed record that says so, and whether it needs re-signing."""

    def __init__(
        self,
        node_id: bytes,
        address: str,
        capacity: LocalCapacity,
        sign: Callable[[bytes], bytes],
        version_floor: int,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.capacity = capacity
        self.signed: SignedRecord | None = None
        self.record: CapacityRecord | None = None
        self.dirty = True
        self.published_at = -math.inf
        self._sign = sign
        self._floor = version_floor

    @property
    def version(self) -> int:
        """The version of the current record (0 before the first)."""
        return self.record.version if self.record is not None else 0

    def update(self, capacity: LocalCapacity) -> None:
        """Take new figures; the record is marked for re-signing if anything changed."""
        if capacity != self.capacity:
            self.capacity = capacity
            self.dirty = True

    def outrank(self, version: int) -> None:
        """Make the next version exceed `version` (a record of ours from a previous life)."""
        # At the wire's ceiling a lie cannot be outranked; stay just below it.
        self._floor = max(self._floor, min(version, MAX_U63 - 1))
        self.dirty = True

    def is_own_echo(self, signed: SignedRecord) -> bool:
        """Whether `signed` is exactly the current record (nothing to outrank)."""
        return self.signed is not None and signed.body == self.signed.body

    def publish(self, now: float, rtt: list[RttEntry]) -> None:
        """Sign a new version with the current figures and the given RTT row."""
        cap = self.capacity
        record = CapacityRecord(
            node_id=self.node_id,
            version=min(max(self.version, self._floor) + 1, MAX_U63),
            address=self.address,
            memory_budget_bytes=cap.memory_budget_bytes,
            models=list(cap.models),
            sessions=cap.sessions,
            queue=cap.queue,
            rtt=rtt,
        )
        self.signed = sign_record(record, self._sign)
        self.record = record
        self.dirty = False
        self.published_at = now


def rtt_entry(peer: bytes, rtt_s: float) -> RttEntry:
    """One RTT row entry (microseconds, clamped to the wire's range)."""
    rtt_us = min((1 << 32) - 1, max(1, round(rtt_s * 1e6)))
    return RttEntry(peer[:RTT_PREFIX_BYTES], rtt_us)


def resolve_rtt(
    record: CapacityRecord | None, by_prefix: Mapping[bytes, bytes]
) -> dict[bytes, float]:
    """A record's RTT row as {peer node id: seconds}, for the peers `by_prefix` can name."""
    if record is None:
        return {}
    row = {}
    for entry in record.rtt:
        peer = by_prefix.get(entry.peer_prefix)
        if peer is not None:
            row[peer] = entry.rtt_us / 1e6
    return row
