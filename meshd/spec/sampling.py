"""Lossless verification of draft tokens, with randomness keyed by absolute position.

The token at absolute position p is always the target's choice from the logits that predict
p, drawn with the uniform `keyed_uniform(seed, p)`: a pure function of (seed, p), never a
stateful generator. A verify window therefore commits exactly the tokens that plain decoding
would have produced for the same seed, whatever the drafts were: drafts only decide how many
of those tokens one round trip yields ("sample from the target, accept while equal" — the
point-mass case of rejection sampling, exact for deterministic drafts). Greedy is the
temperature-0 case and needs no draw at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

_MASK64 = (1 << 64) - 1
# Candidates examined first when finding the top-p nucleus (then 8x more, until found).
_NUCLEUS_FIRST_LOOK = 256


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Target sampling: greedy when `temperature` is 0, else temperature → top-k → top-p.

    `top_k` 0 and `top_p` 1.0 switch those filters off. `seed` keys every draw (0..2**64-1).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 <= t <= 100.0:
            raise ValueError(f"sampling: temperature = {t!r} out of range; allowed 0..100")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ValueError(f"sampling: top_p = {p!r} out of range; allowed (0, 1]")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"sampling: top_k = {k!r} out of range; allowed 0 (off) or more")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _MASK64:
            raise ValueError(f"sampling: seed = {s!r} out of range; allowed 0..2**64-1")

    @property
    def greedy(self) -> bool:
        """True when the target's choice is the argmax (temperature 0)."""
        return self.temperature == 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) for the token at absolute `position` under `seed`.

    splitmix64 is a bijection on 64-bit words, so for a fixed seed distinct positions give
    distinct words; the top 53 bits become the float64 mantissa.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    word = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (word >> 11) * (1.0 / (1 << 53))


def filtered_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float64 probabilities after temperature, top-k and top-p (the transformers order).

    top-k keeps every token scoring at least the k-th best (ties at the threshold are kept,
    as in transformers). top-p keeps each token whose more probable tokens hold less than
    `top_p` of the mass — the smallest set of most likely tokens reaching `top_p` — and, so
    that the result never depends on a sort order, every token tied with the last one kept.
    The result is renormalised only implicitly: callers sample by inverse CDF.
    """
    scores = logits_row.detach().to(device="cpu", dtype=torch.float64) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, -1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs < _nucleus_floor(probs, params.top_p), 0.0)
    return probs


def _nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probability of the least likely token top-p keeps (a 0-d tensor)."""
    vocab = probs.shape[-1]
    # The nucleus is usually small: look at the best few hundred before sorting everything.
    width = min(vocab, _NUCLEUS_FIRST_LOOK)
    while True:
        best = torch.topk(probs, width).values  # descending
        mass = best.cumsum(-1)
        reach = int(torch.searchsorted(mass, torch.tensor([top_p], dtype=mass.dtype)))
        if reach < width or width == vocab:
            return best[min(reach, width - 1)]
        width = min(vocab, width * 8)


def sample_token(logits_row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The target's token at absolute `position` from the logits row that predicts it.

    Greedy: argmax (the lowest id among ties). Sampling: inverse CDF over the filtered
    distribution in token-id order, at `keyed_uniform(params.seed, position)`.
    """
    if params.greedy:
        return int(logits_row.argmax())
    probs = filtered_probs(logits_row, params)
    cdf = probs.cumsum(-1)
    target = keyed_uniform(params.seed, position) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    if index >= cdf.shape[0]:
        # Rounding put the draw past the end: take the last token that has mass.
        index = int(probs.nonzero()[-1])
    return index


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of one verify window.

    `committed` = the first `accepted_len` drafts followed by `next_token` (the target's choice
    at the first mismatch, or the bonus token after the last draft). `eos` is True when
    `next_token` is an end-of-sequence id; a draft equal to an EOS choice is delivered as
    `next_token`, so the window ends there and `accepted_len` counts only the drafts before it.
    """

    accepted_len: int
    next_token: int
    committed: list[int]
    eos: bool


def verify(
    logits: torch.Tensor,
    window_tokens: Sequence[int],
    n_draft: int,
    base_pos: int,
    params: SamplingParams,
    eos_ids: frozenset[int] = frozenset(),
) -> Verdict:
    """Accept drafts while each equals the target's choice at its position.

    `window_tokens[0]` sits at absolute position `base_pos`; its last `n_draft` entries are the
    drafts. `logits` is `[T, V]` with rows aligned to the end of the window: when T equals the
    window length, row i is for position base_pos+i (it predicts position base_pos+i+1); a
    prefill window may pass only its last row(s). At least `n_draft + 1` rows are needed.
    """
    length = len(window_tokens)
    rows = logits.shape[0]
    if not 0 <= n_draft < length:
        raise ValueError(f"n_draft must be in [0, {length - 1}], got {n_draft}")
    if not n_draft + 1 <= rows <= length:
        raise ValueError(f"need {n_draft + 1}..{length} logits rows, got {rows}")
    drafts = [int(t) for t in window_tokens[length - n_draft :]]
    first_row = rows - n_draft - 1
    # Absolute position predicted by row first_row (the last context token's row).
    first_pos = base_pos + length - n_draft
    needed = logits[first_row:]
    if params.greedy:
        choices = needed.argmax(-1).tolist()  # one vectorised pass over all needed rows
        return _walk(drafts, lambda j: int(choices[j]), eos_ids)
    # Sampled: each row only when reached, so a rejected window does no work beyond it.
    return _walk(drafts, lambda j: sample_token(needed[j], params, first_pos + j), eos_ids)


def _walk(drafts: list[int], choice: Callable[[int], int], eos_ids: frozenset[int]) -> Verdict:
    for j, draft in enumerate(drafts):
        target = choice(j)
        if draft != target or target in eos_ids:
            return Verdict(j, target, [*drafts[:j], target], target in eos_ids)
    bonus = choice(len(drafts))
    return Verdict(len(drafts), bonus, [*drafts, bonus], bonus in eos_ids)


def clip_drafts(drafts: Sequence[int], remaining_tokens: int) -> list[int]:
    """Drafts cut so the window cannot commit past `remaining_tokens` (max_tokens left).

    A window commits accepted drafts plus one target token, so at most `remaining_tokens - 1`
    drafts are useful; none when nothing or only one token remains.
    """
    return [int(t) for t in drafts[: max(0, remaining_tokens - 1)]]
