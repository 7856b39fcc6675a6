"""Gumbel-max sampling with keyed noise: exact (chi-square), coupled with a draft's guess."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from meshd.bench.sampling_reference import filtered_probs
from meshd.speculative.sampling import (
    SamplingParams,
    coupled_draft_token,
    coupled_draft_tokens,
    filtered_support,
    keyed_gumbel,
    keyed_mantissas,
    position_key,
    sample_token,
    verify,
)
from tests.speculative.test_sampling import reference_probs

# A row with a spread like a language model's: a few likely tokens, a long tail.
ROW16 = torch.tensor(
    [3.0, 2.2, 1.9, 1.0, 0.8, 0.5, 0.4, 0.1, -0.2, -0.5, -1.0, -1.3, -2.0, -2.5, -3.0, -4.0]
)
Sampler = Callable[[torch.Tensor, SamplingParams, int], int]
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The reference SplitMix64 step (Steele, Lea, Flood 2014) on Python integers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """Pearson's chi-square test of `counts` against `probs` (zero-probability bins must be
    empty: a draw outside the support fails outright)."""
    trials = sum(counts)
    support = [i for i, p in enumerate(probs) if p > 0.0]
    if any(c for c, p in zip(counts, probs, strict=True) if p == 0.0):
        return 0.0
    chi2 = sum((counts[i] - trials * probs[i]) ** 2 / (trials * probs[i]) for i in support)
    dof = len(support) - 1
    upper = torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)
    )
    return float(upper)


def counts_over_seeds(
    sampler: Sampler, row: torch.Tensor, params: SamplingParams, n: int
) -> list[int]:
    counts = [0] * row.shape[-1]
    for seed in range(n):
        p = SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed
        )
        counts[sampler(row, p, 17)] += 1
    return counts


def unlogged_gumbel(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """A deliberately biased rule: the keyed noise added to probabilities, not log-probs."""
    ids, scores = filtered_support(row, params)
    ids = torch.arange(row.shape[-1]) if ids is None else ids
    noisy = torch.softmax(scores, -1) + keyed_gumbel(params.seed, position, ids)
    return int(ids[int(noisy.argmax())])


def half_scale_gumbel(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """A deliberately biased rule: the keyed noise at half scale (samples p**2, renormalised)."""
    ids, scores = filtered_support(row, params)
    ids = torch.arange(row.shape[-1]) if ids is None else ids
    noisy = scores + 0.5 * keyed_gumbel(params.seed, position, ids)
    return int(ids[int(noisy.argmax())])


def test_keyed_noise_is_splitmix64_bit_for_bit() -> None:
    """Vectorised int64 arithmetic (wrapping, masked shifts) equals the uint64 reference."""
    ids = [0, 1, 2, 4095, 151_935, 2**31 + 5, 2**40 + 3]
    for seed, position in ((0, 0), (2**64 - 1, 7), (12345, 2**33), (2**63, 1)):
        key = splitmix64(splitmix64(seed) ^ position)
        assert position_key(seed, position) == key
        got = keyed_mantissas(seed, position, torch.tensor(ids)).tolist()
        # Token i: the i-th output of a SplitMix64 stream whose state starts at the key.
        assert got == [splitmix64((key + i * 0x9E3779B97F4A7C15) & MASK64) >> 12 for i in ids]
        noise = keyed_gumbel(seed, position, torch.tensor(ids)).tolist()
        for m, g in zip(got, noise, strict=True):
            assert g == pytest.approx(-math.log(-math.log((m + 0.5) / 2**52)), rel=1e-13)


def test_noise_is_keyed_by_token_id_alone() -> None:
    """A token's noise does not depend on which other ids are asked for (the coupling relies
    on it), and differs across positions and seeds."""
    everything = keyed_gumbel(9, 40, torch.arange(4096))
    some = torch.tensor([4095, 3, 1000])
    assert keyed_gumbel(9, 40, some).tolist() == everything[some].tolist()
    assert keyed_gumbel(9, 40, 3).item() == everything[3].item()
    assert keyed_gumbel(9, 41, some).tolist() != everything[some].tolist()
    assert keyed_gumbel(8, 40, some).tolist() != everything[some].tolist()
    # Standard Gumbel: mean = Euler–Mascheroni constant, variance = pi^2 / 6.
    assert float(everything.mean()) == pytest.approx(0.5772, abs=0.06)
    assert float(everything.var()) == pytest.approx(math.pi**2 / 6, abs=0.15)
    with pytest.raises(ValueError, match="position"):
        sample_token(ROW16, SamplingParams(temperature=1.0), -1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.8), (1.0, 8, 0.9)],
)
def test_sampled_frequencies_equal_the_filtered_target_distribution(
    temperature: float, top_k: int, top_p: float
) -> None:
    """Seeds 0..9999 at one position: chi-square against the distribution computed
    independently in plain Python."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = reference_probs(ROW16.tolist(), temperature, top_k, top_p)
    probs = filtered_probs(ROW16, params)
    assert (probs / probs.sum()).tolist() == pytest.approx(expected, abs=1e-12)
    counts = counts_over_seeds(sample_token, ROW16, params, 10_000)
    assert chi_square_p_value(counts, expected) > 1e-4


