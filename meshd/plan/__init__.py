"""Topology planner: fewest stages that fit, stage order over pairwise RTT, predicted time.

`plan(...)` returns a `Plan` (its `.route`: the `Route` a coordinator follows); `explain(plan)`
describes it for `meshctl plan`. Pure code: no I/O, no trio, no torch. See docs/planner.md.
"""

from meshd.plan.explain import explain
from meshd.plan.inputs import ModelShape, NodeCapacity, NoFeasiblePlan, PlannerConfig
from meshd.plan.planner import plan
from meshd.plan.result import Alternative, Census, Hop, Plan, PlannedStage
from meshd.plan.route import Route, RouteStage

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
    "Route",
    "RouteStage",
    "explain",
    "plan",
]
