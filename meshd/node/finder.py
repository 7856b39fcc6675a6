"""`PeerFinder`: how a node meets others, by mDNS and by its `join` addresses, and which
members may introduce it to a peer behind NAT.

Every candidate address is only a hint: the node key there is learned by an authenticated
key query (proven by the mesh secret), then the node dials it and joins its membership.
"""

from __future__ import annotations

import logging

import trio

from meshd.mesh.discovery import DiscoveredPeer, DiscoveryConfig, mesh_hash_for, open_discovery
from meshd.mesh.identity import NodeIdentity, fingerprint_of
from meshd.mesh.jointoken import Address
from meshd.net.endpoint import Endpoint
from meshd.net.lane_table import PeerUnreachable
from meshd.node.dialing import LaneKind, NodeLanes, pick_introducers
from meshd.node.gossip_driver import GossipDriver, KeyBook

log = logging.getLogger(__name__)

# A `join` address that does not answer is retried after this long, doubling up to the
# maximum: a peer that starts later is met soon, one that never does costs little.
JOIN_RETRY_INITIAL_S = 0.5
JOIN_RETRY_MAX_S = 8.0


class PeerFinder:
    """Meets the peers mDNS announces (`discover`) and those at `join` addresses
    (`bootstrap`)."""

    def __init__(
        self,
        endpoint: Endpoint,
        peers: NodeLanes,
        keys: KeyBook,
        gossip: GossipDriver,
        *,
        identity: NodeIdentity,
        psk: bytes,
        mdns: DiscoveryConfig,
    ) -> None:
        self.endpoint = endpoint
        self.peers = peers
        self.keys = keys
        self.gossip = gossip
        self.identity = identity
        self.psk = psk
        self.mdns = mdns

    async def discover(self) -> None:
        """Announce this node by mDNS and meet every peer of the mesh it sees, until cancelled."""
        _host, port = self.endpoint.local_address
        async with (
            open_discovery(
                node_id=self.identity.node_id,
                key_fingerprint=self.identity.fingerprint(),
                mesh_hash=mesh_hash_for(self.psk),
                port=port,
                interfaces=list(self.mdns.interfaces),
                config=self.mdns,
            ) as disc,
            trio.open_nursery() as nursery,
        ):
            async for peer in disc.peers():
                if not peer.removed:
                    nursery.start_soon(self._meet_discovered, peer)

    async def bootstrap(self, address: Address) -> None:
        """Meet the node at `address`, retrying with backoff until it answers."""
        delay = JOIN_RETRY_INITIAL_S
        while await self.meet(address) is None:
            await trio.sleep(delay)
            delay = min(delay * 2, JOIN_RETRY_MAX_S)

    async def _meet_discovered(self, peer: DiscoveredPeer) -> None:
        for host in peer.addresses:
            node_id = await self.meet((host, peer.port))
            if node_id is not None and fingerprint_of(node_id) == peer.key_fingerprint:
                return

    async def meet(self, address: Address) -> bytes | None:
        """Learn the node key at `address` (proven by the mesh secret), dial it and join."""
        try:
            node_id = await self.endpoint.query_key(address)
        except TimeoutError:
            return None
        if node_id == self.identity.public_key:
            return node_id
        lane_key = self.keys.x_of(node_id)
        self.peers.addresses[lane_key] = address
        try:
            await self.peers.lane_to(lane_key)
        except PeerUnreachable as exc:
            log.info("could not open a lane to %s: %s", address, exc)
            return None
        self.gossip.join(node_id)
        return node_id

    def introducers(self, target: bytes) -> list[bytes]:
        """Lane keys of members that may introduce this node to `target` (a lane key), best first."""
        target_id = self.keys.ed_of(target)
        if target_id is None:
            return []

        def direct_lane(node_id: bytes) -> bool:
            path = self.peers.path_of(self.keys.x_of(node_id))
            return path is not None and path.kind is not LaneKind.RELAYED

        view = self.gossip.membership.view()
        own = self.identity.public_key
        picked = pick_introducers(view, target_id, own=own, direct_lane=direct_lane)
        return [self.keys.x_of(node_id) for node_id in picked]
