"""The planner at scale: time and plan quality over a seeded geography of n nodes.

Nodes get a memory budget and a memory bandwidth drawn from a home/lab mix; a layer's decode
time on a node is the layer's bytes over its bandwidth (decode is memory-bound), times
(1 + load). Round trips are the geography's (the ones lanes would measure). Each model is
planned from several random coordinators; for each plan we report the wall and CPU time,
the stage count, the predicted time per token, and its ratio to a lower bound and to the
best of many random feasible plans (meshd/sim/plan_quality.py).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from meshd.plan.inputs import ModelShape, NodeCapacity, NoFeasiblePlan, PlannerConfig
from meshd.plan.planner import plan
from meshd.sim.geography import Geography, GeographyConfig
from meshd.sim.plan_quality import best_random_plan_s, lower_bound_s, offers

GiB = 1 << 30
CONTEXT_TOKENS = 8192
# GQA with 8 KV heads of 128 dims, K and V, 2 bytes each: 4 KiB per token per layer.
KV_BYTES = 8 * 128 * 2 * 2

# Shapes of real model families; sizes as stored at the named precision (bytes per layer
# rounded). With node budgets of 16-64 GiB they need about 2, 4 and 8 stages.
MODELS = (
    ModelShape("llama-3-70b-q4", 80, int(0.45 * GiB), KV_BYTES, int(0.5 * GiB), int(0.5 * GiB)),
    ModelShape("llama-3-70b-bf16", 80, int(1.6 * GiB), KV_BYTES, 2 * GiB, 2 * GiB),
    ModelShape("llama-3-405b-q4", 126, int(2.0 * GiB), KV_BYTES, 4 * GiB, 4 * GiB),
)
MEMORY_GIB = (16, 24, 32, 64)
BANDWIDTH_GB_S = (100, 200, 400, 800, 1000)


@dataclass(frozen=True, slots=True)
class PlanScale:
    """One plan: how long the planner took and how good the result is."""

    n: int
    model_id: str
    coordinator: int
    stages: int | None  # None: no feasible plan
    wall_s: float
    cpu_s: float
    predicted_s: float | None
    lower_bound_s: float
    best_random_s: float | None
    random_feasible: int
    random_samples: int
    rtt_lookups: int

    @property
    def vs_lower_bound(self) -> float | None:
        """predicted / lower bound (≥ 1; 1 would be unbeatable)."""
        return None if self.predicted_s is None else self.predicted_s / self.lower_bound_s

    @property
    def vs_best_random(self) -> float | None:
        """predicted / best random feasible plan (< 1: the planner beat them all)."""
        if self.predicted_s is None or self.best_random_s is None:
            return None
        return self.predicted_s / self.best_random_s


def mesh_nodes(n: int, model: ModelShape, rng: random.Random) -> list[NodeCapacity]:
    """n nodes' offers for `model` (node i has key b"node%05d"); 5 % unhealthy."""
    nodes = []
    for i in range(n):
        bandwidth = rng.choice(BANDWIDTH_GB_S) * 1e9
        nodes.append(
            NodeCapacity(
                key=f"node{i:05d}".encode(),
                memory_budget_bytes=rng.choice(MEMORY_GIB) * GiB,
                compute_s_per_layer_token=model.bytes_per_layer / bandwidth,
                healthy=rng.random() > 0.05,
                load=rng.choice((0.0, 0.0, 0.0, 1.0)),
            )
        )
    return nodes


def run_planner(
    n: int,
    *,
    seed: int,
    coordinators: int,
    random_samples: int,
    geography: GeographyConfig | None = None,
    config: PlannerConfig | None = None,
) -> list[PlanScale]:
    """Plan every model in MODELS from `coordinators` random nodes of an n-node mesh."""
    config = config or PlannerConfig()
    geo = Geography(n, seed=seed, config=geography)
    min_rtt_s = geo.config.lan_rtt_min_s
    rng = random.Random(seed)
    out = []
    for model in MODELS:
        nodes = mesh_nodes(n, model, rng)
        keys = [node.key for node in nodes]
        usable = offers(model, nodes, CONTEXT_TOKENS, config)
        bound = lower_bound_s(model.num_layers, usable, min_rtt_s, config)
        for coordinator in rng.sample(range(n), min(coordinators, n)):
            rtt = geo.rtt_mapping(keys)
            started_wall, started_cpu = time.perf_counter(), time.process_time()
            try:
                p = plan(model, nodes, rtt, keys[coordinator], context_tokens=CONTEXT_TOKENS)
            except NoFeasiblePlan:
                p = None
            wall, cpu = time.perf_counter() - started_wall, time.process_time() - started_cpu
            lookups = rtt.lookups
            stages = None if p is None else len(p.stages)
            counts = [stages, stages + 1, stages + 2] if stages else [2, 4, 8]
            search = best_random_plan_s(
                model.num_layers,
                usable,
                rtt,
                keys[coordinator],
                [k for k in counts if k <= config.max_stages],
                samples=random_samples,
                rng=rng,
                config=config,
            )
            out.append(
                PlanScale(
                    n=n,
                    model_id=model.model_id,
                    coordinator=coordinator,
                    stages=stages,
                    wall_s=wall,
                    cpu_s=cpu,
                    predicted_s=None if p is None else p.predicted_s_per_token,
                    lower_bound_s=bound,
                    best_random_s=search.best_s,
                    random_feasible=search.feasible,
                    random_samples=random_samples,
                    rtt_lookups=lookups,
                )
            )
    return out
