"""Speculation never changes the output: every strategy, any drafts, greedy and sampled."""

from __future__ import annotations

import msgspec
import pytest

from meshd.speculative.config import STRATEGIES, SpecConfig
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from tests.speculative.drafts import tiny_draft, tiny_draft_dir
from tests.speculative.target import (
    VOCAB,
    OracleDrafts,
    RandomDrafts,
    Target,
    decode_pipelined,
    decode_plain,
    decode_spec,
    noisy_mtp,
)

PARAMS = {
    "greedy": SamplingParams(),
    "t1": SamplingParams(temperature=1.0, seed=7),
    "t07-topk": SamplingParams(temperature=0.7, top_k=5, seed=11),
    "t13-topp": SamplingParams(temperature=1.3, top_p=0.8, seed=12345678901234567),
    "topk-topp": SamplingParams(temperature=1.0, top_k=8, top_p=0.9, seed=3),
}
CONFIG = SpecConfig(window_max_tokens=6, ngram_min=1, ngram_max=3, ngram_cache_min_hits=1)
# Every strategy runs with a draft model configured (a random one: `auto` weighs it too).
DRAFT_CONFIG = msgspec.structs.replace(CONFIG, draft_model=str(tiny_draft_dir(VOCAB)))
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
MAX_TOKENS = 48
EOS = frozenset({0})


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_commits_exactly_the_plain_tokens(strategy: str, mode: str) -> None:
    params = PARAMS[mode]
    for target_seed, eos in ((1, frozenset()), (2, EOS)):
        target = Target(target_seed)
        plain = decode_plain(target, PROMPT, MAX_TOKENS, params, eos)
        proposer = make_proposer(strategy, DRAFT_CONFIG, draft=tiny_draft(VOCAB), sampling=params)
        mtp = noisy_mtp(target, params, hit=0.7, seed=target_seed)
        run = decode_spec(target, PROMPT, MAX_TOKENS, params, proposer, 6, eos, mtp)
        assert run.tokens == plain
        assert run.accepted <= run.drafted
        # Each window commits its accepted drafts plus exactly one target token.
        assert sum(run.per_window) == len(plain) == run.windows + run.accepted


@pytest.mark.parametrize("mode", list(PARAMS))
def test_adversarial_and_oracle_drafts_change_nothing(mode: str) -> None:
    params = PARAMS[mode]
    for target_seed in (3, 4, 5):
        target = Target(target_seed)
        plain = decode_plain(target, PROMPT, MAX_TOKENS, params)
        for width in (1, 3, 8):
            random_run = decode_spec(
                target, PROMPT, MAX_TOKENS, params, RandomDrafts(target_seed), width
            )
            assert random_run.tokens == plain
            oracle = OracleDrafts(target, params)
            oracle_run = decode_spec(target, PROMPT, MAX_TOKENS, params, oracle, width)
            assert oracle_run.tokens == plain
            # Perfect drafts are all accepted: each window commits width + 1 tokens.
            assert oracle_run.accepted == oracle_run.drafted
            assert oracle_run.windows <= -(-len(plain) // (width + 1)) + 1


@pytest.mark.parametrize("mode", ["greedy", "t1", "topk-topp"])
@pytest.mark.parametrize("strategy", ["ngram-simple", "ngram-cache"])
def test_pipelined_windows_from_propose_after_are_lossless(strategy: str, mode: str) -> None:
    params = PARAMS[mode]
    target = Target(6)
    plain = decode_plain(target, PROMPT, MAX_TOKENS, params)
    run = decode_pipelined(target, PROMPT, MAX_TOKENS, params, make_proposer(strategy, CONFIG), 4)
    assert run.tokens == plain


def test_pipelined_oracle_never_goes_stale_and_random_drafts_do() -> None:
    params = PARAMS["t1"]
    target = Target(8)
    plain = decode_plain(target, PROMPT, MAX_TOKENS, params)
    oracle = decode_pipelined(target, PROMPT, MAX_TOKENS, params, OracleDrafts(target, params), 3)
    assert oracle.tokens == plain
    assert oracle.stale == 0
    noisy = decode_pipelined(target, PROMPT, MAX_TOKENS, params, RandomDrafts(1), 3)
    assert noisy.tokens == plain
    assert noisy.stale > 0


def test_greedy_loops_are_found_by_ngram_drafts() -> None:
    # Not only lossless but useful: greedy output of this target repeats, so n-gram drafts
    # are mostly accepted and windows commit several tokens each.
    target = Target(1)
    params = PARAMS["greedy"]
    plain = decode_plain(target, PROMPT, 96, params)
    run = decode_spec(target, PROMPT, 96, params, make_proposer("ngram-simple", CONFIG), 6)
    assert run.tokens == plain
    assert run.accepted / run.drafted > 0.6
    assert run.windows < len(plain) / 2


def test_different_seeds_give_different_samples() -> None:
    target = Target(1)
    a = decode_plain(target, PROMPT, 32, SamplingParams(temperature=1.0, seed=1))
    b = decode_plain(target, PROMPT, 32, SamplingParams(temperature=1.0, seed=2))
    assert a != b
