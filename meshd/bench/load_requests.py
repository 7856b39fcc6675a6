"""The requests of `meshd bench load`: a seeded mix, fired as a user's client would.

The mix covers chat and text completions, streamed and whole, short/medium/long prompts and
completions, greedy and sampled, all sized to fit the model's context. Each request runs
with `ignore_eos`, so its length is what the mix says. A 429 is retried after the server's
`retry-after-ms` (or `Retry-After`), as openai-python does, and counted; anything else that is
not a 200 with exactly `max_tokens` tokens (and the prompt counted as sent) is an error.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio

from meshd.bench.openai_requests import (
    completion_body,
    completion_path,
    delta_text,
    retry_after_s,
)
from meshd.model.tokenizer import Tokenizer
from meshd.sim.workloads import workloads


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the load is fired and judged."""

    requests: int = 200
    concurrency: int = 8
    seed: int = 0
    request_timeout_s: float = 300.0
    max_retries_429: int = 60
    max_retry_wait_s: float = 5.0
    # After the load: how long open sessions and in-flight requests may take to drain.
    drain_timeout_s: float = 30.0
    # Resident memory may grow this much over idle before it counts as a leak (allocator
    # caches and torch's lazily built kernels keep some; leaked KV of many sessions exceeds it).
    rss_growth_limit_bytes: int = 64 << 20
    # Which size classes (`SIZES` names) the mix draws from.
    sizes: tuple[str, ...] = ("short", "medium", "long")


@dataclass(frozen=True)
class SizeClass:
    """Token ranges of one kind of request (prompt, then completion)."""

    name: str
    prompt_tokens: tuple[int, int]
    max_tokens: tuple[int, int]
    weight: int


# Sized for a 256-token context (the built-in model): the longest fits with the chat template.
SIZES = (
    SizeClass("short", (6, 24), (4, 16), 5),
    SizeClass("medium", (32, 72), (24, 48), 3),
    SizeClass("long", (96, 128), (64, 96), 2),
)


@dataclass(frozen=True)
class Job:
    """One request to fire."""

    index: int
    kind: str  # "chat" or "completion"
    stream: bool
    size: str
    text: str
    prompt_tokens: int  # as the server will count them (template included for chat)
    max_tokens: int
    temperature: float
    seed: int

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body of the request."""
        return completion_body(
            model,
            self.kind,
            self.text,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stream=self.stream,
        )

    @property
    def path(self) -> str:
        """The endpoint's path under `/v1`."""
        return completion_path(self.kind)


