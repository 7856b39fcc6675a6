"""`MeshNode`: one daemon's parts, composed; `run_node` opens the lanes and starts them.

The node keeps the lanes (endpoint + lane table), membership (driven over the gossip stream),
discovery (mDNS and `--join`, each peer's node key learned by an authenticated key query), the
artifact service (weights served to peers, and fetched for a `mesh:ID` model) and routing. It
composes leaderless planning (`PlanLoop`, replan.py) and the operator's commands
(`NodeCommands`, commands.py). Each model it holds is a `HeldModel` (held_model.py: its plan,
stage slot, duty and coordinator); pipeline messages reach them through `held_model.dispatch`.
Which members to route around is `Health`'s to decide, and what a stage is for (serving,
spare, draining, killed, stopping) is its `Duty`'s; both are sans-IO, and the node and its
models only carry out what they return.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import trio

from meshd.config import NodeConfig
from meshd.mesh.identity import NodeIdentity, admission_policy
from meshd.mesh.member import LocalCapacity, MemberEvent
from meshd.mesh.membership import Membership
from meshd.model.device import device_memory_bytes
from meshd.model.governor import ThreadGovernor
from meshd.model.threads import configure_threads
from meshd.net.bulk import BulkGate
from meshd.net.endpoint import Endpoint, open_endpoint
from meshd.net.lane_table import PeerUnreachable
from meshd.net.peer_lane import PeerLane
from meshd.node.basis import NodeBasis
from meshd.node.commands import NodeCommands
from meshd.node.compute import measure_or_cached
from meshd.node.dialing import NodeLanes
from meshd.node.fetch import ArtifactService, model_sources
from meshd.node.finder import PeerFinder
from meshd.node.gossip_driver import GossipDriver, KeyBook
from meshd.node.health import Health
from meshd.node.held_model import HeldModel, NodeShared, capacity_of, dispatch, hold_models
from meshd.node.replan import PlanLoop
from meshd.node.stage_slot import LoadDisplay
from meshd.node.status import EventLog
from meshd.plan.route import Route
from protocol import artifacts, gossip
from protocol.messages import (
    CloseSession,
    DropEntries,
    Message,
    NodeHello,
    SessionKeepAlive,
    StageCommand,
)
from protocol.streams import ARTIFACT_STREAM, GOSSIP_STREAM, PIPELINE_STREAM

log = logging.getLogger(__name__)

# Lane round trips are fed to membership this often: pacing that follows from how the parts
# work, not from a deployment, so it is not configuration.
RTT_REPORT_INTERVAL_S = 1.0


async def run_node(
    config: NodeConfig,
    basis: NodeBasis,
    *,
    load_display: LoadDisplay | None = None,
    task_status: trio.TaskStatus[MeshNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Measure compute, open the lanes, build the node and serve until cancelled; the node is
    passed to `task_status.started` once every part runs."""
    started_unix_s = time.time()
    # As many threads as the largest model gains from (a small one computes on one).
    largest = max(basis.models, key=lambda f: f.checkpoint.config.hidden_size)
    threads = configure_threads(
        config.threads, largest.checkpoint.config, basis.dtype, basis.quantization
    )
    log.info("compute: %d thread(s), quantization %s", threads, basis.quantization)
    if basis.draft is not None:
        # The draft computes on the node's threads, on whichever worker thread runs its pass
        # (a thread's torch count is its own): it loaded before they were set, and a pass it
        # governed on all the cores would compute there on a node given fewer.
        basis.draft.stage.governor = ThreadGovernor(threads)
    compute_ns = [await measure_or_cached(basis, files, config) for files in basis.models]
    admit = admission_policy(config.admitted_public_keys(), config.revoked_public_keys())
    async with (
        open_endpoint(
            static_private=basis.identity.x25519_private,
            psk=basis.psk,
            bind=(config.listen_host, config.listen_port),
            admit=admit,
            lane_config=config.lane,
            egress=config.emulate,
            node_public_key=basis.identity.public_key,
        ) as endpoint,
        trio.open_nursery() as nursery,
    ):
        node = MeshNode(
            config,
            basis,
            endpoint,
            nursery,
            compute_ns=compute_ns,
            load_display=load_display,
            now=trio.current_time(),
            started_unix_s=started_unix_s,
        )
        await node.start()
        task_status.started(node)
        await trio.sleep_forever()


