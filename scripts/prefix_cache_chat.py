"""Time to first token of a multi-turn chat with the prefix cache on and off, in one process.

    python scripts/prefix_cache_chat.py                       # the built-in model, 1 stage
    python scripts/prefix_cache_chat.py --model ~/.cache/meshd/models/X.gguf --stages 2
    python scripts/prefix_cache_chat.py --chunk 64 --loose    # other chunking, reuse decoded KV

Opens a local pipeline, runs a chat of `--turns` turns (a long system prompt, short user turns,
each reply appended as the assistant's message) with the prefix cache on, then replays the same
prompts with it off, alternating turn by turn on the same stages, and prints per turn: prompt
tokens, cached tokens, TTFT on and off and their ratio, and whether the replies are equal.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from typing import Any

import trio

from meshd.coord.coordinator import GenerationRequest, GenerationResult
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.speculative.config import SpecConfig

SYSTEM_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
QUESTIONS = [
    "Summarise the path of one request in two sentences.",
    "Which part decides the verify window's width?",
    "What happens when a stage dies mid-generation?",
    "How are hidden states passed between stages?",
    "What does the coordinator keep per session?",
    "Name one thing the protocol layer must never import.",
]


async def turn(
    pipe: LocalPipeline, prompt: list[int], max_tokens: int, eos: frozenset[int], cache: bool
) -> tuple[GenerationResult, float]:
    pipe.coordinator.prefix_cache = cache
    first: list[float] = []
    started = time.perf_counter()

    async def on_tokens(tokens: list[int]) -> None:
        if not first:
            first.append(time.perf_counter() - started)

    request = GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        eos_ids=eos,
        spec=SpecConfig(strategy="auto"),
        mtp_depth=pipe.checkpoint.config.num_mtp_layers,
    )
    result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
    # Until the close (and keep) reached every stage.
    while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
        await trio.sleep(0.005)
    return result, first[0] if first else float("nan")


async def main(args: argparse.Namespace, model: pathlib.Path, system: str) -> None:
    tokenizer = open_tokenizer(model)
    eos = frozenset(tokenizer.eos_ids)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    quantization = "gguf" if model.suffix == ".gguf" else "none"
    async with open_local_pipeline(
        model, args.stages, quantization=quantization, torch_threads=args.threads
    ) as pipe:
        pipe.coordinator.prefill_chunk_tokens = args.chunk
        pipe.coordinator.prefix_exact = not args.loose
        pipe.coordinator.reply_timeout_s = 600.0  # a cold prefill on a loaded machine
        print(f"model {model.name}, {args.stages} stage(s), chunk {args.chunk}, "
              f"{'loose' if args.loose else 'exact'} reuse")  # fmt: skip
        print("turn prompt cached  ttft_on  ttft_off  ratio  same")
        for index in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
            prompt = tokenizer.encode_chat(messages)
            on, ttft_on = await turn(pipe, prompt, args.max_tokens, eos, cache=True)
            off, ttft_off = await turn(pipe, prompt, args.max_tokens, eos, cache=False)
            print(
                f"{index + 1:4d} {len(prompt):6d} {on.cached_tokens:6d} {ttft_on:8.3f} "
                f"{ttft_off:9.3f} {ttft_on / ttft_off:6.2f}  {on.tokens == off.tokens}"
            )
            reply = tokenizer.decode(on.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        counters = pipe.coordinator.prefix_counters
        print(f"coordinator: {counters}")
        for host in pipe.hosts:
            kv = host.stage.kv
            print(f"stage: {kv.entries} entries, {kv.cache_bytes} bytes, {kv.cache_stats}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model directory or GGUF file")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-chars", type=int, default=2600)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    parser.add_argument("--loose", action="store_true", help="reuse decoded positions too")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parsed = parser.parse_args()
    path = pathlib.Path(parsed.model).expanduser() if parsed.model else builtin_model_dir()
    trio.run(main, parsed, path, SYSTEM_SOURCE.read_text()[: parsed.system_chars])
