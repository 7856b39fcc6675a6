"""Dissemination: which members' changes to gossip next (each a bounded number of times), to whom.

After memberlist's TransmitLimitedQueue: one entry per member (a newer change replaces the
queued one), the least-sent entries go first and, among equals, the newest. Entries sit in
buckets by send count, so choosing k of them costs O(k + limit), not a sort of the queue.
"""

from __future__ import annotations

import itertools
import random


class BroadcastQueue:
    """Member ids whose current state should be piggybacked, with how often each was sent."""

    def __init__(self) -> None:
        self._buckets: list[dict[bytes, None]] = [{}]
        self._count: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._count

    def push(self, node_id: bytes, sent: int = 0) -> None:
        """Queue the member's current state as already sent `sent` times.

        A member already queued keeps the lower of the two counts (a change never gets fewer
        transmissions because a lesser one followed it).
        """
        current = self._count.get(node_id)
        if current is not None:
            if current <= sent:
                return
            self.discard(node_id)
        while len(self._buckets) <= sent:
            self._buckets.append({})
        self._buckets[sent][node_id] = None
        self._count[node_id] = sent

    def discard(self, node_id: bytes) -> None:
        """Forget the member's entry, if queued."""
        count = self._count.pop(node_id, None)
        if count is not None:
            del self._buckets[count][node_id]

    def take(self, max_items: int, transmit_limit: int) -> list[bytes]:
        """Up to max_items ids to piggyback now; each counts as sent once more.

        An entry sent transmit_limit times leaves the queue (the limit may shrink or grow with
        the mesh; entries already past a shrunken limit leave the next time they are taken).
        """
        chosen: list[bytes] = []
        for bucket in self._buckets:
            if bucket:
                chosen.extend(itertools.islice(reversed(bucket), max_items - len(chosen)))
                if len(chosen) == max_items:
                    break
        for node_id in chosen:
            count = self._count[node_id] + 1
            self.discard(node_id)
            if count < transmit_limit:
                while len(self._buckets) <= count:
                    self._buckets.append({})
                self._buckets[count][node_id] = None
                self._count[node_id] = count
        return chosen


class Roster:
    """Ids of live members with O(1) add, remove and random choice (for 1000-node meshes)."""

    def __init__(self) -> None:
        self.ids: list[bytes] = []
        self._index: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, node_id: bytes) -> None:
        """Include `node_id` (no-op if present)."""
        if node_id not in self._index:
            self._index[node_id] = len(self.ids)
            self.ids.append(node_id)

    def remove(self, node_id: bytes) -> None:
        """Exclude `node_id` (no-op if absent)."""
        index = self._index.pop(node_id, None)
        if index is not None:
            last = self.ids.pop()
            if last != node_id:
                self.ids[index] = last
                self._index[last] = index

    def sample(self, rng: random.Random, k: int, exclude: tuple[bytes, ...] = ()) -> list[bytes]:
        """Up to k distinct random ids, none of them in exclude."""
        if len(self.ids) <= 2 * (k + len(exclude)):
            pool = [i for i in self.ids if i not in exclude]
            rng.shuffle(pool)
            return pool[:k]
        chosen: list[bytes] = []
        while len(chosen) < k:
            pick = self.ids[rng.randrange(len(self.ids))]
            if pick not in exclude and pick not in chosen:
                chosen.append(pick)
        return chosen
