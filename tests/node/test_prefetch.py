"""What a spare prefetches: the ranges the re-plan without each stage's node gives it, which is
what it then loads when that node dies (the daemon's sticky planner: survivors keep theirs)."""

from __future__ import annotations

import torch

from meshd.mesh.member import MemberInfo
from meshd.node.planning import assignment, config_shape, plan_view
from meshd.node.prefetch import TakeoverCache, takeover_ranges
from meshd.plan import Plan
from protocol.gossip import Status
from tests.node.test_planning import CONTEXT, GIB, _member, large_config

SHAPE = config_shape(large_config(), "large", torch.float32, "none")
IDS = [bytes([i]) * 32 for i in range(1, 7)]


def _serving_mesh(spares: int) -> tuple[dict[bytes, MemberInfo], list[bytes]]:
    """Three fp32 nodes serving the loaded stages of their plan, and `spares` more nodes."""
    stages = IDS[:3]
    first = plan_view(
        {k: _member(k, "none", GIB // 2, None) for k in stages}, SHAPE, {}, context_tokens=CONTEXT
    )
    assert len(first.stages) == 3
    view = {k: _member(k, "none", GIB // 2, assignment(first, k)) for k in stages}
    view |= {k: _member(k, "none", GIB // 2, None) for k in IDS[3 : 3 + spares]}
    return view, stages


def _plan(view: dict[bytes, MemberInfo], exclude: frozenset[bytes] = frozenset()) -> Plan:
    return plan_view(view, SHAPE, {}, context_tokens=CONTEXT, exclude=exclude)


def test_a_lone_spare_prefetches_every_stage_it_would_take_over_in_stage_order() -> None:
    view, stages = _serving_mesh(spares=1)
    plan = _plan(view)
    spare = IDS[3]
    assert assignment(plan, spare) is None
    ranges = takeover_ranges(view, SHAPE, {}, plan, spare, context_tokens=CONTEXT)
    assert ranges == [(s.layer_start, s.layer_end) for s in plan.stages]
    # ... and it is what the spare is given when that stage's node dies.
    for stage in plan.stages:
        after = _plan(view, frozenset({stage.node_key}))
        assert assignment(after, spare) == (stage.layer_start, stage.layer_end)
    # A node in the plan prefetches nothing.
    assert takeover_ranges(view, SHAPE, {}, plan, stages[0], context_tokens=CONTEXT) == []


def test_two_spares_split_the_take_overs_and_the_cache_follows_the_view() -> None:
    view, _ = _serving_mesh(spares=2)
    plan = _plan(view)
    got = {
        spare: takeover_ranges(view, SHAPE, {}, plan, spare, context_tokens=CONTEXT)
        for spare in IDS[3:5]
    }
    # Every stage's take-over goes to one of them, and each fetches only its own.
    every = [(s.layer_start, s.layer_end) for s in plan.stages]
    assert sorted(got[IDS[3]] + got[IDS[4]]) == sorted(every)
    cache = TakeoverCache()
    assert cache.ranges(view, SHAPE, {}, plan, IDS[3], context_tokens=CONTEXT) == got[IDS[3]]
    # The other spare dies: this one takes over every stage now.
    dead = dict(view)
    dead[IDS[4]] = MemberInfo(IDS[4], Status.DEAD, 1, "", view[IDS[4]].capacity, {}, False, 0.0)
    assert sorted(cache.ranges(dead, SHAPE, {}, plan, IDS[3], context_tokens=CONTEXT)) == sorted(
        every
    )
