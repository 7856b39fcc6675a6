#!/usr/bin/env python3
"""Stream a chat completion from meshd with the official OpenAI client.

    python examples/openai_stream.py                      # a running `meshd serve` on 7392
    python examples/openai_stream.py --port 8000 "Write a haiku about pipelines."
    MESHD_API_KEY=... python examples/openai_stream.py    # when the API requires a key
    python examples/openai_stream.py --serve-local        # no daemon: start a 2-stage
                                                          # pipeline of the built-in model here

Any OpenAI client works the same way: point its base URL at http://127.0.0.1:PORT/v1.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
from typing import Any

import openai

DEFAULT_PORT = 7392
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def stream_chat(base_url: str, api_key: str, prompt: str, max_tokens: int) -> None:
    """Print the answer as it streams, then the usage and meshd's speculative telemetry."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id  # the mesh serves one model
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # meshd's extension key: request-level speculative decoding settings.
        extra_body={"meshd": {"speculative": {"strategy": "auto"}}},
    )
    print(f"{model}> ", end="", flush=True)
    telemetry: dict[str, Any] = {}
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
            telemetry = (chunk.model_extra or {}).get("meshd", telemetry)
        if chunk.usage:
            print(f"\n\n[{chunk.usage.prompt_tokens} prompt + "
                  f"{chunk.usage.completion_tokens} completion tokens]")  # fmt: skip
    spec = telemetry.get("speculative")
    if spec:
        acceptance = "-" if spec["acceptance"] is None else f"{spec['acceptance']:.0%}"
        print(
            f"[speculation: {spec['active_strategy']}, {spec['drafted_tokens']} drafted, "
            f"{acceptance} accepted, {spec['tokens_per_round_trip'] or 0:.2f} tokens per "
            f"verify round trip]"
        )


def serve_local() -> tuple[str, threading.Thread]:
    """Start the built-in model on a 2-stage loopback pipeline and its API in a thread."""
    import trio

    from meshd.api.backend import open_local_backend
    from meshd.api.openai import create_app
    from meshd.api.server import serve_api

    ready: queue.Queue[str] = queue.Queue()

    async def main() -> None:
        async with open_local_backend(stages=2) as backend, trio.open_nursery() as nursery:
            address = await nursery.start(serve_api, create_app(backend))
            ready.put(address.base_url)

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    return ready.get(timeout=120), thread


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default=PROMPT)
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("MESHD_API_PORT", DEFAULT_PORT))
    )
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--serve-local", action="store_true", help="start a local pipeline here")
    args = parser.parse_args()
    api_key = os.environ.get("MESHD_API_KEY", "no-key-needed-on-loopback")
    base_url = f"http://127.0.0.1:{args.port}/v1"
    if args.serve_local:
        base_url, _ = serve_local()
    try:
        stream_chat(base_url, api_key, args.prompt, args.max_tokens)
    except openai.APIConnectionError:
        print(f"no meshd API at {base_url}: is `meshd serve` running?", file=sys.stderr)
        return 1
    except openai.APIStatusError as exc:
        print(f"error {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
