"""`auto` prices the draft model's start and, before it was timed, its passes from its size.

Before its first proposal of a request the draft writes the log its cache lacks (the prompt:
its prefill), a price its per-pass cost leaves out. On one node that price can exceed what a
short request can save however right the draft is; on a 20 ms route a long request pays it
back many times. The draft here is a real (tiny) model whose passes advance a virtual clock:
a drafting pass a third of the target's plain pass plus a tenth of that per token written.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from meshd.model.config import ModelConfig, RopeConfig
from meshd.speculative import draft_price
from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto import AutoProposer
from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.draft_gate import pass_weights, plain_s, start_pays
from meshd.speculative.draft_vocab import DraftVocab
from meshd.speculative.policy import LinkModel
from tests.speculative.drafts import tiny_draft
from tests.speculative.test_auto_cost import DRAFT_S, PLAIN_S, TimedDraft, route
from tests.speculative.test_auto_draft import CONFIG, VOCAB, greedy_text, no_mtp, serve

WRITE_S = DRAFT_S / 10  # a token the draft writes in a long pass (its prefill)
TWENTY_MS = LinkModel(0.020, 0.024, 0.009, stages=2, plain_pass_s=PLAIN_S)


class WritingDraft(TimedDraft):
    """A pass costs `pass_s` plus `WRITE_S` per token it writes (a prefill is not free)."""

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        self.now += WRITE_S * len(tokens)
        return super().rows(session, base_pos, tokens, last_n, vocab)


def writing_auto(book: AcceptanceBook, link: LinkModel) -> tuple[AutoProposer, WritingDraft]:
    draft = WritingDraft(tiny_draft(VOCAB), DRAFT_S)
    auto = AutoProposer(CONFIG, book=book, link=link, draft=draft)
    assert auto._draft is not None
    auto._draft.clock = lambda: draft.now
    return auto, draft


def taught_book(link: LinkModel) -> AcceptanceBook:
    """A book after one long request whose text is the draft's own (it drafted, was timed)."""
    book = AcceptanceBook(CONFIG)
    prompt = [1, 2, 3]
    teacher, _ = writing_auto(book, link)
    stream = greedy_text(tiny_draft(VOCAB), prompt, 90)
    serve(teacher, prompt, stream, no_mtp, link, max_tokens=400)
    assert book.draft_token_s is not None and book.draft_write_token_s is not None
    return book


