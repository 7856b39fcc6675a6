"""Every node's leaderless planning on the simulator: what a mesh of daemons loads as it forms.

Each node does what the daemon's `PlanLoop` and `HeldModel.replan` do, on the virtual clock of
a `Sim`: a while after its view changes (`REPLAN_DEBOUNCE_S`) it plans the model over that view
(`plan_view`, the daemon's own function), asks its `Duty` what to do with its stage (the
daemon's own decider) and carries the effects out: a stage stops at once; a stage to load
is in the node's record as loading at once (`HeldModel._load`), serves its layers `load_s`
later, and the node plans nothing meanwhile (the daemon awaits the load); then the record says
what it holds (`Publish`). The record is signed
and gossiped by the real membership state machines, so plans made on partial member lists,
records that arrive late and loads that overlap happen as they do between daemons.

Used by tests/sim/test_planning.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from meshd.mesh.member import LocalCapacity, MemberInfo
from meshd.node.duty import Duty, Effect, LoadStage, Publish, StopStage
from meshd.node.planning import assignment, plan_view
from meshd.node.replan import REPLAN_DEBOUNCE_S
from meshd.plan import ModelShape, NoFeasiblePlan, Plan, PlannerConfig
from meshd.plan.route import Route
from meshd.sim.simnet import Sim
from protocol.gossip import ModelHolding

Layers = tuple[int, int]


@dataclass
class PlanningNode:
    """One simulated daemon's model: its offer, its duty, its stage and its latest plan."""

    index: int
    memory_budget_bytes: int
    compute_ns_per_layer_token: int
    duty: Duty = field(default_factory=lambda: Duty(drain_timeout_s=30.0))
    layers: Layers | None = None  # the layers the stage serves (None: no stage)
    loading: Layers | None = None  # the layers it is loading (None: no load in flight)
    plan: Plan | None = None
    inputs: object = None  # what the latest plan was made from (re-plan only on a change)
    loads: int = 0


class PlanningSim:
    """Nodes of `sim` that offer the model `shape` and plan it as daemons do."""

    def __init__(
        self,
        sim: Sim,
        shape: ModelShape,
        *,
        context_tokens: int,
        load_s: float,
        config: PlannerConfig | None = None,
    ) -> None:
        self.sim = sim
        self.shape = shape
        self.context_tokens = context_tokens
        self.load_s = load_s
        self.config = config or PlannerConfig()
        self.nodes: dict[int, PlanningNode] = {}

    def start(self, i: int, *, memory_budget_bytes: int, compute_ns: int) -> None:
        """Boot node i alone, offering the model; it plans from now on (join it to someone)."""
        node = PlanningNode(i, memory_budget_bytes, compute_ns)
        self.nodes[i] = node
        self.sim.start(i, capacity=self._capacity(node))
        self.sim.at(self.sim.now, lambda: self._tick(node))

    def routes(self) -> dict[int, Route | None]:
        """Each node's latest plan's route (None: no plan)."""
        return {i: n.plan.route if n.plan is not None else None for i, n in self.nodes.items()}

    def settled(self) -> Plan | None:
        """The plan every node agrees on once each serves its own stage of it (else None)."""
        plans = [n.plan for n in self.nodes.values()]
        first = plans[0] if plans else None
        if first is None or any(p is None or p.route != first.route for p in plans):
            return None
        for node in self.nodes.values():
            if node.loading is not None or node.layers != assignment(first, self._id(node)):
                return None
        return first

    def _id(self, node: PlanningNode) -> bytes:
        return self.sim.nodes[node.index].node_id

    def _capacity(self, node: PlanningNode) -> LocalCapacity:
        lo, hi = node.layers or node.loading or (0, self.shape.num_layers)
        holding = ModelHolding(
            self.shape.model_id,
            lo,
            hi,
            node.layers is not None,
            node.compute_ns_per_layer_token,
            quantization=self.shape.quantization,
            loading=node.loading is not None,
        )
        return LocalCapacity(memory_budget_bytes=node.memory_budget_bytes, models=(holding,))

    def _tick(self, node: PlanningNode) -> None:
        if self.sim.nodes[node.index].up and node.loading is None:
            self._replan(node)
        self.sim.at(self.sim.now + REPLAN_DEBOUNCE_S, lambda: self._tick(node))

    def _replan(self, node: PlanningNode) -> None:
        m = self.sim.nodes[node.index].m
        view, rtt = m.view(), m.rtt_matrix()
        inputs = (_plan_inputs(view), tuple(sorted(rtt.items())))
        if inputs == node.inputs:
            return
        node.inputs = inputs
        try:
            node.plan = plan_view(
                view, self.shape, rtt, context_tokens=self.context_tokens, config=self.config
            )
        except NoFeasiblePlan:
            node.plan = None
        effects = node.duty.on_plan(
            assigned=assignment(node.plan, self._id(node)) if node.plan is not None else None,
            planned=node.plan is not None,
            layers=node.layers,
            now=self.sim.now,
        )
        self._carry_out(node, effects)

    def _carry_out(self, node: PlanningNode, effects: list[Effect]) -> None:
        for at, effect in enumerate(effects):
            if isinstance(effect, StopStage):
                node.layers = None
            elif isinstance(effect, LoadStage):
                node.layers, node.loading = None, effect.layers
                self.sim.set_capacity(node.index, self._capacity(node), urgent=True)
                self._load_later(node, effect.layers, effects[at + 1 :])
                return
            elif isinstance(effect, Publish):
                self.sim.set_capacity(node.index, self._capacity(node), urgent=effect.urgent)

    def _load_later(self, node: PlanningNode, layers: Layers, rest: list[Effect]) -> None:
        """The stage serves `layers` `load_s` from now; then the rest of the effects."""

        def loaded() -> None:
            node.layers, node.loading = layers, None
            node.loads += 1
            node.inputs = None  # the daemon re-plans after a load (requests queued meanwhile)
            self._carry_out(node, rest)

        self.sim.at(self.sim.now + self.load_s, loaded)


def _plan_inputs(view: Mapping[bytes, MemberInfo]) -> tuple[object, ...]:
    """What of `view` the plan depends on: each member's health and capacity record."""
    return tuple((k, info.healthy, info.capacity) for k, info in sorted(view.items()))
