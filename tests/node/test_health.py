"""`Health` on a virtual clock: suspects held out of routes, membership's verdicts."""

from __future__ import annotations

from meshd.mesh.member import EventKind, MemberEvent
from meshd.node.health import PEER_DEAD, Health

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def _event(kind: EventKind, node_id: bytes, at: float = 0.0) -> MemberEvent:
    return MemberEvent(kind, node_id, incarnation=1, at=at)


def test_a_dead_lane_holds_its_node_out_of_routes_for_the_hold_only() -> None:
    health = Health(suspect_hold_s=10.0)
    assert health.on_lane_lost(A, PEER_DEAD, now=100.0)
    assert health.suspects(100.0) == {A} and health.is_suspect(A, 109.9)
    assert health.suspects(109.9) == {A}
    assert health.suspects(110.0) == frozenset() and not health.is_suspect(A, 110.0)
    assert health.suspects(105.0) == frozenset()  # an expired hold is forgotten, not resumed


def test_a_lane_closed_on_purpose_makes_no_suspect() -> None:
    health = Health(suspect_hold_s=10.0)
    for reason in ("closed", "peer_closed", "handshake_timeout"):
        assert not health.on_lane_lost(A, reason, now=1.0)
    assert health.suspects(1.0) == frozenset() and not health.is_suspect(None, 1.0)


def test_suspecting_again_extends_the_hold() -> None:
    health = Health(suspect_hold_s=10.0)
    health.suspect(A, 0.0)
    health.suspect(A, 8.0)
    assert health.suspects(17.0) == {A} and health.suspects(18.0) == frozenset()


def test_alive_again_or_rejoined_ends_a_suspicion_early() -> None:
    health = Health(suspect_hold_s=10.0)
    health.suspect(A, 0.0)
    health.suspect(B, 0.0)
    verdicts = health.on_member_events(
        [_event(EventKind.ALIVE_AGAIN, A), _event(EventKind.JOINED, B)]
    )
    assert health.suspects(1.0) == frozenset()
    assert verdicts.notes == (("member-alive-again", A), ("member-joined", B))
    assert verdicts.gone == ()


def test_a_new_lane_ends_a_suspicion_early() -> None:
    # A node that wakes from a closed lid finds every lane dead on its side and suspects every
    # peer; the lanes gossip opens again at once prove them alive.
    health = Health(suspect_hold_s=10.0)
    for node_id in (A, B):
        assert health.on_lane_lost(node_id, PEER_DEAD, now=0.0)
    assert health.on_lane_up(A)
    assert health.suspects(0.5) == {B}
    assert not health.on_lane_up(A) and not health.on_lane_up(C)  # not suspect: nothing to end


def test_dead_or_departed_members_are_gone_and_capacity_changes_are_quiet() -> None:
    health = Health(suspect_hold_s=10.0)
    health.suspect(A, 0.0)
    verdicts = health.on_member_events(
        [
            _event(EventKind.DIED, A),
            _event(EventKind.CAPACITY_CHANGED, B),
            _event(EventKind.LEFT, C),
            _event(EventKind.SUSPECTED, B),
        ]
    )
    assert verdicts.gone == (A, C)
    assert verdicts.notes == (("member-died", A), ("member-left", C), ("member-suspected", B))
    # Membership's suspicion is its own: it does not hold B out of this node's routes.
    assert health.suspects(1.0) == {A}
