"""The losses: cross-entropy of the main head and each MTP depth (phases 1 and 3), and the
sequence-level unlikelihood of phases 2 and 4 (Welleck et al. 2019) on the model's own greedy
continuations."""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from meshd_train.config import TrainConfig
from meshd_train.corpus import EditStream, batch_at, phase3_batch, ul_prompts
from meshd_train.model import BuiltinModel


def losses(model: BuiltinModel, seq: torch.Tensor) -> list[torch.Tensor]:
    """Mean cross-entropy of the main head, then of each MTP depth."""
    t = seq.shape[1] - 1 - len(model.mtp)
    return [
        F.cross_entropy(lg.flatten(0, 1).float(), seq[:, d + 1 : d + 1 + t].flatten().long())
        for d, lg in enumerate(model(seq))
    ]


@torch.no_grad()
def greedy_continuations(
    model: BuiltinModel, prompts: torch.Tensor, cfg: TrainConfig
) -> torch.Tensor:
    """The model's own greedy continuations (end-of-text suppressed, as the loop check does)."""
    model.eval()
    try:
        return model.lm.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=cfg.ul_new_tokens,
            min_new_tokens=cfg.ul_new_tokens,
        )
    finally:
        model.train()


def repeated_ngram_mask(
    seqs: torch.Tensor,
    prompt_tokens: int,
    n: int,
    *,
    prompt_counts: bool = True,
    min_seen: int = 1,
) -> torch.Tensor:
    """True at each generated token that completes an n-gram seen earlier in its sequence.

    With `prompt_counts=False` only n-grams that ended in the generated part count as seen:
    a model repeating itself (a loop) is marked, a model copying from its prompt is not.
    With `min_seen=k` the n-gram must have been seen k times before (k=2: the third time).
    """
    mask = torch.zeros(seqs.shape, dtype=torch.bool)
    for row, ids in enumerate(seqs.tolist()):
        seen: dict[tuple[int, ...], int] = {}
        for end in range(n - 1, len(ids)):
            gram = tuple(ids[end - n + 1 : end + 1])
            if seen.get(gram, 0) >= min_seen and end >= prompt_tokens:
                mask[row, end] = True
            if prompt_counts or end >= prompt_tokens:
                seen[gram] = seen.get(gram, 0) + 1
    return mask


def unlikelihood_loss(model: BuiltinModel, seqs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of -log(1 - p(token)) over the masked (loop-completing) generated tokens."""
    h, _ = model.trunk(seqs[:, :-1])
    logits = model.logits(h, model.lm.model.norm).float()
    p = logits.softmax(-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    target = mask[:, 1:]
    per_token = -torch.log((1 - p).clamp(min=1e-5))
    return (per_token * target).sum() / target.sum().clamp(min=1)


def phase2_loss(
    model: BuiltinModel,
    stream: torch.Tensor,
    step: int,
    cfg: TrainConfig,
    edits: EditStream | None = None,
) -> tuple[torch.Tensor, tuple[float, ...]]:
    """MLE on a small batch plus unlikelihood on the model's own repeats; logged parts.

    Phase 4 passes `edits`: the MLE batch is then `phase3_batch` and the unlikelihood term
    runs on `edit_ul_sequences` continuations, in fp32 unless `edit_bf16_autocast`.
    """
    ul_cfg = cfg
    if edits is not None:
        ul_cfg = dataclasses.replace(cfg, ul_batch_sequences=cfg.edit_ul_sequences)
    seqs = greedy_continuations(model, ul_prompts(stream, step, ul_cfg), cfg)
    # Phase 3 teaches copying from the prompt: only the model repeating itself is a loop.
    mask = repeated_ngram_mask(
        seqs,
        cfg.ul_prompt_tokens,
        cfg.ul_ngram,
        prompt_counts=edits is None,
        min_seen=1 if edits is None else cfg.edit_ul_min_seen,
    )
    if edits is None:
        batch = batch_at(
            stream, step, dataclasses.replace(cfg, batch_sequences=cfg.ul_mle_batch_sequences)
        )
        autocast = cfg.bf16_autocast
    else:
        batch = phase3_batch(stream, edits, step, cfg)
        autocast = cfg.edit_bf16_autocast
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        parts = losses(model, batch)
        ul = unlikelihood_loss(model, seqs, mask)
    loss = parts[0] + cfg.mtp_loss_weight / max(1, len(parts) - 1) * sum(parts[1:])
    repeat_fraction = mask[:, cfg.ul_prompt_tokens :].float().mean().item()
    logged = (*(p.item() for p in parts), ul.item(), repeat_fraction)
    weight = cfg.ul_weight if edits is None else cfg.edit_ul_weight
    return loss + weight * ul, tuple(round(x, 4) for x in logged)
