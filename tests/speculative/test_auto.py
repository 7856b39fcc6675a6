"""`auto`: shadow-scored strategy choice, fallback to disabled, per-model book."""

from __future__ import annotations

import random

from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto import AutoProposer
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import LinkModel, PolicyInputs, choose
from meshd.speculative.proposer import Proposer
from meshd.speculative.strategies import make_proposer

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
    assert "ngram-simple α₁=0.50 copies 0.00" in auto.reason  # never a copy: its prior stands


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


def test_auto_switches_on_within_a_few_tokens_of_a_repeat_after_a_long_novel_stretch() -> None:
    # A long stable stretch spaces decisions out (they cost time on a fast node); a candidate
    # whose shadow draft came true in full must still bring the next decision forward.
    rng = random.Random(5)
    phrase = rng.sample(range(6000, 7000), 12)
    novel = rng.sample(range(1000, 5000), 300)
    auto = AutoProposer(CONFIG, link=WAN)
    auto.reset([1, *phrase])
    drive(auto, novel)
    assert auto.active == "disabled"
    choices = drive(auto, phrase * 2)
    switched = next(i for i, c in enumerate(choices) if c != "disabled")
    # The first full-window match can only settle `width` tokens into the repeat.
    assert switched <= 8 + 2, choices


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
    assert widths[0] == 0  # the prompt's last token occurs nowhere before: nothing to copy
    assert widths[1] > 0  # the first copy: the prior says try
    assert widths[79] == 0  # the novel stretch switched speculation off
    assert widths[-1] > 0  # and the repeated phrase switched it back on, with no propose calls
    assert auto.active in ("ngram-simple", "ngram-cache")


def _half_right_mtp(stream: list[int]):
    """MTP drafts whose first token is right and the rest wrong (acceptance ≈ 1 of 3)."""

    def mtp(i: int) -> list[int]:
        return [stream[i], -1, -2] if i < len(stream) else []

    return mtp


def _first_request(
    rng: random.Random, link: LinkModel, mtp_of=None
) -> tuple[AcceptanceBook, AutoProposer]:
    """A book taught by one request of 60 novel tokens on `link` (only the MTP heads can draft
    them; their drafts are `mtp_of(stream)`, half right by default): the book and the request."""
    book = AcceptanceBook(CONFIG)
    first = AutoProposer(CONFIG, book=book, link=link)
    stream = rng.sample(range(10_000), 60)
    first.reset([1, 2, 3])
    drive(first, stream, mtp=(mtp_of or _half_right_mtp)(stream))
    return book, first


def _always_right_mtp(stream: list[int]):
    """MTP drafts that are always the next tokens."""
    return lambda i: stream[i : i + 3]


def test_auto_stops_the_mtp_heads_where_their_measured_cost_outweighs_them() -> None:
    from dataclasses import replace

    rng = random.Random(5)
    stream = rng.sample(range(10_000), 60)  # novel text: only the MTP heads can draft it
    # One node, no network: a plain step costs 3.4 ms, the MTP heads 4 ms more per window.
    local = LinkModel(rtt_s=0.0, pass_fixed_s=0.003, pass_per_token_s=0.0002, stages=1)
    costly = replace(local, mtp_s=0.004, mtp_measured=True)
    auto = AutoProposer(CONFIG, link=costly)
    auto.reset([1, 2, 3])
    drive(auto, stream, mtp=_half_right_mtp(stream))
    assert auto.active == "disabled"
    assert not auto.wants_mtp  # enough scored windows, and MTP loses to plain decoding
    auto.stop_mtp()
    assert auto.active == "disabled" and not auto.wants_mtp
    assert "mtp" not in auto.reason  # only the strategies still available are weighed

    # The same acceptance over a 40 ms WAN: one round trip saved per token outweighs the heads.
    wan = replace(WAN, mtp_s=0.004, mtp_measured=True)
    auto = AutoProposer(CONFIG, link=wan)
    auto.reset([1, 2, 3])
    drive(auto, stream, mtp=_half_right_mtp(stream))
    assert auto.active.startswith("mtp") and auto.wants_mtp


