"""A draft model scoring part of its vocabulary (`spec.draft_vocab_tokens`, `DraftVocab`)."""

from __future__ import annotations

import functools

import pytest
import torch

from meshd.speculative.config import DRAFT_STRATEGIES, SpecConfig
from meshd.speculative.draft import DraftModel, DraftProposer
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from tests.speculative.drafts import tiny_draft, tiny_draft_dir
from tests.speculative.target import VOCAB, Target, decode_plain, decode_spec

FIRST = 8  # the draft scores ids 0..7 and the request's own
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


@functools.cache
def block_draft() -> DraftModel:
    """The tiny draft in ggml Q8_0 blocks, as a GGUF draft runs: its head can be narrowed."""
    return DraftModel.load(tiny_draft_dir(VOCAB), quantization="q8_0")


def config(strategy: str = "draft", first: int = FIRST) -> SpecConfig:
    return SpecConfig(
        strategy=strategy,
        window_max_tokens=6,
        ngram_min=1,
        ngram_max=3,
        draft_model=str(tiny_draft_dir(VOCAB)),
        draft_vocab_tokens=first,
    )


def logits(draft: DraftModel, context: list[int], vocab: object = None) -> torch.Tensor:
    session = draft.open(len(context) + 8)
    try:
        return draft.next_logits(session, 0, context, vocab)  # type: ignore[arg-type]
    finally:
        draft.close(session)


def test_a_narrowed_draft_scores_its_first_ids_and_every_id_of_the_request() -> None:
    draft = block_draft()
    context = [3, 20, 1, 27, 20]
    vocab = draft.vocab(FIRST, context)
    assert vocab is not None
    assert vocab.ids.tolist() == [*range(FIRST), 20, 27]
    full = logits(draft, context)
    # Each column is the whole head's logit of its id, to the bit: the same rows' products.
    assert torch.equal(logits(draft, context, vocab), full[vocab.ids])
    vocab.see([31, 2, 20])  # a committed token it did not score joins; the others are there
    assert vocab.ids.tolist() == [*range(FIRST), 20, 27, 31]
    assert torch.equal(logits(draft, context, vocab), full[vocab.ids])


def test_a_draft_scores_the_whole_vocabulary_where_its_head_cannot_be_narrowed() -> None:
    assert tiny_draft(VOCAB).vocab(FIRST, PROMPT) is None  # an fp32 head
    assert block_draft().vocab(0, PROMPT) is None  # 0: all
    assert block_draft().vocab(VOCAB, PROMPT) is None  # nothing left out
    # What the policy's prior prices a pass by: the rows a pass multiplies by.
    assert (block_draft().scored_rows(FIRST), tiny_draft(VOCAB).scored_rows(FIRST)) == (
        FIRST,
        VOCAB,
    )


def test_a_narrowed_draft_proposes_only_ids_it_scores() -> None:
    target = Target(5)
    proposer = DraftProposer(config(), block_draft())
    run = decode_spec(target, PROMPT, 40, SamplingParams(), proposer, 5)
    assert proposer.vocab is not None
    scored = set(proposer.vocab.ids.tolist())
    # The target's tokens past the first ids joined as they were committed, and the draft
    # proposed nothing else.
    committed = set(run.tokens)
    assert committed - set(range(FIRST)), "the run never left the first ids"
    assert committed | set(PROMPT) | set(range(FIRST)) == scored
    # Its choice is the best-scoring id of those it scores.
    ids = sorted(scored)
    full = logits(block_draft(), [*PROMPT, *run.tokens])
    assert proposer.propose(1) == [ids[int(torch.argmax(full[ids]))]]
    for _ in range(3):
        assert set(proposer.propose(4)) <= scored
    proposer.close()


@pytest.mark.parametrize("mode", ["greedy", "t08"])
@pytest.mark.parametrize("strategy", DRAFT_STRATEGIES)
def test_a_narrowed_draft_changes_no_committed_token(strategy: str, mode: str) -> None:
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=0.8, seed=99)
    for target_seed in (1, 2):
        target = Target(target_seed)
        plain = decode_plain(target, PROMPT, 48, params)
        for first in (FIRST, 0):
            proposer = make_proposer(
                strategy, config(strategy, first), draft=block_draft(), sampling=params
            )
            run = decode_spec(target, PROMPT, 48, params, proposer, 6)
            assert run.tokens == plain
            assert run.drafted > 0
            proposer.close()
