"""Who is in the mesh, what each node can host, and who died: a sans-IO SWIM state machine.

After SWIM, Lifeguard and memberlist, adapted to meshd (docs/membership.md says why):
- Members are alive, suspect, dead or left, each with an incarnation number that only the
  member itself raises, to refute a suspicion (or a death) about it.
- One member is probed per interval (`Ping`); no `Ack` in time → `PingReq` through k others;
  still nothing → suspect, and dead after a Lifeguard timeout that shrinks as others confirm.
- A lane death (the caller's `on_lane_dead`) is strong evidence: k indirect probes go out at
  once and, unless one is answered within `lane_dead_probe_s`, the member is declared dead.
- Changes are piggybacked on every message, each a bounded number of times (λ·⌈log10(n+1)⌉).
- Capacity records are signed by their owner; gossip carries only their versions and a node
  fetches a newer record once with `Want`, so record bytes are not multiplied by the fan-out.
- Join and anti-entropy are push-pull `SyncDigest`/`SyncReply` over pages of the id space.

Nothing here touches a socket, a clock or a key: the caller passes `now` (seconds on any
monotonic clock), `sign`/`verify` callables and lane events, and sends what `outgoing` returns
over lanes to the named peers.
"""

from __future__ import annotations

import math

from meshd.mesh.antientropy import in_range, page_of, plan_reply
from meshd.mesh.capacity import resolve_rtt
from meshd.mesh.member import (
    EventKind,
    LocalCapacity,
    MemberEvent,
    MemberInfo,
    MembershipStats,
)
from meshd.mesh.membership_config import MembershipConfig
from meshd.mesh.membership_core import LIVE
from meshd.mesh.probing import Probing
from protocol.gossip import (
    MAX_RECORDS,
    MAX_WANT,
    Ack,
    Gossip,
    GossipMessage,
    Ping,
    PingReq,
    Status,
    SyncDigest,
    SyncReply,
    Want,
)

__all__ = [
    "EventKind",
    "LocalCapacity",
    "MemberEvent",
    "MemberInfo",
    "Membership",
    "MembershipConfig",
    "MembershipStats",
    "Status",
]


