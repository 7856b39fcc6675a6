"""Speculation never changes a greedy token of a quantized (q8_0, q4_k: int8, int4) model either.

On a CPU the block stages compute a verify window's rows with exactly the bits of the same
positions decoded one at a time (each row quantized in its own blocks, per-row attention for
short windows), so every strategy gives plain decoding's tokens, on the built-in model's real
weights, where near-ties between the top two tokens do occur.
"""

from __future__ import annotations

import pytest
import torch
import trio

from meshd.bench.single_node import generate
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.config import SpecConfig

PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef walk(root):",
    "Once upon a time",
    "class Stack:\n    def __init__(self):",
)
TOKENS = 64
STRATEGIES = ("mtp", "ngram-simple", "auto")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
async def test_every_strategy_decodes_plain_decodings_tokens(quantization: str) -> None:
    tok = Tokenizer.open(builtin_model_dir())
    prompts = [tok.encode(p) for p in PROMPTS]
    checkpoint = Checkpoint.open(builtin_model_dir())
    whole = StageModel.load(
        checkpoint, 0, checkpoint.config.num_layers, device="cpu", quantization=quantization
    )
    torch.set_num_threads(1)
    expected = [generate([whole], p, TOKENS).tokens for p in prompts]
    drafted = accepted = 0
    async with open_local_pipeline(builtin_model_dir(), 2, quantization=quantization) as pipe:
        for strategy in STRATEGIES:
            for prompt, want in zip(prompts, expected, strict=True):
                request = GenerationRequest(
                    prompt=prompt,
                    max_tokens=TOKENS,
                    spec=SpecConfig(strategy=strategy, window_max_tokens=6, max_pipeline_depth=2),
                    mtp_depth=2,
                )

                async def on_tokens(tokens: list[int]) -> None:
                    pass

                with trio.fail_after(120):
                    result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
                assert result.tokens == want, (quantization, strategy, tok.decode(prompt))
                drafted += result.telemetry.drafted_tokens
                accepted += result.telemetry.accepted_tokens
    # Windows of several rows really ran (the comparison would be empty otherwise).
    assert drafted > 100 and accepted > 20, (drafted, accepted)
