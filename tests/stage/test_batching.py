"""Batched passes compute what per-session passes compute; a full stage refuses new sessions.

`forward_batch` stacks several sessions' windows (different positions, lengths and caches) into
one pass; its hidden states and logits must match per-session `forward` (fp32, 1e-5) and give
the same greedy tokens. The stage host batches what is queued, FIFO and one window per session,
and answers an OpenSession it cannot hold with `StageError(code="overloaded")`.
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from meshd.bench.checkpoints import make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import ModelError
from meshd.model.stage import BatchItem, StageModel
from meshd.stage.host import StageHost, StageHostConfig
from protocol.messages import (
    OpenSession,
    Sampling,
    StageError,
    VerifyReply,
    VerifyWindow,
)
from tests.stage.outbox import Outbox

LAYERS = 3
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _single_torch_thread() -> object:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    directory: pathlib.Path = tmp_path_factory.mktemp(f"batch_{request.param}")
    make_checkpoint(directory, request.param, seed=11, num_hidden_layers=LAYERS)
    return Checkpoint.open(directory)


def _prefill(stages: list[StageModel], sid: str, tokens: list[int]) -> None:
    for stage in stages:
        stage.open_session(sid, 96)
    x: torch.Tensor = torch.tensor(tokens)
    for stage in stages:
        x = stage.forward(sid, 0, x).hidden


def test_batched_pass_equals_per_session_passes(checkpoint: Checkpoint) -> None:
    # Two copies of a 2-stage split: one runs sessions alone, the other batched.
    split = [(0, 1), (1, LAYERS)]
    alone = [StageModel.load(checkpoint, lo, hi, device="cpu") for lo, hi in split]
    batched = [StageModel.load(checkpoint, lo, hi, device="cpu") for lo, hi in split]
    rng = random.Random(1)
    vocab = checkpoint.config.vocab_size
    prompts = {f"s{i}": [rng.randrange(3, vocab) for _ in range(5 + 7 * i)] for i in range(4)}
    for sid, prompt in prompts.items():
        _prefill(alone, sid, prompt)
        _prefill(batched, sid, prompt)
    # Windows of different lengths; s1 rewinds two positions (a positional rollback).
    windows = {"s0": (5, 1), "s1": (10, 3), "s2": (19, 5), "s3": (26, 2)}
    for _ in range(3):  # a few rounds, so later passes read what batched passes wrote
        tokens = {
            sid: [rng.randrange(3, vocab) for _ in range(n)] for sid, (_, n) in windows.items()
        }
        ref_x = {sid: torch.tensor(t) for sid, t in tokens.items()}
        got_x = dict(ref_x)
        for a, b in zip(alone, batched, strict=True):
            ref = {
                sid: a.forward(sid, windows[sid][0], ref_x[sid], logits_last_n=2) for sid in windows
            }
            items = [BatchItem(sid, windows[sid][0], got_x[sid], 2) for sid in windows]
            got = dict(zip(windows, b.forward_batch(items), strict=True))
            for sid in windows:
                torch.testing.assert_close(got[sid].hidden, ref[sid].hidden, atol=ATOL, rtol=ATOL)
                if a.is_last:
                    r, g = ref[sid].logits, got[sid].logits
                    assert r is not None and g is not None and g.shape == r.shape
                    torch.testing.assert_close(g, r, atol=ATOL, rtol=ATOL)
                    assert g.argmax(-1).tolist() == r.argmax(-1).tolist()
                ref_x[sid], got_x[sid] = ref[sid].hidden, got[sid].hidden
        windows = {sid: (pos + n, n) for sid, (pos, n) in windows.items()}


def test_a_bad_window_refuses_the_whole_pass_before_writing(checkpoint: Checkpoint) -> None:
    stage = StageModel.load(checkpoint, 0, LAYERS, device="cpu")
    _prefill([stage], "a", [5, 6, 7])
    _prefill([stage], "b", [8, 9])
    before = stage.kv.get("a").main.k.clone()
    gap = [BatchItem("a", 3, torch.tensor([4])), BatchItem("b", 7, torch.tensor([4]))]
    with pytest.raises(ModelError, match="gap"):
        stage.forward_batch(gap)
    twice = [BatchItem("a", 3, torch.tensor([4])), BatchItem("a", 4, torch.tensor([4]))]
    with pytest.raises(ModelError, match="one window per session"):
        stage.forward_batch(twice)
    assert torch.equal(stage.kv.get("a").main.k, before)
    assert stage.kv.get("a").main.valid_len == 3


COORD = b"c" * 32


def _host(checkpoint: Checkpoint, **config: object) -> tuple[StageHost, Outbox]:
    stage = StageModel.load(checkpoint, 0, LAYERS, device="cpu")
    outbox = Outbox()
    host = StageHost(stage, outbox, use_thread=False, config=StageHostConfig(**config))  # type: ignore[arg-type]
    return host, outbox


def _open(host: StageHost, sid: str, max_positions: int = 64) -> None:
    host.handle(
        OpenSession(sid, host.stage.model_id, max_positions, stage_index=0, coordinator=COORD),
        COORD,
    )


def _window(sid: str, window_id: int, tokens: list[int]) -> VerifyWindow:
    return VerifyWindow(sid, 0, window_id, base_pos=0, tokens=tokens, sampling=Sampling())


async def _drain(host: StageHost) -> None:
    while host.queued_windows:
        batch = host._take_batch()
        if batch:
            await host._process(batch)
    while host._errors:
        key, error = host._errors.popleft()
        await host._send(key, error)


async def test_host_batches_queued_sessions_fifo_and_replies_as_if_alone(
    checkpoint: Checkpoint,
) -> None:
    prompts = {f"s{i}": [10 + i, 20 + i, 30 + i][: 1 + i % 3] for i in range(5)}
    expected: dict[str, int] = {}
    for sid, prompt in prompts.items():  # each session alone, batching off
        alone, outbox = _host(checkpoint, batching=False)
        _open(alone, sid)
        alone.handle(_window(sid, 1, prompt), COORD)
        await _drain(alone)
        [(_, reply)] = outbox.sent
        assert isinstance(reply, VerifyReply)
        expected[sid] = reply.next_token
    # Budget of 4 rows: FIFO passes s0+s1 (1+2 rows), then s2+s3 (3+1), then s4 (2).
    host, outbox = _host(checkpoint, max_batch_tokens=4)
    for sid in prompts:
        _open(host, sid)
    for sid, prompt in prompts.items():
        host.handle(_window(sid, 1, prompt), COORD)
    await _drain(host)
    replies = [m for _, m in outbox.sent if isinstance(m, VerifyReply)]
    assert [r.session for r in replies] == list(prompts)  # FIFO: nobody overtaken
    assert {r.session: r.next_token for r in replies} == expected
    assert host.stats.passes == 3 and host.stats.largest_batch == 2
    assert [r.stage_timings[-1].batch_sessions for r in replies] == [2, 2, 2, 2, 1]
    assert replies[0].stage_timings[-1].queued_sessions == 3


async def test_a_session_with_two_windows_queued_keeps_its_order(checkpoint: Checkpoint) -> None:
    host, outbox = _host(checkpoint)
    _open(host, "a")
    _open(host, "b")
    host.handle(_window("a", 1, [5, 6]), COORD)
    host.handle(VerifyWindow("a", 0, 2, base_pos=2, tokens=[7], sampling=Sampling()), COORD)
    host.handle(_window("b", 1, [8]), COORD)
    await _drain(host)
    order = [(m.session, m.window_id) for _, m in outbox.sent if isinstance(m, VerifyReply)]
    assert order == [("a", 1), ("b", 1), ("a", 2)]
    assert host.stats.passes == 2


async def test_full_stage_refuses_new_sessions_as_overloaded(checkpoint: Checkpoint) -> None:
    host, outbox = _host(checkpoint, max_sessions=2, overload_retry_after_s=2.5)
    for sid in ("a", "b", "c"):
        _open(host, sid)
    await _drain(host)
    [(key, error)] = outbox.sent
    assert key == COORD and isinstance(error, StageError)
    assert (error.session, error.code, error.retry_after_s) == ("c", "overloaded", 2.5)
    host.handle(_window("c", 1, [5]), COORD)  # the refused session's windows go nowhere
    await _drain(host)
    assert len(outbox.sent) == 1 and host.stats.sessions_refused == 1
    # Room again once a session closes.
    host._close("a")
    _open(host, "c")
    assert host.stats.sessions_open == 2


async def test_kv_memory_full_is_overloaded_but_too_big_is_an_error(
    checkpoint: Checkpoint,
) -> None:
    stage = StageModel.load(checkpoint, 0, LAYERS, device="cpu", kv_budget_bytes=0)  # sized below
    per_session = stage.kv_bytes_per_token * 64
    stage.kv.budget_bytes = per_session
    outbox = Outbox()
    host = StageHost(stage, outbox, use_thread=False)
    _open(host, "a", 64)
    _open(host, "b", 64)  # memory held by "a": retry later
    _open(host, "huge", 65)  # could never fit: a plain error
    await _drain(host)
    codes = {m.session: m.code for _, m in outbox.sent if isinstance(m, StageError)}
    assert codes == {"b": "overloaded", "huge": "KVBudgetExceeded"}
