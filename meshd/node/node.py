"""`MeshNode`: one daemon's parts, composed; `run_node` opens the lanes and starts them.

Lanes (endpoint + lane table), membership (driven over the gossip stream), discovery (mDNS
and `--join`, each peer's node key learned by an authenticated key query), the artifact
service (weights served to peers, and fetched for a `mesh:ID` model), and leaderless planning
(re-run, debounced, whenever the view changes). Each model the node holds is a `HeldModel`
(`meshd/node/held_model.py`): its plan, the stage this node is assigned, and a coordinator for
the requests this node receives (`NodeBackend`); pipeline messages reach them through
`held_model.dispatch`. Which members to route around is `Health`'s to decide, and what a stage
is for (serving, spare, draining, killed, stopping) is its `Duty`'s. Both are sans-IO; the node
and its models only carry out what they return.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import trio

from meshd.config import NodeConfig
from meshd.mesh.identity import NodeIdentity, admission_policy
from meshd.mesh.member import LocalCapacity, MemberEvent
from meshd.mesh.membership import Membership
from meshd.model.device import device_memory_bytes
from meshd.model.threads import configure_threads
from meshd.net.bulk import BulkGate
from meshd.net.endpoint import Endpoint, open_endpoint
from meshd.net.lane_table import PeerUnreachable
from meshd.net.peer_lane import PeerLane
from meshd.node.basis import NodeBasis
from meshd.node.compute import measure_or_cached
from meshd.node.dialing import LaneKind, NodeLanes, pick_introducers
from meshd.node.fetch import FETCH_RETRY_S, ArtifactService, model_sources
from meshd.node.finder import PeerFinder
from meshd.node.gossip_driver import GossipDriver, KeyBook
from meshd.node.health import Health
from meshd.node.held_model import HeldModel, NodeShared, dispatch
from meshd.node.models import full_model_bytes, split_budget
from meshd.node.planning import assignment
from meshd.node.prefetch import TakeoverCache
from meshd.node.stage_slot import LoadDisplay
from meshd.plan.route import Route
from protocol import artifacts, gossip
from protocol.messages import (
    CloseSession,
    Message,
    NodeHello,
    SessionKeepAlive,
    StageCommand,
)
from protocol.streams import ARTIFACT_STREAM, GOSSIP_STREAM, PIPELINE_STREAM

log = logging.getLogger(__name__)

_EVENT_LOG = 200
# Pacing of the daemon's own loops. These follow from how the parts work, not from a
# deployment, so they are not configuration:
# membership changes arriving within this window cause one re-plan, not many;
REPLAN_DEBOUNCE_S = 0.2
# lane round trips are fed to membership this often.
RTT_REPORT_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One thing the operator may want to see (wall-clock time, so processes compare)."""

    at_unix_s: float
    kind: str
    node_id: str
    detail: str = ""


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
    the planning loop; each model it holds is a `HeldModel` (`models`, the first first)."""

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
        self.config = config
        self.basis = basis
        self.identity = basis.identity
        self.endpoint = endpoint
        self._nursery = nursery
        self.started_unix_s = started_unix_s
        self.keys = KeyBook()
        self.events: collections.deque[NodeEvent] = collections.deque(maxlen=_EVENT_LOG)
        self.health = Health(config.suspect_hold_s)
        # Told the node id of a member whose lane died (its peer stopped answering), as it
        # happens: the daemon's metrics count lane deaths by peer.
        self.on_lane_death: Callable[[bytes], None] | None = None
        self._replan = trio.Event()
        self._plan_changed = trio.Event()
        self._handlers: dict[type[Message], Callable[[Message, bytes], None]] = {
            NodeHello: self._on_hello,
            StageCommand: self._on_command,
        }
        self.peers = NodeLanes(
            endpoint,
            self.identity.x25519_public,
            self._dispatch,
            on_lane_lost=self._on_lane_lost,
            on_lane_up=self._on_lane_up,
            streams={
                GOSSIP_STREAM: (gossip.decode, self._on_gossip),
                ARTIFACT_STREAM: (artifacts.decode, self._on_artifact),
            },
            nat=config.nat,
            punch=config.punch,
            introducers=self._introducers_for,
        )
        # Held while a stage here computes a window: weight transfers wait (meshd/net/bulk.py).
        self.bulk_gate = BulkGate(config.bulk)
        self.bulk_gate.subscribe(endpoint.hold_bulk)
        self.models = self._hold_models(compute_ns, load_display)
        self.artifacts = self._artifact_service(load_display)
        # The artifact service fetches one model's tensors over the mesh: the first's (only
        # `--model`'s first may be `mesh:ID`).
        self.models[0].stage_ready = self.artifacts.stage_ready
        self.takeover = TakeoverCache()
        self.membership = self._membership(now)
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

    def _membership(self, now: float) -> Membership:
        return Membership(
            self.node_key,
            address=self.lane_address,
            sign=self.identity.sign,
            verify=NodeIdentity.verify,
            now=now,
            capacity=self.capacity(),
            config=self.config.membership,
            seed=int.from_bytes(self.node_key[:8], "big"),
            # A restart outranks its previous life's words at once.
            incarnation=int(time.time()),
            record_version=int(time.time()),
        )

    def _hold_models(
        self, compute_ns: Sequence[int], load_display: LoadDisplay | None
    ) -> list[HeldModel]:
        basis = self.basis
        shared = NodeShared(
            config=self.config,
            peers=self.peers,
            sender=_RouteSender(self),
            own_key=self.identity.x25519_public,
            nursery=self._nursery,
            device=basis.device,
            dtype=basis.dtype,
            kv_dtype=basis.kv_dtype,
            quantization=basis.quantization,
            note=lambda kind, detail: self.note(kind, self.node_key, detail),
            publish=lambda urgent: self.publish_capacity(urgent=urgent),
            gate=self.bulk_gate,
            draft=basis.draft,
            load_display=load_display,
        )
        several = len(basis.models) > 1
        return [
            HeldModel(files, shared, compute_ns=ns, label=files.name if several else "")
            for files, ns in zip(basis.models, compute_ns, strict=True)
        ]

    def _artifact_service(self, load_display: LoadDisplay | None) -> ArtifactService:
        """Serves this node's files to fetching peers; fetches a `mesh:ID` node's stage."""
        files = self.models[0].files
        return ArtifactService(
            files.checkpoint,
            self.peers,
            lambda: model_sources(
                self.membership.view(), files.shape.model_id, self.node_key, self.keys.x_of
            ),
            config=self.config.fetch,
            load_display=load_display,
            note=lambda kind, detail: self.note(kind, self.node_key, detail),
            gate=self.bulk_gate,
            name=files.name,
            on_fetch_end=self._on_fetch_end,
        )

    async def start(self) -> None:
        """Start every part's tasks; returns once lanes, the stage slots and gossip run."""
        nursery = self._nursery
        await nursery.start(self.peers.run)
        await nursery.start(self.bulk_gate.run)
        await nursery.start(self.artifacts.run)
        for model in self.models:
            await model.start()
        await nursery.start(self.gossip.run)
        nursery.start_soon(self._plan_loop)
        self.request_replan()  # a lone node serves alone until others join
        for address in self.config.bootstrap_peers():
            nursery.start_soon(self.finder.bootstrap, address)
        if self.config.mdns.enabled:
            nursery.start_soon(self.finder.discover)

    # ---- identity and what the operator sees -------------------------------------------
    @property
    def node_key(self) -> bytes:
        """This node's Ed25519 id (what membership and plans name it by)."""
        return self.identity.public_key

    @property
    def disabled(self) -> bool:
        """Killed by the operator (or stopped): hosts nothing, offers nothing."""
        return all(model.duty.disabled for model in self.models)

    @property
    def draining(self) -> bool:
        """A drain or a stop is in progress."""
        return any(model.duty.draining for model in self.models)

    @property
    def stopping(self) -> bool:
        """SIGTERM: no new requests or sessions; see `meshd/node/shutdown.py`."""
        return any(model.duty.stopping for model in self.models)

    def note(self, kind: str, node_id: bytes | str = b"", detail: str = "") -> None:
        """Add to the event log `meshctl status` shows."""
        name = node_id.hex()[:16] if isinstance(node_id, bytes) else node_id
        self.events.append(NodeEvent(time.time(), kind, name, detail))
        log.info("%s %s %s", kind, name, detail)

    @property
    def lane_address(self) -> str:
        """Where others should dial this node's lanes ("" when bound to every address)."""
        host, port = self.endpoint.local_address
        return "" if host in ("0.0.0.0", "::") else f"{host}:{port}"

    def capacity(self) -> LocalCapacity:
        """What this node offers now (the signed record's contents): each model offered,
        with its share of the memory budget (`split_budget`)."""
        budget = self.config.memory_budget_bytes or device_memory_bytes(self.basis.device)
        offered = [(m, h) for m in self.models if (h := m.holding()) is not None]
        needs = [full_model_bytes(m.files.shape, m.files.context_tokens) for m, _ in offered]
        shares = split_budget(budget, needs)
        models = tuple(
            msgspec.structs.replace(h, memory_budget_bytes=share) if len(offered) > 1 else h
            for (_, h), share in zip(offered, shares, strict=True)
        )
        sessions = sum(model.slot.sessions for model in self.models)
        return LocalCapacity(memory_budget_bytes=budget, models=models, sessions=sessions)

    def publish_capacity(self, *, urgent: bool = False) -> None:
        """Re-sign our record if what we offer changed (membership rate-limits it, unless
        `urgent`: we stop offering our stage, and the spare should take it at once)."""
        self.membership.set_capacity(self.capacity(), trio.current_time(), urgent=urgent)
        self.gossip.poke()
        self.request_replan()

    # ---- lanes and messages ---------------------------------------------------------------
    def _dispatch(self, message: Message, lane_key: bytes) -> None:
        handler = self._handlers.get(type(message))
        if handler is not None:
            handler(message, lane_key)
        else:
            dispatch(self.models, message, lane_key)

    def _on_hello(self, message: Message, lane_key: bytes) -> None:
        assert isinstance(message, NodeHello)
        self.gossip.on_hello(message.node_key, lane_key)

    def _on_command(self, message: Message, lane_key: bytes) -> None:
        assert isinstance(message, StageCommand)
        self._nursery.start_soon(self.apply_command, message.action, message.drain)

    def _on_gossip(self, message: gossip.GossipMessage, lane_key: bytes) -> None:
        self.gossip.on_gossip(message, lane_key)

    def _on_artifact(self, message: artifacts.ArtifactMessage, lane_key: bytes) -> None:
        self.artifacts.on_message(message, lane_key)

    def _on_lane_up(self, lane_key: bytes, lane: PeerLane) -> None:
        self._nursery.start_soon(self._say_hello, lane_key, lane)
        self.gossip.on_lane_up(lane_key)
        self.artifacts.on_lane_up(lane_key)
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None and self.health.on_lane_up(node_id):
            self.request_replan()  # routes may take it again

    async def _say_hello(self, lane_key: bytes, lane: PeerLane) -> None:
        with contextlib.suppress(Exception):  # a lane that died at once is handled elsewhere
            await self.peers.send(lane_key, NodeHello(self.node_key))

    def _on_lane_lost(self, lane_key: bytes, lane: PeerLane) -> None:
        node_id = self.keys.ed_of(lane_key)
        if node_id is not None:
            reason = lane.termination.reason.name.lower() if lane.termination else "closed"
            self.note("lane-lost", node_id, reason)
            # Before the coordinators hear: their retries route around the dead node.
            if self.health.on_lane_lost(node_id, reason, trio.current_time()):
                self.request_replan()
                if self.on_lane_death is not None:
                    self.on_lane_death(node_id)
        for model in self.models:  # fail what waits on the lane, free what it left here
            model.coordinator.peer_lost(lane_key)
            model.slot.free_coordinator(lane_key)
        self.gossip.on_lane_dead(lane_key)
        self.artifacts.on_lane_lost(lane_key)

    def suspect(self, node_id: bytes) -> None:
        """Leave `node_id` out of this node's routes for a while (its lane died)."""
        self.health.suspect(node_id, trio.current_time())
        self.request_replan()

    def _on_member_events(self, events: list[MemberEvent]) -> None:
        verdicts = self.health.on_member_events(events)
        for kind, node_id in verdicts.notes:
            self.note(kind, node_id)
        for node_id in verdicts.gone:
            for model in self.models:
                model.slot.free_coordinator(self.keys.x_of(node_id))
        self.request_replan()

    def _introducers_for(self, target: bytes) -> list[bytes]:
        """Lane keys of members that may introduce this node to `target` (a lane key), best first."""
        target_id = self.keys.ed_of(target)
        if target_id is None:
            return []

        def direct_lane(node_id: bytes) -> bool:
            path = self.peers.path_of(self.keys.x_of(node_id))
            return path is not None and path.kind is not LaneKind.RELAYED

        view = self.membership.view()
        picked = pick_introducers(view, target_id, own=self.node_key, direct_lane=direct_lane)
        return [self.keys.x_of(node_id) for node_id in picked]

    # ---- planning -------------------------------------------------------------------------
    def request_replan(self) -> None:
        """Re-plan soon (debounced)."""
        self._replan.set()

    async def _plan_loop(self) -> None:
        while True:
            await self._replan.wait()
            await trio.sleep(REPLAN_DEBOUNCE_S)
            self._replan = trio.Event()
            await self._replan_once()

    async def _replan_once(self) -> None:
        for model in self.models:
            view, rtt = self.membership.view(), self.membership.rtt_matrix()
            await model.replan(view, rtt, self.node_key, trio.current_time())
        await self._steer_fetch(self.models[0])
        self._plan_changed.set()
        self._plan_changed = trio.Event()

    async def _steer_fetch(self, model: HeldModel) -> None:
        """A `mesh:ID` model's background fetch after a re-plan: a stage still to load keeps
        its fetch (`ArtifactService.stage_ready` started it); a spare prefetches the layers it
        would take over (`prefetch` key, `meshd/node/prefetch.py`); otherwise none. With no
        plan at all, whatever runs goes on (like the stage, kept for a later plan)."""
        new = model.plan
        if new is None or not self.artifacts.fetches:
            return
        assigned = assignment(new, self.node_key)
        if not model.duty.offers_model:
            self.artifacts.stop_fetching()
        elif assigned is not None:
            if assigned == model.slot.layers:
                self.artifacts.stop_fetching()
        elif self.config.prefetch and model.slot.layers is None:
            view, rtt = self.membership.view(), self.membership.rtt_matrix()  # fresh copies
            # One plan per stage: in a thread, so a large mesh's planning never stalls lanes.
            ranges = await trio.to_thread.run_sync(
                lambda: self.takeover.ranges(
                    view,
                    model.files.shape,
                    rtt,
                    new,
                    self.node_key,
                    context_tokens=model.files.context_tokens,
                    config=self.config.planner,
                )
            )
            await self.artifacts.prefetch(ranges, max_bytes=self.config.prefetch_max_bytes)
        else:
            self.artifacts.stop_fetching()

    def _on_fetch_end(self, ok: bool) -> None:
        """A background fetch ended: re-plan now (the stage it was for loads), or after a
        failure a little later (and so try again)."""
        if ok:
            self.request_replan()
        else:
            self._nursery.start_soon(self._replan_after, FETCH_RETRY_S)

    async def _replan_after(self, delay_s: float) -> None:
        await trio.sleep(delay_s)
        self.request_replan()

    def route(self, model: HeldModel) -> Route:
        """The route this node coordinates `model`'s requests over now, around the members
        it suspects (NoFeasiblePlan if none)."""
        suspects = self.health.suspects(trio.current_time())
        return model.route(self.membership.view(), self.membership.rtt_matrix(), suspects)

    async def wait_plan_change(self, timeout_s: float) -> None:
        """Return after the next re-plan, or after `timeout_s`."""
        with trio.move_on_after(timeout_s):
            await self._plan_changed.wait()

    # ---- operator commands -------------------------------------------------------------
    async def apply_command(self, action: str, drain: bool) -> None:
        """kill: stop hosting every model (after the sessions end with `drain`); recover:
        host again."""
        for model in self.models:
            await model.apply_command(action, drain, trio.current_time())

    def begin_stop(self) -> None:
        """SIGTERM: admit nothing new and stop offering the models, so every plan (and every
        new request, anywhere) moves to a spare at once, while the stages keep serving the
        sessions they have; `finish_stop` ends it."""
        for model in self.models:
            model.begin_stop(trio.current_time())

    async def finish_stop(self) -> None:
        """Stop the stages: sessions still open get `stage_stopped`, and their coordinators
        continue on the spare (loaded since `begin_stop`)."""
        for model in self.models:
            await model.finish_stop(trio.current_time())

    async def send_command(self, node_id: bytes, action: str, drain: bool) -> None:
        """Deliver a kill/recover to `node_id` (this node itself, or over its lane)."""
        if node_id == self.node_key:
            if action == "kill" and drain:
                self._nursery.start_soon(self.apply_command, action, drain)  # answer at once
            else:
                await self.apply_command(action, drain)
            return
        command = StageCommand("kill" if action == "kill" else "recover", drain)
        await self.peers.send(self.keys.x_of(node_id), command)


class _RouteSender:
    """The coordinator's sender: never dials a node whose lane just died, nor to close.

    Without this, closing a failed session would redial the dead node and wait out a
    handshake before the request could re-plan or answer 503. Closes and keep-alives only
    travel on open lanes: a stage whose lane to this node is gone has freed our sessions
    already (it frees a lost coordinator's sessions), so there is nothing to close or renew.
    """

    def __init__(self, node: MeshNode) -> None:
        self.node = node

    async def send(self, key: bytes, message: Message, stream: int = PIPELINE_STREAM) -> None:
        peers = self.node.peers
        if key != peers.own_key and peers.lane(key) is None:
            node_id = self.node.keys.ed_of(key)
            if self.node.health.is_suspect(node_id, trio.current_time()):
                raise PeerUnreachable(f"peer {key.hex()[:16]} lost its lane recently")
            if isinstance(message, CloseSession | SessionKeepAlive):
                raise PeerUnreachable(f"no lane to {key.hex()[:16]}: nothing to close there")
        await peers.send(key, message, stream)
