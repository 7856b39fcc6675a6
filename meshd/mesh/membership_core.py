"""The state and merge rules behind `Membership` (see meshd/mesh/membership.py).

`MembershipCore` holds every member's state and applies SWIM's rules to updates: higher
incarnation wins, and at equal incarnation alive < suspect < dead < left; updates about this
node itself are refuted by raising its own incarnation. It also owns the piggyback queue, the
suspicion and reaping timers, and the signed capacity records (this node's and the others').
Probing (`meshd.mesh.probing`) and sync (`meshd.mesh.antientropy`) build on it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from meshd.mesh.antientropy import Sweeps
from meshd.mesh.broadcast import BroadcastQueue, Roster
from meshd.mesh.capacity import OwnRecord, rtt_entry
from meshd.mesh.member import EventKind, LocalCapacity, MemberEvent, MembershipStats
from meshd.mesh.membership_config import MembershipConfig
from protocol.errors import RemoteProtocolError
from protocol.gossip import (
    MAX_RECORDS,
    MAX_U63,
    MAX_WANT,
    RTT_PREFIX_BYTES,
    CapacityRecord,
    Gossip,
    GossipMessage,
    MemberUpdate,
    SignedRecord,
    Status,
    Want,
    open_record,
    read_record,
)

Sign = Callable[[bytes], bytes]
Verify = Callable[[bytes, bytes, bytes], bool]
LIVE = (Status.ALIVE, Status.SUSPECT)
# 256 suspicions (76 bytes each) keep a correction well under max_message_bytes.
_CORRECTIONS_PER_MESSAGE = 256
_EVENT_OF = {
    Status.ALIVE: EventKind.ALIVE_AGAIN,
    Status.SUSPECT: EventKind.SUSPECTED,
    Status.DEAD: EventKind.DIED,
    Status.LEFT: EventKind.LEFT,
}


@dataclass(slots=True)
class _Suspicion:
    started: float
    min_s: float
    max_s: float
    expected: int
    suspectors: list[bytes]

    def deadline(self) -> float:
        """Lifeguard: from max_s down to min_s as independent confirmations arrive."""
        if self.expected <= 0:
            return self.started + self.min_s
        confirmations = len(self.suspectors) - 1
        frac = min(1.0, math.log(confirmations + 1) / math.log(self.expected + 1))
        return self.started + max(self.min_s, self.max_s - (self.max_s - self.min_s) * frac)


@dataclass(slots=True)
class _Member:
    node_id: bytes
    status: Status
    incarnation: int
    since: float
    signed: SignedRecord | None = None
    record: CapacityRecord | None = None
    suspicion: _Suspicion | None = None
    timer_at: float = math.inf
    detour_until: float = -math.inf
    rtt_s: float | None = None
    rtt_published_s: float | None = None
    told_at: float = -math.inf

    @property
    def record_version(self) -> int:
        return self.record.version if self.record is not None else 0


@dataclass(slots=True)
class _Probe:
    seq: int
    target: bytes
    sent_at: float
    indirect_at: float  # when to send PingReqs; 0 once sent
    deadline: float
    lane_death: bool
    weak: bool = False  # started by a lane that could not be opened
    relays: set[bytes] = field(default_factory=set)


class MembershipCore:
    """Member states, merge rules, timers, piggyback queue and capacity records."""

    def __init__(
        self,
        node_id: bytes,
        *,
        address: str,
        sign: Sign,
        verify: Verify,
        now: float,
        config: MembershipConfig | None = None,
        capacity: LocalCapacity | None = None,
        seed: int = 0,
        incarnation: int = 0,
        record_version: int = 0,
    ) -> None:
        """Start alone in the mesh, alive; `join` a known peer to meet the others.

        `incarnation` and `record_version` are floors: a restarted node may pass the wall clock
        in seconds so its first words outrank those of its previous life (it would refute them
        anyway, a round trip later). `seed` seeds the choice of probe and gossip targets.
        """
        self.node_id = node_id
        self.config = config or MembershipConfig()
        self.stats = MembershipStats()
        self._verify = verify
        self._rng = random.Random(seed)
        self._status = Status.ALIVE
        self._incarnation = incarnation
        self._since = now
        self._own = OwnRecord(node_id, address, capacity or LocalCapacity(), sign, record_version)
        self._members: dict[bytes, _Member] = {}
        self._now = now  # the latest `now` the caller passed in
        self._lanes_up: set[bytes] = set()
        self._by_prefix: dict[bytes, bytes] = {node_id[:RTT_PREFIX_BYTES]: node_id}
        self._roster = Roster()
        self._queue = BroadcastQueue()
        self._timers: list[tuple[float, bytes]] = []
        self._outbox: list[tuple[bytes, GossipMessage]] = []
        self._events: list[MemberEvent] = []
        self._seq = 0
        self._probes: dict[int, _Probe] = {}
        self._relayed: dict[int, tuple[bytes, int, bytes, float]] = {}
        self._probe_order: list[bytes] = []
        self._next_probe_at = now + self._rng.uniform(0.0, self.config.probe_interval_s)
        self._next_gossip_at = now
        # Records asked for: node id -> (version, retry at, retries left).
        self._wanted: dict[bytes, tuple[int, float, int]] = {}
        self._next_want_check = math.inf
        self._want_batch: dict[bytes, list[bytes]] = {}
        self._corrections: dict[bytes, dict[bytes, None]] = {}  # ordered: deterministic output
        self._sweeps = Sweeps(self.config.sync_retry_s, self.config.sync_retries)
        self._next_sync_at = now + self.config.sync_interval_s(1)
        self._sync_cursor = b""
        self._publish_jitter = 1.0
        self._row_cutoff_s = math.inf  # RTT of the slowest peer in a full published row
        self._publish(now)

    @property
    def address(self) -> str:
        """Where this node's lanes listen, as published in its record."""
        return self._own.address

    # ---- merging ------------------------------------------------------------------------

    def _merge(self, updates: list[MemberUpdate], sender: bytes, now: float) -> None:
        for update in updates:
            self._apply(update, sender, now)

    def _apply(self, u: MemberUpdate, sender: bytes, now: float) -> None:
        if u.node_id == self.node_id:
            self._about_self(u, sender, now)
            return
        member = self._members.get(u.node_id)
        suspector = u.suspector or sender
        if member is None:
            if u.status not in LIVE:
                return  # a stranger's death is no news
            if len(self._members) >= self.config.max_members:
                self.stats.members_refused += 1
                return
            member = _Member(u.node_id, u.status, u.incarnation, now)
            self._members[u.node_id] = member
            self._by_prefix.setdefault(u.node_id[:RTT_PREFIX_BYTES], u.node_id)
            self._event(EventKind.JOINED, member, now)
            self._enter(member, u.status, u.incarnation, now, suspector, None)
        elif (u.incarnation, u.status) > (member.incarnation, member.status):
            self._enter(member, u.status, u.incarnation, now, suspector, member.status)
        elif (u.incarnation, u.status) == (member.incarnation, Status.SUSPECT):
            self._confirm(member, suspector)
        elif u.status is not Status.ALIVE and u.incarnation < member.incarnation:
            # The sender still accuses a member that has refuted since: set it right, or its
            # suspicion timer may fire before the refutation reaches it by chance.
            self._corrections.setdefault(sender, {})[member.node_id] = None
        if member.status in LIVE and u.record_version > member.record_version:
            self._want(member.node_id, u.record_version, sender, now)

    def _about_self(self, u: MemberUpdate, sender: bytes, now: float) -> None:
        if self._status is Status.LEFT:
            return
        stale_alive = u.status is Status.ALIVE and u.incarnation > self._incarnation
        accused = u.status is not Status.ALIVE and u.incarnation >= self._incarnation
        if (stale_alive or accused) and u.incarnation < MAX_U63:
            self._incarnation = u.incarnation + 1
            self.stats.refutations += 1
            self._queue.push(self.node_id)
            self._send(sender, Gossip(updates=[self._update_for(self.node_id)], records=[]))
        elif u.status is not Status.ALIVE:
            self._corrections.setdefault(sender, {})[self.node_id] = None  # already refuted
        if u.record_version > self._own.version:
            # A record of ours from a previous life, or a lie: outrank it only once we hold
            # it with our own signature (an unsigned number could pin us at the ceiling).
            self._want(self.node_id, u.record_version, sender, now)

    def _enter(
        self,
        m: _Member,
        status: Status,
        incarnation: int,
        now: float,
        suspector: bytes,
        old: Status | None,
    ) -> None:
        """Move a member to (status, incarnation): roster, timers, events and gossip.

        `old` is its previous status (None for a member just learned of).
        """
        m.status, m.incarnation, m.since = status, incarnation, now
        m.suspicion = None
        m.timer_at = math.inf
        if status in LIVE:
            self._roster.add(m.node_id)
        else:
            self._roster.remove(m.node_id)
            self._set_timer(m, now + self.config.dead_retention_s)
        if status is Status.SUSPECT:
            lo, hi = self.config.suspicion_bounds_s(len(self._roster) + 1)
            expected = min(self.config.suspicion_confirmations, max(0, len(self._roster) - 1))
            m.suspicion = _Suspicion(now, lo, hi, expected, [suspector])
            self._set_timer(m, m.suspicion.deadline())
        if old is not status and (old is not None or status is Status.SUSPECT):
            self._event(_EVENT_OF[status], m, now)
        self._queue.push(m.node_id)

    def _confirm(self, m: _Member, suspector: bytes) -> None:
        if m.suspicion is not None and suspector not in m.suspicion.suspectors:
            m.suspicion.suspectors.append(suspector)
            self._set_timer(m, m.suspicion.deadline())

    def _set_timer(self, m: _Member, at: float) -> None:
        m.timer_at = at
        heapq.heappush(self._timers, (at, m.node_id))

    def _run_member_timers(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            at, node_id = heapq.heappop(self._timers)
            m = self._members.get(node_id)
            if m is None or m.timer_at != at:
                continue  # superseded by a later change
            if m.status is Status.SUSPECT:
                self._enter(m, Status.DEAD, m.incarnation, now, b"", m.status)
            elif m.status not in LIVE:
                self._forget(m)

    def _forget(self, m: _Member) -> None:
        del self._members[m.node_id]
        self._roster.remove(m.node_id)
        self._queue.discard(m.node_id)
        self._wanted.pop(m.node_id, None)
        if self._by_prefix.get(m.node_id[:RTT_PREFIX_BYTES]) == m.node_id:
            del self._by_prefix[m.node_id[:RTT_PREFIX_BYTES]]

    def _event(self, kind: EventKind, m: _Member, now: float) -> None:
        self._events.append(MemberEvent(kind, m.node_id, m.incarnation, now))

    # ---- dissemination ------------------------------------------------------------------

    def _update_for(self, node_id: bytes) -> MemberUpdate:
        if node_id == self.node_id:
            return MemberUpdate(node_id, self._status, self._incarnation, self._own.version)
        m = self._members[node_id]
        suspector = m.suspicion.suspectors[0] if m.suspicion is not None else None
        return MemberUpdate(node_id, m.status, m.incarnation, m.record_version, suspector)

    def _piggyback(self, to: bytes) -> list[MemberUpdate]:
        limit = self.config.retransmit_limit(len(self._roster) + 1)
        ids = self._queue.take(self.config.max_piggyback_updates, limit)
        updates = [self._update_for(i) for i in ids if i == self.node_id or i in self._members]
        target = self._members.get(to)
        if target is not None and target.status is not Status.ALIVE and to not in ids:
            updates.append(self._update_for(to))  # so it can refute what we believe of it
        return updates

    def _gossip_round(self, now: float) -> None:
        if now < self._next_gossip_at or not len(self._queue):
            return
        self._next_gossip_at = now + self.config.gossip_interval_s
        for peer in self._pick(self.config.gossip_fanout):
            updates = self._piggyback(peer)
            if updates:
                self._send(peer, Gossip(updates=updates, records=[]))

    def _direct(self, node_id: bytes) -> bool:
        """Whether to talk to this member directly (not while others relay for us)."""
        m = self._members.get(node_id)
        return m is None or m.detour_until <= self._now

    def _pick(self, k: int, exclude: tuple[bytes, ...] = ()) -> list[bytes]:
        """Up to k random live members this node talks to directly."""
        candidates = self._roster.sample(self._rng, 2 * k + 2, exclude)
        return [c for c in candidates if self._direct(c)][:k]

    def _send(self, peer: bytes, message: GossipMessage) -> None:
        self._outbox.append((peer, message))

    # ---- capacity records ---------------------------------------------------------------

    def _next_publish_at(self) -> float:
        interval = self.config.capacity_interval_s(len(self._roster) + 1)
        return self._own.published_at + interval * self._publish_jitter

    def _publish(self, now: float) -> None:
        live = [m for m in self._members.values() if m.rtt_s is not None and m.status in LIVE]
        live.sort(key=lambda m: m.rtt_s or 0.0)
        row = []
        for m in self._members.values():
            m.rtt_published_s = None
        for m in live[: self.config.max_rtt_entries]:
            m.rtt_published_s = m.rtt_s
            row.append(rtt_entry(m.node_id, m.rtt_s or 0.0))
        full = len(row) == self.config.max_rtt_entries
        self._row_cutoff_s = (live[len(row) - 1].rtt_s or 0.0) if full else math.inf
        self._own.publish(now, row)
        # Jitter keeps nodes whose figures change together from re-signing in lockstep.
        self._publish_jitter = self._rng.uniform(1.0, 1.5)
        self.stats.records_published += 1
        self._queue.push(self.node_id)

    def _note_rtt(self, m: _Member) -> None:
        """Mark the record for re-signing if this measurement changes the published row."""
        old, new = m.rtt_published_s, m.rtt_s
        if new is None:
            return
        if old is None:
            # It enters the row (lowest RTTs first) only if clearly below the slowest in it:
            # among peers at similar distances, noise alone would otherwise reshuffle the row.
            cutoff = self._row_cutoff_s
            margin = max(self.config.rtt_change_fraction * cutoff, self.config.rtt_change_min_s)
            changed = cutoff == math.inf or new < cutoff - margin
        else:
            threshold = max(self.config.rtt_change_fraction * old, self.config.rtt_change_min_s)
            changed = abs(new - old) > threshold
        if changed:
            self._own.dirty = True

    def _accept_record(self, signed: SignedRecord, now: float) -> None:
        try:
            record = read_record(signed)
        except RemoteProtocolError:
            return
        if record.node_id == self.node_id:
            if record.version < self._own.version or self._own.is_own_echo(signed):
                return
            if self._verified(signed):
                self._own.outrank(record.version)  # a record of ours from a previous life
                self._publish(now)
            return
        m = self._members.get(record.node_id)
        if m is None:
            return
        if record.version <= m.record_version:
            return  # not newer: no need to pay for a signature check
        if not self._verified(signed):
            return
        m.signed, m.record = signed, record
        wanted = self._wanted.get(m.node_id)
        if wanted is not None and wanted[0] <= record.version:
            del self._wanted[m.node_id]
        self._event(EventKind.CAPACITY_CHANGED, m, now)
        # Advertise the version we now hold. A record-only change starts half-sent: missing it
        # costs a stale figure until anti-entropy, not a wrong liveness view.
        limit = self.config.retransmit_limit(len(self._roster) + 1)
        self._queue.push(m.node_id, sent=limit // 2)

    def _verified(self, signed: SignedRecord) -> bool:
        try:
            open_record(signed, self._verify)
        except RemoteProtocolError:
            self.stats.bad_signatures += 1
            return False
        return True

    def _want(self, node_id: bytes, version: int, sender: bytes, now: float) -> None:
        pending = self._wanted.get(node_id)
        if pending is not None and pending[0] >= version and pending[1] > now:
            return
        retry_at = now + self.config.want_timeout_s
        self._wanted[node_id] = (version, retry_at, 2)
        self._next_want_check = min(self._next_want_check, retry_at)
        self._want_batch.setdefault(sender, []).append(node_id)

    def _retry_wants(self, now: float) -> None:
        """Ask again for records that did not come: first the owner, then a random member."""
        if now < self._next_want_check:
            return
        self._next_want_check = math.inf
        for node_id, (version, retry_at, left) in list(self._wanted.items()):
            m = self._members.get(node_id)
            done = m is None or m.status not in LIVE or m.record_version >= version
            if done or (now >= retry_at and left == 0):
                del self._wanted[node_id]
                continue
            if now >= retry_at:
                ask = [node_id] if left == 2 else self._pick(1, (node_id,))
                retry_at = now + self.config.want_timeout_s
                self._wanted[node_id] = (version, retry_at, left - 1)
                for peer in ask:
                    self._want_batch.setdefault(peer, []).append(node_id)
            self._next_want_check = min(self._next_want_check, retry_at)

    def _flush_direct(self) -> None:
        """Send the Wants and corrections gathered while handling input, one batch per peer."""
        for peer, ids in self._want_batch.items():
            for start in range(0, len(ids), MAX_WANT):
                self._send(peer, Want(node_ids=ids[start : start + MAX_WANT]))
        self._want_batch.clear()
        for peer, members in self._corrections.items():
            updates = [
                self._update_for(i) for i in members if i in self._members or i == self.node_id
            ]
            for start in range(0, len(updates), _CORRECTIONS_PER_MESSAGE):
                batch = updates[start : start + _CORRECTIONS_PER_MESSAGE]
                self._send(peer, Gossip(updates=batch, records=[]))
        self._corrections.clear()

    def _record_of(self, node_id: bytes) -> SignedRecord | None:
        if node_id == self.node_id:
            return self._own.signed
        m = self._members.get(node_id)
        return m.signed if m is not None and m.status in LIVE else None

    def _send_records(self, peer: bytes, node_ids: list[bytes]) -> None:
        batch: list[SignedRecord] = []
        budget = self.config.max_message_bytes - 64
        for node_id in node_ids:
            signed = self._record_of(node_id)
            if signed is None:
                continue
            cost = len(signed.body) + len(signed.signature) + 8
            if batch and (cost > budget or len(batch) == MAX_RECORDS):
                self._send(peer, Gossip(updates=[], records=batch))
                batch, budget = [], self.config.max_message_bytes - 64
            batch.append(signed)
            budget -= cost
        if batch:
            self._send(peer, Gossip(updates=[], records=batch))