class Membership(Probing):
    """The membership and failure-detection state machine of one node.

    Inputs: `join`, `on_message`, `on_lane_up`, `on_lane_dead`, `on_rtt`, `set_capacity`,
    `leave`, `tick`. Outputs: `outgoing`, `next_deadline`, `events`, `view`.
    """

    # ---- inputs -------------------------------------------------------------------------

    def join(self, peer: bytes, now: float) -> None:
        """Sync the whole view with a known peer (a seed from mDNS or `--join`)."""
        self._start_sweep(peer, now)

    def on_message(self, sender: bytes, message: GossipMessage, now: float) -> None:
        """Handle one decoded message from `sender` (the lane-authenticated node id)."""
        self._now = now
        if sender == self.node_id or self._status is Status.LEFT:
            return
        if isinstance(message, Ping):
            self._merge(message.updates, sender, now)
            self._send(sender, Ack(seq=message.seq, updates=self._piggyback(sender)))
        elif isinstance(message, Ack):
            self._merge(message.updates, sender, now)
            self._on_ack(sender, message.seq, now)
        elif isinstance(message, PingReq):
            self._merge(message.updates, sender, now)
            self._on_ping_req(sender, message, now)
        elif isinstance(message, Gossip):
            self._merge(message.updates, sender, now)
            for signed in message.records:
                self._accept_record(signed, now)
        elif isinstance(message, Want):
            self._send_records(sender, message.node_ids)
        elif isinstance(message, SyncDigest):
            self._on_sync_digest(sender, message, now)
        else:
            self._on_sync_reply(sender, message, now)
        self._evidence_alive(sender, now)
        self._flush_direct()

    def on_lane_up(self, peer: bytes, now: float) -> None:
        """A lane to `peer` opened (authenticated): it is alive right now."""
        self._now = now
        self._lanes_up.add(peer)
        if self._status is not Status.LEFT:
            self._evidence_alive(peer, now)

    def on_lane_dead(self, peer: bytes, now: float) -> None:
        """The lane to `peer` died, or could not be opened: probe it through others at once.

        An open lane that went silent is strong evidence: unless one of `indirect_probes`
        relays gets an answer within `lane_dead_probe_s`, the member is declared dead. A lane
        that never opened is weak evidence (the path may be filtered, the node fine): it counts
        as a failed direct probe, so silence ends in suspicion, which the member can refute.
        Either way the relays tell a dead node from a broken path, so one flaky link does not
        flap a member mesh-wide.
        """
        self._now = now
        was_open = peer in self._lanes_up
        self._lanes_up.discard(peer)
        self._sweeps.drop(peer)
        member = self._members.get(peer)
        if member is None or member.status not in LIVE or self._status is Status.LEFT:
            return
        if not was_open and member.detour_until > now:
            return  # a known filtered path; relays vouch for it
        if any(p.target == peer and p.indirect_at == 0.0 for p in self._probes.values()):
            return  # indirect probes of it are already out
        if was_open:
            deadline = now + self.config.lane_dead_probe_s
        else:
            deadline = now + self.config.probe_interval_s - self.config.probe_timeout_s
        probe = self._new_probe(peer, now, deadline, lane_death=was_open)
        probe.weak = not was_open
        self._send_ping_reqs(probe)
        if was_open:
            # And a Ping of its own, which the driver sends on a fresh lane: the lane may have
            # died of this node's silence (a frozen process, a closed lid) while the peer lives
            # and already declared this node dead. Without it, in a mesh with no relay the two
            # declare each other dead and neither ever speaks to the other again; with it the
            # peer hears from this node, tells it what it believes, and the refutation follows.
            self._send(peer, Ping(seq=probe.seq, updates=self._piggyback(peer)))

    def on_rtt(self, peer: bytes, rtt_s: float, now: float) -> None:
        """A round-trip measurement to `peer` (e.g. its lane's smoothed RTT), in seconds."""
        member = self._members.get(peer)
        if member is not None and 0.0 < rtt_s < math.inf:
            member.rtt_s = rtt_s
            self._note_rtt(member)

    def set_capacity(self, capacity: LocalCapacity, now: float, *, urgent: bool = False) -> None:
        """What this node offers now; re-signed and gossiped when changed, at a bounded rate.

        `urgent` re-signs at the next tick past the rate limit: for a node that stops offering
        its stage (a stop or a drain), so every node re-plans onto the spare at once instead of
        up to `capacity_interval_s` later. Rare by nature (once per stop), so it cannot flood.
        """
        self._own.update(capacity)
        if urgent and self._own.dirty:
            self._own.published_at = -math.inf

    def leave(self, now: float) -> None:
        """Leave the mesh gracefully: tell others (keep sending `outgoing` for about a second)."""
        if self._status is Status.LEFT:
            return
        self._status = Status.LEFT
        self._since = now
        self._queue.push(self.node_id)
        update = [self._update_for(self.node_id)]
        for peer in self._pick(2 * self.config.gossip_fanout):
            self._send(peer, Gossip(updates=update, records=[]))

    def tick(self, now: float) -> None:
        """Run every timer due at `now`."""
        self._now = now
        if self._status is not Status.LEFT:
            self._run_probes(now)
            if now >= self._next_probe_at:
                self._next_probe_at = now + self.config.probe_interval_s
                self._start_probe(now)
            # After the probes: a failed probe's confirmation can make a suspicion due now.
            self._run_member_timers(now)
            self._run_sync(now)
            self._retry_wants(now)
            self._flush_direct()
            if self._own.dirty and now >= self._next_publish_at():
                self._publish(now)
        self._gossip_round(now)

    # ---- outputs ------------------------------------------------------------------------

    def outgoing(self, now: float) -> list[tuple[bytes, GossipMessage]]:
        """Messages to send now, as (peer node id, message); each is returned once."""
        out, self._outbox = self._outbox, []
        return out

    def next_deadline(self) -> float | None:
        """When `tick` should run next (None: not before the next input; past: now)."""
        gossip = [self._next_gossip_at] if len(self._queue) else []
        if self._status is Status.LEFT:
            return gossip[0] if gossip else None
        times = [self._next_probe_at, self._next_sync_at, *gossip, *self._sweeps.deadlines()]
        if self._timers:
            times.append(self._timers[0][0])
        if self._wanted:
            times.append(self._next_want_check)
        for probe in self._probes.values():
            times.append(probe.indirect_at or probe.deadline)
        if self._own.dirty:
            times.append(self._next_publish_at())
        return min(times)

    def events(self) -> list[MemberEvent]:
        """Changes in the view of other members since the last call, in order."""
        out, self._events = self._events, []
        return out

    def statuses(self) -> dict[bytes, Status]:
        """Every known member's status, self included (cheap; `view` has the details)."""
        result = {nid: m.status for nid, m in self._members.items()}
        result[self.node_id] = self._status
        return result

    def view(self) -> dict[bytes, MemberInfo]:
        """Every known member (self included) with state, address, capacity and RTT row."""
        result = {}
        for nid, m in self._members.items():
            result[nid] = MemberInfo(
                node_id=nid,
                status=m.status,
                incarnation=m.incarnation,
                address=m.record.address if m.record is not None else "",
                capacity=m.record,
                rtt_s=resolve_rtt(m.record, self._by_prefix),
                lane_up=nid in self._lanes_up,
                since=m.since,
            )
        result[self.node_id] = MemberInfo(
            node_id=self.node_id,
            status=self._status,
            incarnation=self._incarnation,
            address=self._own.address,
            capacity=self._own.record,
            # The row this node's record publishes, as every other node reads it: plans must
            # come out the same everywhere, and the live measurements drift from the published
            # row by up to the re-signing threshold (`rtt_change_fraction`, `rtt_change_min_s`).
            rtt_s=resolve_rtt(self._own.record, self._by_prefix),
            lane_up=True,
            since=self._since,
        )
        return result

    def rtt_matrix(self) -> dict[tuple[bytes, bytes], float]:
        """Pairwise round trips {(a, b): seconds} as each member reported them (ours too)."""
        return {
            (nid, peer): rtt
            for nid, info in self.view().items()
            for peer, rtt in info.rtt_s.items()
        }

    def _evidence_alive(self, peer: bytes, now: float) -> None:
        """`peer` just spoke to us: settle probes of it, and make sure we agree about it."""
        for probe in [p for p in self._probes.values() if p.target == peer]:
            del self._probes[probe.seq]
        member = self._members.get(peer)
        if member is not None:
            member.detour_until = -math.inf
        if member is None:
            self._start_sweep(peer, now)  # it knows us, we do not know it: sync
        elif (
            member.status is not Status.ALIVE
            and now - member.told_at >= self.config.probe_interval_s
        ):
            # It is talking, so it lives: tell it our belief so it refutes (or rejoins).
            member.told_at = now
            self._send(peer, Gossip(updates=[self._update_for(peer)], records=[]))

    # ---- join and anti-entropy ----------------------------------------------------------

    def _sorted_ids(self) -> list[bytes]:
        return sorted([*self._members, self.node_id])

    def _send_digest(self, peer: bytes, start: bytes) -> None:
        chunk, end = page_of(self._sorted_ids(), start, self.config.sync_page_entries)
        entries = [self._update_for(i) for i in chunk]
        self._send(peer, SyncDigest(start=start, end=end, entries=entries))

    def _start_sweep(self, peer: bytes, now: float) -> None:
        if peer != self.node_id and self._sweeps.start(peer, now):
            self._send_digest(peer, b"")

    def _run_sync(self, now: float) -> None:
        for peer, start in self._sweeps.due(now):
            self._send_digest(peer, start)
        if now >= self._next_sync_at:
            self._next_sync_at = now + self.config.sync_interval_s(len(self._roster) + 1)
            for peer in self._pick(1):
                self._send_digest(peer, self._sync_cursor)

    def _on_sync_digest(self, sender: bytes, msg: SyncDigest, now: float) -> None:
        self._merge(msg.entries, sender, now)
        theirs = {e.node_id: e for e in msg.entries}
        mine = (self._update_for(i) for i in self._sorted_ids() if in_range(i, msg.start, msg.end))
        plan = plan_reply(mine, theirs, self._record_of, self.config.max_message_bytes, MAX_RECORDS)
        want = self._want_batch.pop(sender, [])[:MAX_WANT]
        self._corrections.pop(sender, None)  # the reply carries our newer states anyway
        reply = SyncReply(
            start=msg.start,
            end=msg.end,
            updates=plan.updates,
            records=plan.records,
            want=want,
            resume=plan.resume,
        )
        self._send(sender, reply)

    def _on_sync_reply(self, sender: bytes, msg: SyncReply, now: float) -> None:
        self._merge(msg.updates, sender, now)
        for signed in msg.records:
            self._accept_record(signed, now)
        if msg.want:
            self._send_records(sender, msg.want)
        next_start = msg.resume or msg.end
        if self._sweeps.advance(sender, msg.start, next_start, now):
            self._send_digest(sender, next_start)
        if msg.start == self._sync_cursor:
            self._sync_cursor = next_start
