"""`MeshNode`: one daemon's parts, composed; `run_node` opens the lanes and starts them.

Lanes (endpoint + lane table), membership (driven over the gossip stream), discovery (mDNS
and `--join`, each peer's node key learned by an authenticated key query), leaderless
planning (re-run, debounced, whenever the view changes), the stage this node is assigned, and
a coordinator for the requests this node receives (`NodeBackend`). Messages reach the parts
through `NodeWiring` (shared with the in-process local pipeline); which members to route
around is `Health`'s to decide, and what the stage is for (serving, spare, draining, killed,
stopping) is `Duty`'s. Both are sans-IO; `MeshNode` only carries out what they return.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import torch
import trio

from meshd.config import NodeConfig
from meshd.coord.coordinator import Coordinator
from meshd.coord.wiring import NodeWiring
from meshd.mesh.identity import NodeIdentity, admission_policy
from meshd.mesh.member import LocalCapacity, MemberEvent
from meshd.mesh.membership import Membership
from meshd.model.checkpoint import Checkpoint
from meshd.model.device import device_memory_bytes, pick_device
from meshd.model.files import open_checkpoint
from meshd.model.threads import configure_threads
from meshd.model.tokenizer import Tokenizer
from meshd.net.bulk import BulkGate
from meshd.net.endpoint import Endpoint, PeerLane, open_endpoint
from meshd.net.lane_table import PeerUnreachable
from meshd.node.dialing import LaneKind, NodeLanes, pick_introducers
from meshd.node.duty import (
    CancelDrain,
    Duty,
    Effect,
    Ignored,
    LoadStage,
    Note,
    Publish,
    StartDrain,
    StopStage,
)
from meshd.node.fetch import FETCH_RETRY_S, ArtifactService, model_sources
from meshd.node.finder import PeerFinder
from meshd.node.gossip_driver import GossipDriver, KeyBook
from meshd.node.health import Health
from meshd.node.models import (
    ModelFiles,
    ModelSet,
    full_model_bytes,
    split_budget,
    tokenizer_and_shape,
)
from meshd.node.planning import assignment, lane_route, plan_view
from meshd.node.prefetch import TakeoverCache
from meshd.node.stage_slot import LoadDisplay, StageSlot, measure_compute_ns
from meshd.plan import ModelShape, NoFeasiblePlan, Plan
from meshd.plan.route import Route
from meshd.speculative.draft import DraftModel
from protocol import artifacts, gossip
from protocol.gossip import ModelHolding
from protocol.handshake import psk_from_secret
from protocol.messages import (
    CloseSession,
    Message,
    NodeHello,
    SessionKeepAlive,
    StageCommand,
)
from protocol.streams import ARTIFACT_STREAM, GOSSIP_STREAM, PIPELINE_STREAM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EVENT_LOG = 200
# Pacing of the daemon's own loops. These follow from how the parts work, not from a
# deployment, so they are not configuration:
# membership changes arriving within this window cause one re-plan, not many;
REPLAN_DEBOUNCE_S = 0.2
# single-token passes timed at start-up to measure compute per layer and token (the fastest
# counts: the least disturbed by other work on the machine);
WARMUP_PASSES = 6
# lane round trips are fed to membership this often.
RTT_REPORT_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One thing the operator may want to see (wall-clock time, so processes compare)."""

    at_unix_s: float
    kind: str
    node_id: str
    detail: str = ""


