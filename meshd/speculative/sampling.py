"""Lossless verification of draft tokens, with randomness keyed by absolute position.

The token at absolute position p is always the target's choice from the logits that predict
p. Sampled, it is a Gumbel-max draw: argmax over the filtered support (temperature → top-k →
top-p) of log p_i + g_i, where the noise g_i = `keyed_gumbel(seed, p, i)` is a pure function
of (seed, p, token id), never a stateful generator. A verify window therefore commits exactly
the tokens that plain decoding would have produced for the same seed, whatever the drafts
were: drafts only decide how many of those tokens one round trip yields ("sample from the
target, accept while equal" — the point-mass case of rejection sampling, exact for
deterministic drafts). Greedy is the temperature-0 case and needs no draw at all.

Keying the noise by token id (not one uniform per position) is what lets a draft model
predict a sampled token: `coupled_draft_token` takes argmax_i(log q_i + g_i) with the same g
over the draft's distribution q, which equals the target's sample whenever q is close to p
(Gumbel-max coupling), so "accept while equal" still accepts well under sampling.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from meshd.model.kernels.blocks import argmax_rows
from protocol.messages import TokenLogprobs

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


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def filtered_support(
    logits_row: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The sampling support and its float64 logits over temperature: `(ids, scores)`.

    `ids` is None when no filter removed anything (the support is the whole row, `scores`
    then covers every id); otherwise `scores[j]` belongs to token `ids[j]`. The filtered
    distribution is `softmax(scores)` on the support. top-k keeps every token scoring at least
    the k-th best (ties at the threshold are kept, as in transformers). top-p keeps each token
    whose more probable tokens hold less than `top_p` of the mass — the smallest set of most
    likely tokens reaching `top_p` — and, so that the result never depends on a sort order,
    every token tied with the last one kept.
    """
    row = logits_row.detach().to(device="cpu")
    vocab = row.shape[-1]
    ids: torch.Tensor | None = None
    if 0 < params.top_k < vocab:
        # On the raw row: dividing float32/bfloat16 values by T in float64 keeps their order and
        # keeps distinct values distinct, so the kept set is the same, found without converting
        # the whole row.
        kth = torch.topk(row, params.top_k).values[-1]
        ids = (row >= kth).nonzero().squeeze(-1)
        scores = row[ids].to(torch.float64) / params.temperature
    else:
        scores = row.to(torch.float64) / params.temperature
    if params.top_p < 1.0:
        probs = torch.softmax(scores, -1)
        kept = (probs >= nucleus_floor(probs, params.top_p)).nonzero().squeeze(-1)
        ids = kept if ids is None else ids[kept]
        scores = scores[kept]
    return ids, scores


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
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


def _as_int64(word: int) -> int:
    """A 64-bit word as the int64 with the same bits (torch has no wrapping uint64 ops)."""
    word &= _MASK64
    return word - (1 << 64) if word >> 63 else word


_GOLDEN_I64 = _as_int64(_GOLDEN)
_MIX1_I64 = _as_int64(_MIX1)
_MIX2_I64 = _as_int64(_MIX2)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of absolute `position` under `seed`: splitmix64(splitmix64(seed) ^ p).

    splitmix64 is a bijection on 64-bit words, so for a fixed seed distinct positions get
    distinct keys.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def keyed_gumbel(seed: int, position: int, token_ids: torch.Tensor | int) -> torch.Tensor:
    """Standard Gumbel noise for each token id at `position` under `seed` (float64).

    A pure function of (seed, position, id): token i gets the i-th output of a SplitMix64
    stream started at `position_key(seed, position)`, i.e. splitmix64(key + i * golden). Its
    top 52 bits m give u = (m + 1/2) / 2**52, exact in float64 and strictly inside (0, 1) (with
    53 bits the largest m + 1/2 would round to 2**53: u = 1, g = inf), and g = -log(-log u).
    The same id gets the same noise whatever the rest of the row, the vocabulary size or the
    filters, which is what lets a draft model's sample predict the target's. Vectorised in
    int64 arithmetic, which wraps like the uint64 reference (right shifts masked to be
    logical).
    """
    mantissa = keyed_mantissas(seed, position, token_ids)
    u = (mantissa.to(torch.float64) + 0.5) * (1.0 / (1 << 52))
    return u.log_().neg_().log_().neg_()


