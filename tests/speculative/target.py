"""A tiny reference "target model" for the spec tests: logits from the last two tokens.

Peaked enough that greedy decoding falls into loops (so n-gram drafts often hit) while
temperature-1 sampling stays varied. Also a simulated coordinator loop over `verify`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from meshd.speculative.proposer import Proposer
from meshd.speculative.sampling import SamplingParams, clip_drafts, sample_token, verify
from meshd.speculative.telemetry import Recorder

VOCAB = 32


class Target:
    """Deterministic logits over VOCAB tokens given a prefix (depends on its last 2 tokens)."""

    def __init__(self, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.last = torch.randn(vocab, vocab, generator=g, dtype=torch.float32) * scale
        self.prev = torch.randn(vocab, vocab, generator=g, dtype=torch.float32) * scale * 0.5
        self.calls = 0

    def logits(self, prefix: Sequence[int]) -> torch.Tensor:
        """The row predicting the token after `prefix`."""
        self.calls += 1
        row = self.last[prefix[-1]].clone()
        if len(prefix) >= 2:
            row += self.prev[prefix[-2]]
        return row

    def window_logits(self, context: Sequence[int], window: Sequence[int]) -> torch.Tensor:
        """Rows for every window position, as the last stage computes them."""
        prefix = list(context)
        rows = []
        for token in window:
            prefix.append(token)
            rows.append(self.logits(prefix))
        return torch.stack(rows)


def decode_plain(
    target: Target,
    prompt: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    eos_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Non-speculative decoding: one sampled token per step at its absolute position."""
    log = list(prompt)
    while len(log) - len(prompt) < max_tokens:
        token = sample_token(target.logits(log), params, len(log))
        log.append(token)
        if token in eos_ids:
            break
    return log[len(prompt) :]


DraftSource = Callable[[list[int], int], list[int]]


@dataclass
class SpecRun:
    """Outcome of a simulated speculative decode."""

    tokens: list[int]
    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    stale: int = 0
    per_window: list[int] = field(default_factory=list)


def decode_spec(
    target: Target,
    prompt: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    proposer: Proposer,
    width: int,
    eos_ids: frozenset[int] = frozenset(),
    mtp: DraftSource | None = None,
    recorder: Recorder | None = None,
    ahead: int = 0,
) -> SpecRun:
    """A coordinator in miniature: propose, verify one window, commit, observe (depth 1).

    `mtp(log, width)` plays the last stage's MTP heads: the draft sent with each reply.
    `ahead`: while each window is out, the proposer thinks up to that many tokens ahead.
    """
    log = list(prompt)
    proposer.reset(prompt)
    run = SpecRun([])
    mtp_draft: list[int] = mtp(log, width) if mtp else []
    while len(log) - len(prompt) < max_tokens:
        remaining = max_tokens - (len(log) - len(prompt))
        drafts = clip_drafts(proposer.propose(width, mtp_draft), remaining)
        window = [log[-1], *drafts]
        base = len(log) - 1
        while ahead and proposer.think_ahead(drafts, ahead):
            pass
        logits = target.window_logits(log[:base], window)
        verdict = verify(logits, window, len(drafts), base, params, eos_ids)
        log.extend(verdict.committed)
        proposer.observe(verdict.committed)
        proposer.record(len(drafts), verdict.accepted_len)
        if recorder is not None:
            recorder.window_sent()
            recorder.verdict(
                proposer.active, len(drafts), verdict.accepted_len, len(verdict.committed)
            )
        run.windows += 1
        run.drafted += len(drafts)
        run.accepted += verdict.accepted_len
        run.per_window.append(len(verdict.committed))
        if verdict.eos:
            break
        mtp_draft = mtp(log, width) if mtp else []
    run.tokens = log[len(prompt) :]
    return run


def decode_pipelined(
    target: Target,
    prompt: Sequence[int],
    max_tokens: int,
    params: SamplingParams,
    proposer: Proposer,
    width: int,
    eos_ids: frozenset[int] = frozenset(),
) -> SpecRun:
    """Depth 2: window n+1 is built with `propose_after` before n's verdict, assuming n fully
    accepted with the proposer's guess for its bonus token. It is used only when that holds
    and dropped (stale) otherwise; its logits come from the assumed prefix, as on a stage."""
    log = list(prompt)
    proposer.reset(prompt)
    run = SpecRun([])
    pending: tuple[list[int], int, list[int]] | None = None  # (window, base, assumed context)
    while len(log) - len(prompt) < max_tokens:
        remaining = max_tokens - (len(log) - len(prompt))
        if pending is None:
            drafts = clip_drafts(proposer.propose(width), remaining)
            window, base, context = [log[-1], *drafts], len(log) - 1, log[: len(log) - 1]
        else:
            window, base, context = pending
            drafts = clip_drafts(window[1:], remaining)
            window = [window[0], *drafts]
        # Speculate the next window now: assume all drafts and a guessed bonus.
        guess = proposer.propose_after(drafts, 1 + width)
        pending = None
        if guess:
            assumed_context = [*context, *window]
            pending = (guess, base + len(window), assumed_context)
        logits = target.window_logits(context, window)
        verdict = verify(logits, window, len(drafts), base, params, eos_ids)
        log.extend(verdict.committed)
        proposer.observe(verdict.committed)
        run.windows += 1
        run.drafted += len(drafts)
        run.accepted += verdict.accepted_len
        if verdict.eos:
            break
        if pending is not None and pending[2] + [pending[0][0]] != log:
            pending = None
            run.stale += 1
    run.tokens = log[len(prompt) :]
    return run


def noisy_mtp(target: Target, params: SamplingParams, hit: float, seed: int) -> DraftSource:
    """MTP heads that predict the target's true next tokens, each right with chance `hit`."""
    rng = random.Random(seed)

    def draft(log: list[int], width: int) -> list[int]:
        out: list[int] = []
        prefix = list(log)
        for _ in range(width):
            token = sample_token(target.logits(prefix), params, len(prefix))
            if rng.random() > hit:
                token = (token + 1 + rng.randrange(target.vocab - 1)) % target.vocab
            out.append(token)
            prefix.append(token)
        return out

    return draft


class RandomDrafts:
    """Adversarial proposer: random tokens of random length (no learning at all)."""

    name = "random"
    active = "random"

    def __init__(self, seed: int, vocab: int = VOCAB) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def reset(self, prompt: Sequence[int]) -> None:
        pass

    def observe(self, committed: Sequence[int]) -> None:
        pass

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, max_tokens))]

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        return self.propose(max_tokens)

    def record(self, drafted: int, accepted: int) -> None:
        pass


class OracleDrafts(RandomDrafts):
    """Drafts the target's true continuation (every draft accepted), to hit the bonus path."""

    name = "oracle"

    def __init__(self, target: Target, params: SamplingParams) -> None:
        super().__init__(0)
        self.target = target
        self.params = params
        self.log: list[int] = []

    def reset(self, prompt: Sequence[int]) -> None:
        self.log = list(prompt)

    def observe(self, committed: Sequence[int]) -> None:
        self.log.extend(committed)

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        return self.propose_after((), max_tokens)

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        prefix = [*self.log, *assumed]
        out = []
        for _ in range(max_tokens):
            token = sample_token(self.target.logits(prefix), self.params, len(prefix))
            out.append(token)
            prefix.append(token)
        return out
