"""What a spare prefetches: the layers it would take over when a stage's node dies.

A spare (a node offering the model that the plan leaves out) runs the planner once per stage
of the current plan, on its own view without that stage's node: exactly the re-plan every
node makes when that node dies (membership marks it dead, the survivors keep their layers,
`docs/planner.md` "Re-planning after a failure"). The ranges those plans give the spare,
in the order of the stages, are what it would load, so it fetches them ahead (in the
background, `ArtifactService.prefetch`) and a take-over loads from its own store at once.

Planning is pure and deterministic, so the same view gives every spare the same answer; the
result is cached by the plan's route and the planner's inputs (offers and loaded layers), since
re-plans come often and most change neither.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshd.mesh.member import MemberInfo
from meshd.node.planning import assignment, plan_inputs, plan_view
from meshd.plan import ModelShape, NoFeasiblePlan, Plan, PlannerConfig

Layers = tuple[int, int]


def takeover_ranges(
    view: Mapping[bytes, MemberInfo],
    shape: ModelShape,
    rtt_s: Mapping[tuple[bytes, bytes], float],
    plan: Plan,
    own: bytes,
    *,
    context_tokens: int,
    config: PlannerConfig | None = None,
) -> list[Layers]:
    """The layer ranges `own` would serve after each single stage failure of `plan`, in the
    plan's stage order, without repeats (empty: `own` is in the plan, or takes over nothing)."""
    if assignment(plan, own) is not None:
        return []
    ranges: list[Layers] = []
    for stage in plan.stages:
        try:
            after = plan_view(
                view,
                shape,
                rtt_s,
                context_tokens=context_tokens,
                exclude=frozenset({stage.node_key}),
                config=config,
            )
        except NoFeasiblePlan:
            continue
        layers = assignment(after, own)
        if layers is not None and layers not in ranges:
            ranges.append(layers)
    return ranges


class TakeoverCache:
    """`takeover_ranges`, computed again only when the plan's route or the planner's inputs
    (the healthy members' offers and the layers they have loaded) changed."""

    def __init__(self) -> None:
        self._key: object = None
        self._ranges: list[Layers] = []

    def ranges(
        self,
        view: Mapping[bytes, MemberInfo],
        shape: ModelShape,
        rtt_s: Mapping[tuple[bytes, bytes], float],
        plan: Plan,
        own: bytes,
        *,
        context_tokens: int,
        config: PlannerConfig | None = None,
    ) -> list[Layers]:
        """The ranges for this view and plan (see `takeover_ranges`)."""
        # Everything the planner reads of the view: offers, and the layers loaded (anchors).
        inputs = plan_inputs(view, shape.model_id, shape.quantization)
        key = (plan.route, inputs.nodes, tuple(sorted(inputs.held.items())))
        if key != self._key:
            self._ranges = takeover_ranges(
                view, shape, rtt_s, plan, own, context_tokens=context_tokens, config=config
            )
            self._key = key
        return list(self._ranges)
