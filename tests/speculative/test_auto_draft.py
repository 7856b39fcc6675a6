"""`auto` with a draft model: the draft scored teacher-forced, decisions as often as they pay.

A real (tiny, random) draft model drafts. The text a request "generates" is either the draft's
own greedy continuation (its drafts are always right) or tokens it never predicts, and the MTP
drafts the test hands over are right or wrong, so each stretch has a clear winner.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto import AutoProposer
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel, DraftNgram, DraftProposer
from meshd.speculative.draft_scoring import draft_ngram_shadow as _draft_ngram_shadow
from meshd.speculative.policy import LinkModel, PolicyInputs, choose
from meshd.speculative.sampling import SamplingParams
from tests.speculative.drafts import tiny_draft

VOCAB = 4096
CONFIG = SpecConfig(strategy="auto", ngram_min=1, ngram_max=3, mtp_depth=3)
# Two stages, 20 ms a hop; the heads cost 2 ms a window.
WAN = LinkModel(
    rtt_s=0.040, pass_fixed_s=0.004, pass_per_token_s=0.0005, stages=2, mtp_s=0.002,
    mtp_measured=True,
)  # fmt: skip

Mtp = Callable[[list[int], int], list[int]]


def right_mtp(stream: list[int], i: int) -> list[int]:
    return stream[i : i + 3]


def wrong_mtp(stream: list[int], i: int) -> list[int]:
    return [-5, -6, -7]


def greedy_text(draft: DraftModel, context: list[int], n: int) -> list[int]:
    """The draft's own greedy continuation of `context`: every draft of it is right."""
    session = draft.open(len(context) + n + 8)
    try:
        row = draft.next_logits(session, 0, context)
        out: list[int] = []
        for i in range(n):
            out.append(int(row.argmax()))
            row = draft.next_logits(session, len(context) + i, [out[-1]])
        return out
    finally:
        draft.close(session)


def novel(rng: random.Random, n: int) -> list[int]:
    """Tokens the draft never predicts (ids past its vocabulary) and no n-gram repeats."""
    return rng.sample(range(VOCAB, 40_000), n)


@dataclass
class Served:
    choices: list[str] = field(default_factory=list)  # the strategy drafting each window
    starts: list[int] = field(default_factory=list)  # stream index each window starts at
    heads: list[bool] = field(default_factory=list)  # whether the heads ran for it
    widths: list[int] = field(default_factory=list)  # drafts it sent
    decided: list[str] = field(default_factory=list)  # the last decision's choice


def with_draft(
    draft: DraftModel,
    book: AcceptanceBook | None = None,
    link: LinkModel = WAN,
    pass_s: float = 0.0005,
) -> AutoProposer:
    """`auto` with `draft`, its draft's passes timed on a virtual clock: each timed call (a
    proposal, a scoring pass) takes `pass_s`, so what auto decides does not depend on this
    machine's speed or load."""
    auto = AutoProposer(CONFIG, book=book, link=link, draft=draft)
    assert auto._draft is not None
    auto._draft.clock = itertools.count(0.0, pass_s).__next__
    return auto


def serve(
    auto: AutoProposer,
    prompt: list[int],
    stream: list[int],
    mtp: Mtp,
    link: LinkModel = WAN,
    *,
    planned: bool = False,
    max_tokens: int | None = None,
) -> Served:
    """One request as a depth-1 coordinator runs it: each window commits the drafts that
    match `stream` plus one token; once `wants_mtp` says no, the heads stop for the request
    and send no more drafts. Each window asks for 8 drafts, or with `planned` for the width
    the window policy plans from the active strategy's estimates (`WindowLoop._plan`).
    `max_tokens`: the request's budget, as the window loop tells it (`expect_tokens`)."""
    out = Served()
    auto.reset(prompt)
    if max_tokens is not None:
        auto.expect_tokens(max_tokens)
    heads, i = True, 0
    while i < len(stream):
        auto.set_link(link)
        if heads and not auto.wants_mtp:
            auto.stop_mtp()
            heads = False
        width = 8
        if planned:
            cost = link.with_draft_cost(auto.draft_cost_s) if auto.draft_cost_s else link
            on = auto.active != "disabled"
            width = choose(PolicyInputs(cost, auto.acceptance()), CONFIG).width if on else 0
        drafts = auto.propose(width, mtp(stream, i) if heads else ())
        accepted = 0
        while accepted < len(drafts) and i + accepted < len(stream):
            if drafts[accepted] != stream[i + accepted]:
                break
            accepted += 1
        out.choices.append(auto.active)
        out.starts.append(i)
        out.heads.append(heads)
        out.widths.append(len(drafts))
        out.decided.append(auto.choice)
        auto.record(len(drafts), accepted)
        committed = stream[i : i + accepted + 1]
        auto.observe(committed)
        i += len(committed)
    auto.close()
    return out


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_the_drafts_teacher_forced_choices_are_what_it_would_have_drafted(mode: str) -> None:
    draft = tiny_draft(VOCAB)
    rng = random.Random(5)
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=0.8, seed=3)
    log = [rng.randrange(VOCAB) for _ in range(40)]
    scorer = DraftProposer(CONFIG, draft, params)
    scorer.reset(log[:10])
    choices: dict[int, int] = {}
    for upto in (10, 14, 15, 23, 40):  # the log grows; each pass writes only the new tokens
        scorer.observe(log[len(scorer.tokens) : upto])
        since = max(choices, default=9) + 1
        first, tokens = scorer.predict_log(since)
        assert first == min(since, upto)
        choices.update({first + j: t for j, t in enumerate(tokens)})
    assert sorted(choices) == list(range(10, 41))
    for position in (10, 11, 17, 30, 40):
        own = DraftProposer(CONFIG, draft, params)
        own.reset(log[:position])
        assert own.propose(1) == [choices[position]]
        own.close()
    scorer.close()


