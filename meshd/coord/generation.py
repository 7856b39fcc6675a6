"""What a generation asks for and what it gives back: `GenerationRequest`, `GenerationResult`,
the failures that end a route's attempt (`RouteFailed`, `StageOverloaded`), and how a prompt is
cut into prefill windows (`prefill_windows`, `prefill_timeout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from meshd.speculative.config import SpecConfig
from meshd.speculative.grammar import Constraint
from meshd.speculative.telemetry import SpecTelemetry
from protocol.messages import Message, Sampling, TokenLogprobs


class RouteFailed(Exception):
    """A stage failed or became unreachable; `committed` holds what was generated so far."""

    def __init__(self, message: str, committed: Sequence[int] = (), node_key: bytes = b"") -> None:
        super().__init__(message)
        self.committed = list(committed)
        self.node_key = node_key


class StageOverloaded(RouteFailed):
    """A stage refused the session (its KV memory or queue is full): retry after a while.

    A `RouteFailed`, so callers that only know that type still fail fast; the API may answer
    429/503 with `Retry-After: retry_after_s`.
    """

    def __init__(
        self,
        message: str,
        retry_after_s: float,
        committed: Sequence[int] = (),
        node_key: bytes = b"",
    ) -> None:
        super().__init__(message, committed, node_key)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt token ids, limits, sampling and speculation settings."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    spec: SpecConfig = field(default_factory=SpecConfig)
    eos_ids: frozenset[int] = frozenset()
    mtp_depth: int = 0  # MTP depths the model has (0: no MTP)
    # -1: no log-probs. n >= 0: each generated token's log-prob and its n likeliest
    # alternatives come back with it (`WindowLoop.logprobs_to_stream`, `GenerationResult`).
    logprobs: int = -1
    # Called with the log-probs of each batch of tokens just before the driver streams them
    # (one per token, in order), so a recovered request's batches keep coming to one place.
    on_logprobs: Callable[[list[TokenLogprobs]], None] | None = field(default=None, compare=False)
    # Structured output: the grammar every generated token must follow. Stateful: it stays at
    # the committed tokens' state, so a recovery's next attempt continues where this one
    # stopped. A completed grammar ends the generation.
    grammar: Constraint | None = field(default=None, compare=False)
    # Where `prompt` holds tokens an earlier attempt generated (a recovery): from this position
    # on they are fed in windows of at most `REPLAY_WINDOW_TOKENS`, as decoding first fed them
    # (None: every token is the client's prompt).
    replay_from: int | None = None


# A CPU stage computes each row of a window of at most this many tokens to the bits it gives
# that row alone (`meshd.model.llama.ROW_ATTENTION_MAX`); longer prefill windows differ in the
# last bits, which quantized activations can grow into a different greedy token. Replaying a
# recovery's generated tokens in such windows rebuilds the KV the undisturbed run had.
REPLAY_WINDOW_TOKENS = 16


@dataclass
class GenerationResult:
    """What came out: generated token ids (no EOS), why it stopped, and telemetry."""

    tokens: list[int]
    finish_reason: str  # "stop" (EOS or asked to stop) or "length"
    telemetry: SpecTelemetry
    # Prompt positions taken from the stages' prefix cache instead of being prefilled.
    cached_tokens: int = 0
    # One per token when the request asked for log-probs; empty otherwise.
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def prefill_windows(
    length: int, start: int, replay_from: int | None, chunk: int
) -> list[tuple[int, int]]:
    """A prompt of `length` tokens in windows from position `start`: the client's prompt in
    chunks cut at multiples of `chunk` (the coordinator's `prefill_chunk_tokens`) from 0 (as
    every attempt cuts it, so a cached prefix's positions hold the bits a cold run gives them),
    then the tokens from `replay_from` (`GenerationRequest.replay_from`) in windows of at most
    `REPLAY_WINDOW_TOKENS`, so their KV gets the bits decoding gave it."""
    own = length if replay_from is None else min(max(replay_from, 1), length)
    windows = [
        (max(lo, start), min(own, lo + chunk)) for lo in range(0, own, chunk) if lo + chunk > start
    ]
    step = REPLAY_WINDOW_TOKENS
    windows += [
        (max(lo, start), min(length, lo + step))
        for lo in range(own, length, step)
        if lo + step > start
    ]
    return [(lo, hi) for lo, hi in windows if hi > lo]


def prefill_timeout(windows: int, reply_timeout_s: float) -> float:
    """How long a prefill's reply may take: `reply_timeout_s` per window sent. Only the last
    window replies, and a stage computes the windows one after another, so a long prompt on a
    slow or busy machine must not fail as a lost reply would."""
    return reply_timeout_s * max(1, windows)


class Send(NamedTuple):
    """One message for the driver to send to the stage node `key`."""

    key: bytes
    message: Message


@dataclass
class Window:
    """A verify window in flight: what the window loop keeps until its reply."""

    window_id: int
    base_pos: int
    tokens: list[int]
    n_draft: int
    sent_s: float
    # The grammar's masks for the window's choosing rows (empty: no grammar).
    mask: bytes = b""
    # Coordinator time drafting (a draft model) between `sent_s` and the window's real send:
    # not network, so it is taken out of the round trip the route's costs see.
    draft_s: float = 0.0
