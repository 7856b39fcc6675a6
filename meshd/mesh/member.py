"""What the membership state machine tells its caller: member views, events, counters.

Plain values (frozen dataclasses); the state machine itself is `meshd.mesh.membership`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.gossip import CapacityRecord, ModelHolding, Status


class EventKind(enum.StrEnum):
    """What happened to a member, as the local node learned it."""

    JOINED = "joined"
    SUSPECTED = "suspected"
    ALIVE_AGAIN = "alive-again"
    DIED = "died"
    LEFT = "left"
    CAPACITY_CHANGED = "capacity-changed"


@dataclass(frozen=True, slots=True)
class MemberEvent:
    """One change in the local view of another member (`at` is the caller's `now`)."""

    kind: EventKind
    node_id: bytes
    incarnation: int
    at: float


@dataclass(frozen=True, slots=True)
class LocalCapacity:
    """What this node offers, as the caller measures it; signed into a CapacityRecord."""

    memory_budget_bytes: int = 0
    models: tuple[ModelHolding, ...] = ()
    sessions: int = 0
    queue: int = 0


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member as this node sees it.

    `rtt_s` holds the round trips the member's signed record names, by peer node id (for this
    node itself too: the row it published, which every node reads alike, not its latest
    measurements). `lane_up` says whether this node has an open lane to it. `since` is when its
    status last changed (the caller's clock).
    """

    node_id: bytes
    status: Status
    incarnation: int
    address: str
    capacity: CapacityRecord | None
    rtt_s: Mapping[bytes, float]
    lane_up: bool
    since: float

    @property
    def healthy(self) -> bool:
        """Whether routing may use it: alive (a suspect may be dead, so it is avoided)."""
        return self.status is Status.ALIVE


@dataclass(slots=True)
class MembershipStats:
    """Counters for the operator (bad input is counted, never raised)."""

    bad_signatures: int = 0
    members_refused: int = 0
    refutations: int = 0
    suspicions: int = 0
    records_published: int = 0
