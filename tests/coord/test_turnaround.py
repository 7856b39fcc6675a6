"""The coordinator's own turnaround between a reply and its next window is a per-window cost.

A slow stream consumer (or a slow coordinator) makes every window dearer, plain decoding
included, so the policy must see it beside the network: it is what makes several tokens
per window worth more.
"""

from __future__ import annotations

import pathlib

import pytest
import trio

from meshd.coord.local import open_local_pipeline
from meshd.coord.pipeline import GenerationRequest
from meshd.spec.config import SpecConfig
from tests.model.tiny import make_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("turnaround_ckpt")
    make_checkpoint(directory, "llama", seed=5, num_hidden_layers=2)
    return directory


async def _fixed_cost_after(model_dir: pathlib.Path, consumer_delay_s: float) -> float:
    async with open_local_pipeline(model_dir, 2, rtt_s=0.0, wire_dtype="f32") as pipe:

        async def on_tokens(tokens: list[int]) -> None:
            await trio.sleep(consumer_delay_s)

        request = GenerationRequest(
            prompt=list(range(40, 56)), max_tokens=12, spec=SpecConfig(strategy="disabled")
        )
        with trio.fail_after(60):
            await pipe.coordinator.generate(pipe.route, request, on_tokens)
        return pipe.coordinator.link_model(pipe.route).rtt_s


async def test_a_slow_consumer_counts_as_fixed_cost_per_window(model_dir: pathlib.Path) -> None:
    fast = await _fixed_cost_after(model_dir, 0.0)
    slow = await _fixed_cost_after(model_dir, 0.03)
    assert slow >= 0.025  # EWMA over 11 turnarounds of ≥ 30 ms each
    assert slow > fast + 0.02