@dataclass(frozen=True)
class NodeBasis:
    """What a node is before it opens lanes: its identity, the mesh key, and the model it
    serves (files, device, formats, and the planner's view of it)."""

    identity: NodeIdentity
    psk: bytes
    model_dir: str
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    # What this node offers: (model id, quantization). It plans with, and serves stages of,
    # the nodes offering the same quantization (docs/planner.md, "Quantization").
    quantization: str
    shape: ModelShape
    context_tokens: int
    # The coordinator's draft model (`spec.draft_model`), at the node's quantization.
    draft: DraftModel | None = None
    # What the API calls the model, and the node's further models (`meshd/node/models.py`).
    name: str = ""
    extras: tuple[ModelFiles, ...] = ()
    # What compute is measured on, when not `checkpoint` (a `mesh:ID` node: random weights of
    # the model's shapes, before it fetched any).
    timing_checkpoint: Checkpoint | None = None

    @classmethod
    def load(cls, config: NodeConfig, model_dir: str) -> NodeBasis:
        """Read the identity, the mesh secret and the model's files (ConfigError, ModelError)."""
        from meshd.model.manifest import set_cache_dir

        set_cache_dir(config.model_cache_path())
        identity = NodeIdentity.load_or_create(config.state_dir)
        psk = psk_from_secret(config.read_mesh_secret())
        return cls.of(config, identity, psk, model_dir, open_checkpoint(model_dir))

    @classmethod
    def of(
        cls,
        config: NodeConfig,
        identity: NodeIdentity,
        psk: bytes,
        model_dir: str,
        checkpoint: Checkpoint,
        *,
        timing_checkpoint: Checkpoint | None = None,
    ) -> NodeBasis:
        """The basis over an opened checkpoint (its tokenizer files are in `model_dir`)."""
        device = pick_device(None if config.device == "auto" else config.device)
        dtype = _DTYPES.get(config.dtype, torch.float32)
        kv_dtype = _DTYPES.get(config.kv_dtype, dtype)
        quantization = (
            checkpoint.default_quantization
            if config.quantization == "auto"
            else config.quantization
        )
        if quantization == "gguf" and device.type != "cpu" and config.quantization == "auto":
            # The block kernels run on CPUs; elsewhere a GGUF file is converted at load.
            quantization = "int8"
        tokenizer, shape = tokenizer_and_shape(
            checkpoint, model_dir, dtype, quantization, kv_dtype, device
        )
        return cls(
            identity=identity,
            psk=psk,
            model_dir=model_dir,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            shape=shape,
            context_tokens=config.context_tokens or checkpoint.config.max_position_embeddings,
            draft=(
                DraftModel.load(config.spec.draft_model, quantization=quantization)
                if config.spec.draft_model
                else None
            ),
            timing_checkpoint=timing_checkpoint,
        )


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
    threads = configure_threads(
        config.threads, basis.checkpoint.config, basis.dtype, basis.quantization
    )
    log.info("compute: %d thread(s), quantization %s", threads, basis.quantization)
    measured_at = time.perf_counter()
    compute_ns = await trio.to_thread.run_sync(
        lambda: measure_compute_ns(
            basis.timing_checkpoint or basis.checkpoint,
            basis.device,
            basis.dtype,
            WARMUP_PASSES,
            quantization=basis.quantization,
            kv_dtype=basis.kv_dtype,
        )
    )
    log.info(
        "compute: %.2f ms per layer and token (measured in %.2f s)",
        compute_ns / 1e6,
        time.perf_counter() - measured_at,
    )
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
    `nursery`."""

    def __init__(
        self,
        config: NodeConfig,
        basis: NodeBasis,
        endpoint: Endpoint,
        nursery: trio.Nursery,
        *,
        compute_ns: int,
        now: float,
        started_unix_s: float,
        load_display: LoadDisplay | None = None,
    ) -> None:
        self.config = config
        self.basis = basis
        self.identity = basis.identity
        self.psk = basis.psk
        self.model_dir = basis.model_dir
        self.checkpoint = basis.checkpoint
        self.tokenizer = basis.tokenizer
        self.device = basis.device
        self.dtype = basis.dtype
        self.kv_dtype = basis.kv_dtype
        self.quantization = basis.quantization
        self.shape = basis.shape
        self.context_tokens = basis.context_tokens
        self.compute_ns = compute_ns
        self.endpoint = endpoint
        self._nursery = nursery
        self.started_unix_s = started_unix_s
        self.keys = KeyBook()
        self.events: collections.deque[NodeEvent] = collections.deque(maxlen=_EVENT_LOG)
        self.plan: Plan | None = None
        self.plan_error = "not planned yet"
        self.health = Health(config.suspect_hold_s)
        # Told the node id of a member whose lane died (its peer stopped answering), as it
        # happens: the daemon's metrics count lane deaths by peer.
        self.on_lane_death: Callable[[bytes], None] | None = None
        self.duty = Duty(config.drain_timeout_s)
        self._drain_scope: trio.CancelScope | None = None
        self._replan = trio.Event()
        self._plan_changed = trio.Event()
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
        # Serves this node's files to fetching peers; fetches a `mesh:ID` node's stage.
        self.artifacts = ArtifactService(
            self.checkpoint,
            self.peers,
            lambda: model_sources(
                self.membership.view(), self.shape.model_id, self.node_key, self.keys.x_of
            ),
            config=config.fetch,
            load_display=load_display,
            note=lambda kind, detail: self.note(kind, self.node_key, detail),
            gate=self.bulk_gate,
            name=basis.name,
            on_fetch_end=self._on_fetch_end,
        )
        self.takeover = TakeoverCache()
        self.coordinator = Coordinator(
            _RouteSender(self),
            self.identity.x25519_public,
            wire_dtype="f32",
            session_lease_s=config.session_lease_s,
            draft=basis.draft,
            draft_quantization=self.quantization,
        )
        self.slot = StageSlot(
            self.checkpoint,
            self.peers,
            device=self.device,
            dtype=self.dtype,
            eos_ids=frozenset(self.tokenizer.eos_ids),
            load_display=load_display,
            host_config=config.stage,
            session_lease_s=config.session_lease_s,
            quantization=self.quantization,
            kv_dtype=self.kv_dtype,
            gate=self.bulk_gate,
        )
        self.models = ModelSet(
            basis.extras,
            self.peers,
            _RouteSender(self),
            self.identity.x25519_public,
            config,
            device=self.device,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            quantization=self.quantization,
            note=lambda kind, detail: self.note(kind, self.node_key, detail),
            publish=self.publish_capacity,
            gate=self.bulk_gate,
        )
        self.wiring = NodeWiring(
            coordinator=self.coordinator,
            stage=self.slot,
            handlers={NodeHello: self._on_hello, StageCommand: self._on_command},
        )
        self.membership = Membership(
            self.node_key,
            address=self.lane_address,
            sign=self.identity.sign,
            verify=NodeIdentity.verify,
            now=now,
            capacity=self.capacity(),
            config=config.membership,
            seed=int.from_bytes(self.node_key[:8], "big"),
            # A restart outranks its previous life's words at once.
            incarnation=int(time.time()),
            record_version=int(time.time()),
        )
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
            psk=self.psk,
            mdns=config.mdns,
        )

    async def start(self) -> None:
        """Start every part's tasks; returns once lanes, the stage slot and gossip run."""
        nursery = self._nursery
        await nursery.start(self.peers.run)
        await nursery.start(self.bulk_gate.run)
        await nursery.start(self.artifacts.run)
        await nursery.start(self.slot.run)
        await self.models.start(nursery)
        await nursery.start(self.gossip.run)
        nursery.start_soon(self.coordinator.keep_alive)
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
        return self.duty.disabled

    @property
    def draining(self) -> bool:
        """A drain or a stop is in progress."""
        return self.duty.draining

    @property
    def stopping(self) -> bool:
        """SIGTERM: no new requests or sessions; see `meshd/node/shutdown.py`."""
        return self.duty.stopping

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
        """What this node offers now (the signed record's contents)."""
        budget = self.config.memory_budget_bytes or device_memory_bytes(self.device)
        models: tuple[ModelHolding, ...] = ()
        if self.duty.offers_model:
            layers = self.slot.layers
            lo, hi = layers if layers is not None else (0, self.shape.num_layers)
            holding = ModelHolding(
                self.shape.model_id,
                lo,
                hi,
                layers is not None,
                self.compute_ns,
                quantization=self.quantization,
                weight_bytes=self.slot.weight_bytes if layers is not None else 0,
                kv_bytes_per_token=self.slot.kv_bytes_per_token if layers is not None else 0,
                name=self.basis.name,
            )
            models = (holding,)
        models = self._share_budget(budget, (*models, *self.models.holdings()))
        sessions = self.slot.sessions + self.models.sessions
        return LocalCapacity(memory_budget_bytes=budget, models=models, sessions=sessions)

    def _share_budget(
        self, budget: int, holdings: tuple[ModelHolding, ...]
    ) -> tuple[ModelHolding, ...]:
        """With several models, each offered holds its share of the budget (`split_budget`)."""
        if len(holdings) < 2:
            return holdings
        needs = {self.shape.model_id: full_model_bytes(self.shape, self.context_tokens)}
        for held in self.models:
            needs[held.model_id] = full_model_bytes(held.files.shape, held.files.context_tokens)
        shares = split_budget(budget, [needs[h.model_id] for h in holdings])
        return tuple(
            msgspec.structs.replace(h, memory_budget_bytes=share)
            for h, share in zip(holdings, shares, strict=True)
        )

    def publish_capacity(self, *, urgent: bool = False) -> None:
        """Re-sign our record if what we offer changed (membership rate-limits it, unless
        `urgent`: we stop offering our stage, and the spare should take it at once)."""
        self.membership.set_capacity(self.capacity(), trio.current_time(), urgent=urgent)
        self.gossip.poke()
        self.request_replan()

    # ---- lanes and messages ---------------------------------------------------------------
    def _dispatch(self, message: Message, lane_key: bytes) -> None:
        rest = self.models.dispatch(message, lane_key)  # the further models' part
        if rest is not None:
            self.wiring.dispatch(rest, lane_key)

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
            # Before the coordinator hears: its retry routes around the dead node.
            if self.health.on_lane_lost(node_id, reason, trio.current_time()):
                self.request_replan()
                if self.on_lane_death is not None:
                    self.on_lane_death(node_id)
        self.wiring.lane_lost(lane_key)
        self.models.lane_lost(lane_key)
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
            self.slot.free_coordinator(self.keys.x_of(node_id))
            self.models.free_coordinator(self.keys.x_of(node_id))
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

    def _plan_now(self, exclude: Iterable[bytes] = ()) -> Plan:
        return plan_view(
            self.membership.view(),
            self.shape,
            self.membership.rtt_matrix(),
            context_tokens=self.context_tokens,
            exclude=frozenset(exclude),
            config=self.config.planner,
        )

    async def _replan_once(self) -> None:
        try:
            new = self._plan_now()
            error = ""
        except NoFeasiblePlan as exc:
            new, error = None, str(exc)
        old_route = self.plan.route if self.plan is not None else None
        self.plan, self.plan_error = new, error
        if (new.route if new is not None else None) != old_route:
            self.note("plan", self.node_key, _describe(new) if new is not None else error)
        await self._carry_out(
            self.duty.on_plan(
                assigned=assignment(new, self.node_key) if new is not None else None,
                planned=new is not None,
                layers=self.slot.layers,
                now=trio.current_time(),
            )
        )
        await self._steer_fetch(new)
        view, rtt = self.membership.view(), self.membership.rtt_matrix()
        await self.models.replan(view, rtt, self.node_key, trio.current_time())
        self._plan_changed.set()
        self._plan_changed = trio.Event()

    async def _steer_fetch(self, new: Plan | None) -> None:
        """A `mesh:ID` node's background fetch after a re-plan: a stage still to load keeps
        its fetch (`ArtifactService.stage_ready` started it); a spare prefetches the layers it
        would take over (`prefetch` key, `meshd/node/prefetch.py`); otherwise none. With no
        plan at all, whatever runs goes on (like the stage, kept for a later plan)."""
        if new is None or not self.artifacts.fetches:
            return
        assigned = assignment(new, self.node_key)
        if not self.duty.offers_model:
            self.artifacts.stop_fetching()
        elif assigned is not None:
            if assigned == self.slot.layers:
                self.artifacts.stop_fetching()
        elif self.config.prefetch and self.slot.layers is None:
            view, rtt = self.membership.view(), self.membership.rtt_matrix()  # fresh copies
            # One plan per stage: in a thread, so a large mesh's planning never stalls lanes.
            ranges = await trio.to_thread.run_sync(
                lambda: self.takeover.ranges(
                    view,
                    self.shape,
                    rtt,
                    new,
                    self.node_key,
                    context_tokens=self.context_tokens,
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

    def route(self) -> Route:
        """The route this node coordinates its requests over now (NoFeasiblePlan if none)."""
        return lane_route(self._plan_now(exclude=self.health.suspects(trio.current_time())))

    async def wait_plan_change(self, timeout_s: float) -> None:
        """Return after the next re-plan, or after `timeout_s`."""
        with trio.move_on_after(timeout_s):
            await self._plan_changed.wait()

    # ---- operator commands and the stage's duty ----------------------------------------
    async def apply_command(self, action: str, drain: bool) -> None:
        """kill: stop hosting (after the sessions end with `drain`); recover: host again."""
        now = trio.current_time()
        if action == "kill":
            effects = self.duty.kill(
                drain=drain, layers=self.slot.layers, sessions=self.slot.sessions, now=now
            )
        else:
            effects = self.duty.recover(now)
        if any(isinstance(e, Ignored) for e in effects):
            log.info("ignoring %s: this node is stopping", action)
        await self._carry_out(effects)
        await self.models.apply_command(action, drain, now)

    def begin_stop(self) -> None:
        """SIGTERM: admit nothing new and stop offering the model, so every plan (and every
        new request, anywhere) moves to a spare at once, while the stage keeps serving the
        sessions it has; `finish_stop` ends it."""
        effects = self.duty.begin_stop(sessions=self.slot.sessions, now=trio.current_time())
        for effect in effects:  # nothing here waits: no stage stops or loads
            assert not isinstance(effect, StopStage | LoadStage)
            self._carry_out_now(effect)
        self.models.begin_stop(trio.current_time())

    async def finish_stop(self) -> None:
        """Stop the stage: sessions still open get `stage_stopped`, and their coordinators
        continue on the spare (loaded since `begin_stop`)."""
        await self._carry_out(
            self.duty.finish_stop(sessions=self.slot.sessions, now=trio.current_time())
        )
        await self.models.finish_stop(trio.current_time())

    async def _carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StopStage):
                self.slot.refuse_new_sessions = self.duty.refuses_new_sessions
                await self.slot.stop(effect.reason)
            elif isinstance(effect, LoadStage):
                # A `mesh:ID` node fetches its stage's tensors first, in the background: the
                # fetch's end re-plans, and the stage loads then (`_on_fetch_end`).
                if await self.artifacts.stage_ready(effect.layers):
                    await self.slot.load(effect.layers)
                else:  # nothing changed yet: no note, nothing to publish
                    return
            else:
                self._carry_out_now(effect)

    def _carry_out_now(self, effect: Effect) -> None:
        self.slot.refuse_new_sessions = self.duty.refuses_new_sessions
        if isinstance(effect, Note):
            self.note(effect.kind, self.node_key, effect.detail)
        elif isinstance(effect, Publish):
            self.publish_capacity(urgent=effect.urgent)
        elif isinstance(effect, StartDrain):
            # Made here, not in the task: a CancelDrain before the task runs still reaches it.
            self._drain_scope = trio.CancelScope()
            self._nursery.start_soon(self._drain, effect.deadline, self._drain_scope)
        elif isinstance(effect, CancelDrain) and self._drain_scope is not None:
            self._drain_scope.cancel()
            self._drain_scope = None

    async def _drain(self, deadline: float, scope: trio.CancelScope) -> None:
        """Wait for the draining stage's sessions to end (or the deadline), then tell `duty`."""
        with scope:
            with trio.move_on_at(deadline) as waited:
                await self.slot.drain()
            if self._drain_scope is scope:
                self._drain_scope = None
            now = trio.current_time()
            timed_out = waited.cancelled_caught
            effects = self.duty.on_timer(now) if timed_out else self.duty.on_drained(now)
        if not scope.cancelled_caught:
            await self._carry_out(effects)

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


def _describe(p: Plan) -> str:
    return (
        ", ".join(f"{s.node_key.hex()[:8]}[{s.layer_start},{s.layer_end})" for s in p.stages)
        + f" {p.quantization} ~{p.predicted_s_per_token * 1000:.2f} ms/token"
    )
