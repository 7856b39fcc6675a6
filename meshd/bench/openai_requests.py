"""OpenAI completion requests as the load and chaos benches send them, and the replies' parts
both read: one body builder, the endpoint path, the server's retry hint, a chunk's text."""

from __future__ import annotations

from typing import Any

import httpx


def completion_path(kind: str) -> str:
    """The endpoint's path under `/v1` for a "chat" or a text "completion" request."""
    return "/chat/completions" if kind == "chat" else "/completions"


def completion_body(
    model: str,
    kind: str,
    text: str,
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
    stream: bool,
) -> dict[str, Any]:
    """The JSON body: `text` as the user's message (chat) or the prompt, a fixed length
    whatever EOS the model picks (`ignore_eos`), usage reported at the end of a stream."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": stream,
        "meshd": {"ignore_eos": True},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def retry_after_s(response: httpx.Response) -> float | None:
    """What the server asks a client to wait, ms precision when given (as openai-python
    reads it); None when it says nothing."""
    ms = response.headers.get("retry-after-ms")
    if ms is not None:
        return float(ms) / 1000
    seconds = response.headers.get("retry-after")
    return float(seconds) if seconds is not None else None


def delta_text(choice: dict[str, Any]) -> str:
    """The text of one streamed choice: a chat delta's content or a completion's text."""
    delta = choice.get("delta")
    return str(delta.get("content") or "") if delta is not None else str(choice.get("text") or "")
