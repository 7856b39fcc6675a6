"""`meshd serve --model FILE.gguf`: two daemons split a GGUF model and generate exactly what one
process decodes from the same file."""

from __future__ import annotations

import pathlib

import httpx
import pytest
import torch

from meshd.bench.gguf_writer import write_gguf
from meshd.bench.single_node import generate
from meshd.cli.supervisor import kill_all, settled_plan, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel
from meshd.node.control_client import GenerateOp, request_lines
from tests.node.daemons import SECRET, Daemon

pytestmark = pytest.mark.slow


def test_two_daemons_serve_a_quantized_gguf_file(tmp_path: pathlib.Path) -> None:
    model = write_gguf(builtin_model_dir(), tmp_path / "tiny-stories-q8.gguf", "Q8_0")
    budget = stage_budget(str(model), 2)  # two nodes hold it, one cannot
    daemons = [
        Daemon(tmp_path, i, secret=SECRET, budget=budget, extra=("--model", str(model)))
        for i in (2, 3)
    ]
    try:
        started(daemons)
        wait_until(lambda: settled_plan(daemons) is not None, 60, "a settled plan")
        plan = settled_plan(daemons)
        assert plan is not None and len(plan) == 2
        prompt = open_tokenizer(model).encode("Once upon a time")
        # Plain decoding and speculation (quantized windows compute plain decoding's bits).
        finals = [
            list(
                request_lines(
                    daemons[0].socket,
                    GenerateOp(prompt=prompt, max_tokens=24, ignore_eos=True, strategy=strategy),
                    timeout_s=60,
                )
            )[-1]
            for strategy in ("disabled", "ngram-simple", "auto")
        ]
        assert all(final["ok"] for final in finals), finals
        checkpoint = open_checkpoint(model)
        # A Q8_0 file is served as stored by default (`quantization = "auto"`), never as fp32.
        assert checkpoint.default_quantization == "gguf"
        whole = StageModel.load(
            checkpoint, 0, checkpoint.config.num_layers, device="cpu", quantization="gguf"
        )
        previous = torch.get_num_threads()
        torch.set_num_threads(1)  # the daemons hold the cores
        try:
            expected = generate([whole], prompt, 24).tokens
        finally:
            torch.set_num_threads(previous)
        assert [final["tokens"] for final in finals] == [expected] * 3
        models = httpx.get(f"{daemons[0].api_url}/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny-stories-q8"]
    finally:
        kill_all(daemons)