def test_auto_keeps_the_mtp_heads_until_their_cost_is_measured() -> None:
    rng = random.Random(6)
    stream = rng.sample(range(10_000), 40)
    local = LinkModel(rtt_s=0.0, pass_fixed_s=0.003, pass_per_token_s=0.0002, stages=1)
    auto = AutoProposer(CONFIG, link=local)  # mtp_measured False: the heads have not run yet
    auto.reset([1, 2, 3])
    drive(auto, stream, mtp=_half_right_mtp(stream))
    assert auto.wants_mtp


def test_mtp_drafts_pay_the_heads_cost_in_the_policy_but_plain_decoding_does_not() -> None:
    from dataclasses import replace

    link = LinkModel(rtt_s=0.0, pass_fixed_s=0.003, pass_per_token_s=0.0002, mtp_s=0.002)
    config = SpecConfig(strategy="mtp", window_max_tokens=2)
    free = choose(PolicyInputs(link, (0.5,)), config)
    paid = choose(PolicyInputs(link.with_mtp_drafts(), (0.5,)), config)
    assert paid.baseline_s_per_token == free.baseline_s_per_token  # plain: no heads
    assert link.with_mtp_drafts().compute_s(2) == link.compute_s(2) + 0.002
    assert replace(link, draft_overhead_s=0.0).compute_s(0) == link.compute_s(0)
    assert paid.width == 0 and free.width > 0  # the heads' cost turns a gain into a loss


def test_auto_does_not_re_decide_every_token_where_a_token_is_quick() -> None:
    """An n-gram choice with nothing to match drafts nothing; on one fast node (a plain token
    ≈ 3 ms) that is no reason to weigh every candidate again at each token (it was: a search
    over every candidate per token on novel text). Where a token takes a round trip of 40 ms
    a decision is cheap beside it, and auto looks again every token."""
    rng = random.Random(9)
    phrase = [5, 17, 3, 99, 42, 8, 23, 61, 7, 11]
    fast = LinkModel(rtt_s=0.0, pass_fixed_s=0.0025, pass_per_token_s=0.0005, stages=1)
    decided = {}
    for name, link in (("fast", fast), ("wan", WAN)):
        auto = AutoProposer(CONFIG, link=link)
        auto.reset(phrase * 3)
        assert auto.active != "disabled"  # the repeated prompt says speculate
        before = auto.decisions
        for token in rng.sample(range(1000, 5000), 10):
            auto.set_link(link)
            auto.observe([token])
        decided[name] = auto.decisions - before
    # Every 4 tokens at first on the fast node (the spacing doubles while the choice holds).
    assert decided["fast"] <= 3
    assert decided["wan"] >= 8


def test_a_few_unlucky_mtp_windows_do_not_stop_the_heads_where_the_book_says_they_pay() -> None:
    from dataclasses import replace

    rng = random.Random(8)
    # Heads so dear that they pay only while more than half of their first drafts are right.
    wan = replace(WAN, mtp_s=0.020, mtp_measured=True)
    book, first = _first_request(rng, wan)  # novel: only the MTP heads can draft it
    assert first.active.startswith("mtp")

    # The next request's first MTP drafts all miss, then the heads are right again.
    second = AutoProposer(CONFIG, book=book, link=wan)
    stream = rng.sample(range(10_000), 60)
    second.reset([1, 2, 3])
    kept_on, choices = [], []
    for i, token in enumerate(stream):
        second.propose(8, [-5, -6, -7] if i < 5 else _half_right_mtp(stream)(i))
        kept_on.append(second.wants_mtp)
        choices.append(second.active)
        second.observe([token])
    assert not all(c.startswith("mtp") for c in choices[:8]), choices  # the misses told
    assert all(kept_on), (kept_on, choices)  # five misses were this request's only evidence
    assert second.active.startswith("mtp")
    # One request's bad start moved the book's estimate, but not below what pays.
    assert book.tracker("mtp").per_position()[0] > 0.9