def test_a_draft_ngram_start_is_settled_by_the_first_disagreement_or_a_full_window() -> None:
    log = [10, 11, 12, 13, 14, 15]
    choices = {2: 12, 3: 13, 4: 99, 5: 15, 6: 16}
    eos = frozenset({7})
    # Prompt lookup's copy agrees with the draft's first token: the copy is the proposal.
    assert _draft_ngram_shadow(choices, log, 2, [12, 50], 8, eos) == ([12, 50], False)
    # Else the draft's chain, to its first token that differs from the log.
    assert _draft_ngram_shadow(choices, log, 2, [51, 12], 8, eos) == ([12, 13, 99], False)
    assert _draft_ngram_shadow(choices, log, 2, [], 2, eos) == ([12, 13], False)  # a full window
    # A chain right to the log's end is known so far, and open: the log (and the draft) go on.
    assert _draft_ngram_shadow(choices, log, 5, [], 8, eos) == ([15, 16], True)
    assert _draft_ngram_shadow({5: 15}, log, 5, [], 8, eos) == ([15], True)  # no pass beyond
    assert _draft_ngram_shadow(choices, log, 1, [], 8, eos) is None  # not run there yet
    assert _draft_ngram_shadow({2: 7}, log, 2, [], 8, eos) == ([7], False)  # nothing after EOS


def test_auto_scores_the_draft_with_one_pass_over_several_commits_not_a_pass_per_draft() -> None:
    """While the heads win, the draft is scored at every commit's start at the cost of one
    pass over several new tokens, and never drafts."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(6)
    stream = novel(rng, 150)
    auto = with_draft(draft)
    part = auto._draft
    assert isinstance(part, DraftNgram)
    served = serve(auto, [1, 2, 3], stream, right_mtp)
    assert served.choices[-1].startswith("mtp")
    assert "draft-ngram" not in served.choices
    windows = len(served.choices)
    scored = auto.estimate("draft-ngram")
    assert scored[0] < 0.2  # it was scored, and found wrong
    # One pass per few commits (a pass per drafted token would be 8 a commit).
    assert 0 < part.passes < windows


def test_a_request_that_moved_to_the_heads_moves_back_when_the_text_turns_to_the_draft() -> None:
    """The draft is scored at every start while the heads draft, so auto sees it pay again
    within a few windows (9 here; with a shadow draft at one start in 16 it took 21, through a
    stretch of ngram-simple)."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(7)
    prompt = [1, 2, 3]
    first = novel(rng, 60)  # the heads' text
    second = greedy_text(draft, [*prompt, *first], 120)  # then the draft's
    stream = first + second

    def mtp(stream: list[int], i: int) -> list[int]:
        return right_mtp(stream, i) if i < len(first) else wrong_mtp(stream, i)

    auto = with_draft(draft, AcceptanceBook(CONFIG))
    served = serve(auto, prompt, stream, mtp)
    turned = next(w for w, start in enumerate(served.starts) if start >= len(first))
    assert served.choices[turned - 1].startswith("mtp")
    back = served.choices.index("draft-ngram", turned)
    assert back - turned <= 12, served.choices[turned:]
    assert served.choices[-1] == "draft-ngram"


