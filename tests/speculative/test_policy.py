"""Window width and depth policy, and the acceptance tracker."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import (
    AcceptanceTracker,
    LinkModel,
    PolicyInputs,
    choose,
    search,
    with_copy_rate,
)

CONFIG = SpecConfig(window_max_tokens=12, max_pipeline_depth=3, min_speedup=1.0)
WAN = LinkModel(rtt_s=0.040, pass_fixed_s=0.003, pass_per_token_s=0.0004, stages=2)
LOCAL = LinkModel(rtt_s=0.0, pass_fixed_s=0.004, pass_per_token_s=0.002, stages=1)


def plan(link: LinkModel, *alphas: float, config: SpecConfig = CONFIG):
    return choose(PolicyInputs(link, tuple(alphas)), config)


def expected_tokens(alpha: float, k: int) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def test_no_rtt_and_low_acceptance_means_no_speculation() -> None:
    p = plan(LOCAL, 0.1)
    assert (p.width, p.depth) == (0, 1)
    assert p.expected_s_per_token == p.baseline_s_per_token
    assert "no speculation" in p.reason and "α₁=0.10" in p.reason


def test_high_rtt_and_high_acceptance_means_wide_and_pipelined() -> None:
    p = plan(WAN, 0.95)
    assert p.width >= 8
    assert p.depth > 1
    assert p.expected_tokens == pytest.approx(expected_tokens(0.95, p.width))
    assert p.expected_s_per_token < p.baseline_s_per_token / 3
    assert "rtt 40.0 ms dominates compute" in p.reason
    assert f"k={p.width}" in p.reason and f"depth {p.depth}" in p.reason
    assert "α₁=0.95" in p.reason


def test_low_acceptance_keeps_depth_one() -> None:
    p = plan(WAN, 0.5)
    assert p.width > 0
    assert p.depth == 1  # a whole window is rarely accepted: pipelined work would be wasted


def test_load_narrows_speculation_and_can_stop_it() -> None:
    link = LinkModel(rtt_s=0.010, pass_fixed_s=0.002, pass_per_token_s=0.001, stages=2)
    widths = []
    for sessions in (1, 2, 4, 8, 32):
        loaded = dataclasses.replace(link, concurrent_sessions=sessions)
        widths.append(plan(loaded, 0.6).width)
    assert widths == sorted(widths, reverse=True)
    assert widths[0] > widths[-1]
    assert widths[-1] <= 1
    busy = plan(dataclasses.replace(link, concurrent_sessions=8), 0.6)
    assert "compute 40.0 ms (8 sessions share the stages) dominates rtt 10.0 ms" in busy.reason
    # Where each drafted position costs more than the fixed part, heavy load stops speculation.
    per_token_bound = LinkModel(rtt_s=0.010, pass_fixed_s=0.001, pass_per_token_s=0.002, stages=2)
    assert plan(per_token_bound, 0.6).width > 0
    stopped = plan(dataclasses.replace(per_token_bound, concurrent_sessions=32), 0.6)
    assert stopped.width == 0
    assert "32 sessions share the stages" in stopped.reason


def test_width_grows_with_acceptance_and_rtt() -> None:
    by_alpha = [plan(WAN, a).width for a in (0.0, 0.05, 0.3, 0.5, 0.7, 0.9, 0.98)]
    assert by_alpha == sorted(by_alpha)
    assert by_alpha[0] == 0
    by_rtt = [
        plan(LinkModel(rtt, 0.003, 0.0004, stages=2), 0.7).width
        for rtt in (0.0, 0.001, 0.005, 0.02, 0.08)
    ]
    assert by_rtt == sorted(by_rtt)


def test_min_speedup_margin_and_window_bounds() -> None:
    marginal = plan(LOCAL, 0.6, config=SpecConfig(min_speedup=1.0, window_max_tokens=8))
    assert marginal.width > 0
    gain = marginal.baseline_s_per_token / marginal.expected_s_per_token
    strict = plan(LOCAL, 0.6, config=SpecConfig(min_speedup=gain * 1.01, window_max_tokens=8))
    assert strict.width == 0 and "min_speedup" in strict.reason
    narrow = plan(WAN, 0.95, config=SpecConfig(window_min_tokens=2, window_max_tokens=3))
    assert narrow.width == 3
    off = plan(WAN, 0.99, config=SpecConfig(window_min_tokens=0, window_max_tokens=0))
    assert off.width == 0 and "window_max_tokens is 0" in off.reason
    floor = plan(WAN, 0.3, config=SpecConfig(window_min_tokens=6, window_max_tokens=8))
    assert floor.width in (0, 6, 7, 8)


def test_per_position_acceptance_uses_the_product_form() -> None:
    config = SpecConfig(window_min_tokens=2, window_max_tokens=2, max_pipeline_depth=1)
    p = plan(WAN, 0.9, 0.5, config=config)
    assert p.width == 2
    assert p.expected_tokens == pytest.approx(1 + 0.9 + 0.9 * 0.5)
    # A collapsing second position keeps the window at one draft.
    q = plan(WAN, 0.9, 0.01, 0.01, config=SpecConfig(max_pipeline_depth=1))
    assert q.width == 1


@settings(max_examples=150)
@given(
    rtt=st.floats(0.0, 0.2),
    fixed=st.floats(0.0001, 0.05),
    per_token=st.floats(0.0, 0.01),
    stages=st.integers(1, 8),
    sessions=st.integers(1, 16),
    alphas=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
)
def test_plans_never_lose_to_plain_decoding(
    rtt: float, fixed: float, per_token: float, stages: int, sessions: int, alphas: list[float]
) -> None:
    link = LinkModel(rtt, fixed, per_token, stages, sessions)
    p = plan(link, *alphas)
    assert p.expected_s_per_token <= p.baseline_s_per_token * (1 + 1e-12)
    assert p.baseline_s_per_token == pytest.approx(rtt + sessions * (fixed + per_token))
    assert p.width == 0 or CONFIG.window_min_tokens <= p.width <= CONFIG.window_max_tokens
    assert 1 <= p.depth <= CONFIG.max_pipeline_depth
    assert p.width > 0 or p.depth == 1
    assert p.reason


def test_choose_is_cheap() -> None:
    inputs = PolicyInputs(WAN, (0.8,))
    config = SpecConfig()  # defaults: 8 tokens, depth 2
    choose(inputs, config)
    start = time.perf_counter()
    for _ in range(200):
        choose(inputs, config)
    mean_s = (time.perf_counter() - start) / 200
    assert mean_s < 1e-3  # ~25 µs measured; loose bound for a shared, noisy machine


def test_tracker_ewma_per_position() -> None:
    t = AcceptanceTracker(positions=4, ewma_alpha=0.5, prior=0.5)
    t.update(drafted=4, accepted=2)  # positions 1, 2 accepted; 3 rejected; 4 untested
    assert t.per_position() == (0.75, 0.75, 0.25, 0.5)
    t.update(drafted=1, accepted=0)
    assert t.per_position()[0] == 0.375
    t.update(drafted=8, accepted=8)  # deeper than tracked: all tracked positions succeed
    assert all(a > 0.5 for a in t.per_position()[1:])
    twin = t.copy()
    twin.update(4, 0)
    assert twin.per_position() != t.per_position()
    assert t.samples == 3
    with pytest.raises(ValueError):
        t.update(2, 3)


def test_tracker_converges_to_the_true_rate() -> None:
    t = AcceptanceTracker(positions=1, ewma_alpha=0.05, prior=0.5)
    for i in range(2000):
        t.update(1, 1 if i % 10 < 8 else 0)
    assert t.per_position()[0] == pytest.approx(0.8, abs=0.1)


def test_a_warm_copy_lets_a_requests_first_windows_outweigh_the_book() -> None:
    """The book's estimate counts as one window in a warm copy: three rejections take α₁
    from 0.9 to a quarter of it (1/2, 1/3, 1/4 weights), where the EWMA alone keeps half of
    it; from the fourth window on both forget at the EWMA's weight."""
    book = AcceptanceTracker(4, 0.05, 0.9)
    warm, cold = book.copy(0.2, warm=True), book.copy(0.2)
    for tracker in (warm, cold):
        for _ in range(3):
            tracker.update(4, 0)
    assert abs(warm.per_position()[0] - 0.9 / 4) < 1e-9
    assert abs(cold.per_position()[0] - 0.9 * 0.8**3) < 1e-9
    before = warm.per_position()[0]
    warm.update(4, 0)
    assert abs(warm.per_position()[0] - before * 0.8) < 1e-9
    assert book.per_position()[0] == 0.9  # the book itself is untouched


