"""Run one prepared request on the backend: text deltas out, usage and telemetry at the end.

Shared by the streamed and the non-streamed paths; they differ only in what `emit` does with
the text. Generation stops early when a stop sequence matches (the coordinator is told by
`on_tokens` returning False), and is cancelled with everything else when the client goes away.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from meshd.api.backend import MeshBackend, Overloaded, ServiceUnavailable
from meshd.api.errors import from_backend
from meshd.api.logprobs import Scored
from meshd.api.metrics import ApiMetrics
from meshd.api.prepare import Prepared
from meshd.api.schemas import FinishReason, PromptTokensDetails, Usage
from meshd.api.textstream import TextStream
from meshd.api.tools import CallReader, ToolCall
from meshd.speculative.telemetry import SpecTelemetry
from protocol.messages import TokenLogprobs

# Text released, and the tokens that went into it with their log-probs (when asked for).
Emit = Callable[[str, list[Scored]], Awaitable[None]]


@dataclass(frozen=True)
class Outcome:
    """How a generation ended."""

    finish_reason: FinishReason
    usage: Usage
    telemetry: SpecTelemetry
    tool_calls: list[ToolCall] = field(default_factory=list)


async def run_generation(
    backend: MeshBackend,
    prepared: Prepared,
    metrics: ApiMetrics,
    emit: Emit,
    *,
    arrived_s: float,
) -> Outcome:
    """Generate `prepared`, passing text to `emit` as it commits.

    `arrived_s` is the request's arrival on `time.perf_counter()` (for time to first token).
    Raises `ApiError` (429/503) when the backend is overloaded or cannot serve.
    """
    text = TextStream(backend.tokenizer, prepared.stops)
    # With tools, what is sent is the prose before any call; the calls come at the end.
    plan = prepared.tools
    names = [f["name"] for f in plan.functions] if plan else []
    reader = CallReader(backend.tokenizer, plan.family, names) if plan else None
    last_s: float | None = None
    pending: list[TokenLogprobs] = []  # the coordinator's log-probs of the next batch
    generation = prepared.generation
    if generation.logprobs >= 0:
        generation = replace(generation, on_logprobs=pending.extend)

    async def on_tokens(tokens: list[int]) -> bool:
        nonlocal last_s
        now = time.perf_counter()
        if last_s is None:
            metrics.prompt_tokens.inc(prepared.prompt_tokens)
            metrics.ttft.observe(now - arrived_s)
        else:
            # A verify window commits several tokens at once: spread its interval over them.
            per_token = (now - last_s) / len(tokens)
            for _ in tokens:
                metrics.tpot.observe(per_token)
        last_s = now
        metrics.generated_tokens.inc(len(tokens))
        before = text.tokens_used
        delta = text.push(tokens)
        # Only the tokens that went into the text (a stop sequence ends it) are reported.
        used = text.tokens_used - before
        if reader is not None:
            delta = reader.push(tokens[:used])
        scored = list(zip(tokens[:used], pending[:used], strict=False)) if pending else []
        pending.clear()
        if delta or scored:
            await emit(delta, scored)
        return not text.stopped

    try:
        result = await backend.generate(generation, on_tokens)
    except (Overloaded, ServiceUnavailable) as exc:
        raise from_backend(exc) from exc
    tail = text.finish()
    calls: list[ToolCall] = []
    if reader is not None:
        tail, calls = reader.finish()
    if tail:
        await emit(tail, [])
    metrics.speculation(result.telemetry)
    finish: FinishReason = "stop" if text.stopped or result.finish_reason == "stop" else "length"
    if calls:
        finish = "tool_calls"
    completion = text.tokens_used
    usage = Usage(
        prepared.prompt_tokens,
        completion,
        prepared.prompt_tokens + completion,
        PromptTokensDetails(result.cached_tokens),
    )
    return Outcome(finish, usage, result.telemetry, calls)
