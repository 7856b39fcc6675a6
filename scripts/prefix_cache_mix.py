"""Tokens computed against tokens prompted for a request mix that shares system prompts.

    python scripts/prefix_cache_mix.py                  # the built-in model, 2 stages, 64 requests

Opens a local pipeline and sends `--requests` chat requests one after another, each with one of
`--systems` system prompts (drawn at random) and its own question, and prints the prompt tokens
sent, the tokens the first stage computed for the prompts, and the coordinator's counters.
"""

from __future__ import annotations

import argparse
import pathlib
import random

import trio

from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.speculative.config import SpecConfig

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


async def main(args: argparse.Namespace, systems: list[str]) -> None:
    model = builtin_model_dir()
    tokenizer = open_tokenizer(model)
    rng = random.Random(args.seed)
    async with open_local_pipeline(model, args.stages) as pipe:
        prompted = computed = 0

        async def ignore(tokens: list[int]) -> None:
            pass

        for index in range(args.requests):
            system = rng.choice(systems)
            question = f"Question {index}: what does section {rng.randrange(100)} say?"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            prompt = tokenizer.encode_chat(messages)
            before = pipe.hosts[0].stats.tokens_computed
            request = GenerationRequest(prompt=prompt, max_tokens=1, spec=SpecConfig())
            await pipe.coordinator.generate(pipe.route, request, ignore)
            # Until the close (and keep) reached every stage.
            while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
                await trio.sleep(0.005)
            prompted += len(prompt)
            computed += pipe.hosts[0].stats.tokens_computed - before
        print(f"{args.requests} requests, {len(systems)} system prompts")
        print(f"prompt tokens {prompted}, computed {computed} ({computed / prompted:.2f}x)")
        print(pipe.coordinator.prefix_counters)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=700)
    parser.add_argument("--seed", type=int, default=0)
    parsed = parser.parse_args()
    sources = sorted(DOCS.glob("*.md"))[: parsed.systems]
    texts = [path.read_text()[: parsed.system_chars] for path in sources]
    trio.run(main, parsed, texts)
