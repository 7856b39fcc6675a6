"""Cost per token of the target's sampled draw (`sample_token`), beside the earlier rule.

    python scripts/sampling_cost.py            # vocabularies 4096 and 152064, one thread

Rows: logits `torch.randn(V) * 3` (fp32), temperature 0.8, with and without top-k 50 and top-p
0.9, and greedy. `gumbel` is the shipped rule (Gumbel-max with keyed noise over the filtered
support); `inverse-cdf` is the rule before it (float64 filtered probabilities over the whole
row, inverse CDF in token-id order at one keyed uniform), kept here only as the reference.
Both run alternately in one process (median of rounds), because timings on a shared machine
drift.
"""

from __future__ import annotations

import statistics
import timeit

import torch

from meshd.bench.sampling_reference import keyed_uniform
from meshd.speculative.sampling import SamplingParams, nucleus_floor, sample_token


def inverse_cdf_token(row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The rule before Gumbel-max (for comparison only)."""
    if params.greedy:
        return int(row.argmax())
    scores = row.to(dtype=torch.float64) / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    probs = torch.softmax(scores, -1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs < nucleus_floor(probs, params.top_p), 0.0)
    cdf = probs.cumsum(-1)
    target = keyed_uniform(params.seed, position) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    return index if index < cdf.shape[0] else int(probs.nonzero()[-1])


CASES = [
    ("T=0.8", {"temperature": 0.8}),
    ("T=0.8 top-k 50", {"temperature": 0.8, "top_k": 50}),
    ("T=0.8 top-p 0.9", {"temperature": 0.8, "top_p": 0.9}),
    ("T=0.8 top-k 50 top-p 0.9", {"temperature": 0.8, "top_k": 50, "top_p": 0.9}),
    ("greedy", {}),
]


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    print("| vocabulary | sampling | gumbel ms | inverse-cdf ms | ratio |")
    print("|---|---|---|---|---|")
    for vocab in (4096, 152_064):
        row = torch.randn(vocab, generator=generator) * 3
        number = 100 if vocab < 10_000 else 20
        for name, kwargs in CASES:
            params = SamplingParams(seed=7, **kwargs)
            times: dict[str, list[float]] = {"gumbel": [], "inverse-cdf": []}
            for _ in range(7):
                for label, rule in (("gumbel", sample_token), ("inverse-cdf", inverse_cdf_token)):
                    seconds = timeit.timeit(
                        lambda r=rule, x=row, p=params: r(x, p, 123), number=number
                    )
                    times[label].append(seconds / number)
            new = statistics.median(times["gumbel"])
            old = statistics.median(times["inverse-cdf"])
            print(f"| {vocab} | {name} | {new * 1e3:.3f} | {old * 1e3:.3f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