def keyed_mantissas(seed: int, position: int, token_ids: torch.Tensor | int) -> torch.Tensor:
    """The top 52 bits of splitmix64(position_key + id * golden) per id, as int64."""
    x = torch.as_tensor(token_ids, dtype=torch.int64) + 1
    x *= _GOLDEN_I64
    x += _as_int64(position_key(seed, position))
    # In place, one scratch buffer: full-vocabulary rows make every pass count.
    shifted = torch.empty_like(x)
    for shift, multiplier in ((30, _MIX1_I64), (27, _MIX2_I64), (31, 0)):
        torch.bitwise_right_shift(x, shift, out=shifted)
        shifted &= (1 << (64 - shift)) - 1  # int64 shifts are arithmetic: make them logical
        x ^= shifted
        if multiplier:
            x *= multiplier
    torch.bitwise_right_shift(x, 12, out=shifted)
    return shifted.bitwise_and_((1 << 52) - 1)


def _gumbel_argmax(
    logits_row: torch.Tensor,
    params: SamplingParams,
    position: int,
    columns: torch.Tensor | None = None,
) -> int:
    ids, scores = filtered_support(logits_row, params)
    if ids is None:
        ids = torch.arange(scores.shape[-1])
    if columns is not None:
        ids = columns[ids]  # the row's columns are these vocabulary ids
    # argmax over the support of log p_i + g_i; log p_i = scores_i - logsumexp(scores), and the
    # constant does not move the argmax.
    best = int((scores + keyed_gumbel(params.seed, position, ids)).argmax())
    return int(ids[best])


