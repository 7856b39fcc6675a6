"""`HeldModel`: one model a node holds, and what serves it: its stage slot, its coordinator,
its duty and its plan. A node holds a list of them (`MeshNode.models`, the first named by
`--model` first); each is planned, commanded, stopped and drained the same way.

Each model is planned on its own over the members offering it (`plan_view` filters by model
id). A node's memory budget is shared by the models it holds: it offers each a share in its
signed record (`ModelHolding.memory_budget_bytes`, `split_budget`), so every node plans every
model from the view alone and the plans come out the same everywhere. Pipeline messages reach
a model's stage by the `OpenSession`'s model id and then by session id (`dispatch`); replies
go to every coordinator (each drops the sessions that are not its own).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import trio

from meshd.config import NodeConfig
from meshd.coord.coordinator import Coordinator, Sender
from meshd.mesh.member import LocalCapacity, MemberInfo
from meshd.net.bulk import BulkGate
from meshd.net.lane_table import LaneTable
from meshd.node.basis import NodeBasis
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
from meshd.node.models import ModelFiles, full_model_bytes, split_budget
from meshd.node.planning import assignment, lane_route, plan_view
from meshd.node.stage_slot import LoadDisplay, StageSlot
from meshd.plan import NoFeasiblePlan, Plan
from meshd.plan.route import Route
from protocol.gossip import ModelHolding
from protocol.messages import (
    CloseSession,
    DropEntries,
    Message,
    OpenSession,
    Rollback,
    SessionKeepAlive,
    StageError,
    StageHidden,
    VerifyReply,
    VerifyWindow,
)

log = logging.getLogger(__name__)

# Session ids the stage side remembers per model; past this, ids of sessions the stage no
# longer holds are forgotten (the stages free sessions on their own: leases, lost coordinators).
_SESSION_MAP_PRUNE_AT = 4096

StageReady = Callable[[tuple[int, int]], Awaitable[bool]]


@dataclass(frozen=True)
class NodeShared:
    """What every model of a node shares: the node's basis (identity, formats, draft), the
    lanes, its nursery, and the node's hooks."""

    config: NodeConfig
    basis: NodeBasis
    peers: LaneTable
    sender: Sender  # the coordinators' (`meshd.node.node._RouteSender`)
    nursery: trio.Nursery
    # note(kind, detail): an event about this node; publish(urgent): re-sign its record.
    note: Callable[[str, str], None]
    publish: Callable[[bool], None]
    gate: BulkGate
    load_display: LoadDisplay | None = None


async def _on_disk(_layers: tuple[int, int]) -> bool:
    return True