def test_the_chi_square_test_rejects_biased_rules() -> None:
    """The same test over 20000 seeds passes the sampler and fails the same keyed noise used
    wrongly (added to probabilities, or at half scale): it has the power to see a bias."""
    params = SamplingParams(temperature=1.0)
    expected = reference_probs(ROW16.tolist(), 1.0, 0, 1.0)
    assert (
        chi_square_p_value(counts_over_seeds(sample_token, ROW16, params, 20_000), expected) > 1e-4
    )
    for biased in (unlogged_gumbel, half_scale_gumbel):
        assert chi_square_p_value(counts_over_seeds(biased, ROW16, params, 20_000), expected) < 1e-4


def test_sampled_frequencies_over_positions_for_one_seed() -> None:
    """A single request draws across positions: the same row at positions 0..19999 under one
    seed has the target's distribution."""
    params = SamplingParams(temperature=0.9, seed=2024)
    expected = reference_probs(ROW16.tolist(), 0.9, 0, 1.0)
    counts = [0] * 16
    for position in range(20_000):
        counts[sample_token(ROW16, params, position)] += 1
    assert chi_square_p_value(counts, expected) > 1e-4


def test_a_draft_with_the_target_distribution_always_guesses_the_sample() -> None:
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(),
    ):
        for seed in range(500):
            p = SamplingParams(
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed
            )
            for position in (0, 3, 1000):
                assert coupled_draft_token(ROW16, p, position) == sample_token(ROW16, p, position)


def test_a_close_draft_agrees_far_more_often_than_an_independent_sample() -> None:
    """q = p perturbed: agreement is at least the Gumbel coupling's bound (1-δ)/(1+δ), δ the
    total variation distance, and far above an independent draft's Σ p_i q_i."""
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(64, generator=gen) * 2.5
    draft = target + torch.randn(64, generator=gen) * 0.25
    params = SamplingParams(temperature=1.0)
    p = filtered_probs(target, params)
    q = filtered_probs(draft, params)
    tv = 0.5 * float((p - q).abs().sum())
    independent = float((p * q).sum())
    trials = 4000
    agree = sum(
        coupled_draft_token(draft, SamplingParams(temperature=1.0, seed=s), 11)
        == sample_token(target, SamplingParams(temperature=1.0, seed=s), 11)
        for s in range(trials)
    )
    rate = agree / trials
    margin = 3 * math.sqrt(0.25 / trials)
    assert rate >= (1 - tv) / (1 + tv) - margin
    assert rate > 0.8
    assert rate > 2 * independent


def test_a_draft_with_a_prefix_vocabulary_shares_the_noise() -> None:
    """Ids are the key: a draft whose vocabulary is a prefix of the target's guesses the
    target's sample when the target gives the extra ids no mass."""
    target = torch.cat([ROW16, torch.full((8,), -math.inf)])
    for seed in range(300):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert coupled_draft_token(ROW16, params, 5) == sample_token(target, params, 5)


def test_batched_draft_tokens_match_row_by_row() -> None:
    rows = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    for params in (SamplingParams(temperature=0.9, top_k=10, seed=4), SamplingParams()):
        expected = [coupled_draft_token(r, params, 100 + j) for j, r in enumerate(rows)]
        assert coupled_draft_tokens(rows, params, 100) == expected


def test_coupled_drafts_are_accepted_by_verify_and_commit_the_plain_text() -> None:
    """Drafts from a model equal to the target pass verify whole, and the committed tokens are
    the ones plain decoding samples at those positions."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 40, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=77)
    base = 30  # window_tokens[0] sits at position 30; row j predicts position 31 + j
    drafts = coupled_draft_tokens(logits[:4], params, base + 1)
    verdict = verify(logits, [9, *drafts], 4, base, params)
    assert verdict.accepted_len == 4
    assert verdict.committed == [sample_token(logits[j], params, base + 1 + j) for j in range(5)]
