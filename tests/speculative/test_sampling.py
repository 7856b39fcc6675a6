"""Position-keyed sampling and `verify`: exactness, filters, EOS, clipping, errors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from meshd.bench.sampling_reference import keyed_uniform
from meshd.speculative.sampling import SamplingParams, clip_drafts, sample_token, verify

V8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.25])


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """The target distribution computed independently (plain Python, HF filter order)."""
    scaled = [x / temperature for x in logits]
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    top = max(scaled)
    weights = [math.exp(x - top) if x > -math.inf else 0.0 for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        order = sorted(range(len(probs)), key=lambda i: -probs[i])
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


def test_params_validation_names_the_field() -> None:
    for bad, word in (
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ):
        with pytest.raises(ValueError, match=word):
            SamplingParams(**bad)
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_keyed_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert keyed_uniform(5, 100) == keyed_uniform(5, 100)
    draws = [keyed_uniform(5, p) for p in range(20_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert keyed_uniform(5, 100) != keyed_uniform(6, 100)
    # Uniform enough: ten equal bins, chi-square with 9 dof below the 0.1 % critical value.
    bins = [0] * 10
    for u in draws:
        bins[int(u * 10)] += 1
    chi2 = sum((b - 2000) ** 2 / 2000 for b in bins)
    assert chi2 < 27.88
    with pytest.raises(ValueError):
        keyed_uniform(1, -1)


def test_greedy_is_argmax_with_the_lowest_id_on_ties() -> None:
    row = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample_token(row, SamplingParams(), 0) == 1
    assert sample_token(V8, SamplingParams(), 9) == 0


def test_sampling_is_deterministic_for_seed_and_position() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample_token(V8, params, p) for p in range(200)]
    again = [sample_token(V8, params, p) for p in range(200)]
    assert first == again
    assert len(set(first)) > 4  # and not stuck on one token


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.5, 5, 0.9), (2.0, 0, 1.0)],
)
def test_speculative_first_token_follows_the_target_distribution(
    temperature: float, top_k: int, top_p: float
) -> None:
    """Over many seeds, the first committed token of a window of random drafts has the target's
    (filtered) softmax distribution, and equals the non-speculative sample seed by seed."""
    expected = reference_probs(V8.tolist(), temperature, top_k, top_p)
    rng = random.Random(0)
    counts_spec = [0] * 8
    counts_plain = [0] * 8
    trials = 3000
    position = 17
    for seed in range(trials):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        plain = sample_token(V8, params, position)
        drafts = [rng.randrange(8) for _ in range(rng.randint(1, 4))]
        window = [3, *drafts]
        logits = V8.expand(len(window), 8)  # the same row at every position
        verdict = verify(logits, window, len(drafts), position - 1, params)
        assert verdict.committed[0] == plain
        counts_spec[verdict.committed[0]] += 1
        counts_plain[plain] += 1
    assert counts_spec == counts_plain
    for i, p in enumerate(expected):
        if p == 0.0:
            assert counts_spec[i] == 0, f"token {i} is filtered out but was sampled"
    support = [i for i, p in enumerate(expected) if p > 0]
    chi2 = sum(
        (counts_spec[i] - trials * expected[i]) ** 2 / (trials * expected[i]) for i in support
    )
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
    assert chi2 < critical[len(support) - 1]
    total_variation = 0.5 * sum(
        abs(c / trials - p) for c, p in zip(counts_spec, expected, strict=True)
    )
    assert total_variation < 0.04


def test_top_k_and_top_p_restrict_the_support() -> None:
    probs_logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen_p = {
        sample_token(probs_logits, SamplingParams(temperature=1.0, top_p=0.75, seed=s), 0)
        for s in range(300)
    }
    assert seen_p == {0, 1}
    seen_k = {
        sample_token(V8, SamplingParams(temperature=1.0, top_k=2, seed=s), 0) for s in range(300)
    }
    assert seen_k == {0, 1}


def one_hot_rows(choices: list[int], vocab: int = 8) -> torch.Tensor:
    rows = torch.full((len(choices), vocab), -5.0)
    for i, c in enumerate(choices):
        rows[i, c] = 5.0
    return rows


def test_verify_accepts_while_equal_then_emits_the_target_token() -> None:
    greedy = SamplingParams()
    # Target choices after positions 10..13: 4, 5, 6, 7.
    logits = one_hot_rows([4, 5, 6, 7])
    v = verify(logits, [1, 4, 5, 2], 3, 10, greedy)
    assert (v.accepted_len, v.next_token, v.committed, v.eos) == (2, 6, [4, 5, 6], False)
    v = verify(logits, [1, 4, 5, 6], 3, 10, greedy)
    assert (v.accepted_len, v.next_token, v.committed) == (3, 7, [4, 5, 6, 7])  # bonus token
    v = verify(logits, [1, 0, 5, 6], 3, 10, greedy)
    assert (v.accepted_len, v.committed) == (0, [4])


def test_eos_inside_a_window_ends_it() -> None:
    greedy = SamplingParams()
    eos = frozenset({2})
    logits = one_hot_rows([4, 2, 6, 7])
    # The draft equal to EOS is committed as next_token; the drafts after it are not accepted.
    v = verify(logits, [1, 4, 2, 6], 3, 0, greedy, eos)
    assert (v.accepted_len, v.next_token, v.committed, v.eos) == (1, 2, [4, 2], True)
    # A wrong draft where the target says EOS: EOS is committed.
    v = verify(logits, [1, 4, 3, 6], 3, 0, greedy, eos)
    assert (v.committed, v.eos) == ([4, 2], True)
    # EOS as the bonus token.
    v = verify(one_hot_rows([4, 5, 2]), [1, 4, 5], 2, 0, greedy, eos)
    assert (v.committed, v.eos) == ([4, 5, 2], True)


def test_prefill_window_may_pass_only_its_last_row() -> None:
    params = SamplingParams(temperature=1.0, seed=9)
    context = [5, 6, 7, 1, 2]
    full = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    a = verify(full, context, 0, 100, params)
    b = verify(full[-1:], context, 0, 100, params)
    assert a == b
    assert a.committed == [sample_token(full[-1], params, 105)]


def test_greedy_verify_matches_row_by_row_argmax() -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        logits = torch.randn(6, 40, generator=g)
        choices = [int(r.argmax()) for r in logits]
        drafts = choices[:5]
        wrong = int(torch.randint(0, 6, (1,), generator=g))  # 5: every draft right
        if wrong < 5:
            drafts[wrong] = (choices[wrong] + 1) % 40
        v = verify(logits, [0, *drafts], 5, 0, SamplingParams())
        expected = 0
        while expected < 5 and drafts[expected] == choices[expected]:
            expected += 1
        assert v.accepted_len == expected
        assert v.next_token == choices[expected]


def test_verify_rejects_malformed_windows() -> None:
    logits = one_hot_rows([1, 2])
    with pytest.raises(ValueError, match="n_draft"):
        verify(logits, [0, 1], 2, 0, SamplingParams())
    with pytest.raises(ValueError, match="rows"):
        verify(logits[:1], [0, 1], 1, 0, SamplingParams())
    with pytest.raises(ValueError, match="rows"):
        verify(one_hot_rows([1, 2, 3]), [0, 1], 1, 0, SamplingParams())


def test_clip_drafts_never_drafts_past_max_tokens() -> None:
    drafts = [5, 6, 7, 8]
    assert clip_drafts(drafts, 10) == drafts
    assert clip_drafts(drafts, 3) == [5, 6]  # 2 drafts + 1 target token = 3 tokens
    assert clip_drafts(drafts, 1) == []
    assert clip_drafts(drafts, 0) == []
    # Property: a window of clipped drafts commits at most the remaining tokens.
    for remaining in range(0, 7):
        assert len(clip_drafts(drafts, remaining)) + 1 <= max(remaining, 1)
