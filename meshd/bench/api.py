"""What the HTTP layer costs: the same greedy request straight to the backend and through the API.

    python -m meshd.bench.api [--stages 2] [--tokens 128] [--runs 7] [--strategy disabled]

Runs a local pipeline of the built-in model and its API in this process, then alternates three
ways of making the same request (so machine noise hits all three alike): the backend directly,
the API streamed (SSE), and the API non-streamed, both over loopback HTTP with httpx. Prints
the median wall time, time to first token and tokens/s of each, and the API's overhead per
request and per token against the direct call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import trio

from meshd.api.backend import LocalPipelineBackend, open_local_backend
from meshd.api.openai import create_app
from meshd.api.server import serve_api
from meshd.bench.harness import alternate_async
from meshd.coord.coordinator import GenerationRequest
from meshd.speculative.config import STRATEGIES, SpecConfig
from protocol.messages import Sampling

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@dataclass(frozen=True)
class Sample:
    """One request: wall time and time to the first token (seconds)."""

    wall_s: float
    ttft_s: float


async def direct(backend: LocalPipelineBackend, tokens: int, strategy: str) -> Sample:
    """The request straight to the backend (no HTTP, no detokenization; EOS ignored)."""
    request = GenerationRequest(
        prompt=backend.tokenizer.encode(PROMPT),
        max_tokens=tokens,
        sampling=Sampling(temperature=0.0),
        spec=SpecConfig(strategy=strategy),
        mtp_depth=backend.mtp_depth,
    )
    t0 = time.perf_counter()
    first: list[float] = []

    async def on_tokens(tokens: list[int]) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    await backend.generate(request, on_tokens)
    return Sample(time.perf_counter() - t0, first[0])


async def streamed(client: httpx.AsyncClient, body: dict[str, object]) -> Sample:
    """The request through the API as server-sent events."""
    t0 = time.perf_counter()
    ttft = 0.0
    async with client.stream("POST", "/completions", json=body | {"stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and not ttft:
                ttft = time.perf_counter() - t0
    return Sample(time.perf_counter() - t0, ttft)


async def whole(client: httpx.AsyncClient, body: dict[str, object]) -> Sample:
    """The request through the API, one JSON response (TTFT = the whole request)."""
    t0 = time.perf_counter()
    response = await client.post("/completions", json=body)
    response.raise_for_status()
    wall = time.perf_counter() - t0
    return Sample(wall, wall)


async def bench(args: argparse.Namespace) -> None:
    """Run the comparison and print it."""
    body: dict[str, object] = {
        "model": "meshd-builtin",
        "prompt": PROMPT,
        "max_tokens": args.tokens,
        "temperature": 0,
        "meshd": {"ignore_eos": True, "speculative": {"strategy": args.strategy}},
    }
    async with open_local_backend(stages=args.stages) as backend, trio.open_nursery() as nursery:
        address = await nursery.start(serve_api, create_app(backend))
        async with httpx.AsyncClient(base_url=address.base_url, timeout=120) as client:
            ways: dict[str, Callable[[], Awaitable[Sample]]] = {
                "direct": lambda: direct(backend, args.tokens, args.strategy),
                "api stream": lambda: streamed(client, body),
                "api whole": lambda: whole(client, body),
            }
            samples = await alternate_async(ways, args.runs, warmup=1)
        nursery.cancel_scope.cancel()
    _report(samples, args)


def _report(samples: dict[str, list[Sample]], args: argparse.Namespace) -> None:
    print(
        f"{args.stages} stages, {args.tokens} tokens, strategy {args.strategy}, "
        f"median of {args.runs} interleaved runs"
    )
    base = statistics.median(s.wall_s for s in samples["direct"])
    for name, runs in samples.items():
        wall = statistics.median(s.wall_s for s in runs)
        ttft = statistics.median(s.ttft_s for s in runs)
        extra = wall - base
        print(
            f"  {name:<11} {wall * 1000:8.1f} ms  ttft {ttft * 1000:7.1f} ms  "
            f"{args.tokens / wall:7.1f} tok/s  overhead {extra * 1000:+7.1f} ms "
            f"({extra / args.tokens * 1e6:+6.0f} µs/token, {wall / base:.3f}×)"
        )


def main() -> None:
    """`python -m meshd.bench.api`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--strategy", default="disabled", choices=STRATEGIES)
    trio.run(bench, parser.parse_args())


if __name__ == "__main__":
    main()