def long_prompt_request(seed: int, answer: int) -> tuple[list[int], list[int]]:
    """A 150-token prompt (the draft must write it before drafting) and an answer that is
    the draft's own greedy text (it is right nearly always)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(8, VOCAB) for _ in range(150)]
    return prompt, greedy_text(tiny_draft(VOCAB), prompt, answer)


def test_on_one_node_a_short_request_declines_a_draft_whose_start_costs_more_than_it_saves() -> (
    None
):
    """One node, a draft right nearly always (serially it beats plain decoding by ~1.4x
    here), a 150-token prompt and 12 tokens to answer: writing the prompt (0.15 s) costs more
    than 12 tokens can save (~0.1 s), so auto decodes plainly and never runs the draft. The
    gate without the start's price (no budget told) let the draft in and drafted; with a long
    budget (the start pays back) it drafts too."""
    link = route(0.0, measured=True)
    book = taught_book(link)
    prompt, answer = long_prompt_request(1, 12)
    auto, draft = writing_auto(book, link)
    before = draft.now
    served = serve(auto, prompt, answer, no_mtp, link, max_tokens=len(answer))
    assert "draft-ngram" not in served.choices, (served.choices, auto.reason)
    assert draft.now == before  # no pass at all: no prefill, no scoring on one node
    for budget in (None, 400):
        auto, draft = writing_auto(book, link)
        served = serve(auto, prompt, answer, no_mtp, link, max_tokens=budget)
        assert "draft-ngram" in served.choices, (budget, served.choices)


def test_at_20_ms_a_long_request_pays_the_drafts_start_back_and_drafts_with_it() -> None:
    """2 stages at 20 ms, the same 150-token prompt, 90 tokens the draft gets right nearly
    always: each window saves round trips, the start is paid back many times, and auto
    drafts with the draft in most windows."""
    book = taught_book(TWENTY_MS)
    prompt, answer = long_prompt_request(2, 90)
    auto, _ = writing_auto(book, TWENTY_MS)
    served = serve(auto, prompt, answer, no_mtp, TWENTY_MS, max_tokens=len(answer))
    assert served.choices.count("draft-ngram") > len(served.choices) // 2, served.choices


def test_the_start_is_weighed_against_what_the_rest_of_the_request_saves() -> None:
    tuning = AutoTuning()
    link = route(0.0, measured=True)
    # 1.5x faster for 12 tokens saves 12 * 30 ms / 3 = 0.12 s.
    assert start_pays(link, 1.5, 0.11, 12, tuning)
    assert not start_pays(link, 1.5, 0.13, 12, tuning)
    assert start_pays(link, 1.5, 0.13, 14, tuning)
    assert start_pays(link, 1.5, 10.0, None, tuning)  # the length is not known: no price
    assert plain_s(TWENTY_MS) == pytest.approx(0.020 + PLAIN_S)


def qwen2(hidden: int, inter: int, layers: int, heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        family="qwen2",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope=RopeConfig(),
    )


def test_before_the_draft_was_timed_it_costs_its_share_of_the_weights_of_the_targets_pass() -> None:
    """Qwen2.5-Coder 0.5B beside its 1.5B (their shapes): a pass reads ~0.32 of the target's
    weights, so until the draft was timed a pass is priced at 0.32 of the target's measured
    plain pass (it was 1 ms: a real draft looked free and the first request drafted with it);
    without the sizes, at `draft_cost_prior_ratio`; once timed, as timed."""
    target = qwen2(1536, 8960, 28, 12, 128)
    draft = qwen2(896, 4864, 24, 14, 64)
    ratio = pass_weights(draft) / pass_weights(target)
    assert 0.30 < ratio < 0.34
    link = route(0.0, measured=True)
    book = AcceptanceBook(CONFIG)
    auto, _ = writing_auto(book, link)
    part = auto._draft
    assert part is not None
    assert draft_price.token_s(part, book, link) == pytest.approx(PLAIN_S / 3)
    book.draft_size_ratio = ratio
    assert draft_price.token_s(part, book, link) == pytest.approx(ratio * PLAIN_S)
    # A prefill token before one was timed: a fifth of a pass; the prompt it lacks, all.
    part.reset([5] * 40)
    assert draft_price.start_s(part, book, link) == pytest.approx(40 * 0.2 * ratio * PLAIN_S)
    book.time_score(0.004)
    assert draft_price.token_s(part, book, link) == pytest.approx(0.004)


def test_on_one_node_a_new_book_does_not_draft_with_a_draft_it_has_not_timed() -> None:
    """A fresh node, one node, a text the draft gets right nearly always: priced at its size
    before it was timed (a third of the target's pass), the draft is not let in on the prior
    (its first pass, the prompt's prefill, comes after ~20 plain commits, and only then is it
    weighed as measured); priced at a near-free prior (1 ms, as it was), it drafted from the
    fifth window, before anything of its cost was known."""
    link = route(0.0, measured=True)
    prompt, answer = long_prompt_request(3, 24)
    choices = {}
    for ratio in (1 / 3, 0.001 / PLAIN_S):
        book = AcceptanceBook(CONFIG, tuning=AutoTuning(draft_cost_prior_ratio=ratio))
        auto, _ = writing_auto(book, link)
        choices[ratio] = serve(auto, prompt, answer, no_mtp, link, max_tokens=400).choices
    assert "draft-ngram" not in choices[1 / 3][:20], choices[1 / 3]
    assert "draft-ngram" in choices[0.001 / PLAIN_S][:8], choices


def test_a_short_request_after_a_long_prompt_does_not_pay_the_drafts_prefill_for_a_score() -> None:
    """2 stages at 20 ms, a fresh node (the draft never timed, nothing in the book): scoring
    the draft teacher-forced needs its cache to hold the log, so a cold session's first
    scoring pass writes the whole prompt. Forced at least every 32 commits, it made a chat's
    first 48-token answer after a 663-token prompt take 3x as long as plain decoding on the
    real pair. Now the floor forces that start only where the rest of the request could pay
    it back: after a 400-token prompt, 40 tokens run no draft pass at all; after a 20-token
    prompt the draft is scored as before."""
    rng = random.Random(5)
    long_prompt = [rng.randrange(8, VOCAB) for _ in range(400)]
    for prompt, scored in ((long_prompt, False), (long_prompt[:20], True)):
        answer = greedy_text(tiny_draft(VOCAB), prompt, 40)
        book = AcceptanceBook(CONFIG)
        auto, draft = writing_auto(book, TWENTY_MS)
        served = serve(auto, prompt, answer, no_mtp, TWENTY_MS, max_tokens=len(answer))
        assert (draft.now > 0) == scored, (len(prompt), draft.now, served.choices)
