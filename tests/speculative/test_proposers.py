"""Proposers: n-gram lookup and cache, MTP and hybrids, accounting, the factory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.speculative.config import STRATEGIES, SpecConfig
from meshd.speculative.ngram import NgramCache
from meshd.speculative.strategies import UnknownStrategyError, make_proposer
from tests.speculative.drafts import tiny_draft, tiny_draft_dir
from tests.speculative.target import VOCAB

WIDE = SpecConfig(ngram_min=1, ngram_max=3, ngram_cache_min_hits=1, mtp_depth=3)
# The same with a (random) draft model configured, for the draft strategies and `auto`.
WIDE_DRAFT = SpecConfig(
    ngram_min=1,
    ngram_max=3,
    ngram_cache_min_hits=1,
    mtp_depth=3,
    draft_model=str(tiny_draft_dir(VOCAB)),
)


def simple(history: list[int], config: SpecConfig = WIDE):
    p = make_proposer("ngram-simple", config)
    p.reset(history)
    return p


def test_ngram_simple_prefers_the_longest_matching_suffix() -> None:
    # Suffix (2,3,4) occurred at the start (then 5 6 9); the shorter (3,4) more recently (then 7).
    p = simple([1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 2, 3, 4])
    assert p.propose(4) == [5, 6, 9, 3]


def test_ngram_simple_continues_the_most_recent_occurrence() -> None:
    # transformers' prompt lookup would take the leftmost "1 2" (→ 5); we take the newest (→ 6).
    p = simple([1, 2, 5, 1, 2, 6, 1, 2])
    assert p.propose(3) == [6, 1, 2]


def test_ngram_simple_without_a_match_drafts_nothing() -> None:
    assert simple([1, 2, 3, 4, 5]).propose(4) == []
    assert simple([1, 2, 3, 4, 5]).propose(0) == []
    assert simple([]).propose(4) == []


def test_ngram_simple_repeats_a_loop_for_the_whole_window() -> None:
    assert simple([9, 7, 7, 7]).propose(5) == [7, 7, 7, 7, 7]
    assert simple([4, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_ngram_simple_learns_from_observed_tokens() -> None:
    p = simple([10, 11, 12])
    assert p.propose(2) == []
    p.observe([13, 10, 11])
    assert p.propose(2) == [12, 13]


def test_ngram_min_bounds_the_match_length() -> None:
    config = SpecConfig(ngram_min=2, ngram_max=3)
    # Only a 1-token suffix (5) recurs: below ngram_min, no draft.
    assert simple([5, 6, 1, 2, 5], config).propose(3) == []
    assert simple([5, 6, 1, 2, 5], WIDE).propose(3) == [6, 1, 2]


def test_propose_after_uses_assumed_tokens() -> None:
    p = simple([1, 2, 3, 4, 5, 9, 9])
    assert p.propose_after([2, 3], 3) == [4, 5, 9]
    # The continuation runs through the history end into the assumed tokens themselves.
    q = simple([1, 2, 3])
    assert q.propose_after([1, 2], 5) == [3, 1, 2, 3, 1]
    # Nothing is committed by propose_after.
    assert q.propose(2) == []


def test_ngram_cache_respects_min_hits() -> None:
    # 1 2 → 3 twice and → 4 once; 2 3 → 0 once and → 9 once (so the chain stops there at 2).
    history = [1, 2, 3, 0, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    for hits, expected in ((1, [3, 9, 1]), (2, [3]), (3, [])):
        config = SpecConfig(ngram_min=1, ngram_max=2, ngram_cache_min_hits=hits)
        p = make_proposer("ngram-cache", config)
        p.reset(history)
        assert p.propose(3) == expected, hits


def test_ngram_cache_resets_per_request() -> None:
    p = make_proposer("ngram-cache", WIDE)
    assert isinstance(p, NgramCache)
    p.reset([1, 2, 3, 1, 2, 3, 1, 2])
    assert p.propose(2) == [3, 1]
    assert p.count([1, 2], 3) == 2
    p.reset([1, 2, 7])
    assert p.count([1, 2], 3) == 0  # the previous request's statistics are gone
    assert p.propose(2) == []
    p.observe([1, 2])
    assert p.propose(2) == [7, 1]


def test_ngram_cache_breaks_ties_by_recency() -> None:
    p = make_proposer("ngram-cache", SpecConfig(ngram_min=1, ngram_max=1, ngram_cache_min_hits=1))
    p.reset([5, 1, 5, 2, 5])
    assert p.propose(1) == [2]
    p.observe([1, 5])
    assert p.propose(1) == [1]  # 5→1 now seen twice


def test_mtp_returns_the_last_stage_draft() -> None:
    p = make_proposer("mtp", WIDE)
    p.reset([1, 2])
    assert p.propose(8) == []
    assert p.propose(8, mtp_draft=[7, 8, 9, 10]) == [7, 8, 9]  # capped at mtp_depth
    assert p.propose(2) == [7, 8]
    assert p.propose_after([7], 4) == [8, 9]
    assert p.propose_after([6], 4) == []
    p.observe([7])
    assert p.propose(4) == [8, 9]  # what is left of the draft after the committed 7
    p.observe([5])
    assert p.propose(4) == []  # contradicted by the log


def test_mtp_simple_appends_an_ngram_tail_after_the_mtp_tokens() -> None:
    config = SpecConfig(ngram_min=1, ngram_max=3, mtp_depth=2, extension_tokens=2)
    p = make_proposer("mtp-simple", config)
    p.reset([1, 2, 3, 4, 5, 6, 1, 2])
    # MTP says 3 4; n-gram lookup after history + [3, 4] continues with 5 6 (2 tokens at most).
    assert p.propose(8, mtp_draft=[3, 4]) == [3, 4, 5, 6]
    assert p.propose(3, mtp_draft=[3, 4]) == [3, 4, 5]
    assert p.propose(1, mtp_draft=[3, 4]) == [3]
    # Pipelined: after assumed [3], MTP has [4] left, then the tail.
    assert p.propose_after([3], 8) == [4, 5, 6]
    # Without an MTP draft the tail alone (up to extension_tokens) is proposed.
    p.observe([9])
    assert p.propose(8) == []
    q = make_proposer("mtp-simple", config)
    q.reset([1, 2, 3, 4, 5, 6, 1, 2])
    assert q.propose(8) == [3, 4]


def test_mtp_simple_follows_the_copy_where_it_agrees_with_the_mtp_draft() -> None:
    config = SpecConfig(ngram_min=1, ngram_max=3, mtp_depth=2, extension_tokens=3)
    p = make_proposer("mtp-simple", config)
    p.reset([1, 2, 3, 4, 5, 6, 7, 1, 2])
    # MTP guesses 3 9, the copy after [1, 2] is 3 4 5 6 7: same first token, so the model is
    # copying and the window is the copy (up to MTP depth + extension tokens), not 3 9 ...
    assert p.propose(8, mtp_draft=[3, 9]) == [3, 4, 5, 6, 7]
    assert p.propose(3, mtp_draft=[3, 9]) == [3, 4, 5]
    # Pipelined after an assumed 3: MTP has 9 left, the copy goes on with 4: they differ,
    # so the MTP rest leads and the n-gram tail follows it.
    assert p.propose_after([3], 8) == [9]
    # A first token the copy does not start with keeps the MTP prefix.
    assert p.propose(8, mtp_draft=[8, 4]) == [8, 4, 5, 6, 7]


def test_mtp_cache_uses_counts_for_its_tail() -> None:
    config = SpecConfig(
        ngram_min=1, ngram_max=1, mtp_depth=1, extension_tokens=3, ngram_cache_min_hits=2
    )
    p = make_proposer("mtp-cache", config)
    p.reset([1, 2, 1, 2, 1, 3, 3])
    assert p.propose(8, mtp_draft=[1]) == [1, 2, 1, 2]
    p.reset([1, 2, 1, 3, 1, 4])  # 1→x seen once each: below min hits
    assert p.propose(8, mtp_draft=[1]) == [1]


def test_accounting_uses_accepted_over_drafted() -> None:
    p = make_proposer("ngram-simple", WIDE)
    p.reset([1])
    assert p.stats.acceptance is None
    p.record(4, 3)
    p.record(4, 0)
    p.record(0, 0)  # a window without drafts is not a draft window
    assert (p.stats.drafted, p.stats.accepted, p.stats.windows) == (8, 3, 2)
    assert p.stats.acceptance == pytest.approx(3 / 8)
    first = p.acceptance()[0]
    p.record(4, 0)
    assert p.acceptance()[0] < first  # rejects shrink the estimate
    p.reset([1])
    assert p.stats.drafted == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_factory_builds_each_strategy(strategy: str) -> None:
    p = make_proposer(strategy, WIDE_DRAFT, draft=tiny_draft(VOCAB))
    p.reset([1, 2, 3, 1, 2])
    assert p.name == strategy
    drafts = p.propose(4)
    assert len(drafts) <= 4
    assert all(isinstance(t, int) for t in drafts)
    assert make_proposer("disabled", WIDE).propose(8, mtp_draft=[1, 2]) == []


def test_unknown_strategy_is_a_clear_error() -> None:
    with pytest.raises(UnknownStrategyError, match=r"'eagle'.*ngram-simple"):
        make_proposer("eagle", WIDE)


@settings(max_examples=60)
@given(
    history=st.lists(st.integers(0, 5), min_size=0, max_size=60),
    assumed=st.lists(st.integers(0, 5), max_size=4),
    mtp_draft=st.lists(st.integers(0, 5), max_size=3),
)
def test_shorter_proposals_are_prefixes_of_longer_ones(
    history: list[int], assumed: list[int], mtp_draft: list[int]
) -> None:
    """`auto` scores a candidate's widest draft and sends a prefix of it: this must hold."""
    for strategy in STRATEGIES:
        p = make_proposer(strategy, WIDE_DRAFT, draft=tiny_draft(VOCAB))
        p.reset(history)
        widest = p.propose(8, mtp_draft)
        assert len(widest) <= 8
        for m in range(9):
            assert p.propose(m, mtp_draft) == widest[:m], (strategy, m)
        after = p.propose_after(assumed, 8)
        for m in range(9):
            assert p.propose_after(assumed, m) == after[:m], (strategy, m)
