"""SWIM probing: one member per interval, indirect probes on silence, suspicion on failure.

`Probing` adds the failure detector to `MembershipCore`: `Ping` a member chosen round-robin
from a shuffled list (so every live member is probed within n intervals); no `Ack` within
`probe_timeout_s` → `PingReq` through k others; no answer by the end of the interval →
suspect it. A lane death starts the same indirect probes at once, with a short deadline that
ends in death rather than suspicion. This node also relays others' `PingReq`s.
"""

from __future__ import annotations

from meshd.mesh.membership_core import LIVE, MembershipCore, _Probe
from protocol.gossip import RTT_PREFIX_BYTES, Ack, Gossip, Ping, PingReq, Status


class Probing(MembershipCore):
    """The probe side of the state machine."""

    def _new_probe(self, target: bytes, now: float, deadline: float, lane_death: bool) -> _Probe:
        self._seq += 1
        indirect_at = 0.0 if lane_death else now + self.config.probe_timeout_s
        probe = _Probe(self._seq, target, now, indirect_at, deadline, lane_death)
        self._probes[probe.seq] = probe
        return probe

    def _start_probe(self, now: float) -> None:
        target = self._next_probe_target()
        if target is not None:
            probe = self._new_probe(target, now, now + self.config.probe_interval_s, False)
            self._send(target, Ping(seq=probe.seq, updates=self._piggyback(target)))

    def _next_probe_target(self) -> bytes | None:
        """Round-robin over a shuffled list of live members (SWIM's bounded detection time)."""
        while True:
            if not self._probe_order:
                self._probe_order = list(self._roster.ids)
                self._rng.shuffle(self._probe_order)
                if not self._probe_order:
                    return None
            candidate = self._probe_order.pop()
            member = self._members.get(candidate)
            if member is not None and member.status in LIVE and self._direct(candidate):
                return candidate

    def _send_ping_reqs(self, probe: _Probe) -> None:
        probe.indirect_at = 0.0
        for relay in self._relays_for(probe.target):
            probe.relays.add(relay)
            msg = PingReq(seq=probe.seq, target=probe.target, updates=self._piggyback(relay))
            self._send(relay, msg)

    def _relays_for(self, target: bytes) -> list[bytes]:
        """k random members to probe `target` for us, preferring ones that measured it.

        A member whose RTT row names the target has reached it lately: with some paths
        filtered, those are the relays most likely to get through.
        """
        k = self.config.indirect_probes
        candidates = self._pick(4 * k, (target,))
        prefix = target[:RTT_PREFIX_BYTES]

        def reaches(relay: bytes) -> bool:
            record = self._members[relay].record
            return record is not None and any(e.peer_prefix == prefix for e in record.rtt)

        candidates.sort(key=lambda relay: not reaches(relay))
        return candidates[:k]

    def _run_probes(self, now: float) -> None:
        for probe in list(self._probes.values()):
            if probe.indirect_at and now >= probe.indirect_at:
                self._send_ping_reqs(probe)
            if now >= probe.deadline:
                del self._probes[probe.seq]
                self._probe_failed(probe, now)
        for seq, (_, _, _, expires) in list(self._relayed.items()):
            if now >= expires:
                del self._relayed[seq]

    def _probe_failed(self, probe: _Probe, now: float) -> None:
        m = self._members.get(probe.target)
        if m is None or m.status not in LIVE:
            return
        if probe.lane_death:
            self._enter(m, Status.DEAD, m.incarnation, now, b"", m.status)
        elif m.status is Status.ALIVE:
            self.stats.suspicions += 1
            self._enter(m, Status.SUSPECT, m.incarnation, now, self.node_id, m.status)
            # If it lives and only our probes got lost, this is its quickest chance to refute.
            self._send(m.node_id, Gossip(updates=[self._update_for(m.node_id)], records=[]))
        else:
            self._confirm(m, self.node_id)

    def _on_ack(self, sender: bytes, seq: int, now: float) -> None:
        relayed = self._relayed.get(seq)
        if relayed is not None and relayed[2] == sender:
            del self._relayed[seq]
            requester, their_seq, _, _ = relayed
            self._send(requester, Ack(seq=their_seq, updates=self._piggyback(requester)))
            return
        probe = self._probes.get(seq)
        if probe is None or (sender != probe.target and sender not in probe.relays):
            return
        del self._probes[seq]
        member = self._members.get(probe.target)
        if member is not None and probe.weak and sender != probe.target:
            member.detour_until = now + self.config.detour_hold_s  # alive, but not via us
        if member is not None and sender == probe.target:
            sample = now - probe.sent_at
            old = member.rtt_s
            member.rtt_s = sample if old is None else 0.875 * old + 0.125 * sample
            self._note_rtt(member)

    def _on_ping_req(self, sender: bytes, msg: PingReq, now: float) -> None:
        if msg.target == self.node_id:
            self._send(sender, Ack(seq=msg.seq, updates=self._piggyback(sender)))
            return
        if len(self._relayed) >= 4 * self.config.max_members:
            return  # bounded: a flood of PingReqs cannot grow this table without limit
        self._seq += 1
        expires = now + self.config.probe_interval_s
        self._relayed[self._seq] = (sender, msg.seq, msg.target, expires)
        self._send(msg.target, Ping(seq=self._seq, updates=self._piggyback(msg.target)))
