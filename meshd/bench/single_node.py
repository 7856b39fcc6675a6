"""A lean single-node decode loop over a list of stages (for the bench and for tests).

Prefill runs in chunks; decode then runs one token per step through every stage. The loop is
kept to tensor work: token ids live in one preallocated buffer, the next input is a view of it,
and nothing but the sampled id crosses back to Python (only when a stop token must be checked).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshd.model.kernels.blocks import argmax_rows
from meshd.model.stage import StageModel

_session_ids = itertools.count()


@dataclass(frozen=True)
class Sampling:
    """Greedy when `temperature` is 0; otherwise temperature / top-k / top-p with a seed."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class DecodeResult:
    """Generated token ids (prompt excluded), why decoding stopped, and wall times."""

    tokens: list[int]
    finish_reason: str  # "length" or "stop"
    prefill_s: float
    decode_s: float


class Sampler:
    """Picks the next token from fp32 logits `[vocab]` (greedy or seeded sampling)."""

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self._generator: torch.Generator | None = None
        if sampling.temperature > 0:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor | int:
        """The chosen token id (a 0-d tensor on the logits' device where it is sampled)."""
        if self._generator is None:
            # On an accelerator the id stays there (no sync per step); on the CPU the block
            # library's argmax is a tenth of torch's over a large vocabulary.
            return argmax_rows(logits)[0] if logits.device.type == "cpu" else logits.argmax()
        s = self.sampling
        scaled = logits / s.temperature
        if s.top_k > 0:
            kth = torch.topk(scaled, min(s.top_k, scaled.shape[-1])).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if s.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= s.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self._generator)[0]


def generate(
    stages: Sequence[StageModel],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    prefill_chunk: int = 512,
) -> DecodeResult:
    """Decode up to `max_new_tokens` after `prompt` through `stages` (in layer order)."""
    if not prompt or max_new_tokens < 1:
        raise ValueError("generate needs a non-empty prompt and max_new_tokens >= 1")
    session_id = f"decode-{next(_session_ids)}"
    total = len(prompt) + max_new_tokens
    for stage in stages:
        stage.open_session(session_id, total)
    try:
        with torch.inference_mode():
            return _run(
                stages, session_id, prompt, max_new_tokens, sampling, stop_ids, prefill_chunk
            )
    finally:
        for stage in stages:
            stage.close_session(session_id)


def _run(
    stages: Sequence[StageModel],
    session_id: str,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None,
    stop_ids: Sequence[int],
    prefill_chunk: int,
) -> DecodeResult:
    device = stages[0].device
    sampler = Sampler(sampling or Sampling(), stages[-1].device)
    buf = torch.empty(len(prompt) + max_new_tokens, dtype=torch.long, device=device)
    buf[: len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    stops = set(stop_ids)
    started = time.perf_counter()
    logits = torch.empty(0)
    for pos in range(0, len(prompt), prefill_chunk):
        logits = _step(stages, session_id, pos, buf[pos : min(pos + prefill_chunk, len(prompt))])
    prefill_done = time.perf_counter()
    pos, finish = len(prompt), "length"
    for _ in range(max_new_tokens):
        buf[pos] = sampler(logits[-1])
        pos += 1
        if stops and int(buf[pos - 1]) in stops:
            finish = "stop"
            break
        if pos == buf.shape[0]:
            break
        logits = _step(stages, session_id, pos - 1, buf[pos - 1 : pos])
    tokens = buf[len(prompt) : pos].tolist()
    return DecodeResult(tokens, finish, prefill_done - started, time.perf_counter() - prefill_done)


def _step(
    stages: Sequence[StageModel], session_id: str, base_pos: int, ids: torch.Tensor
) -> torch.Tensor:
    x = ids
    for stage in stages[:-1]:
        x = stage.forward(session_id, base_pos, x).hidden
    logits = stages[-1].forward(session_id, base_pos, x, logits_last_n=1).logits
    assert logits is not None
    return logits
