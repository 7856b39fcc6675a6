"""Stale windows are dropped before compute; a cancelled request frees KV on every stage."""

from __future__ import annotations

import pathlib

import pytest
import torch
import trio

from meshd.bench.checkpoints import make_checkpoint
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.speculative.config import SpecConfig
from meshd.stage.wire import to_blob
from protocol.messages import OpenSession, Rollback, Sampling, StageHidden, VerifyWindow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("stale_ckpt")
    make_checkpoint(directory, "llama", seed=7, num_hidden_layers=2)
    return directory


async def wait_until(predicate: object, timeout_s: float = 3.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_window_of_an_older_epoch_is_dropped_not_computed(model_dir: pathlib.Path) -> None:
    async with open_local_pipeline(model_dir, 2, use_thread=False) as pipe:
        first, second = pipe.nodes
        host = second.host
        assert host is not None
        own = first.key
        open_msg = OpenSession(
            session="s",
            model_id=pipe.route.model_id,
            max_positions=64,
            stage_index=1,
            coordinator=own,
        )
        await first.peers.send(second.key, open_msg)
        await wait_until(lambda: host.stats.sessions_open == 1)
        # Hidden states for epoch 0 and a rollback to epoch 1 arrive before the worker runs:
        # the stage must drop the window without computing it.
        window = VerifyWindow("s", 0, 1, 0, [3, 4, 5], Sampling())
        hidden = StageHidden(window, to_blob(torch.zeros(3, 64), "f32"), [])
        host.handle(hidden, own)
        host.handle(Rollback("s", 1), own)
        await wait_until(lambda: host.stats.windows_stale == 1)
        assert host.stats.windows_computed == 0


async def test_cancelled_request_frees_kv_on_every_stage(model_dir: pathlib.Path) -> None:
    async with open_local_pipeline(model_dir, 2, rtt_s=0.01) as pipe:
        request = GenerationRequest(
            prompt=list(range(3, 30)), max_tokens=200, spec=SpecConfig(strategy="ngram-simple")
        )
        got: list[int] = []
        scope = trio.CancelScope()

        async def on_tokens(tokens: list[int]) -> None:
            got.extend(tokens)
            if len(got) >= 5:
                scope.cancel()  # the client went away mid-generation

        with scope, trio.fail_after(30):
            await pipe.coordinator.generate(pipe.route, request, on_tokens)
        assert scope.cancelled_caught and 0 < len(got) < 200
        await wait_until(lambda: all(h.stats.sessions_open == 0 for h in pipe.hosts))
        assert all(len(h.stage.kv) == 0 for h in pipe.hosts)