def sample_token(logits_row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The target's token at absolute `position` from the logits row that predicts it.

    Greedy: argmax (the lowest id among ties). Sampling: Gumbel-max over the filtered support,
    argmax_i(log p_i + g_i) with g = `keyed_gumbel(params.seed, position, i)`.
    """
    if params.greedy:
        return argmax_rows(logits_row)[0]
    return _gumbel_argmax(logits_row, params, position)


def coupled_draft_token(
    logits_row: torch.Tensor,
    params: SamplingParams,
    position: int,
    columns: torch.Tensor | None = None,
) -> int:
    """A draft model's guess of the target's token at `position`: argmax_i(log q_i + g_i).

    `logits_row` is the draft's row predicting `position`; `params` are the request's, their
    filters applied to the draft's distribution q; g is the target's own keyed noise (the same
    per token id), so the guess equals the target's sample whenever q is close enough to p
    (always when q = p) — Gumbel-max coupling. Greedy requests get the draft's argmax. A draft
    vocabulary that is a prefix of the target's shares its ids, hence its noise. `columns`,
    where given, are the vocabulary ids of the row's columns (a draft scoring part of its
    vocabulary, `DraftVocab`): q is then its distribution over those ids.
    """
    if columns is None:
        return sample_token(logits_row, params, position)
    if params.greedy:
        return int(columns[argmax_rows(logits_row)[0]])
    return _gumbel_argmax(logits_row, params, position, columns)


def coupled_draft_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    first_position: int,
    columns: torch.Tensor | None = None,
) -> list[int]:
    """`coupled_draft_token` for each row of `logits` `[n, V]`, row j predicting
    `first_position + j`."""
    if params.greedy:
        picks = argmax_rows(logits)
        return picks if columns is None else [int(columns[i]) for i in picks]
    return [
        coupled_draft_token(row, params, first_position + j, columns)
        for j, row in enumerate(logits)
    ]


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


def unpack_masks(packed: bytes, rows: int, vocab: int) -> torch.Tensor:
    """A window's grammar masks (`grammar.pack_masks`) as a bool tensor `[rows, vocab]`.

    Ids beyond the packed words are not allowed; ValueError for data that is not `rows` rows
    of whole 32-bit words (decompressed at most to what a `vocab`-wide mask needs, so a
    hostile blob cannot balloon).
    """
    words = vocab // 32 + 1  # engines may round up by a whole word
    limit = rows * words * 4
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(packed, limit + 1)
    except zlib.error as exc:
        raise ValueError(f"grammar mask: {exc}") from None
    if not inflater.eof or len(raw) > limit or len(raw) % (rows * 4):
        raise ValueError(f"grammar mask: {len(raw)} bytes is not {rows} rows of 32-bit words")
    have = len(raw) // (rows * 4)
    packed_words = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, have)
    bits = (packed_words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    width = min(vocab, have * 32)
    allowed[:, :width] = bits.view(rows, have * 32)[:, :width].bool()
    return allowed


def verify(
    logits: torch.Tensor,
    window_tokens: Sequence[int],
    n_draft: int,
    base_pos: int,
    params: SamplingParams,
    eos_ids: frozenset[int] = frozenset(),
    allowed: torch.Tensor | None = None,
) -> Verdict:
    """Accept drafts while each equals the target's choice at its position.

    `window_tokens[0]` sits at absolute position `base_pos`; its last `n_draft` entries are the
    drafts. `logits` is `[T, V]` with rows aligned to the end of the window: when T equals the
    window length, row i is for position base_pos+i (it predicts position base_pos+i+1); a
    prefill window may pass only its last row(s). At least `n_draft + 1` rows are needed.
    `allowed` (`[n_draft + 1, V]` bools, a grammar's masks) restricts each choosing row to its
    allowed tokens before anything else: the choice is then the one plain decoding under the
    grammar would make.
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
    if allowed is not None:
        needed = needed.masked_fill(~allowed.to(needed.device), float("-inf"))
    if params.greedy:
        choices = argmax_rows(needed)  # one pass over all needed rows
        return _walk(drafts, lambda j: choices[j], eos_ids)
    # Sampled: each row only when reached, so a rejected window does no work beyond it.
    return _walk(drafts, lambda j: sample_token(needed[j], params, first_pos + j), eos_ids)


def _walk(drafts: list[int], choice: Callable[[int], int], eos_ids: frozenset[int]) -> Verdict:
    for j, draft in enumerate(drafts):
        target = choice(j)
        if draft != target or target in eos_ids:
            return Verdict(j, target, [*drafts[:j], target], target in eos_ids)
    bonus = choice(len(drafts))
    return Verdict(len(drafts), bonus, [*drafts, bonus], bonus in eos_ids)


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Each token's log-prob under its row's raw distribution, with the `top` most likely ids.

    `rows` is `[len(tokens), V]`, row j the logits that chose `tokens[j]`. The distribution is
    the model's own (log-softmax of the logits, before temperature, top-k/top-p and any grammar
    mask), as OpenAI reports it, so the numbers do not depend on how the token was drawn.
    """
    logp = torch.log_softmax(rows.detach().to(device="cpu", dtype=torch.float32), -1)
    chosen = logp.gather(-1, torch.tensor([[int(t)] for t in tokens], dtype=torch.int64))
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]), -1)
        top_ids, top_values = ids.tolist(), values.tolist()
    else:
        top_ids = top_values = [[] for _ in tokens]
    return [
        TokenLogprobs(float(c), i, v)
        for c, i, v in zip(chosen.squeeze(-1).tolist(), top_ids, top_values, strict=True)
    ]


def clip_drafts(drafts: Sequence[int], remaining_tokens: int) -> list[int]:
    """Drafts cut so the window cannot commit past `remaining_tokens` (max_tokens left).

    A window commits accepted drafts plus one target token, so at most `remaining_tokens - 1`
    drafts are useful; none when nothing or only one token remains.
    """
    return [int(t) for t in drafts[: max(0, remaining_tokens - 1)]]
