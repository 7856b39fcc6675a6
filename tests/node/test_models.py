"""A node's memory budget shared by the models it holds, and each model planned within its
share: the same plans on every node, from the view alone."""

from __future__ import annotations

import pathlib

import pytest
import torch

from meshd.coord.coordinator import Coordinator
from meshd.mesh.member import MemberInfo
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.node.models import _draft_fits, full_model_bytes, split_budget
from meshd.node.planning import model_shape, plan_view
from meshd.plan import NoFeasiblePlan
from meshd.speculative.config import SpecConfig
from meshd.speculative.strategies import UnknownStrategyError, make_proposer
from protocol.gossip import CapacityRecord, ModelHolding, Status
from tests.speculative.test_draft import other_tokenizer

CONTEXT = 1024


def test_the_budget_is_split_in_proportion_to_what_each_whole_model_needs() -> None:
    assert split_budget(1000, [123]) == [1000]  # one model: all of it
    shares = split_budget(1000, [100, 300])
    assert shares == [250, 750]
    assert sum(split_budget(1001, [1, 2, 3])) <= 1001
    # Deterministic: the same inputs, the same shares (every node reads them from the record).
    assert split_budget(7919, [5, 11, 2]) == split_budget(7919, [5, 11, 2])


def _member(node_id: bytes, budget: int, holdings: list[ModelHolding]) -> MemberInfo:
    record = CapacityRecord(node_id, 1, "", budget, holdings, 0, 0, [])
    return MemberInfo(node_id, Status.ALIVE, 1, "", record, {}, True, 0.0)


def test_each_model_is_planned_within_the_share_its_nodes_offer_it() -> None:
    shape = model_shape(Checkpoint.open(builtin_model_dir()), torch.float32)
    whole = full_model_bytes(shape, CONTEXT)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    big = 3 * whole  # either node could hold the whole model ... if it held nothing else

    def holding(share: int) -> ModelHolding:
        return ModelHolding(shape.model_id, 0, shape.num_layers, False, 100_000,
                            memory_budget_bytes=share, name="meshd-builtin")  # fmt: skip

    # Both nodes give the model all of their budget: one node holds it whole.
    view = {a: _member(a, big, [holding(0)]), b: _member(b, big, [holding(0)])}
    assert len(plan_view(view, shape, {}, context_tokens=CONTEXT).stages) == 1
    # Both share their budget with another model and offer this one 75% of the whole
    # model's bytes each: it needs both nodes, and the plan is the same whoever computes it.
    share = whole * 3 // 4
    view = {a: _member(a, big, [holding(share)]), b: _member(b, big, [holding(share)])}
    p = plan_view(view, shape, {}, context_tokens=CONTEXT)
    assert {s.node_key for s in p.stages} == {a, b}
    assert all(s.memory_bytes <= share for s in p.stages)
    again = plan_view(dict(reversed(view.items())), shape, {}, context_tokens=CONTEXT)
    assert again.route == p.route
    # Shares too small for the two together: no plan, though the budgets alone would fit.
    view = {a: _member(a, big, [holding(whole // 3)]), b: _member(b, big, [holding(whole // 3)])}
    try:
        plan_view(view, shape, {}, context_tokens=CONTEXT)
    except NoFeasiblePlan:
        pass
    else:
        raise AssertionError("a plan beyond the shares the nodes offer")


def test_the_nodes_draft_drafts_only_for_models_with_its_tokenizer(tmp_path: pathlib.Path) -> None:
    draft = str(builtin_draft_dir())
    assert _draft_fits(draft, str(builtin_model_dir()))
    assert _draft_fits("", str(tmp_path))  # no draft configured: nothing to refuse
    # A further model with a tokenizer of its own: its requests run without the draft, and a
    # request for the `draft` strategy is refused by name instead of feeding it foreign ids.
    other = other_tokenizer(tmp_path / "other")
    assert not _draft_fits(draft, str(other))
    coordinator = Coordinator(None, b"k" * 32)  # type: ignore[arg-type]
    coordinator.drafts_allowed = False
    assert coordinator.draft_model(SpecConfig(draft_model=draft)) is None
    with pytest.raises(UnknownStrategyError, match="needs a draft model"):
        make_proposer("draft", SpecConfig(draft_model=draft), draft=None)
