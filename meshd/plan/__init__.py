"""Topology planner: fewest stages that fit, stage order over pairwise RTT, predicted time.

`plan(...)` returns a `Plan` (convert with `.route`); `explain(plan)` describes it for
`meshctl plan`. Pure code: no I/O, no trio, no torch. See docs/planner.md.
"""

from meshd.plan.explain import explain
from meshd.plan.inputs import ModelShape, NodeCapacity, NoFeasiblePlan, PlannerConfig
from meshd.plan.planner import plan
from meshd.plan.result import Alternative, Census, Hop, Plan, PlannedStage

__all__ = [
    "Alternative",
    "Census",
    "Hop",
    "ModelShape",
    "NoFeasiblePlan",
    "NodeCapacity",
    "Plan",
    "PlannedStage",
    "PlannerConfig",
    "explain",
    "plan",
]
