"""Sampling helpers only measurements use: the sampler's distribution as a row, and the
inverse-CDF draw the sampler's Gumbel-max rule is compared against (scripts/sampling_cost.py,
scripts/coupling_acceptance.py)."""

from __future__ import annotations

import torch

from meshd.speculative.sampling import SamplingParams, filtered_support, position_key


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) keyed by (`seed`, `position`): the top 53 bits of `position_key`
    (the inverse-CDF rule's draw; the sampler's own noise is `keyed_gumbel`)."""
    return (position_key(seed, position) >> 11) * (1.0 / (1 << 53))


def filtered_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float64 probabilities after temperature, top-k and top-p (the transformers order): zero
    outside the support, summing to 1 over it. The sampler never forms this row (it works on
    the support's logits, `filtered_support`); it is the distribution the sampler draws from."""
    ids, scores = filtered_support(logits_row, params)
    if ids is None:
        return torch.softmax(scores, -1)
    probs = torch.zeros(logits_row.shape[-1], dtype=torch.float64)
    probs[ids] = torch.softmax(scores, -1)
    return probs