class HeldModel:
    """One model this node holds: plans it, hosts its stage and coordinates its requests.

    `stage_ready(layers)` says whether the stage's tensors are here (a `mesh:ID` model fetches
    them first: `ArtifactService.stage_ready`); `label` prefixes its events (the model's name
    where the node holds several)."""

    def __init__(
        self,
        files: ModelFiles,
        shared: NodeShared,
        *,
        compute_ns: int,
        label: str = "",
        stage_ready: StageReady = _on_disk,
    ) -> None:
        config, basis = shared.config, shared.basis
        self.files = files
        self.shared = shared
        self.compute_ns = compute_ns
        self.label = label
        self.stage_ready = stage_ready
        self.slot = StageSlot(
            files.checkpoint,
            shared.peers,
            device=basis.device,
            dtype=basis.dtype,
            eos_ids=frozenset(files.tokenizer.eos_ids),
            load_display=shared.load_display,
            host_config=config.stage,
            session_lease_s=config.session_lease_s,
            quantization=basis.quantization,
            kv_dtype=basis.kv_dtype,
            gate=shared.gate,
        )
        self.coordinator = Coordinator(
            shared.sender,
            basis.identity.x25519_public,
            wire_dtype="f32",
            session_lease_s=config.session_lease_s,
            draft=basis.draft if files.draft_fits else None,
            draft_quantization=basis.quantization,
            target_config=files.checkpoint.config,
            prefix_max_entries=config.stage.prefix_cache_entries,
        )
        self.coordinator.drafts_allowed = files.draft_fits
        self.duty = Duty(config.drain_timeout_s)
        self.plan: Plan | None = None
        self.plan_error = "not planned yet"
        # The layers the stage is loading now (None: no load in flight); the record says so.
        self.loading: tuple[int, int] | None = None
        self.drain_scope: trio.CancelScope | None = None
        # Stage side: which of this model's sessions are open here (by session id).
        self.session_ids: set[str] = set()

    @property
    def model_id(self) -> str:
        return self.files.shape.model_id

    async def start(self) -> None:
        """Run the stage slot and the coordinator's keep-alives in the node's nursery."""
        await self.shared.nursery.start(self.slot.run)
        self.shared.nursery.start_soon(self.coordinator.keep_alive)

    def holding(self) -> ModelHolding | None:
        """What this node offers of the model (None: nothing; the node sets its share of the
        budget)."""
        if not self.duty.offers_model:
            return None
        layers = self.slot.layers
        loading = self.loading if layers is None else None
        lo, hi = layers or loading or (0, self.files.shape.num_layers)
        return ModelHolding(
            self.model_id,
            lo,
            hi,
            layers is not None,
            self.compute_ns,
            quantization=self.shared.basis.quantization,
            weight_bytes=self.slot.weight_bytes if layers is not None else 0,
            kv_bytes_per_token=self.slot.kv_bytes_per_token if layers is not None else 0,
            name=self.files.name,
            loading=loading is not None,
        )

    def note(self, kind: str, detail: str = "") -> None:
        self.shared.note(kind, f"{self.label}: {detail}".rstrip(": ") if self.label else detail)

    # ---- planning ----------------------------------------------------------------------
    def plan_now(
        self,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        exclude: Iterable[bytes] = (),
    ) -> Plan:
        """The mesh's plan for the model as `view` shows it (NoFeasiblePlan if none fits)."""
        return plan_view(
            view,
            self.files.shape,
            rtt_s,
            context_tokens=self.files.context_tokens,
            exclude=frozenset(exclude),
            config=self.shared.config.planner,
        )

    def route(
        self,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        suspects: Iterable[bytes],
    ) -> Route:
        """The route this node coordinates the model's requests over now (NoFeasiblePlan)."""
        return lane_route(self.plan_now(view, rtt_s, suspects))

    async def replan(
        self,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        node_id: bytes,
        now: float,
    ) -> None:
        """Plan the model again and load or stop its stage to match."""
        try:
            new: Plan | None = self.plan_now(view, rtt_s)
            error = ""
        except NoFeasiblePlan as exc:
            new, error = None, str(exc)
        old_route = self.plan.route if self.plan is not None else None
        self.plan, self.plan_error = new, error
        if (new.route if new is not None else None) != old_route:
            self.note("plan", describe(new) if new is not None else error)
        effects = self.duty.on_plan(
            assigned=assignment(new, node_id) if new is not None else None,
            planned=new is not None,
            layers=self.slot.layers,
            now=now,
        )
        await self._carry_out(effects)

    # ---- operator commands and the stage's duty ----------------------------------------
    async def apply_command(self, action: str, drain: bool, now: float) -> None:
        """kill: stop hosting (after the sessions end with `drain`); recover: host again."""
        if action == "kill":
            effects = self.duty.kill(
                drain=drain, layers=self.slot.layers, sessions=self.slot.sessions, now=now
            )
        else:
            effects = self.duty.recover(now)
        if any(isinstance(e, Ignored) for e in effects):
            log.info("ignoring %s: this node is stopping", action)
        await self._carry_out(effects)

    def begin_stop(self, now: float) -> None:
        """SIGTERM: admit nothing new and stop offering the model (its sessions go on until
        `finish_stop`)."""
        for effect in self.duty.begin_stop(sessions=self.slot.sessions, now=now):
            assert not isinstance(effect, StopStage | LoadStage)  # nothing here waits
            self._carry_out_now(effect)

    async def finish_stop(self, now: float) -> None:
        """Stop the stage: sessions still open get `stage_stopped`."""
        await self._carry_out(self.duty.finish_stop(sessions=self.slot.sessions, now=now))

    async def _carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StopStage):
                self.slot.refuse_new_sessions = self.duty.refuses_new_sessions
                await self.slot.stop(effect.reason)
                self.session_ids.clear()
            elif isinstance(effect, LoadStage):
                # Tensors still to fetch: the fetch's end re-plans, and the stage loads then.
                if not await self.stage_ready(effect.layers):
                    return  # nothing changed yet: no note, nothing to publish
                await self._load(effect.layers)
            else:
                self._carry_out_now(effect)

    async def _load(self, layers: tuple[int, int]) -> None:
        """Load the stage, the record saying so meanwhile (urgent: plans that nodes make while
        it loads keep the range here, rather than each loading it again elsewhere)."""
        self.loading = layers
        self.shared.publish(True)
        try:
            await self.slot.load(layers)
        finally:
            self.loading = None
        self.session_ids.clear()

    def _carry_out_now(self, effect: Effect) -> None:
        self.slot.refuse_new_sessions = self.duty.refuses_new_sessions
        if isinstance(effect, Note):
            self.note(effect.kind, effect.detail)
        elif isinstance(effect, Publish):
            self.shared.publish(effect.urgent)
        elif isinstance(effect, StartDrain):
            # Made here, not in the task: a CancelDrain before the task runs still reaches it.
            self.drain_scope = trio.CancelScope()
            self.shared.nursery.start_soon(self._drain, effect.deadline, self.drain_scope)
        elif isinstance(effect, CancelDrain) and self.drain_scope is not None:
            self.drain_scope.cancel()
            self.drain_scope = None

    async def _drain(self, deadline: float, scope: trio.CancelScope) -> None:
        """Wait for the draining stage's sessions to end (or the deadline), then tell `duty`."""
        with scope:
            with trio.move_on_at(deadline) as waited:
                await self.slot.drain()
            if self.drain_scope is scope:
                self.drain_scope = None
            now = trio.current_time()
            timed_out = waited.cancelled_caught
            effects = self.duty.on_timer(now) if timed_out else self.duty.on_drained(now)
        if not scope.cancelled_caught:
            await self._carry_out(effects)

    # ---- messages ----------------------------------------------------------------------
    def remember(self, session: str) -> None:
        if len(self.session_ids) >= _SESSION_MAP_PRUNE_AT:
            self.session_ids = {s for s in self.session_ids if self.slot.holds_session(s)}
        self.session_ids.add(session)


