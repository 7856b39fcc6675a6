"""Route costs as the window policy sees them: measured per window size, not one line."""

from __future__ import annotations

import pytest

from meshd.coord.route_costs import RouteCosts
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import PolicyInputs, choose

MS = 1e-3


def _window(costs: RouteCosts, tokens: int, compute_s: float) -> None:
    costs.observe(tokens, compute_s + 0.5 * MS, compute_s, 0.0)


def _cpu_like(costs: RouteCosts) -> None:
    """A stage with a one-token fast path: 4 ms for one token, 6 ms for two, +0.25 ms each
    further token (within what scripts/window_costs.py measures on 2 CPU stages of the
    built-in model)."""
    for _ in range(6):
        for tokens in (1, 2, 3, 5, 9):
            _window(costs, tokens, (4.0 if tokens == 1 else 6.0 + 0.25 * (tokens - 2)) * MS)


def test_plain_decoding_is_priced_at_the_measured_one_token_pass() -> None:
    costs = RouteCosts(stages=2)
    _cpu_like(costs)
    link = costs.link_model()
    assert link.compute_s(0) == pytest.approx(4.0 * MS, rel=0.02)
    assert link.compute_s(1) == pytest.approx(6.0 * MS, rel=0.05)
    assert link.compute_s(8) == pytest.approx(7.75 * MS, rel=0.05)


def test_a_stretch_of_plain_decoding_keeps_what_wider_windows_cost() -> None:
    costs = RouteCosts(stages=2)
    _cpu_like(costs)
    for i in range(200):  # a long request decoded plainly, with the usual jitter
        _window(costs, 1, (4.0 + (0.4 if i % 2 else -0.4)) * MS)
    link = costs.link_model()
    assert link.compute_s(0) == pytest.approx(4.0 * MS, rel=0.1)
    assert link.compute_s(4) == pytest.approx(6.75 * MS, rel=0.05)


def test_where_any_draft_costs_half_a_pass_more_low_acceptance_does_not_speculate() -> None:
    costs = RouteCosts(stages=2)
    _cpu_like(costs)
    for _ in range(40):
        _window(costs, 1, 4.0 * MS)
    spec = SpecConfig(strategy="ngram-simple")
    # One draft at 35 % commits 1.35 tokens for ≈ 6 ms against 1 token for 4 ms: a loss, which
    # a forgetting line fit through every window size hid (it priced a one-draft window at
    # ≈ 5 ms and planned 3.7 ms per token against 4.5).
    plan = choose(PolicyInputs(costs.link_model(), (0.35,)), spec)
    assert plan.width == 0, plan.reason
    # Where drafts are mostly right, the same route speculates.
    assert choose(PolicyInputs(costs.link_model(), (0.8,)), spec).width > 0
