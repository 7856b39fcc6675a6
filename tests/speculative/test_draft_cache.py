"""The draft model's prompt cache: a request that starts with an earlier one's tokens (a chat's
next turn) reuses the KV the draft computed for them instead of writing them again."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel, DraftProposer
from meshd.speculative.draft_vocab import DraftVocab
from meshd.speculative.sampling import SamplingParams
from tests.speculative.drafts import tiny_draft, tiny_draft_dir
from tests.speculative.target import VOCAB, Target, decode_spec

TURN = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
MIB = 1 << 20


class CountingDraft(DraftModel):
    """The tiny draft (a copy of its own: its cache is this test's), recording how many tokens
    each pass writes."""

    def __init__(self, prefix_cache_bytes: int) -> None:
        inner = DraftModel.load(tiny_draft_dir(VOCAB))
        super().__init__(inner.stage, inner.path, sorted(inner.eos_ids), prefix_cache_bytes)
        self.written: list[int] = []

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        self.written.append(len(tokens))
        return super().rows(session, base_pos, tokens, last_n, vocab)


def config() -> SpecConfig:
    return SpecConfig(strategy="draft", window_max_tokens=4, draft_model=str(tiny_draft_dir(VOCAB)))


def test_a_chats_next_turn_writes_only_its_new_tokens_to_the_draft() -> None:
    draft = CountingDraft(prefix_cache_bytes=8 * MIB)
    first = DraftProposer(config(), draft)
    run = decode_spec(Target(1), TURN, 24, SamplingParams(), first, 4)
    first.close()
    assert draft.sessions == 0 and draft.cache_bytes > 0  # the session ended, its KV stayed
    # The next turn: the conversation so far, then the user's new message.
    second_prompt = [*TURN, *run.tokens, 7, 7, 2]
    draft.written.clear()
    second = DraftProposer(config(), draft)
    second.reset(second_prompt)
    # What `auto` prices the draft's start by, before the session opens, is the same count.
    unwritten = second.unwritten()
    assert unwritten <= 3 + 4
    drafts = second.propose(3)
    assert draft.written[0] == unwritten
    # Its first pass wrote the new message and the tokens the first request's cache never
    # held (its last committed tokens), not the conversation again.
    assert draft.written[0] <= 3 + 4
    assert draft.written[0] < len(second_prompt) // 2
    # And it drafts what a draft that wrote everything drafts.
    fresh = DraftProposer(config(), tiny_draft(VOCAB))
    fresh.reset(second_prompt)
    assert drafts == fresh.propose(3)
    second.close()
    fresh.close()
    assert draft.sessions == 0


def test_without_a_cache_limit_a_draft_keeps_nothing() -> None:
    draft = CountingDraft(prefix_cache_bytes=0)
    first = DraftProposer(config(), draft)
    decode_spec(Target(1), TURN, 16, SamplingParams(), first, 4)
    first.close()
    assert draft.cache_bytes == 0
    draft.written.clear()
    again = DraftProposer(config(), draft)
    again.reset(TURN)
    again.propose(1)
    assert draft.written[0] == len(TURN)  # written in full
    again.close()


def test_kept_entries_stay_within_the_cache_bytes() -> None:
    per_token = tiny_draft(VOCAB).stage.kv.layout.bytes_per_token
    limit = per_token * 100  # room for about two of these requests' logs
    draft = CountingDraft(prefix_cache_bytes=limit)
    for seed in range(5):
        proposer = DraftProposer(config(), draft)
        prompt = [(seed * 7 + i) % VOCAB for i in range(20)]
        decode_spec(Target(seed), prompt, 24, SamplingParams(), proposer, 4)
        proposer.close()
        assert 0 < draft.cache_bytes <= limit
    assert draft.sessions == 0 and draft.kv_used_bytes == 0


def test_a_session_that_outgrows_its_positions_keeps_its_kv_in_the_larger_one() -> None:
    # A session holds its log and 256 positions more; a request that runs past them gets a
    # larger session, which starts from the KV the smaller one held rather than the prompt.
    draft = CountingDraft(prefix_cache_bytes=8 * MIB)
    proposer = DraftProposer(config(), draft)
    decode_spec(Target(2), TURN, 320, SamplingParams(), proposer, 4)
    proposer.close()
    assert draft.written[0] == len(TURN)  # the prompt, once
    assert max(draft.written[1:]) <= config().window_max_tokens + 1
    assert draft.sessions == 0


def test_a_turn_that_extends_a_kept_entry_replaces_it() -> None:
    # Each turn of a chat holds the previous one's tokens: keeping both would hold the
    # conversation once per turn.
    draft = CountingDraft(prefix_cache_bytes=8 * MIB)
    log = list(TURN)
    for turn in range(4):
        proposer = DraftProposer(config(), draft)
        run = decode_spec(Target(turn), log, 12, SamplingParams(), proposer, 4)
        held = list(proposer._cached)
        proposer.close()
        assert draft.stage.kv.entries == 1
        assert draft.cache_bytes == len(held) * draft.stage.kv.layout.bytes_per_token
        log = [*held, *run.tokens[-2:], 5, 6]  # the next turn starts with what was kept


def test_the_first_score_after_resuming_is_not_the_price_of_a_pass() -> None:
    # A session resumed from a kept prefix still writes everything since the oldest start it
    # scores in its first pass: timed as a score, that catch-up priced the real 0.5B draft at
    # 85 ms a token (20 ms a pass), and `auto` never let it draft again in the process.
    draft = CountingDraft(prefix_cache_bytes=8 * MIB)
    first = DraftProposer(config(), draft)
    decode_spec(Target(1), TURN, 16, SamplingParams(), first, 4)
    first.close()
    second = DraftProposer(config(), draft)
    second.reset([*TURN, 4, 4])
    second.observe([1, 2, 3, 1, 2, 3])
    second.predict_log(len(TURN))
    assert draft.written[-1] > 1 and second.last_score_s is None
    second.observe([5])
    second.predict_log(len(TURN) + 8)
    assert second.last_score_s is not None and second.last_score_s > 0
    second.close()


class FailingAfterWrite(CountingDraft):
    """A pass that writes its tokens, then raises (a bug after the layers ran)."""

    fail = False

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        out = super().rows(session, base_pos, tokens, last_n, vocab)
        if self.fail:
            raise RuntimeError("draft pass failed")
        return out


def test_a_pass_that_fails_leaves_no_entry_claiming_tokens_it_overwrote() -> None:
    # After a rejection the next pass rewrites the cache from the common prefix; if it fails
    # there, the positions past that prefix hold its tokens' KV, not the ones the proposer
    # remembered, and keeping the session under the old tokens would hand a later request
    # wrong KV for them.
    draft = FailingAfterWrite(prefix_cache_bytes=8 * MIB)
    proposer = DraftProposer(config(), draft)
    proposer.reset(TURN)
    drafts = proposer.propose(4)
    assert proposer._cached == [*TURN, *drafts[:-1]]
    other = (drafts[1] + 1) % VOCAB
    proposer.observe([drafts[0], other, 5, 6])  # the second draft rejected, then two more
    draft.fail = True
    with pytest.raises(RuntimeError):
        proposer.propose(1)
    proposer.close()
    # What was kept is only what the cache still holds: the prompt and the accepted draft.
    assert proposer.draft.kept_prefix([*TURN, drafts[0], drafts[1], 9, 9]) <= len(TURN) + 1
