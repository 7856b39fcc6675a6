"""The daemon's dial policy: direct first, then through an introducer (punch, else relay).

Every send in the daemon (gossip, pipeline windows, stage hand-offs, NAT messages) asks the
lane table for a lane. `NodeLanes.lane_to` dials the member's advertised address first: on a
LAN that is the common case and costs one handshake. When that fails (no usable address, a
handshake timeout, unreachable), it asks a member it already holds a direct lane to for an
introduction (`NatTraversal.connect_via`), which punches a direct lane through both NATs or
falls back to an end-to-end encrypted relay through that member.

Which path a peer took is remembered: for `direct_retry_s` after a peer needed an
introduction, its (known failing) advertised address is not dialed again; after that the
next dial tries it first once more. When both sides need a lane at once, the side with the
larger key waits `yield_s` for the other's lane before asking for its own introduction, so
one punch (not two racing ones) usually makes the lane.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Unpack

import trio

from meshd.config.tables import NatDialConfig
from meshd.mesh.member import MemberInfo
from meshd.net.endpoint import Endpoint
from meshd.net.lane_table import Dispatch, LaneTable, LaneTableOptions, PeerUnreachable
from meshd.net.peer_lane import PeerLane
from meshd.net.punch import NatTraversal, Path
from protocol.punch import PunchConfig, RelayPath

log = logging.getLogger(__name__)


class LaneKind(enum.Enum):
    """How an open lane travels."""

    DIRECT = "direct"  # dialed or accepted at the peer's own address
    PUNCHED = "punched"  # direct, after an introducer helped punch the NATs
    RELAYED = "relayed"  # through an introducer's relay (still end-to-end encrypted)


@dataclass(frozen=True, slots=True)
class LanePath:
    """The path of the lane to one peer; `via` is the introducer's lane key, if one helped."""

    kind: LaneKind
    via: bytes | None
    since: float


# Lane keys of members to ask for an introduction to the target (given its lane key), best first.
IntroducerPicker = Callable[[bytes], list[bytes]]


class NodeLanes(LaneTable):
    """The daemon's lane table: `lane_to` dials direct, then through an introducer."""

    def __init__(
        self,
        endpoint: Endpoint,
        own_key: bytes,
        dispatch: Dispatch,
        *,
        nat: NatDialConfig | None = None,
        punch: PunchConfig | None = None,
        introducers: IntroducerPicker = lambda _target: [],
        **options: Unpack[LaneTableOptions],
    ) -> None:
        super().__init__(endpoint, own_key, dispatch, **options)
        self.nat_config = nat if nat is not None else NatDialConfig()
        self.nat = NatTraversal(self, punch if punch is not None else PunchConfig())
        self.introducers = introducers
        self.paths: dict[bytes, LanePath] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept and read lanes, and serve introductions and relaying, until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.nat.run)
            await nursery.start(super().run)
            task_status.started()

    def path_of(self, key: bytes) -> LanePath | None:
        """How the open lane to `key` travels (None without one).

        A relayed lane is known from its address; a direct one was punched if this node
        asked for the introduction (the answering side sees an ordinary incoming lane).
        """
        lane = self.lane(key)
        if lane is None:
            return None
        record = self.paths.get(key)
        if isinstance(lane.addr, RelayPath):
            via = record.via if record is not None and record.kind is LaneKind.RELAYED else None
            return LanePath(LaneKind.RELAYED, via or self._key_at(lane.addr.via), 0.0)
        if record is not None and record.kind is LaneKind.PUNCHED:
            return record
        return LanePath(LaneKind.DIRECT, None, 0.0)

    async def _open_lane(self, key: bytes) -> PeerLane:
        """A direct dial, or a lane made through a member (see the module docstring)."""
        now = trio.current_time()
        record = self.paths.get(key)
        recent_nat = (
            record is not None
            and record.kind is not LaneKind.DIRECT
            and now - record.since < self.nat_config.direct_retry_s
        )
        error: PeerUnreachable | None = None
        if not recent_nat:
            try:
                lane = await self._dial_address(key)
            except PeerUnreachable as exc:
                error = exc
            else:
                self.paths[key] = LanePath(LaneKind.DIRECT, None, now)
                return lane
        return await self._traverse(key, error)

    async def _traverse(self, key: bytes, direct_error: PeerUnreachable | None) -> PeerLane:
        if self.own_key > key:
            lane = await self._wait_for_lane(key, self.nat_config.yield_s)
            if lane is not None:
                return lane
        tried: list[str] = []
        for introducer in self.introducers(key)[: self.nat_config.max_introducers]:
            if self.lane(introducer) is None or introducer == key:
                continue
            try:
                result = await self.nat.connect_via(introducer, key)
            except PeerUnreachable as exc:
                tried.append(f"{introducer.hex()[:16]}: {exc}")
                continue
            if result is None:  # the peer's own lane arrived meanwhile
                lane = self.lane(key)
                if lane is not None:
                    return lane
                continue
            kind = LaneKind.PUNCHED if result.path is Path.DIRECT else LaneKind.RELAYED
            self.paths[key] = LanePath(kind, introducer, trio.current_time())
            log.info(
                "lane to %s %s via %s in %.2f s",
                key.hex()[:16],
                kind.value,
                introducer.hex()[:16],
                result.took_s,
            )
            return result.lane
        lane = self.lane(key)  # the peer may have reached us meanwhile
        if lane is not None:
            return lane
        reasons = "; ".join(tried) or "no member to introduce us"
        raise PeerUnreachable(f"peer {key.hex()[:16]}: direct: {direct_error}; via: {reasons}")

    async def _wait_for_lane(self, key: bytes, timeout_s: float) -> PeerLane | None:
        with trio.move_on_after(timeout_s):
            return await self.wait_for_lane(key)
        return None

    def _key_at(self, addr: tuple[str, int]) -> bytes | None:
        """The peer whose direct lane reaches `addr` (a relay's address)."""
        for key, lane in self.connected.items():
            if isinstance(lane.addr, tuple) and tuple(lane.addr[:2]) == tuple(addr[:2]):
                return key
        return None


def pick_introducers(
    view: Mapping[bytes, MemberInfo],
    target: bytes,
    *,
    own: bytes,
    direct_lane: Callable[[bytes], bool],
) -> list[bytes]:
    """Node ids to ask for an introduction to `target`, best first.

    Only members this node holds a direct lane to can introduce (the introducer must see both
    sides' observed addresses). Members that report a measured RTT to the target (so held a
    lane to it lately) come first, nearest the target first; the others follow by id, since
    a member's RTT report can lag its lanes.
    """
    listed: list[tuple[float, bytes]] = []
    others: list[bytes] = []
    for node_id in sorted(view):
        info = view[node_id]
        if node_id in (own, target) or not info.healthy or not direct_lane(node_id):
            continue
        rtt_s = info.rtt_s.get(target)
        if rtt_s is not None:
            listed.append((rtt_s, node_id))
        else:
            others.append(node_id)
    return [node_id for _rtt, node_id in sorted(listed)] + others
