"""A multi-turn chat drafted by a draft model, with the draft's prompt cache on and off.

    M=~/.cache/meshd/models
    python scripts/draft_cache_chat.py --model $M/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --draft $M/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --stages 2 --rtt-ms 20

Opens a local pipeline (the stages' own prompt cache on, as a daemon's is), runs a chat of
`--turns` turns (a long system prompt, short user turns, each reply appended as the assistant's
message) with `--strategy` and the draft keeping its KV between requests
(`stage.prefix_cache_bytes`), and replays each turn's prompt with the draft keeping nothing,
alternating which goes first turn by turn, on the same stages. Prints per turn: prompt tokens,
the tokens the draft's first pass wrote, the decode seconds (the draft's catch-up on the
conversation falls in decode: it runs at the first proposal) on and off and their ratio, and
whether the replies are equal.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import trio

from meshd.coord.coordinator import GenerationRequest, GenerationResult
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.files import open_tokenizer
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.draft_vocab import DraftVocab
from meshd.stage.host_config import StageHostConfig

SYSTEM_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
QUESTIONS = [
    "Summarise the path of one request in two sentences.",
    "Which part decides the verify window's width?",
    "What happens when a stage dies mid-generation?",
    "How are hidden states passed between stages?",
    "What does the coordinator keep per session?",
    "Name one thing the protocol layer must never import.",
]


class CountingDraft(DraftModel):
    """A draft model recording how many tokens each of its passes writes."""

    def __init__(self, inner: DraftModel) -> None:
        super().__init__(inner.stage, inner.path, sorted(inner.eos_ids))
        self.written: list[int] = []

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        self.written.append(len(tokens))
        return super().rows(session, base_pos, tokens, last_n, vocab)


async def turn(
    pipe: LocalPipeline, prompt: list[int], args: argparse.Namespace, eos: frozenset[int]
) -> tuple[GenerationResult, float]:
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=args.max_tokens,
        eos_ids=eos,
        spec=SpecConfig(strategy=args.strategy, draft_model=args.draft),
        mtp_depth=0,
    )
    started = time.perf_counter()
    result = await pipe.coordinator.generate(pipe.route, request, _ignore)
    wall = time.perf_counter() - started
    while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
        await trio.sleep(0.005)  # until the close (and keep) reached every stage
    telemetry = result.telemetry
    return result, telemetry.decode_s or max(1e-9, wall - telemetry.prompt_s)


async def _ignore(tokens: list[int]) -> None:
    return None


async def main(args: argparse.Namespace, system: str) -> None:
    tokenizer = open_tokenizer(args.model)
    eos = frozenset(tokenizer.eos_ids)
    keep = StageHostConfig().prefix_cache_bytes
    draft = CountingDraft(DraftModel.load(args.draft, quantization="gguf", prefix_cache_bytes=keep))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    async with open_local_pipeline(
        args.model,
        args.stages,
        rtt_s=args.rtt_ms / 1000,
        quantization="gguf",
        torch_threads=1 if args.stages > 1 else None,
        draft=draft,
    ) as pipe:
        pipe.coordinator.reply_timeout_s = 600.0
        print(f"{args.strategy}, {args.stages} stage(s) at {args.rtt_ms:g} ms")
        print("turn prompt written_on written_off decode_on decode_off ratio same")
        ratios = []
        for index in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
            prompt = tokenizer.encode_chat(messages)
            runs: dict[bool, tuple[GenerationResult, float, int]] = {}
            for cache in (True, False) if index % 2 == 0 else (False, True):
                draft.stage.kv.cache_limit_bytes = keep if cache else 0
                draft.written.clear()
                result, decode_s = await turn(pipe, prompt, args, eos)
                runs[cache] = (result, decode_s, draft.written[0] if draft.written else 0)
            (on, on_s, on_w), (off, off_s, off_w) = runs[True], runs[False]
            ratios.append(off_s / on_s)
            print(
                f"{index + 1:4d} {len(prompt):6d} {on_w:10d} {off_w:11d} {on_s:9.2f} "
                f"{off_s:10.2f} {off_s / on_s:5.2f} {on.tokens == off.tokens}",
                flush=True,
            )
            reply = tokenizer.decode(on.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        print(f"median decode speed-up with the draft's cache: {statistics.median(ratios):.2f}x")
        print(f"draft: sessions {draft.sessions}, kept {draft.cache_bytes} bytes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target: a GGUF file")
    parser.add_argument("--draft", required=True, help="the draft: a GGUF file")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--strategy", default="draft-ngram")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--system-chars", type=int, default=2600)
    parsed = parser.parse_args()
    trio.run(main, parsed, SYSTEM_SOURCE.read_text()[: parsed.system_chars])
