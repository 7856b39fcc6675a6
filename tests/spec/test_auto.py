"""`auto`: shadow-scored strategy choice, fallback to disabled, per-model book."""

from __future__ import annotations

import random

from meshd.spec import (
    AcceptanceBook,
    AutoProposer,
    LinkModel,
    PolicyInputs,
    SpecConfig,
    choose,
    make_proposer,
)
from meshd.spec.proposer import Proposer

CONFIG = SpecConfig(strategy="auto", ngram_min=1, ngram_max=3, mtp_depth=3)
WAN = LinkModel(rtt_s=0.040, pass_fixed_s=0.004, pass_per_token_s=0.0005, stages=2)


def drive(p: Proposer, stream: list[int], width: int = 8, mtp=None) -> list[str]:
    """Feed `stream` one token per window (as a depth-1 coordinator would); choices made."""
    choices = []
    for i, token in enumerate(stream):
        draft = mtp(i) if mtp else ()
        p.propose(width, draft)
        choices.append(p.active)
        p.observe([token])
    return choices


def test_auto_falls_back_to_disabled_when_nothing_is_accepted() -> None:
    rng = random.Random(1)
    novel = rng.sample(range(10_000), 120)  # no token ever repeats: n-gram drafts never match
    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset(novel[:20])
    choices = drive(auto, novel[20:])
    assert choices[-1] == "disabled"
    assert auto.propose(8) == []
    assert auto.reason.startswith("disabled: no strategy pays")
    assert "ngram-simple α₁=0.0" in auto.reason


def test_auto_picks_an_ngram_strategy_on_repetitive_input() -> None:
    phrase = [5, 17, 3, 99, 42, 8, 23, 61, 7, 11]
    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset(phrase)
    choices = drive(auto, phrase * 6)
    assert choices[-1] in ("ngram-simple", "ngram-cache")
    assert auto.propose(6) == (phrase * 2)[:6]  # the stream ended at the end of a phrase
    assert auto.plan is not None and auto.plan.width > 0
    assert auto.choice in auto.reason and "rtt 40.0 ms" in auto.reason
    assert auto.acceptance()[0] > 0.9


def test_auto_recovers_after_a_novel_stretch() -> None:
    rng = random.Random(2)
    phrase = [5, 17, 3, 99, 42, 8, 23, 61, 7, 11]
    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset([1])
    drive(auto, rng.sample(range(1000, 5000), 60))
    assert auto.active == "disabled"
    drive(auto, phrase * 5)
    assert auto.active in ("ngram-simple", "ngram-cache")


def test_auto_uses_mtp_only_once_the_model_sends_mtp_drafts() -> None:
    rng = random.Random(3)
    stream = rng.sample(range(10_000), 80)  # novel text: n-grams useless, MTP heads right

    def mtp(i: int) -> list[int]:
        return stream[i : i + 3]

    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset([1, 2, 3])
    assert all(c == "disabled" or c.startswith("ngram") for c in drive(auto, stream[:20]))
    auto.reset([1, 2, 3])
    choices = drive(auto, stream, mtp=mtp)
    assert choices[-1].startswith("mtp")
    assert auto.propose(8, stream[5:8])[:3] == stream[5:8]


def test_auto_learns_per_model_across_requests() -> None:
    rng = random.Random(4)
    book = AcceptanceBook(CONFIG)
    first = AutoProposer(CONFIG, book=book, link=WAN)
    first.reset([0])
    drive(first, rng.sample(range(10_000), 80))
    # A new session of the same model starts from what the book learned: no speculation.
    second = make_proposer("auto", CONFIG, book=book, link=WAN)
    assert isinstance(second, AutoProposer)
    second.reset([0])
    second.propose(8)
    assert second.active == "disabled"
    # A session with its own fresh book starts from the prior and tries n-grams.
    fresh = AutoProposer(CONFIG, link=WAN)
    fresh.reset([0, 1, 0])
    fresh.propose(8)
    assert fresh.active != "disabled"


def test_auto_counts_real_windows_separately_from_shadow_estimates() -> None:
    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset([1, 2, 1, 2])
    before = auto.estimate("ngram-simple")
    auto.record(4, 4)
    assert (auto.stats.drafted, auto.stats.accepted) == (4, 4)
    assert auto.estimate("ngram-simple") == before


def test_auto_on_a_fast_local_link_does_not_speculate_without_evidence() -> None:
    # Zero RTT and compute growing with width: speculation cannot pay at the 0.5 prior.
    local = LinkModel(rtt_s=0.0, pass_fixed_s=0.001, pass_per_token_s=0.001)
    auto = AutoProposer(CONFIG, link=local)
    auto.reset([1, 2, 1, 2, 1])
    assert auto.propose(8) == []
    assert auto.active == "disabled"


def test_auto_keeps_learning_when_the_coordinator_stops_asking_for_drafts() -> None:
    """A coordinator plans from `acceptance()` and calls `propose` only when the width is > 0;
    `auto` must still notice when speculation starts paying again."""
    rng = random.Random(5)
    phrase = [5, 17, 3, 99, 42, 8, 23, 61, 7, 11]
    stream = phrase * 2 + rng.sample(range(1000, 5000), 60) + phrase * 4
    auto = AutoProposer(CONFIG)
    auto.reset(phrase)
    widths = []
    for token in stream:
        auto.set_link(WAN)
        plan = choose(PolicyInputs(WAN, auto.acceptance()), CONFIG)
        if plan.width > 0:
            assert len(auto.propose(plan.width)) <= plan.width
        widths.append(plan.width)
        auto.observe([token])
    assert widths[0] > 0  # the prior says try
    assert widths[79] == 0  # the novel stretch switched speculation off
    assert widths[-1] > 0  # and the repeated phrase switched it back on, with no propose calls
    assert auto.active in ("ngram-simple", "ngram-cache")
