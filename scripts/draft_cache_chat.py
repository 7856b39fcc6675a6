"""A multi-turn chat drafted by a draft model, with the draft's prompt cache on and off.

    M=~/.cache/meshd/models
    python scripts/draft_cache_chat.py --model $M/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --draft $M/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --stages 2 --rtt-ms 20

Opens a local pipeline (the stages' own prompt cache on, as a daemon's is), runs a chat of
`--turns` turns (a long system prompt, short user turns, each reply appended as the assistant's
message), each turn's prompt three times: with `--strategy` and the draft keeping its KV
between requests (`stage.prefix_cache_bytes`), with a draft keeping nothing,
and plainly (`disabled`, the reference text), rotating which goes first turn by turn, on the
same stages. The uncached draft is a second copy of the file the coordinator loads under
another name. Prints per turn: prompt tokens, the tokens the cached draft's first pass wrote,
the decode seconds (the draft's catch-up on the conversation falls in decode: it runs at the
first proposal) with and without the cache and their ratio, and whether each reply equals the
plain one.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import trio
from prefix_cache_chat import QUESTIONS, SYSTEM_SOURCE  # the same chat (scripts/ is on sys.path)

from meshd.coord.coordinator import GenerationRequest, GenerationResult
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.files import open_tokenizer
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.draft_vocab import DraftVocab
from meshd.stage.host_config import StageHostConfig


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
    pipe: LocalPipeline, prompt: list[int], args: argparse.Namespace, eos: frozenset[int], run: str
) -> tuple[GenerationResult, float]:
    """One request: `run` "on" drafts with the pipeline's draft (it keeps its KV), "off" with
    a second copy the coordinator loads from another path (it keeps nothing), "disabled"
    decodes plainly (the reference text)."""
    draft = args.draft if run == "on" else args.draft_off
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=args.max_tokens,
        eos_ids=eos,
        spec=SpecConfig(
            strategy="disabled" if run == "disabled" else args.strategy, draft_model=draft
        ),
        mtp_depth=0,
    )
    started = time.perf_counter()
    result = await pipe.coordinator.generate(pipe.route, request, _ignore)
    wall = time.perf_counter() - started
    while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
        await trio.sleep(0.005)  # until the close (and keep) reached every stage
    telemetry = result.telemetry
    return result, telemetry.decode_s or max(1e-9, wall - telemetry.prompt_s)


def result_reason(result: GenerationResult) -> str:
    return str(getattr(result, "finish_reason", "?"))


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
        eos_ids=eos,  # the last stage ends a window at an end-of-sequence token, as a daemon's
        draft=draft,
    ) as pipe:
        pipe.coordinator.reply_timeout_s = 600.0
        print(f"{args.strategy}, {args.stages} stage(s) at {args.rtt_ms:g} ms")
        print("turn prompt written_on decode_on decode_off ratio decode_plain same_on same_off")
        ratios, plains = [], []
        order = ["disabled", "on", "off"]
        for index in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
            prompt = tokenizer.encode_chat(messages)
            runs: dict[str, tuple[GenerationResult, float, int]] = {}
            for run in order[index % 3 :] + order[: index % 3]:
                draft.written.clear()
                result, decode_s = await turn(pipe, prompt, args, eos, run)
                runs[run] = (result, decode_s, draft.written[0] if draft.written else 0)
            (on, on_s, on_w), (off, off_s, _) = runs["on"], runs["off"]
            plain = runs["disabled"][0].tokens
            ratios.append(off_s / on_s)
            plains.append(runs["disabled"][1] / on_s)
            print(
                f"{index + 1:4d} {len(prompt):6d} {on_w:10d} {on_s:9.2f} {off_s:10.2f} "
                f"{off_s / on_s:5.2f} {runs['disabled'][1]:12.2f} {on.tokens == plain} "
                f"{off.tokens == plain}",
                flush=True,
            )
            for name, got in (("on", on.tokens), ("off", off.tokens)):
                if got != plain:  # where a run's text left the plain decode's
                    at = next(
                        (i for i, (a, b) in enumerate(zip(got, plain, strict=False)) if a != b),
                        min(len(got), len(plain)),
                    )
                    print(
                        f"     {name}: {len(got)} tokens against {len(plain)}, from {at}: "
                        f"{got[at:][:8]} against {plain[at:][:8]} (EOS {sorted(eos)}), "
                        f"finish {result_reason(runs[name][0])} against "
                        f"{result_reason(runs['disabled'][0])}"
                    )
            reply = tokenizer.decode(plain, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
        print(f"median decode speed-up with the draft's cache: {statistics.median(ratios):.2f}x")
        print(f"median decode speed-up over plain decoding: {statistics.median(plains):.2f}x")
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
    # The uncached copy: the same file under another name, which the coordinator loads on
    # first use as a draft of its own, keeping nothing (`DraftModel.load`'s default).
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="meshd-draft-off-"))
    parsed.draft_off = str(scratch / pathlib.Path(parsed.draft).name)
    os.symlink(pathlib.Path(parsed.draft).resolve(), parsed.draft_off)
    try:
        trio.run(main, parsed, SYSTEM_SOURCE.read_text()[: parsed.system_chars])
    finally:
        shutil.rmtree(scratch)
