"""Push-pull anti-entropy and join paging over the id space (bookkeeping for Membership).

A digest names a range [start, end) of node ids and carries the sender's state of every member
in it (at most `page` of them: the range ends where the page is full). The receiver merges it
and replies with what the sender lacks in the same range, bounded by a byte budget; if it had
to stop early it names where to resume. A join is a sweep of such pages from the start of the
id space to its end with one peer; the periodic anti-entropy exchange sends one page per
interval to a random member, moving a cursor round the id space.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol.gossip import MemberUpdate, SignedRecord, Status, encoded_size

# Leaves room for the reply's own framing and its want list under the message budget.
_REPLY_OVERHEAD_BYTES = 256 * 34 + 256


def page_of(ids: list[bytes], start: bytes, page: int) -> tuple[list[bytes], bytes]:
    """The sorted ids from `start` on, at most `page` of them, and the range's end (b"": last)."""
    first = bisect.bisect_left(ids, start)
    chunk = ids[first : first + page]
    end = ids[first + page] if first + page < len(ids) else b""
    return chunk, end


def in_range(node_id: bytes, start: bytes, end: bytes) -> bool:
    """Whether start <= node_id < end (an empty end is the end of the id space)."""
    return start <= node_id and (not end or node_id < end)


def _newer(mine: MemberUpdate, theirs: MemberUpdate | None) -> bool:
    if theirs is None:
        return True
    return (mine.incarnation, mine.status) > (theirs.incarnation, theirs.status)


@dataclass(slots=True)
class ReplyPlan:
    """What a sync reply carries: updates, records, and where the next digest should start."""

    updates: list[MemberUpdate]
    records: list[SignedRecord]
    resume: bytes


def plan_reply(
    mine: Iterable[MemberUpdate],
    theirs: dict[bytes, MemberUpdate],
    record_of: Callable[[bytes], SignedRecord | None],
    budget_bytes: int,
    max_records: int,
) -> ReplyPlan:
    """Pick, in id order, the states and records the digest's sender lacks, within the budget."""
    plan = ReplyPlan([], [], b"")
    budget = budget_bytes - _REPLY_OVERHEAD_BYTES
    for update in mine:
        other = theirs.get(update.node_id)
        their_version = other.record_version if other is not None else 0
        send_update = _newer(update, other) or update.record_version > their_version
        signed = None
        if update.record_version > their_version and update.status <= Status.SUSPECT:
            signed = record_of(update.node_id)
        cost = encoded_size(update) if send_update else 0
        cost += encoded_size(signed) if signed is not None else 0
        full = cost > budget or (signed is not None and len(plan.records) >= max_records)
        if full and (plan.updates or plan.records):
            plan.resume = update.node_id
            break
        if send_update:
            plan.updates.append(update)
        if signed is not None:
            plan.records.append(signed)
        budget -= cost
    return plan


@dataclass(slots=True)
class Sweep:
    """A join-style sync with one peer: the page in flight and how often it was resent."""

    start: bytes
    sent_at: float
    tries: int = 0


class Sweeps:
    """Full-view syncs in progress, one per peer, with resend deadlines."""

    def __init__(self, retry_s: float, retries: int) -> None:
        self._retry_s = retry_s
        self._retries = retries
        self.by_peer: dict[bytes, Sweep] = {}

    def start(self, peer: bytes, now: float) -> bool:
        """Begin a sweep with `peer` from the start of the id space (False: one is running)."""
        if peer in self.by_peer:
            return False
        self.by_peer[peer] = Sweep(b"", now)
        return True

    def advance(self, peer: bytes, start: bytes, next_start: bytes, now: float) -> bool:
        """A reply for page `start` came; True if the sweep continues at `next_start`."""
        sweep = self.by_peer.get(peer)
        if sweep is None or sweep.start != start:
            return False
        if not next_start:
            del self.by_peer[peer]
            return False
        sweep.start, sweep.sent_at, sweep.tries = next_start, now, 0
        return True

    def drop(self, peer: bytes) -> None:
        """Abandon the sweep with `peer` (its lane died)."""
        self.by_peer.pop(peer, None)

    def due(self, now: float) -> list[tuple[bytes, bytes]]:
        """(peer, start) of unanswered pages to resend now; sweeps out of tries are dropped."""
        resend = []
        for peer, sweep in list(self.by_peer.items()):
            if now < sweep.sent_at + self._retry_s:
                continue
            if sweep.tries >= self._retries:
                del self.by_peer[peer]
                continue
            sweep.tries += 1
            sweep.sent_at = now
            resend.append((peer, sweep.start))
        return resend

    def deadlines(self) -> list[float]:
        """When each sweep's page is due for a resend."""
        return [s.sent_at + self._retry_s for s in self.by_peer.values()]
