"""Every path that takes `--model DIR` takes a GGUF file: local pipeline, bench, reference."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import trio

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.decode import DEFAULT_PROMPT
from meshd.bench.gguf_writer import write_gguf
from meshd.bench.reference import transformers_model
from meshd.bench.single_node import generate
from meshd.cli.main import main
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel

PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211, 17, 3]


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"])
def test_the_transformers_reference_of_a_gguf_equals_the_directorys(
    tmp_path: pathlib.Path, family: str
) -> None:
    make_checkpoint(tmp_path / "hf", family, seed=8)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", sliding_window=family == "mistral")
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ours = transformers_model(path, torch.float32)(ids).logits
        theirs = transformers_model(tmp_path / "hf", torch.float32)(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bench_decode_takes_a_gguf_model(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_gguf(builtin_model_dir(), tmp_path / "builtin-q8.gguf", "Q8_0")
    args = ["bench", "decode", "--model", str(path), "--tokens", "8", "--rounds", "1", "--json"]
    # Dequantized to fp32 (as transformers' reference holds it), both sides decode alike; by
    # default the file is benched as stored (tests/bench/test_decode.py).
    assert main([*args, "--quantization", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == str(path) and report["same_tokens"] is True
    assert report["quantization"] == "none"
    assert report["prompt_tokens"] == len(open_tokenizer(path).encode(DEFAULT_PROMPT))


async def test_a_local_pipeline_splits_a_gguf_file(tmp_path: pathlib.Path) -> None:
    path = write_gguf(builtin_model_dir(), tmp_path / "builtin.gguf", "Q8_0")
    checkpoint = open_checkpoint(path)
    prompt = open_tokenizer(path).encode("One day, a girl named")
    whole = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    expected = generate([whole], prompt, 16).tokens
    async with open_local_pipeline(path, 2, wire_dtype="f32") as pipe:

        async def ignore(tokens: list[int]) -> None:
            pass

        with trio.fail_after(60):
            result = await pipe.coordinator.generate(
                pipe.route, GenerationRequest(prompt=prompt, max_tokens=16), ignore
            )
    assert result.tokens == expected
