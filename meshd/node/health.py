"""`Health`: which members this node routes around, from lane deaths and membership verdicts.

Sans-IO: every method takes `now` (trio's clock in the daemon, any number in tests) and
returns what the caller should do; nothing here reads a clock or does I/O.

- A member whose lane died with `peer_dead` is *suspect*: left out of this node's routes for
  `suspect_hold_s`, so a request that lost it re-plans around it before membership decides.
- Membership's verdicts end that early: a member that joins or is alive again is no longer
  suspect. So does a new lane to it: a handshake is an answer. A node whose lid closed wakes
  with every lane dead on its side (its clock ran on while it was frozen) and suspects every
  peer, while its membership never saw them die; without this it refused every request for
  `suspect_hold_s` after the lid opened. A member that died or left can never close the
  sessions it coordinates here, so the caller frees them (`MemberVerdicts.gone`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshd.mesh.member import EventKind, MemberEvent

# A lane that ended this way means the peer stopped answering (not a clean close).
PEER_DEAD = "peer_dead"


@dataclass(frozen=True, slots=True)
class MemberVerdicts:
    """What membership events mean for this node."""

    # (event kind, node id) for the operator's event log; capacity changes are not logged.
    notes: tuple[tuple[str, bytes], ...]
    # Members that died or left: free the sessions they coordinate on this node's stage.
    gone: tuple[bytes, ...]


class Health:
    """Suspects with their hold deadlines (node ids are Ed25519 keys)."""

    def __init__(self, suspect_hold_s: float) -> None:
        self.suspect_hold_s = suspect_hold_s
        self._until: dict[bytes, float] = {}

    def suspect(self, node_id: bytes, now: float) -> None:
        """Route around `node_id` until `now + suspect_hold_s` (or until it is alive again)."""
        self._until[node_id] = now + self.suspect_hold_s

    def on_lane_lost(self, node_id: bytes, reason: str, now: float) -> bool:
        """The lane to `node_id` ended with `reason`; True when that made it suspect."""
        if reason != PEER_DEAD:
            return False
        self.suspect(node_id, now)
        return True

    def on_lane_up(self, node_id: bytes) -> bool:
        """A lane to `node_id` opened (it answered a handshake): no longer suspect. True when
        it was."""
        return self._until.pop(node_id, None) is not None

    def on_member_events(self, events: Iterable[MemberEvent]) -> MemberVerdicts:
        """Apply membership's verdicts: alive again clears a suspicion, dead or left is gone."""
        notes: list[tuple[str, bytes]] = []
        gone: list[bytes] = []
        for event in events:
            if event.kind is not EventKind.CAPACITY_CHANGED:
                notes.append((f"member-{event.kind.value}", event.node_id))
            if event.kind in (EventKind.JOINED, EventKind.ALIVE_AGAIN):
                self._until.pop(event.node_id, None)
            if event.kind in (EventKind.DIED, EventKind.LEFT):
                gone.append(event.node_id)
        return MemberVerdicts(tuple(notes), tuple(gone))

    def is_suspect(self, node_id: bytes | None, now: float) -> bool:
        """True while `node_id` is held out of routes."""
        until = self._until.get(node_id) if node_id is not None else None
        return until is not None and until > now

    def suspects(self, now: float) -> frozenset[bytes]:
        """Members to leave out of a route made at `now` (expired holds are forgotten)."""
        for node_id in [n for n, until in self._until.items() if until <= now]:
            del self._until[node_id]
        return frozenset(self._until)
