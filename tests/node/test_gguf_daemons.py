"""`meshd serve --model FILE.gguf`: two daemons split a GGUF model and generate exactly what one
process decodes from the same file; a third waits as the spare. When a stage that holds
prompt-cache entries is SIGKILLed, the spare takes its layers, the same prompt gets the same
tokens, and the survivors are left with no session and no task of the dead stage."""

from __future__ import annotations

import pathlib
from typing import Any

import httpx
import pytest
import torch

from meshd.bench.gguf_writer import write_gguf
from meshd.bench.single_node import generate
from meshd.cli.supervisor import (
    agreed_plan,
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
)
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel
from meshd.node.control_client import GenerateOp, request_lines
from tests.node.daemons import SECRET, Daemon, tasks_of, wait_tasks_back

pytestmark = pytest.mark.slow


def test_two_daemons_serve_a_quantized_gguf_file(tmp_path: pathlib.Path) -> None:
    model = write_gguf(builtin_model_dir(), tmp_path / "tiny-stories-q8.gguf", "Q8_0")
    budget = stage_budget(str(model), 2)  # two nodes hold it, one cannot
    daemons = [
        Daemon(tmp_path, i, secret=SECRET, budget=budget, extra=("--model", str(model)))
        for i in (2, 3, 4)
    ]
    try:
        started(daemons)
        plan = agreed_plan(daemons, timeout_s=60, stable_s=1.0)
        assert len(plan) == 2  # the third node is the spare
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
        _kill_a_stage_holding_prompt_cache_entries(daemons, plan, prompt)
    finally:
        kill_all(daemons)


def _generate(coordinator: Daemon, prompt: list[int]) -> list[int]:
    op = GenerateOp(prompt=prompt, max_tokens=12, ignore_eos=True, strategy="disabled")
    final = list(request_lines(coordinator.socket, op, timeout_s=60))[-1]
    assert final["ok"], final
    return list(final["tokens"])


def _kill_a_stage_holding_prompt_cache_entries(
    daemons: list[Daemon], plan: list[dict[str, Any]], prompt: list[int]
) -> None:
    coordinator = daemons[0]
    # Three prefill chunks (128 tokens each) and a tail: the stages keep entries of it.
    long_prompt = (prompt * 100)[:400]
    _generate(coordinator, long_prompt)
    answer = _generate(coordinator, long_prompt)
    assert coordinator.status()["prefix_cache"]["hits"] >= 1
    stage_keys = [s["key"] for s in plan]
    victim = next(d for d in daemons if d.key() in stage_keys and d is not coordinator)
    assert victim.status()["prefix_cache"]["entries"] >= 1
    survivors = [d for d in daemons if d is not victim]
    spare = next(d for d in survivors if d.key() not in stage_keys)
    before = tasks_of(survivors)

    victim.kill()

    def moved() -> bool:
        now = settled_plan(survivors)
        return now is not None and victim.key() not in {s["key"] for s in now}

    wait_until(moved, 60, "a plan without the killed stage, loaded")
    assert spare.status()["stage_layers"] is not None
    # The entries died with the stage: the prompt is prefilled again, to the same tokens.
    assert _generate(coordinator, long_prompt) == answer
    wait_until(
        lambda: all(d.status()["sessions_hosted"] == 0 for d in survivors),
        30,
        "no session left on a survivor",
    )
    wait_tasks_back(survivors, before, took_stage=[spare])