def test_a_draft_model_on_one_node_runs_one_window_at_a_time() -> None:
    """On one node the draft model drafts on the cores that verify, so a pipelined window's
    drafting overlaps nothing and the plan keeps depth 1 (the pipelined search had chosen
    depth 2 there, each window then paying k + 1 draft passes in series with the verify);
    two stages 20 ms apart still pipeline the same draft."""
    acceptance = (0.95,) * 9
    one_node = LinkModel(0.0, 0.071, 0.009, stages=1, draft_per_token_s=0.03)
    plan = choose(PolicyInputs(one_node, acceptance), SpecConfig())
    assert plan.width > 0 and plan.depth == 1, plan
    two_stages = LinkModel(0.040, 0.071, 0.009, stages=2, draft_per_token_s=0.03)
    assert choose(PolicyInputs(two_stages, acceptance), SpecConfig()).depth == 2


def test_a_lookup_that_rarely_finds_a_copy_is_priced_between_its_copies_and_plain_tokens() -> None:
    """Prompt lookup's windows: a copy window where it finds one (its acceptance is per copy),
    a plain token where it does not. Found at every window start it is its copies' price;
    never found, plain decoding's (so it does not speculate); in between, the mixture."""
    config = SpecConfig()
    link = LinkModel(rtt_s=0.020, pass_fixed_s=0.030, pass_per_token_s=0.004, stages=2)
    copies = search(PolicyInputs(link, (0.9,) * 8), config)
    per_copy, width = copies.s_per_token(config)
    assert width > 0 and per_copy < copies.baseline
    assert with_copy_rate(copies, 1.0).s_per_token(config) == (per_copy, width)
    assert with_copy_rate(copies, 0.0).s_per_token(config) == (copies.baseline, 0)
    half, half_width = with_copy_rate(copies, 0.5).s_per_token(config)
    assert per_copy < half < copies.baseline and half_width == width
    # A window start is one commit: half the starts copy k tokens and the other half commit
    # one, so the tokens follow the copies (more of them), the time the starts.
    _, _, _, expected = copies.best
    assert half == pytest.approx((per_copy * expected + copies.baseline) / (expected + 1), rel=1e-9)
