"""Several models on one node: every model after the first, with its own stage, coordinator,
duty and plan, over the node's one set of lanes and one membership.

The node's first model (`NodeBasis`) is held as before; `ModelSet` holds the others. Each model
is planned on its own over the members offering it (`plan_view` filters by model id). A node's
memory budget is shared by the models it holds: it offers each a share in its signed record
(`ModelHolding.memory_budget_bytes`, `split_budget`), so every node plans every model from the
view alone and the plans come out the same everywhere. Pipeline messages reach a model's stage
by the `OpenSession`'s model id and then by session id; replies go to every coordinator (each
drops the sessions that are not its own).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio

from meshd.config import ConfigError, NodeConfig
from meshd.coord.coordinator import Coordinator, Sender
from meshd.mesh.member import MemberInfo
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import ModelError
from meshd.model.files import model_name, open_checkpoint, open_tokenizer
from meshd.model.tokenizer import Tokenizer
from meshd.net.bulk import BulkGate
from meshd.net.lane_table import LaneTable
from meshd.node.duty import (
    CancelDrain,
    Duty,
    Effect,
    LoadStage,
    Note,
    Publish,
    StartDrain,
    StopStage,
)
from meshd.node.planning import assignment, lane_route, model_shape, plan_view
from meshd.node.stage_slot import StageSlot, measure_compute_ns
from meshd.plan import ModelShape, NoFeasiblePlan, Plan, PlannerConfig
from meshd.plan.route import Route
from meshd.speculative.draft import DraftMismatchError, check_draft_tokenizer
from protocol.gossip import ModelHolding
from protocol.messages import (
    CloseSession,
    Message,
    OpenSession,
    Rollback,
    SessionKeepAlive,
    StageError,
    StageHidden,
    VerifyReply,
    VerifyWindow,
)

if TYPE_CHECKING:
    from meshd.node.node import NodeBasis

log = logging.getLogger(__name__)

# The name the API gives the built-in model.
BUILTIN_MODEL_NAME = "meshd-builtin"
# Session ids the stage side remembers per model; past this, ids of sessions the stages no
# longer hold are forgotten (the stages free sessions on their own: leases, lost coordinators).
_SESSION_MAP_PRUNE_AT = 4096
# Single-token passes timed per model at start-up (as `meshd.node.node.WARMUP_PASSES`).
_WARMUP_PASSES = 6


def display_name(model: str) -> str:
    """What the API calls a model given by path: the directory's name, a GGUF file's stem,
    `meshd-builtin` for "" (the built-in model)."""
    return model_name(model) if model else BUILTIN_MODEL_NAME


@dataclass(frozen=True)
class ModelFiles:
    """One more model a node holds: its files, the planner's view of it, its name."""

    name: str
    model_dir: str
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    shape: ModelShape
    context_tokens: int

    @classmethod
    def load(
        cls,
        config: NodeConfig,
        model: str,
        model_dir: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        quantization: str,
    ) -> ModelFiles:
        """Open the checkpoint and tokenizer (ModelError); the node's formats apply."""
        checkpoint = open_checkpoint(model_dir)
        tokenizer, shape = tokenizer_and_shape(
            checkpoint, model_dir, dtype, quantization, kv_dtype, device
        )
        return cls(
            name=display_name(model),
            model_dir=model_dir,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            shape=shape,
            context_tokens=config.context_tokens or checkpoint.config.max_position_embeddings,
        )


def tokenizer_and_shape(
    checkpoint: Checkpoint,
    model_dir: str,
    dtype: torch.dtype,
    quantization: str,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tokenizer, ModelShape]:
    """(blocking) The model's tokenizer and `model_shape`, side by side: the shape's model id
    hashes every tensor on a first start, which hashlib does without the GIL, so it runs in a
    thread while this one builds the tokenizer (seconds each for a 150k-token vocabulary and a
    1 GB file; docs/benchmarks.md, "Start-up")."""
    with ThreadPoolExecutor(1, thread_name_prefix="model-id") as pool:
        shape = pool.submit(model_shape, checkpoint, dtype, quantization, kv_dtype, device)
        tokenizer = open_tokenizer(model_dir)
        return tokenizer, shape.result()