class MeshNode:
    """A meshd daemon's parts, composed over an open endpoint; `start` runs them in
    `nursery`. It keeps the lanes, membership and gossip, discovery, the artifact service and
    routing; each model it holds is a `HeldModel` (`models`, the first first), re-planned by
    `planning` (`request`, `wait_change`), commanded by `commands` (`apply`, `disabled`,
    `draining`); `finder` meets peers and names who may introduce this node to one."""

    def __init__(
        self,
        config: NodeConfig,
        basis: NodeBasis,
        endpoint: Endpoint,
        nursery: trio.Nursery,
        *,
        compute_ns: Sequence[int],
        now: float,
        started_unix_s: float,
        load_display: LoadDisplay | None = None,
    ) -> None:
        self.config, self.basis, self.endpoint = config, basis, endpoint
        self.identity = basis.identity
        self._nursery = nursery
        self.started_unix_s = started_unix_s
        self.keys = KeyBook()
        self.events = EventLog()
        self.health = Health(config.suspect_hold_s)
        # Told the node id of a member whose lane died (its peer stopped answering), as it
        # happens: the daemon's metrics count lane deaths by peer.
        self.on_lane_death: Callable[[bytes], None] | None = None
        self.peers = NodeLanes(
            endpoint,
            self.identity.x25519_public,
            self._dispatch,
            on_lane_lost=self._on_lane_lost,
            on_lane_up=self._on_lane_up,
            streams={
                GOSSIP_STREAM: (gossip.decode, lambda m, k: self.gossip.on_gossip(m, k)),
                ARTIFACT_STREAM: (artifacts.decode, lambda m, k: self.artifacts.on_message(m, k)),
            },
            nat=config.nat,
            punch=config.punch,
            introducers=lambda target: self.finder.introducers(target),
        )
        # Held while a stage here computes a window: weight transfers wait (meshd/net/bulk.py).
        self.bulk_gate = BulkGate(config.bulk)
        self.bulk_gate.subscribe(endpoint.hold_bulk)
        self.models = hold_models(self._shared(load_display), compute_ns)
        self.artifacts = self._artifact_service(load_display)
        self.membership = _membership(
            self.identity, self.lane_address, self.capacity(), config, now
        )
        self.planning = PlanLoop(config, self.models, self.membership, self.artifacts, nursery)
        self.commands = NodeCommands(self.models, self.node_key, self.peers, self.keys, nursery)
        self.gossip = GossipDriver(
            self.membership,
            self.peers,
            self.keys,
            self._on_member_events,
            rtt_report_interval_s=RTT_REPORT_INTERVAL_S,
        )
        self.finder = PeerFinder(
            endpoint,
            self.peers,
            self.keys,
            self.gossip,
            identity=self.identity,
            psk=basis.psk,
            mdns=config.mdns,
        )

    def _shared(self, load_display: LoadDisplay | None) -> NodeShared:
        """What the node's models share of it."""
        return NodeShared(
            config=self.config,
            basis=self.basis,
            peers=self.peers,
            sender=_RouteSender(self),
            nursery=self._nursery,
            note=lambda kind, detail: self.events.note(kind, self.node_key, detail),
            publish=lambda urgent: self.publish_capacity(urgent=urgent),
            gate=self.bulk_gate,
            load_display=load_display,
        )

    def _artifact_service(self, load_display: LoadDisplay | None) -> ArtifactService:
        """Serves this node's files to fetching peers; fetches a `mesh:ID` node's stage: the
        first model's (only `--model`'s first may be `mesh:ID`), which waits for it."""
        first = self.models[0]
        files = first.files
        service = ArtifactService(
            files.checkpoint,
            self.peers,
            lambda: model_sources(
                self.membership.view(), files.shape.model_id, self.node_key, self.keys.x_of
            ),
            config=self.config.fetch,
            load_display=load_display,
            note=lambda kind, detail: self.events.note(kind, self.node_key, detail),
            gate=self.bulk_gate,
            name=files.name,
            on_fetch_end=lambda ok: self.planning.on_fetch_end(ok),
        )
        first.stage_ready = service.stage_ready
        return service

    async def start(self) -> None:
        """Start every part's tasks; returns once lanes, the stage slots and gossip run."""
        nursery = self._nursery
        await nursery.start(self.peers.run)
        await nursery.start(self.bulk_gate.run)
        await nursery.start(self.artifacts.run)
        for model in self.models:
            await model.start()
        await nursery.start(self.gossip.run)
        nursery.start_soon(self.planning.run)
        self.planning.request()  # a lone node serves alone until others join
        for address in self.config.bootstrap_peers():
            nursery.start_soon(self.finder.bootstrap, address)
        if self.config.mdns.enabled:
            nursery.start_soon(self.finder.discover)

    # ---- identity and what the node offers ---------------------------------------------
    @property
    def node_key(self) -> bytes:
        """This node's Ed25519 id (what membership and plans name it by)."""
        return self.identity.public_key

    @property
    def lane_address(self) -> str:
        """Where others should dial this node's lanes ("" when bound to every address)."""
        host, port = self.endpoint.local_address
        return "" if host in ("0.0.0.0", "::") else f"{host}:{port}"

    def capacity(self) -> LocalCapacity:
        """What this node offers now (the signed record's contents)."""
        budget = self.config.memory_budget_bytes or device_memory_bytes(self.basis.device)
        return capacity_of(self.models, budget)

    def publish_capacity(self, *, urgent: bool = False) -> None:
        """Re-sign our record if what we offer changed (membership rate-limits it, unless
        `urgent`: we stop offering our stage, and the spare should take it at once)."""
        self.membership.set_capacity(self.capacity(), trio.current_time(), urgent=urgent)
        self.gossip.poke()
        self.planning.request()

    # ---- lanes and messages ---------------------------------------------------------------
    def _dispatch(self, message: Message, lane_key: bytes) -> None:
        if isinstance(message, NodeHello):
            self.gossip.on_hello(message.node_key, lane_key)
        elif isinstance(message, StageCommand):
            self._nursery.start_soon(self.commands.apply, message.action, message.drain)
        else:
            dispatch(self.models, message, lane_key)

    def _on_lane_up(self, lane_key: bytes, lane: PeerLane) -> None:
        self._nursery.start_soon(self.gossip.say_hello, lane_key)
        self.gossip.on_lane_up(lane_key)
        self.artifacts.on_lane_up(lane_key)
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None and self.health.on_lane_up(node_id):
            self.planning.request()  # routes may take it again

    def _on_lane_lost(self, lane_key: bytes, lane: PeerLane) -> None:
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None:
            reason = lane.termination.reason.name.lower() if lane.termination else "closed"
            self.events.note("lane-lost", node_id, reason)
            # Before the coordinators hear: their retries route around the dead node.
            if self.health.on_lane_lost(node_id, reason, trio.current_time()):
                self.planning.request()
                if self.on_lane_death is not None:
                    self.on_lane_death(node_id)
        for model in self.models:  # fail what waits on the lane, free what it left here
            model.coordinator.peer_lost(lane_key)
            model.slot.free_coordinator(lane_key)
        self.gossip.on_lane_dead(lane_key)
        self.artifacts.on_lane_lost(lane_key)

    def _on_member_events(self, events: list[MemberEvent]) -> None:
        verdicts = self.health.on_member_events(events)
        for kind, node_id in verdicts.notes:
            self.events.note(kind, node_id)
        for node_id in verdicts.gone:
            for model in self.models:
                model.slot.free_coordinator(self.keys.x_of(node_id))
        self.planning.request()

    # ---- routing and planning -------------------------------------------------------------
    def suspect(self, node_id: bytes) -> None:
        """Leave `node_id` out of this node's routes for a while (its lane died)."""
        self.health.suspect(node_id, trio.current_time())
        self.planning.request()

    def route(self, model: HeldModel) -> Route:
        """The route this node coordinates `model`'s requests over now, around the members
        it suspects (NoFeasiblePlan if none)."""
        suspects = self.health.suspects(trio.current_time())
        return model.route(self.membership.view(), self.membership.rtt_matrix(), suspects)


