"""Concurrent generations share batched stage passes and still say exactly what they say alone.

Several requests run at once on a 2-stage local pipeline (real lanes, real stage hosts); the
stages batch their windows into shared passes. Every request's greedy output must equal its
output alone. A full stage refuses a new request with a retryable `StageOverloaded`, and the
load the stages report narrows speculation.
"""

from __future__ import annotations

import pathlib

import pytest
import trio

from meshd.bench.checkpoints import add_mtp, make_checkpoint
from meshd.bench.single_node import generate
from meshd.coord.coordinator import Coordinator, GenerationRequest, StageOverloaded
from meshd.coord.local import open_local_pipeline
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.plan.route import Route, RouteStage
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import PolicyInputs, choose
from meshd.stage.host import StageHostConfig

LAYERS = 3
TOKENS = 16
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3,
    list(range(40, 61)),
    [100, 101, 102, 100, 101, 102, 100],
    list(range(200, 213)),
    [7, 7, 7, 7],
    list(range(60, 90, 2)),
]
# One window policy per request, so batches mix widths, depths and MTP.
SPECS = [
    SpecConfig(strategy="disabled"),
    SpecConfig(strategy="ngram-simple", window_min_tokens=1, window_max_tokens=4),
    SpecConfig(strategy="mtp", window_min_tokens=1, window_max_tokens=2, max_pipeline_depth=2),
    SpecConfig(strategy="ngram-cache", window_min_tokens=1, window_max_tokens=3),
    SpecConfig(strategy="disabled"),
    SpecConfig(strategy="auto"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("concurrency_ckpt")
    model = make_checkpoint(directory, "llama", seed=21, num_hidden_layers=LAYERS)
    add_mtp(directory, model, 2, seed=22)
    return directory


def _alone(model_dir: pathlib.Path, prompt: list[int]) -> list[int]:
    stage = StageModel.load(Checkpoint.open(model_dir), 0, LAYERS, device="cpu")
    return list(generate([stage], prompt, TOKENS).tokens)


def _request(index: int) -> GenerationRequest:
    return GenerationRequest(
        prompt=PROMPTS[index], max_tokens=TOKENS, spec=SPECS[index], mtp_depth=2
    )


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_concurrent_greedy_outputs_equal_each_alone(
    model_dir: pathlib.Path, batching: bool
) -> None:
    expected = [_alone(model_dir, p) for p in PROMPTS]
    got: dict[int, list[int]] = {}
    async with open_local_pipeline(model_dir, 2, wire_dtype="f32") as pipe:
        for host in pipe.hosts:
            host.batching = batching

        async def one(index: int) -> None:
            result = await pipe.coordinator.generate(pipe.route, _request(index), _ignore)
            got[index] = result.tokens

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for index in range(len(PROMPTS)):
                    nursery.start_soon(one, index)
        largest = max(host.stats.largest_batch for host in pipe.hosts)
    assert [got[i] for i in range(len(PROMPTS))] == expected
    if batching:
        assert largest > 1  # the sessions really shared passes
    else:
        assert largest == 1


async def _ignore(tokens: list[int]) -> None:
    return None


async def test_a_full_stage_refuses_a_new_request_with_retry_after(
    model_dir: pathlib.Path,
) -> None:
    async with open_local_pipeline(model_dir, 2, wire_dtype="f32") as pipe:
        pipe.hosts[1].config = StageHostConfig(max_sessions=1, overload_retry_after_s=3.0)
        first_token = trio.Event()
        release = trio.Event()
        first: list[int] = []

        async def hold(tokens: list[int]) -> None:
            first.extend(tokens)
            first_token.set()
            await release.wait()

        async def first_request() -> None:
            await pipe.coordinator.generate(pipe.route, _request(0), hold)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_request)
                await first_token.wait()
                with pytest.raises(StageOverloaded) as refused:
                    await pipe.coordinator.generate(pipe.route, _request(1), _ignore)
                release.set()
        assert refused.value.retry_after_s == 3.0
        assert "overloaded" in str(refused.value)
        assert pipe.hosts[1].stats.sessions_refused == 1
        # Once the first request is done, the same request is served.
        with trio.fail_after(60):
            result = await pipe.coordinator.generate(pipe.route, _request(1), _ignore)
        assert result.tokens == _alone(model_dir, PROMPTS[1])


async def test_reported_stage_load_narrows_speculation() -> None:
    class _Nowhere:
        async def send(self, key: bytes, message: object, stream: int = 0) -> None:
            return None

    coord = Coordinator(_Nowhere(), b"k" * 32)
    route = Route("m", (RouteStage(b"a" * 32, 0, 2), RouteStage(b"b" * 32, 2, 4)))
    costs = coord.costs(route)
    for tokens in (1, 5, 1, 9, 1, 5):  # 5 ms RTT; compute 0.2 ms + 1 ms per token
        compute = 0.0002 + 0.001 * tokens
        costs.observe(tokens, 0.005 + compute, compute, 0.0)
    spec = SpecConfig(strategy="ngram-simple", window_min_tokens=0, window_max_tokens=8)
    acceptance = (0.6,)
    alone = choose(PolicyInputs(coord.link_model(route), acceptance), spec)
    coord.observe_load(route, 8)  # a reply says 8 sessions shared the pass or waited
    assert coord.stage_load(route) == 8
    busy = choose(PolicyInputs(coord.link_model(route), acceptance), spec)
    assert coord.link_model(route).concurrent_sessions == 8
    assert alone.width > 0
    assert busy.width < alone.width  # here: it stops speculating
    for _ in range(10):  # the load falls back as replies report an idle stage
        coord.observe_load(route, 1)
    assert coord.stage_load(route) < 1.5


async def test_a_full_stage_is_a_429_with_the_stages_retry_after_through_the_backend(
    model_dir: pathlib.Path,
) -> None:
    from meshd.api.backend import LocalPipelineBackend, Overloaded
    from meshd.model.builtin import builtin_model_dir
    from meshd.model.tokenizer import Tokenizer

    async with open_local_pipeline(model_dir, 2, wire_dtype="f32") as pipe:
        pipe.hosts[1].config = StageHostConfig(max_sessions=1, overload_retry_after_s=2.5)
        # The tiny test checkpoint has no tokenizer; the backend only carries one for the API.
        tokenizer = Tokenizer.open(builtin_model_dir())
        backend = LocalPipelineBackend(pipe, tokenizer, model_name="t")
        first_token, release = trio.Event(), trio.Event()

        async def hold(tokens: list[int]) -> None:
            first_token.set()
            await release.wait()

        async def first_request() -> None:
            await backend.generate(_request(0), hold)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_request)
                await first_token.wait()
                with pytest.raises(Overloaded) as refused:
                    await backend.generate(_request(1), _ignore)
                release.set()
        assert refused.value.retry_after_s == 2.5