def test_the_heads_stop_at_once_in_a_new_request_where_the_book_says_they_do_not_pay() -> None:
    from dataclasses import replace

    rng = random.Random(9)
    local = LinkModel(rtt_s=0.0, pass_fixed_s=0.003, pass_per_token_s=0.0002, stages=1)
    costly = replace(local, mtp_s=0.004, mtp_measured=True)
    book, first = _first_request(rng, costly)
    assert book.tracker("mtp").samples >= 8 and not first.wants_mtp
    # The book has judged the heads on this route: the next request does not pay for them.
    second = AutoProposer(CONFIG, book=book, link=costly)
    stream = rng.sample(range(10_000), 60)
    second.reset([1, 2, 3])
    second.propose(8, _half_right_mtp(stream)(0))
    assert not second.wants_mtp


def test_an_editing_request_that_favoured_ngrams_does_not_stop_the_heads_for_novel_text() -> None:
    """The book's n-gram estimate comes from another request's text: after a request that
    repeats itself (n-gram drafts all right), a request of novel text must still get to use
    the MTP heads where they pay on the route (it once stopped them at its first window)."""
    from dataclasses import replace

    rng = random.Random(10)
    wan = replace(WAN, mtp_s=0.002, mtp_measured=True)
    book = AcceptanceBook(CONFIG)
    phrase = rng.sample(range(10_000), 12)
    edit = AutoProposer(CONFIG, book=book, link=wan)
    edit.reset(phrase)
    repeated = phrase * 6
    drive(edit, repeated, mtp=_half_right_mtp(repeated))
    assert edit.active.startswith("ngram") or edit.active == "mtp-simple"
    assert book.tracker("mtp").samples >= 8

    prose = AutoProposer(CONFIG, book=book, link=wan)
    stream = rng.sample(range(10_000), 60)  # novel: only the MTP heads can draft it
    prose.reset([1, 2, 3])
    kept_on, choices = [], []
    for i, token in enumerate(stream):
        prose.propose(8, _half_right_mtp(stream)(i))
        kept_on.append(prose.wants_mtp)
        choices.append(prose.active)
        prose.observe([token])
    assert all(kept_on), (kept_on, choices)
    assert sum(c.startswith("mtp") for c in choices[-20:]) >= 15, choices


def test_a_request_whose_text_starts_badly_for_the_heads_keeps_them_a_while() -> None:
    """Where the book says the heads pay, a request that has only chosen plain decoding so
    far keeps them past its first eight windows: its text may get better for them (prose
    often does), and stopping them is final for the request."""
    from dataclasses import replace

    rng = random.Random(11)
    wan = replace(WAN, mtp_s=0.002, mtp_measured=True)
    book, first = _first_request(rng, wan)
    assert first.active.startswith("mtp")

    second = AutoProposer(CONFIG, book=book, link=wan)
    stream = rng.sample(range(10_000), 60)
    second.reset([1, 2, 3])
    kept_on, choices = [], []
    for i, token in enumerate(stream):
        bad = i < 14  # fourteen windows of wrong drafts, then the heads find their feet
        second.propose(8, [-5, -6, -7] if bad else _half_right_mtp(stream)(i))
        kept_on.append(second.wants_mtp)
        choices.append(second.active)
        second.observe([token])
    assert "disabled" in choices[:14], choices
    assert all(kept_on), (kept_on, choices)
    assert second.active.startswith("mtp"), choices


def test_a_request_that_chose_plain_decoding_gets_no_grace_for_heads_dear_on_its_route() -> None:
    """On a fast route the heads are a large share of a plain token (here ≈ 45 %): a request
    whose own drafts have all missed stops them once it has judged them (8 windows), not after
    the 24-window grace a slow route gives, even where the book says they pay."""
    from dataclasses import replace

    rng = random.Random(13)
    local = LinkModel(rtt_s=0.0, pass_fixed_s=0.003, pass_per_token_s=0.0002, stages=2)
    dear = replace(local, mtp_s=0.0015, mtp_measured=True)
    book, first = _first_request(rng, dear, _always_right_mtp)  # the heads are always right
    assert first.active.startswith("mtp") and first.wants_mtp

    second = AutoProposer(CONFIG, book=book, link=dear)
    stream = rng.sample(range(10_000), 30)
    second.reset([1, 2, 3])
    kept_on = []
    for token in stream:
        second.propose(8, [-5, -6, -7])  # this request's text is novel and the heads miss
        kept_on.append(second.wants_mtp)
        second.observe([token])
    assert second.active == "disabled"
    assert not any(kept_on[12:]), kept_on