def test_the_draft_is_scored_more_sparsely_where_a_token_is_quick() -> None:
    """On one fast node the draft's teacher-forced pass waits for many commits, so scoring it
    costs a small share of each token there too; at 40 ms a window it comes every few."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(8)
    stream = novel(rng, 120)
    scoring = {}
    for name, rtt in (("wan", 0.040), ("fast", 0.0)):
        link = LinkModel(rtt_s=rtt, pass_fixed_s=0.0025, pass_per_token_s=0.0005, stages=1)
        auto = with_draft(draft, link=link)
        assert auto._draft is not None
        auto.reset([1, 2, 3])
        scoring[name] = 0
        for token in stream:
            auto.set_link(link)
            auto.propose(8)
            before = auto._draft.passes
            auto.observe([token])  # the scoring passes run here, drafting ones in `propose`
            scoring[name] += auto._draft.passes - before
        auto.close()
    assert 1 <= scoring["fast"] <= len(stream) // 30, scoring
    assert scoring["wan"] >= len(stream) // 4, scoring


def test_a_new_request_weighs_the_draft_at_what_it_cost_before_not_as_free() -> None:
    """Until it drafts in a request, the draft is weighed at the cost per token the book
    keeps: one that cost 30 ms a token is no candidate on a 40 ms route however right."""
    draft = tiny_draft(VOCAB)
    prompt = [1, 2, 3]
    stream = greedy_text(draft, prompt, 80)
    picked = {}
    for name, cost in (("cheap", 0.0002), ("dear", 0.030)):
        book = AcceptanceBook(CONFIG)
        teacher = with_draft(draft, book)
        serve(teacher, prompt, stream, wrong_mtp)  # the book learns the draft is right
        book.draft_token_s = cost
        auto = with_draft(draft, book)
        auto.reset(prompt)
        picked[name] = auto.active
        auto.close()
    assert picked["cheap"] == "draft-ngram"
    assert picked["dear"] != "draft-ngram", picked


def test_a_request_the_draft_wins_stops_the_heads_though_the_book_favours_them() -> None:
    """After requests where the heads were right and the draft wrong, the book favours the
    heads; a request whose text is the draft's stops them by its own estimates (the heads'
    drafts half right here), so its windows no longer pay for them."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(9)
    book = AcceptanceBook(CONFIG)
    for _ in range(3):
        teacher = with_draft(draft, book)
        serve(teacher, [1, 2, 3], novel(rng, 100), right_mtp)

    def half_right(stream: list[int], i: int) -> list[int]:
        return [stream[i], -1, -2] if i < len(stream) else []

    prompt = [7, 8, 9]
    auto = with_draft(draft, book)
    served = serve(auto, prompt, greedy_text(draft, prompt, 240), half_right)
    assert served.choices[-1] == "draft-ngram"
    assert False in served.heads, served.choices
    stopped = served.heads.index(False)
    assert stopped <= 30, served.choices
    assert not any(served.heads[stopped:])


def no_mtp(stream: list[int], i: int) -> list[int]:
    return []  # a model without MTP heads