def make_jobs(
    tokenizer: Tokenizer,
    count: int,
    seed: int,
    context_tokens: int,
    sizes: tuple[str, ...] = ("short", "medium", "long"),
) -> list[Job]:
    """A seeded mix of `count` requests whose prompt and completion fit `context_tokens`.

    `sizes` names the `SIZES` classes to draw from (by their weights).
    """
    rng = random.Random(seed)
    sources = [tokenizer.encode(w.prompt, add_special_tokens=False) for w in workloads(3)]
    classes = [s for s in SIZES if s.name in sizes]
    if not classes:
        raise ValueError(f"no size class among {sizes}; known: {[s.name for s in SIZES]}")
    jobs = []
    for index in range(count):
        size = rng.choices(classes, weights=[s.weight for s in classes])[0]
        kind = rng.choice(("chat", "completion"))
        source = rng.choice(sources)
        want = rng.randint(*size.prompt_tokens)
        start = rng.randrange(max(1, len(source) - want))
        text = tokenizer.decode(source[start : start + want]).strip() or "Hello"
        if kind == "chat":
            counted = len(tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            counted = len(tokenizer.encode(text))
        max_tokens = min(rng.randint(*size.max_tokens), context_tokens - counted)
        sampled = rng.random() < 0.5
        jobs.append(
            Job(
                index=index,
                kind=kind,
                stream=rng.random() < 0.5,
                size=size.name,
                text=text,
                prompt_tokens=counted,
                max_tokens=max(1, max_tokens),
                temperature=0.8 if sampled else 0.0,
                seed=rng.randrange(1 << 31),
            )
        )
    return jobs


@dataclass(frozen=True)
class Record:
    """One request as the client saw it (times from its first attempt, retries included)."""

    index: int
    target: int
    status: int  # HTTP status of the last attempt; 0: no response (connection, timeout)
    error: str  # "" when the request succeeded
    retries_429: int
    latency_s: float
    ttft_s: float | None  # streamed requests only: first content chunk
    completion_tokens: int


async def fire(
    client: httpx.AsyncClient, url: str, target: int, model: str, job: Job, cfg: LoadConfig
) -> Record:
    """Send one job to `url` (target number `target`), retrying 429s after their Retry-After.

    Never raises for HTTP trouble: a failure is a `Record` with its `error` set.
    """
    t0 = time.perf_counter()
    retries = 0
    while True:
        try:
            if job.stream:
                status, wait_s, ttft, tokens, error = await _streamed(client, url, model, job, t0)
            else:
                status, wait_s, tokens, error = await _whole(client, url, model, job)
                ttft = None
        except httpx.HTTPError as exc:
            status, wait_s, ttft, tokens, error = 0, None, None, 0, type(exc).__name__
        except (ValueError, LookupError, AttributeError, TypeError) as exc:
            # A body that is not the OpenAI shape is the server's error: recorded, not fatal.
            status, wait_s, ttft, tokens, error = 200, None, None, 0, f"bad body: {exc!r}"[:120]
        if status == 429 and wait_s is not None and retries < cfg.max_retries_429:
            retries += 1
            await trio.sleep(min(wait_s, cfg.max_retry_wait_s))
            continue
        if not error and tokens != job.max_tokens:
            error = f"{tokens} of {job.max_tokens} tokens"
        latency = time.perf_counter() - t0
        return Record(job.index, target, status, error, retries, latency, ttft, tokens)


def _retry_after_s(response: httpx.Response) -> float:
    """What the server asks a client to wait (1 s when it does not say)."""
    wait = retry_after_s(response)
    return 1.0 if wait is None else wait


async def _whole(
    client: httpx.AsyncClient, url: str, model: str, job: Job
) -> tuple[int, float | None, int, str]:
    response = await client.post(url + job.path, json=job.body(model))
    if response.status_code == 429:
        return 429, _retry_after_s(response), 0, "429"
    if response.status_code != 200:
        return response.status_code, None, 0, f"HTTP {response.status_code}"
    data = response.json()
    usage = data.get("usage") or {}
    return 200, None, int(usage.get("completion_tokens", 0)), _prompt_check(usage, job)


def _prompt_check(usage: dict[str, Any], job: Job) -> str:
    """An error unless the server counted the prompt as the client did (it saw all of it)."""
    counted = usage.get("prompt_tokens")
    if counted == job.prompt_tokens:
        return ""
    return f"prompt counted {counted}, sent {job.prompt_tokens}"


async def _streamed(
    client: httpx.AsyncClient, url: str, model: str, job: Job, t0: float
) -> tuple[int, float | None, float | None, int, str]:
    ttft: float | None = None
    tokens = 0
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + job.path, json=job.body(model)) as response:
        if response.status_code != 200:
            await response.aread()
            wait = _retry_after_s(response) if response.status_code == 429 else None
            return response.status_code, wait, None, 0, f"HTTP {response.status_code}"
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                return 200, None, ttft, tokens, f"stream error: {event['error'].get('code')}"
            if ttft is None and any(delta_text(c) for c in event.get("choices", ())):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
                tokens = int(usage["completion_tokens"])
        if not done:
            return 200, None, ttft, tokens, "stream ended without [DONE]"
    return 200, None, ttft, tokens, _prompt_check(usage, job)


async def run_load(
    urls: list[str], model: str, jobs: list[Job], cfg: LoadConfig
) -> tuple[list[Record], float]:
    """Fire `jobs` at `cfg.concurrency`, job i to `urls[i % len(urls)]`; records and wall time."""
    records: list[Record] = []
    send, receive = trio.open_memory_channel[Job](max(1, len(jobs)))
    for job in jobs:
        send.send_nowait(job)
    send.close()
    limits = httpx.Limits(max_connections=cfg.concurrency * len(urls))
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:

        async def worker() -> None:
            async for job in receive:
                target = job.index % len(urls)
                records.append(await fire(client, urls[target], target, model, job, cfg))

        async with trio.open_nursery() as nursery:
            for _ in range(cfg.concurrency):
                nursery.start_soon(worker)
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0