def _edit_then_write(rng: random.Random, wan: LinkModel) -> tuple[list[bool], list[str]]:
    """A request on `wan` that copies its prompt for 48 tokens (prompt lookup wins), then
    writes 48 new ones (only the half-right MTP heads can draft them), after a novel request
    taught the book that the heads pay. Drives it as the coordinator does: once `wants_mtp`
    says no, the heads stop for the request and send no more drafts. Heads on per token, and
    the choices."""
    book, first = _first_request(rng, wan)
    assert first.active.startswith("mtp")

    body = rng.sample(range(10_000, 20_000), 48)
    answer = body + rng.sample(range(20_000, 30_000), 48)
    edit = AutoProposer(CONFIG, book=book, link=wan)
    edit.reset(body)
    heads_on, choices = [], []
    for i, token in enumerate(answer):
        if heads_on and heads_on[-1] and not edit.wants_mtp:
            edit.stop_mtp()
        heads_on.append(not heads_on or (heads_on[-1] and edit.wants_mtp))
        edit.propose(8, _half_right_mtp(answer)(i) if heads_on[-1] else ())
        choices.append(edit.active)
        edit.observe([token])
    return heads_on, choices


def test_an_edit_answer_keeps_cheap_heads_through_a_copied_stretch_for_the_new_lines() -> None:
    """Where the heads are a small part of a window (a 40 ms route), a request whose choice
    is prompt lookup while it copies keeps them, and drafts its new lines with them after;
    where they cost more than a tenth of a window, they stop once prompt lookup wins."""
    from dataclasses import replace

    cheap = replace(WAN, mtp_s=0.002, mtp_measured=True)
    heads_on, choices = _edit_then_write(random.Random(12), cheap)
    assert any(c.startswith("ngram") for c in choices[:48]), choices
    assert all(heads_on), (heads_on, choices)
    assert sum(c.startswith("mtp") for c in choices[-24:]) >= 18, choices

    costly = replace(WAN, mtp_s=0.012, mtp_measured=True)
    heads_on, choices = _edit_then_write(random.Random(12), costly)
    assert any(c.startswith("ngram") for c in choices[:48]), choices
    assert not heads_on[48], (heads_on, choices)


def test_on_one_node_prompt_lookup_drafts_its_rare_copies_where_they_pay() -> None:
    """Novel text with a phrase of the prompt recurring now and then: the lookup has a copy at
    one position in nine, and its copies are right. On one node (a window's drafts are dear,
    no round trip to save) each copy still pays, and a position without one costs nothing
    more than plain decoding: `auto` drafts the copies as prompt lookup alone does. Counted
    per position, the positions without a copy read as rejects and kept it plain."""
    one_node = LinkModel(rtt_s=0.0, pass_fixed_s=0.030, pass_per_token_s=0.004, stages=1)
    rng = random.Random(11)
    phrase = [5, 17, 3, 99, 42, 8]
    stream: list[int] = []
    for _ in range(12):
        stream += rng.sample(range(1000, 9000), 12) + phrase
    prompt = [1, *phrase, 2]

    def copies_drafted(p: Proposer) -> int:
        p.reset(prompt)
        drafted, at = 0, 0
        while at < len(stream):
            drafts = p.propose(6)
            good = 0
            while (
                good < len(drafts) and at + good < len(stream) and drafts[good] == stream[at + good]
            ):
                good += 1
            drafted += good
            step = good + 1
            p.observe(stream[at : at + step])
            at += step
        return drafted

    lookup = copies_drafted(make_proposer("ngram-simple", CONFIG))
    auto = AutoProposer(CONFIG, link=one_node)
    assert lookup >= 40  # the case arose: most recurrences were copied
    assert copies_drafted(auto) >= 0.8 * lookup
