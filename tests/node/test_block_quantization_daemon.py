"""A daemon serving a safetensors checkpoint quantized at load into ggml blocks (`q4_k`)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pytest
import torch

from meshd.bench.single_node import generate
from meshd.cli.supervisor import kill_all, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel, stage_weight_bytes
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import GenerateOp, request_lines
from tests.node.daemons import Daemon
from tests.node.test_daemon import meshctl

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
# This module's own mesh: daemons of other test modules running beside it never join it.
SECRET = "meshd-block-quantization-secret-01234"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp: pathlib.Path = tmp_path_factory.mktemp("blocks")
    budget = stage_budget(str(builtin_model_dir()), 1, "q4_k")
    d = Daemon(tmp, 21, secret=SECRET, budget=budget, extra=("--quantization", "q4_k"))
    try:
        started([d])
        yield d
    finally:
        kill_all([d])


def test_a_q4_k_node_holds_the_planned_bytes_and_answers_its_stages_tokens(
    daemon: Daemon,
) -> None:
    def serving() -> bool:
        s = daemon.try_status()
        return s is not None and s["stage_layers"] == [0, 6] and s["weight_bytes"] > 0

    wait_until(serving, 60, "the node serving the whole model")
    status = json.loads(meshctl("status", "--json", "--socket", daemon.socket))
    assert status["quantization"] == status["plan_quantization"] == "q4_k"
    checkpoint = Checkpoint.open(builtin_model_dir())
    config = checkpoint.config
    planned = stage_weight_bytes(config, 0, config.num_layers, torch.float32, "q4_k")
    assert status["weight_bytes"] == planned
    prompt = Tokenizer.open(builtin_model_dir()).encode("def fibonacci(n):\n")
    op = GenerateOp(prompt=prompt, max_tokens=MAX_TOKENS, strategy="disabled", ignore_eos=True)
    final = list(request_lines(daemon.socket, op, timeout_s=60))[-1]
    assert final["ok"], final
    torch.set_num_threads(1)
    stage = StageModel.load(checkpoint, 0, config.num_layers, device="cpu", quantization="q4_k")
    assert final["tokens"] == generate([stage], prompt, MAX_TOKENS).tokens
