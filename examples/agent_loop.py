#!/usr/bin/env python3
"""An agent loop with the official OpenAI client: the model calls a tool, the program runs it
and sends the result back, the model answers.

    python examples/agent_loop.py                          # a running `meshd serve` on 7392
    python examples/agent_loop.py "Weather in Oslo and Lima?"
    python examples/agent_loop.py --base-url http://192.168.1.20:7392/v1 --require-tool
    python examples/agent_loop.py --serve-local ~/.cache/meshd/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf

The model must have been trained for tool calls, with a chat template that renders `tools`
(Qwen2.5, Llama 3.1+, Mistral, Hermes models; see docs/api.md). `--serve-local FILE` serves a
model file in this process, for trying it without a daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from typing import Any

import openai

DEFAULT_PORT = 7392
QUESTION = "What's the weather in Paris right now? Answer in one sentence."
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """The tool itself: a real agent would call a weather service here."""
    celsius = 8 + sum(map(ord, city)) % 20
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "temperature": temperature, "unit": unit, "sky": "clear"}


def run_agent(
    client: openai.OpenAI, question: str, rounds: int = 4, first_choice: Any = "auto"
) -> str:
    """Ask; run every call the model makes and send the results; stop at a text answer.
    `first_choice`: the first request's `tool_choice` (`required` makes the model call)."""
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": question}]
    for round_ in range(rounds):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=first_choice if round_ == 0 else "auto",
            temperature=0,
            max_tokens=200,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            print(f"[tool] {call.function.name}({arguments})")
            result = get_weather(**arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
            )
    return "(no answer within the rounds allowed)"


def serve_local(model: str) -> str:
    """Serve `model` (a GGUF file or checkpoint directory) on one stage, in a thread."""
    import trio

    from meshd.api.backend import open_local_backend
    from meshd.api.openai import create_app
    from meshd.api.server import serve_api

    ready: queue.Queue[str] = queue.Queue()

    async def main() -> None:
        async with open_local_backend(model, stages=1) as backend, trio.open_nursery() as nursery:
            address = await nursery.start(serve_api, create_app(backend))
            ready.put(address.base_url)

    threading.Thread(target=trio.run, args=(main,), daemon=True).start()
    return ready.get(timeout=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("MESHD_API_PORT", DEFAULT_PORT))
    )
    parser.add_argument("--base-url", help="the API's URL (default: 127.0.0.1 at --port)")
    parser.add_argument("--serve-local", metavar="MODEL", help="serve this model here")
    parser.add_argument(
        "--require-tool", action="store_true", help="the first reply must call the tool"
    )
    args = parser.parse_args()
    base_url = args.base_url or f"http://127.0.0.1:{args.port}/v1"
    if args.serve_local:
        base_url = serve_local(os.path.expanduser(args.serve_local))
    api_key = os.environ.get("MESHD_API_KEY", "no-key-needed-on-loopback")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=600)
    try:
        choice = "required" if args.require_tool else "auto"
        print(run_agent(client, args.question, first_choice=choice))
    except openai.APIConnectionError:
        print(f"no meshd API at {base_url}: is `meshd serve` running?", file=sys.stderr)
        return 1
    except openai.APIStatusError as exc:
        print(f"error {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