def _membership(
    identity: NodeIdentity, address: str, capacity: LocalCapacity, config: NodeConfig, now: float
) -> Membership:
    """A node's membership: its record, signed with `identity`, says `address` and `capacity`."""
    node_id = identity.public_key
    return Membership(
        node_id,
        address=address,
        sign=identity.sign,
        verify=NodeIdentity.verify,
        now=now,
        capacity=capacity,
        config=config.membership,
        seed=int.from_bytes(node_id[:8], "big"),
        # A restart outranks its previous life's words at once.
        incarnation=int(time.time()),
        record_version=int(time.time()),
    )


class _RouteSender:
    """The coordinator's sender: never dials a node whose lane just died, nor to close.

    Without this, closing a failed session would redial the dead node and wait out a
    handshake before the request could re-plan or answer 503. Closes, keep-alives and prefix
    drops only travel on open lanes: a stage whose lane to this node is gone has freed our
    sessions and prefix-cache entries already (it frees what a lost coordinator left), so
    there is nothing to close, renew or drop.
    """

    def __init__(self, node: MeshNode) -> None:
        self.node = node

    async def send(self, key: bytes, message: Message, stream: int = PIPELINE_STREAM) -> None:
        peers = self.node.peers
        if key != peers.own_key and peers.lane(key) is None:
            node_id = self.node.keys.ed_of(key)
            if self.node.health.is_suspect(node_id, trio.current_time()):
                raise PeerUnreachable(f"peer {key.hex()[:16]} lost its lane recently")
            if isinstance(message, CloseSession | SessionKeepAlive | DropEntries):
                raise PeerUnreachable(f"no lane to {key.hex()[:16]}: nothing to close there")
        await peers.send(key, message, stream)