def full_model_bytes(shape: ModelShape, context_tokens: int) -> int:
    """Bytes the whole model takes on one node: weights and KV for `context_tokens`."""
    weights = shape.embedding_bytes + shape.head_bytes - shape.shared_bytes
    layers = shape.num_layers * shape.layer_bytes(context_tokens)
    return weights + layers + shape.head_kv_bytes_per_token * context_tokens


def split_budget(budget: int, needs: Sequence[int]) -> list[int]:
    """A node's memory budget shared among the models it holds, in proportion to what each
    whole model needs (so each can hold the same fraction of its layers). One model: all."""
    if len(needs) <= 1:
        return [budget] * len(needs)
    total = sum(max(1, n) for n in needs)
    return [max(1, budget * max(1, n) // total) for n in needs]


@dataclass
class HeldModel:
    """One more model this node holds, and what serves it."""

    files: ModelFiles
    slot: StageSlot
    coordinator: Coordinator
    duty: Duty
    compute_ns: int = 0
    plan: Plan | None = None
    plan_error: str = "not planned yet"
    drain_scope: trio.CancelScope | None = None
    # Stage side: which of this model's sessions are open here (by session id).
    sessions: set[str] = field(default_factory=set)

    @property
    def model_id(self) -> str:
        return self.files.shape.model_id


class ModelSet:
    """The node's models after the first; the node calls its hooks (see `MeshNode`)."""

    def __init__(
        self,
        files: Iterable[ModelFiles],
        peers: LaneTable,
        sender: Sender,
        own_key: bytes,
        config: NodeConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        quantization: str,
        note: Callable[[str, str], None],
        publish: Callable[[], None],
        gate: BulkGate | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.quantization = quantization
        self._note = note
        self._publish = publish
        self._nursery: trio.Nursery | None = None
        self.models: dict[str, HeldModel] = {}
        for f in files:
            slot = StageSlot(
                f.checkpoint,
                peers,
                device=device,
                dtype=dtype,
                eos_ids=frozenset(f.tokenizer.eos_ids),
                host_config=config.stage,
                session_lease_s=config.session_lease_s,
                quantization=quantization,
                kv_dtype=kv_dtype,
                gate=gate,
            )
            coordinator = Coordinator(
                sender,
                own_key,
                wire_dtype="f32",
                session_lease_s=config.session_lease_s,
                draft_quantization=quantization,
            )
            coordinator.drafts_allowed = _draft_fits(config.spec.draft_model, f.model_dir)
            self.models[f.shape.model_id] = HeldModel(
                f, slot, coordinator, Duty(config.drain_timeout_s)
            )

    def __iter__(self) -> Iterator[HeldModel]:
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)

    async def start(self, nursery: trio.Nursery) -> None:
        """Measure each model's compute, then run its stage slot and keep-alives."""
        self._nursery = nursery
        for held in self:
            files = held.files
            held.compute_ns = await trio.to_thread.run_sync(
                lambda f=files: measure_compute_ns(  # type: ignore[misc]
                    f.checkpoint,
                    self.device,
                    self.dtype,
                    _WARMUP_PASSES,
                    quantization=self.quantization,
                    kv_dtype=self.kv_dtype,
                )
            )
            await nursery.start(held.slot.run)
            nursery.start_soon(held.coordinator.keep_alive)
        if self.models:
            self._publish()  # the record now carries each model's measured compute

    # ---- what the node offers ----------------------------------------------------------
    def holdings(self) -> list[ModelHolding]:
        """What this node offers of each model (its share of the budget is set by the node)."""
        out = []
        for held in self:
            if not held.duty.offers_model:
                continue
            layers = held.slot.layers
            lo, hi = layers if layers is not None else (0, held.files.shape.num_layers)
            out.append(
                ModelHolding(
                    held.model_id,
                    lo,
                    hi,
                    layers is not None,
                    held.compute_ns,
                    quantization=self.quantization,
                    weight_bytes=held.slot.weight_bytes if layers is not None else 0,
                    kv_bytes_per_token=held.slot.kv_bytes_per_token if layers is not None else 0,
                    name=held.files.name,
                )
            )
        return out

    @property
    def sessions(self) -> int:
        """Sessions open on these models' stages."""
        return sum(held.slot.sessions for held in self)

    # ---- messages ----------------------------------------------------------------------
    def dispatch(self, message: Message, sender: bytes) -> Message | None:
        """Deliver what of a pipeline message is meant for these models; returns what is left
        for the node's first model (None: nothing). Replies go to every coordinator, and on."""
        if not self.models:
            return message
        if isinstance(message, VerifyReply | StageError):
            for held in self:
                held.coordinator.handle(message, sender)
            return message
        if isinstance(message, OpenSession):
            found = self.models.get(message.model_id)
            if found is None:
                return message
            self._remember(found, message.session)
            found.slot.handle(message, sender)
            return None
        if isinstance(message, SessionKeepAlive):
            rest = list(message.sessions)
            for held in self:
                mine = [s for s in rest if s in held.sessions]
                if mine:
                    rest = [s for s in rest if s not in held.sessions]
                    held.slot.handle(SessionKeepAlive(mine), sender)
            if len(rest) == len(message.sessions):
                return message
            return SessionKeepAlive(rest) if rest else None
        session = _session_of(message)
        for held in self:
            if session is not None and session in held.sessions:
                if isinstance(message, CloseSession):
                    held.sessions.discard(session)
                held.slot.handle(message, sender)
                return None
        return message

    def _remember(self, held: HeldModel, session: str) -> None:
        if len(held.sessions) >= _SESSION_MAP_PRUNE_AT:
            held.sessions = {s for s in held.sessions if held.slot.holds_session(s)}
        held.sessions.add(session)

    def lane_lost(self, key: bytes) -> None:
        """The lane to `key` died: fail what waits on it, free what it left here."""
        for held in self:
            held.coordinator.peer_lost(key)
            held.slot.free_coordinator(key)

    def free_coordinator(self, key: bytes) -> None:
        """The coordinator at `key` (a lane key) is gone: free its sessions here."""
        for held in self:
            held.slot.free_coordinator(key)

    # ---- planning ----------------------------------------------------------------------
    def plan_now(
        self,
        held: HeldModel,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        exclude: Iterable[bytes] = (),
        planner: PlannerConfig | None = None,
    ) -> Plan:
        """The mesh's plan for `held` as `view` shows it (NoFeasiblePlan if none fits)."""
        return plan_view(
            view,
            held.files.shape,
            rtt_s,
            context_tokens=held.files.context_tokens,
            exclude=frozenset(exclude),
            config=planner or self.config.planner,
        )

    def route(
        self,
        held: HeldModel,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        suspects: Iterable[bytes],
    ) -> Route:
        """The route this node coordinates `held`'s requests over now (NoFeasiblePlan)."""
        return lane_route(self.plan_now(held, view, rtt_s, suspects))

    async def replan(
        self,
        view: Mapping[bytes, MemberInfo],
        rtt_s: Mapping[tuple[bytes, bytes], float],
        node_id: bytes,
        now: float,
    ) -> None:
        """Plan every model again and load or stop each stage to match."""
        for held in self:
            try:
                new: Plan | None = self.plan_now(held, view, rtt_s)
                error = ""
            except NoFeasiblePlan as exc:
                new, error = None, str(exc)
            old_route = held.plan.route if held.plan is not None else None
            held.plan, held.plan_error = new, error
            if (new.route if new is not None else None) != old_route:
                self._note("plan", f"{held.files.name}: {_describe(new) if new else error}")
            effects = held.duty.on_plan(
                assigned=assignment(new, node_id) if new is not None else None,
                planned=new is not None,
                layers=held.slot.layers,
                now=now,
            )
            await self._carry_out(held, effects)

    # ---- operator commands -------------------------------------------------------------
    async def apply_command(self, action: str, drain: bool, now: float) -> None:
        """kill / recover every model's stage, as the node's first model's."""
        for held in self:
            if action == "kill":
                effects = held.duty.kill(
                    drain=drain, layers=held.slot.layers, sessions=held.slot.sessions, now=now
                )
            else:
                effects = held.duty.recover(now)
            await self._carry_out(held, effects)

    def begin_stop(self, now: float) -> None:
        """SIGTERM: stop offering every model (their sessions go on until `finish_stop`)."""
        for held in self:
            for effect in held.duty.begin_stop(sessions=held.slot.sessions, now=now):
                self._carry_out_now(held, effect)

    async def finish_stop(self, now: float) -> None:
        """Stop every model's stage."""
        for held in self:
            effects = held.duty.finish_stop(sessions=held.slot.sessions, now=now)
            await self._carry_out(held, effects)

    async def _carry_out(self, held: HeldModel, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, StopStage):
                held.slot.refuse_new_sessions = held.duty.refuses_new_sessions
                await held.slot.stop(effect.reason)
                held.sessions.clear()
            elif isinstance(effect, LoadStage):
                await held.slot.load(effect.layers)
                held.sessions.clear()
            else:
                self._carry_out_now(held, effect)

    def _carry_out_now(self, held: HeldModel, effect: Effect) -> None:
        held.slot.refuse_new_sessions = held.duty.refuses_new_sessions
        if isinstance(effect, Note):
            self._note(effect.kind, f"{held.files.name}: {effect.detail}".rstrip(": "))
        elif isinstance(effect, Publish):
            self._publish()
        elif isinstance(effect, StartDrain):
            held.drain_scope = trio.CancelScope()
            assert self._nursery is not None
            self._nursery.start_soon(self._drain, held, effect.deadline, held.drain_scope)
        elif isinstance(effect, CancelDrain) and held.drain_scope is not None:
            held.drain_scope.cancel()
            held.drain_scope = None

    async def _drain(self, held: HeldModel, deadline: float, scope: trio.CancelScope) -> None:
        with scope:
            with trio.move_on_at(deadline) as waited:
                await held.slot.drain()
            if held.drain_scope is scope:
                held.drain_scope = None
            now = trio.current_time()
            timed_out = waited.cancelled_caught
            effects = held.duty.on_timer(now) if timed_out else held.duty.on_drained(now)
        if not scope.cancelled_caught:
            await self._carry_out(held, effects)


def with_models(config: NodeConfig, basis: NodeBasis, more: Sequence[str]) -> NodeBasis:
    """`basis` named, and holding `more` models after its first (ModelError), each opened with
    the node's device, formats and quantization."""
    from meshd.model.builtin import builtin_model_dir

    extras = tuple(
        ModelFiles.load(
            config,
            model,
            model or str(builtin_model_dir()),
            device=basis.device,
            dtype=basis.dtype,
            kv_dtype=basis.kv_dtype,
            quantization=basis.quantization,
        )
        for model in more
    )
    ids = [basis.shape.model_id, *(f.shape.model_id for f in extras)]
    if len(set(ids)) != len(ids):
        raise ConfigError("model: two of the models listed are the same checkpoint", key="model")
    name = basis.name or display_name(config.models[0])  # a `mesh:ID` node: the holders' name
    return dataclasses.replace(basis, name=name, extras=extras)


def _session_of(message: Message) -> str | None:
    if isinstance(message, CloseSession | Rollback | VerifyWindow):
        return message.session
    if isinstance(message, StageHidden):
        return message.window.session
    return None


def _describe(p: Plan) -> str:
    return (
        ", ".join(f"{s.node_key.hex()[:8]}[{s.layer_start},{s.layer_end})" for s in p.stages)
        + f" {p.quantization} ~{p.predicted_s_per_token * 1000:.2f} ms/token"
    )


def _draft_fits(draft: str, model_dir: str) -> bool:
    """Whether the node's draft (`spec.draft_model`, checked at start against the first model)
    drafts for this further model too: the same tokenizer, or a prefix of its vocabulary.
    Where it does not, the model's requests run without it (a `draft` request is refused)."""
    if not draft:
        return True
    try:
        check_draft_tokenizer(model_dir, draft)
    except (DraftMismatchError, ModelError) as exc:
        log.warning("spec.draft_model does not draft for %s: %s", model_dir, exc)
        return False
    return True
