"""The planner's memory figures are the bytes a stage really holds at its quantization, and a
plan runs only on nodes that hold the model at the plan's quantization."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from nacl.signing import SigningKey

from meshd.bench.decode import RANDOM_CONFIGS
from meshd.mesh.member import MemberInfo
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.config import ModelConfig, parse_config
from meshd.model.stage import StageModel
from meshd.node.planning import config_shape, lane_route, model_shape, plan_view, route_served
from meshd.plan import NodeCapacity, NoFeasiblePlan, PlannerConfig, plan
from meshd.plan.cost_model import make_candidate, stage_bytes
from meshd.plan.route import Route, RouteStage
from protocol.gossip import CapacityRecord, ModelHolding, Status
from protocol.noise import x25519_public_from_ed25519_public

CONTEXT = 256
GIB = 1 << 30


def large_config() -> ModelConfig:
    """The config of `meshd bench decode --random large` (16 layers, hidden 1024)."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return parse_config({**raw, "max_position_embeddings": 4096, **RANDOM_CONFIGS["large"]})


@pytest.mark.parametrize("quantization", ["none", "q8_0", "int8", "int4"])
def test_the_shape_counts_what_each_loaded_stage_holds(quantization: str) -> None:
    torch.set_num_threads(1)
    checkpoint = Checkpoint.open(builtin_model_dir())
    shape = model_shape(checkpoint, torch.float32, quantization, torch.float16)
    # The old names are planned as the block formats they stand for, under those names.
    assert shape.quantization == {"int8": "q8_0", "int4": "q4_k"}.get(quantization, quantization)
    n = checkpoint.config.num_layers
    for lo, hi in ((0, n), (0, 2), (2, 4), (4, n)):
        stage = StageModel.load(
            checkpoint, lo, hi, device="cpu", quantization=quantization, kv_dtype=torch.float16
        )
        assert stage_bytes(shape, 0, lo, hi) == stage.weight_bytes, (lo, hi)
        # KV for one position: the layers', plus the MTP depths' on the last stage.
        kv_one = stage_bytes(shape, 1, lo, hi) - stage_bytes(shape, 0, lo, hi)
        assert kv_one == stage.kv_bytes_per_token, (lo, hi)