def hold_models(shared: NodeShared, compute_ns: Sequence[int]) -> list[HeldModel]:
    """The node's models, the first first; each labels its events with its name where several."""
    files = shared.basis.models
    return [
        HeldModel(f, shared, compute_ns=ns, label=f.name if len(files) > 1 else "")
        for f, ns in zip(files, compute_ns, strict=True)
    ]


def capacity_of(models: Sequence[HeldModel], budget: int) -> LocalCapacity:
    """What a node holding `models` offers (its signed record's contents): each model offered,
    with its share of the memory `budget` (`split_budget`)."""
    offered = [(m, h) for m in models if (h := m.holding()) is not None]
    needs = [full_model_bytes(m.files.shape, m.files.context_tokens) for m, _ in offered]
    shares = split_budget(budget, needs)
    holdings = tuple(
        msgspec.structs.replace(h, memory_budget_bytes=share) if len(offered) > 1 else h
        for (_, h), share in zip(offered, shares, strict=True)
    )
    sessions = sum(model.slot.sessions for model in models)
    return LocalCapacity(memory_budget_bytes=budget, models=holdings, sessions=sessions)


def dispatch(models: Sequence[HeldModel], message: Message, sender: bytes) -> None:
    """Deliver a pipeline message from `sender` (a lane key) to the models: replies to every
    coordinator; an open by its model id, the rest by session id. What no model claims goes to
    the first model's stage, which answers it (a model or a session it does not hold). Entries to
    drop go to every model's stage: each drops those it holds for `sender` (ids are random)."""
    if isinstance(message, VerifyReply | StageError):
        for model in models:
            model.coordinator.handle(message, sender)
        return
    if isinstance(message, DropEntries):
        for model in models:
            model.slot.handle(message, sender)
        return
    if isinstance(message, OpenSession):
        found = next((m for m in models if m.model_id == message.model_id), models[0])
        found.remember(message.session)
        found.slot.handle(message, sender)
        return
    if isinstance(message, SessionKeepAlive):
        claims = [[s for s in message.sessions if s in m.session_ids] for m in models]
        claimed = {s for mine in claims for s in mine}
        claims[0] += [s for s in message.sessions if s not in claimed]
        for model, mine in zip(models, claims, strict=True):
            if mine:
                model.slot.handle(SessionKeepAlive(mine), sender)
        return
    session = _session_of(message)
    found = next((m for m in models if session in m.session_ids), models[0])
    if isinstance(message, CloseSession) and session is not None:
        found.session_ids.discard(session)
    found.slot.handle(message, sender)


def _session_of(message: Message) -> str | None:
    if isinstance(message, CloseSession | Rollback | VerifyWindow):
        return message.session
    if isinstance(message, StageHidden):
        return message.window.session
    return None


def describe(p: Plan) -> str:
    """A plan in one line, for the event log."""
    return (
        ", ".join(f"{s.node_key.hex()[:8]}[{s.layer_start},{s.layer_end})" for s in p.stages)
        + f" {p.quantization} ~{p.predicted_s_per_token * 1000:.2f} ms/token"
    )