def half_the_drafts(draft: DraftModel, prompt: list[int], n: int, seed: int) -> list[int]:
    """Text the draft gets about half right: two tokens of its own greedy continuation, then
    two it never predicts, and so on."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += greedy_text(draft, [*prompt, *out], 2)
        out += novel(rng, 2)
    return out[:n]


def test_on_one_node_where_the_draft_costs_more_than_it_saves_auto_decodes_plainly() -> None:
    """One node (no round trip; a plain token 3 ms) and a draft whose pass costs 1.5 ms: at
    half its drafts right, a draft window costs more than the tokens it saves. After one
    request has taught the node's book, a request settles on plain decoding within a few
    windows and runs no draft pass at all: declined by the gate, the draft is only probed in
    the network's wait, and one node has none (it had spent one pass per 32 commits, the
    prompt's prefill included: 5-7 % of a request on the built-in model). On a 20 ms route
    the same text and costs make the draft pay, and auto drafts with it."""
    draft = tiny_draft(VOCAB)
    prompt = [1, 2, 3]
    one_node = LinkModel(rtt_s=0.0, pass_fixed_s=0.0025, pass_per_token_s=0.0005, stages=1)
    pass_s = 0.0015
    plain_s = one_node.compute_s(0)
    for link, name in ((one_node, "one node"), (WAN, "wan")):
        book = AcceptanceBook(CONFIG)
        teacher = with_draft(draft, book, link, pass_s)
        serve(teacher, prompt, half_the_drafts(draft, prompt, 120, 1), no_mtp, link)
        auto = with_draft(draft, book, link, pass_s)
        part = auto._draft
        assert part is not None
        stream = half_the_drafts(draft, prompt, 120, 2)
        served = serve(auto, prompt, stream, no_mtp, link)
        if name == "wan":
            assert served.choices.count("draft-ngram") > len(served.choices) // 2, served.choices
            continue
        assert "draft-ngram" not in served.choices[4:], served.choices
        assert part.passes == 0, (part.passes, len(stream) * plain_s)


def test_decoding_plainly_auto_moves_to_the_draft_within_a_few_windows_of_its_text() -> None:
    """While auto decodes plainly (a commit a window) the draft's scored starts are credited
    as far as the log has confirmed them, not only once a whole window's worth is known: when
    the text turns to the draft's, auto drafts with it the next window (it took 8 when a start's
    credit waited for its full window)."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(11)
    prompt = [1, 2, 3]
    first = novel(rng, 40)  # nothing predicts this: plain decoding
    stream = first + greedy_text(draft, [*prompt, *first], 100)
    auto = with_draft(draft, AcceptanceBook(CONFIG))
    served = serve(auto, prompt, stream, no_mtp)
    turned = served.starts.index(len(first))
    assert served.choices[turned - 1] == "disabled", served.choices
    back = served.choices.index("draft-ngram", turned)
    assert back - turned <= 3, served.choices[turned:]


def test_prompt_lookup_with_nothing_to_copy_hands_its_windows_to_the_draft() -> None:
    """Where prompt lookup is the choice (a copied stretch) and finds nothing to copy, the
    window drafts with the draft model, not plainly: such windows had committed one token
    each until the next decision (8 of 47 windows of a completion request at 2 stages /
    20 ms), where the draft's commit several."""
    draft = tiny_draft(VOCAB)
    rng = random.Random(12)
    prompt = novel(rng, 60)
    stream: list[int] = []
    for start in (0, 20, 40):
        stream += prompt[start : start + 16]  # a stretch prompt lookup copies
        stream += greedy_text(draft, [*prompt, *stream], 24)  # then the draft's own text
    book = AcceptanceBook(CONFIG)
    serve(with_draft(draft, book), prompt, stream, no_mtp, planned=True)  # the book learns
    served = serve(with_draft(draft, book), prompt, stream, no_mtp, planned=True)
    handed = [
        w
        for w, (choice, active) in enumerate(zip(served.decided, served.choices, strict=True))
        if choice == "ngram-simple" and active != choice
    ]
    assert handed, served.decided  # the case arose: lookup chosen, nothing to copy
    assert all(served.choices[w] == "draft-ngram" and served.widths[w] > 0 for w in handed)
    plain = [w for w, width in enumerate(served.widths) if width == 0]
    assert len(plain) <= 2, (plain, served.choices)


def test_a_declined_draft_is_probed_only_within_a_small_share_of_the_network_wait() -> None:
    """Where text the draft never predicts made the gate decline it, later requests still
    probe it on a route with a long round trip (a text it predicts could bring it back), but
    their passes, the cold session's prefill included, cost at most `draft_probe_share` of
    the round trips they waited, on a LAN (2 ms) as on a 40 ms route, not a share of the
    decoding time."""
    draft = tiny_draft(VOCAB)
    lan = LinkModel(rtt_s=0.002, pass_fixed_s=0.0025, pass_per_token_s=0.0005, stages=2)
    pass_s = 0.003
    probes: dict[float, int] = {}
    for link in (lan, WAN):
        rng = random.Random(13)
        book = AcceptanceBook(CONFIG)
        serve(with_draft(draft, book, link, pass_s), novel(rng, 40), novel(rng, 150), no_mtp, link)
        probes[link.rtt_s], waited = 0, 0.0
        for _ in range(3):
            auto = with_draft(draft, book, link, pass_s)
            part = auto._draft
            assert part is not None
            served = serve(auto, novel(rng, 40), novel(rng, 300), no_mtp, link)
            assert "draft-ngram" not in served.choices, served.choices
            probes[link.rtt_s] += part.passes
            waited += len(served.choices) * link.rtt_s
        assert probes[link.rtt_s] * pass_s <= book.tuning.draft_probe_share * waited, probes
    assert probes[WAN.rtt_s] >= 1, probes  # it is probed where the wait is long