def test_a_budget_holds_about_four_times_more_layers_at_q8_0_than_at_fp32() -> None:
    config = large_config()
    node = NodeCapacity(b"\x01" * 32, GIB // 2, 1e-4)  # 512 MiB, 90 % usable
    caps = {}
    for q in ("none", "q8_0", "q4_k"):
        shape = config_shape(config, "large", torch.float32, q)
        caps[q] = make_candidate(node, shape, CONTEXT, PlannerConfig()).cap_mid
    # Per layer 45.1 MB at fp32, 12.0 MB at q8_0, 6.4 MB at q4_k.
    assert caps["none"] == 10
    assert caps["q8_0"] == config.num_layers  # all 16 (it would hold 40)
    uncapped = {
        q: (GIB // 2 * 9 // 10)
        // config_shape(config, "large", torch.float32, q).layer_bytes(CONTEXT)
        for q in ("none", "q8_0")
    }
    assert 3.5 <= uncapped["q8_0"] / uncapped["none"] <= 4.2  # 37 / 10 here

    # The same four nodes: fp32 needs three stages, q8_0 fits on one node.
    nodes = [NodeCapacity(bytes([i]) * 32, GIB // 2, 1e-4) for i in range(1, 5)]
    stages = {}
    for q in ("none", "q8_0"):
        shape = config_shape(config, "large", torch.float32, q)
        p = plan(shape, nodes, {}, nodes[0].key, context_tokens=CONTEXT)
        assert p.quantization == q
        stages[q] = len(p.stages)
    assert stages == {"none": 3, "q8_0": 1}


def _member(
    node_id: bytes, quantization: str, budget: int, loaded: tuple[int, int] | None
) -> MemberInfo:
    lo, hi = loaded or (0, 16)
    holding = ModelHolding(
        "large", lo, hi, loaded is not None, 100_000, quantization=quantization,
        weight_bytes=1 if loaded else 0,
    )  # fmt: skip
    record = CapacityRecord(node_id, 1, "", budget, [holding], 0, 0, [])
    return MemberInfo(node_id, Status.ALIVE, 1, "", record, {}, True, 0.0)


def test_a_plan_runs_only_on_nodes_holding_its_quantization() -> None:
    config = large_config()
    ids = [bytes([i]) * 32 for i in range(1, 6)]
    # The lowest id holds q8_0 and layers [0, 16) loaded; fp32 nodes are bigger.
    view = {
        ids[0]: _member(ids[0], "q8_0", GIB // 2, (0, 16)),
        ids[1]: _member(ids[1], "none", GIB, None),
        ids[2]: _member(ids[2], "q8_0", GIB // 2, None),
        ids[3]: _member(ids[3], "none", GIB, None),
        ids[4]: _member(ids[4], "q4_k", GIB // 4, None),
    }
    plans = {}
    for q in ("none", "q8_0", "q4_k"):
        shape = config_shape(config, "large", torch.float32, q)
        plans[q] = plan_view(view, shape, {}, context_tokens=CONTEXT)
        assert plans[q].quantization == q
        assert plans[q].model_id == "large"  # one model id whatever the quantization
    assert {s.node_key for s in plans["none"].stages} == {ids[1], ids[3]}
    assert plans["none"].coordinator == ids[1]  # the lowest id among the fp32 nodes
    assert [s.node_key for s in plans["q8_0"].stages] == [ids[0]]  # keeps its loaded stage
    assert plans["q8_0"].coordinator == ids[0]
    assert [s.node_key for s in plans["q4_k"].stages] == [ids[4]]
    # Every node of a quantization plans the same: the plan does not depend on who asks.
    again = plan_view(
        dict(reversed(view.items())),
        config_shape(config, "large", torch.float32, "none"),
        {},
        context_tokens=CONTEXT,
    )
    assert again.route == plans["none"].route

    # No member at a quantization: no plan, and the error says which.
    only_fp32 = {k: v for k, v in view.items() if k in (ids[1], ids[3])}
    with pytest.raises(NoFeasiblePlan, match="quantization q8_0"):
        plan_view(
            only_fp32, config_shape(config, "large", torch.float32, "q8_0"), {},
            context_tokens=CONTEXT,
        )  # fmt: skip


def test_an_earlier_route_is_served_while_its_stages_hold_their_layers() -> None:
    ids = [bytes(SigningKey.generate().verify_key) for _ in range(3)]
    view = {
        ids[0]: _member(ids[0], "q8_0", GIB, (0, 8)),
        ids[1]: _member(ids[1], "q8_0", GIB, (8, 16)),
        ids[2]: _member(ids[2], "q8_0", GIB, None),
    }
    stage = [(x25519_public_from_ed25519_public(i), lo, hi) for i, lo, hi in (
        (ids[0], 0, 8), (ids[1], 8, 16), (ids[2], 8, 16))]  # fmt: skip
    earlier = Route("large", (RouteStage(*stage[0]), RouteStage(*stage[1])), "q8_0")
    assert route_served(earlier, view)
    assert not route_served(earlier, view, exclude={ids[1]})  # a suspect
    assert not route_served(replace(earlier, quantization="none"), view)
    # A node that holds nothing, or other layers, does not serve the route's stage.
    assert not route_served(Route("large", (RouteStage(*stage[0]), RouteStage(*stage[2]))), view)
    view[ids[1]] = _member(ids[1], "q8_0", GIB, (4, 16))
    assert not route_served(earlier, view)


def test_a_stage_still_loading_stays_where_it_is_and_serves_no_route_yet() -> None:
    # A plan made while a member loads its stage (a member that joins meanwhile plans then)
    # keeps the range there, as it keeps a loaded stage: otherwise every such plan could start
    # another load of the same layers elsewhere, before the first one is even done.
    ids = sorted(bytes(SigningKey.generate().verify_key) for _ in range(3))
    shape = config_shape(large_config(), "large", torch.float32, "q8_0")
    loading = ModelHolding("large", 0, 16, False, 100_000, quantization="q8_0", loading=True)
    record = CapacityRecord(ids[2], 1, "", GIB, [loading], 0, 0, [])
    view = {i: _member(i, "q8_0", GIB, None) for i in ids[:2]}
    view[ids[2]] = MemberInfo(ids[2], Status.ALIVE, 1, "", record, {}, True, 0.0)
    p = plan_view(view, shape, {}, context_tokens=CONTEXT)
    assert [(s.node_key, s.layer_start, s.layer_end) for s in p.stages] == [(ids[2], 0, 16)]
    assert p.reload_layers == 0
    # Not serving yet: a route through it is not served.
    assert not route_served(lane_route(p), view)
