"""`auto` weighs what the draft model costs beside the target, not only how often it is right.

A real draft costs a sizeable share of the target per token. On one node there is no round
trip for its passes to hide behind, so at the same acceptance it can lose where on a 20 ms
route it wins. The draft here is a real (tiny) model whose passes advance a virtual clock by a
third of the target's plain pass, so the decision does not depend on this machine's speed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto import AutoProposer
from meshd.speculative.auto_decision import Decision
from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.draft import DraftModel
from meshd.speculative.draft_gate import priced_link, serial_gain
from meshd.speculative.draft_vocab import DraftVocab
from meshd.speculative.policy import LinkModel
from tests.speculative.drafts import tiny_draft
from tests.speculative.test_auto_draft import CONFIG, VOCAB, greedy_text, no_mtp, novel, serve

PLAIN_S = 0.030  # the target's one-token pass
DRAFT_S = PLAIN_S / 3  # the draft's pass: a third of the target's


class TimedDraft(DraftModel):
    """The draft model, each of its passes taking `pass_s` on a virtual clock (`now`)."""

    def __init__(self, inner: DraftModel, pass_s: float) -> None:
        super().__init__(inner.stage, inner.path, sorted(inner.eos_ids))
        self.now = 0.0
        self.pass_s = pass_s

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        self.now += self.pass_s
        return super().rows(session, base_pos, tokens, last_n, vocab)


def timed_auto(book: AcceptanceBook, link: LinkModel) -> AutoProposer:
    draft = TimedDraft(tiny_draft(VOCAB), DRAFT_S)
    auto = AutoProposer(CONFIG, book=book, link=link, draft=draft)
    assert auto._draft is not None
    auto._draft.clock = lambda: draft.now
    return auto


def mostly_the_drafts(draft: DraftModel, prompt: list[int], n: int, seed: int) -> list[int]:
    """Text the draft gets about three tokens in four right: three of its own greedy
    continuation, then one it never predicts, and so on."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        out += greedy_text(draft, [*prompt, *out], 3)
        out += novel(rng, 1)
    return out[:n]


def route(rtt_s: float, measured: bool) -> LinkModel:
    """One stage at `rtt_s`: as the coordinator reports it before any window wider than one
    token (a flat line), or once wide windows were measured (a CPU stage's line: two tokens
    1.4x a plain pass, five 2.3x, nine 3.5x)."""
    if measured:
        return LinkModel(rtt_s, 0.024, 0.009, stages=1, plain_pass_s=PLAIN_S)
    return LinkModel(rtt_s, PLAIN_S, 0.0, stages=1, plain_pass_s=PLAIN_S)


@pytest.mark.parametrize("measured", [False, True], ids=["flat", "measured"])
def test_a_draft_at_a_third_of_the_target_is_declined_on_one_node_and_chosen_at_20_ms(
    measured: bool,
) -> None:
    """The same draft, the same text (three drafts in four right): on one node, where a
    window of drafts costs more than the tokens it saves, auto decodes plainly (at most the
    first few windows draft); at 20 ms a round trip, where each window saves round trips, it
    drafts with it in most windows."""
    draft = tiny_draft(VOCAB)
    prompt = [1, 2, 3]
    choices = {}
    for name, rtt in (("one node", 0.0), ("20 ms", 0.020)):
        link = route(rtt, measured)
        book = AcceptanceBook(CONFIG)
        serve(timed_auto(book, link), prompt, mostly_the_drafts(draft, prompt, 90, 1), no_mtp, link)
        auto = timed_auto(book, link)
        served = serve(auto, prompt, mostly_the_drafts(draft, prompt, 90, 2), no_mtp, link)
        assert auto.estimate("draft-ngram")[0] > 0.6, auto.reason  # the draft is mostly right
        choices[name] = served.choices
    assert "draft-ngram" not in choices["one node"][4:], choices["one node"]
    drafted = choices["20 ms"].count("draft-ngram")
    assert drafted > len(choices["20 ms"]) // 2, choices["20 ms"]


def test_an_unmeasured_verify_pass_is_priced_per_draft_and_a_measured_one_as_measured() -> None:
    tuning = AutoTuning()
    flat = route(0.0, measured=False)
    priced = priced_link(flat, tuning)
    assert priced.compute_s(0) == pytest.approx(PLAIN_S)
    assert priced.compute_s(4) == pytest.approx(PLAIN_S * (1 + 4 * tuning.verify_token_prior))
    measured = route(0.0, measured=True)
    assert priced_link(measured, tuning) is measured
    # Serially, a draft as dear as the target never pays; a free one at certainty pays ~k+1.
    dear = priced.with_draft_cost(PLAIN_S)
    assert serial_gain(dear, (0.999,), CONFIG) < 1.0 + 1e-9
    free = LinkModel(0.0, PLAIN_S, 0.0, stages=1).with_draft_cost(0.0)
    assert serial_gain(free, (0.999,), CONFIG) > CONFIG.window_max_tokens


def test_each_decision_is_told_to_the_trace_with_every_candidate_weighed() -> None:
    draft = tiny_draft(VOCAB)
    prompt = [1, 2, 3]
    link = route(0.020, measured=True)
    auto = timed_auto(AcceptanceBook(CONFIG), link)
    told: list[Decision] = []
    auto.trace = told.append
    before = auto.decisions
    served = serve(auto, prompt, mostly_the_drafts(draft, prompt, 60, 3), no_mtp, link)
    assert len(told) == auto.decisions - before > 1
    assert [d.log_length for d in told] == sorted(d.log_length for d in told)
    last = told[-1]
    assert last.choice == served.decided[-1] == auto.choice
    assert last.reason == auto.reason
    assert set(last.candidates) == {"ngram-simple", "ngram-cache", "draft-ngram"}
    assert (last.candidates[last.choice][1] > 0) == (last.choice != "disabled")
