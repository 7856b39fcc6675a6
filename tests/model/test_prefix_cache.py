"""Prefix-cache entries in a stage's KV cache: kept bits, the memory budget, eviction, misses."""

from __future__ import annotations

import pathlib

import pytest
import torch

from meshd.bench.checkpoints import make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import KVBudgetExceeded
from meshd.model.stage import StageModel


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    directory: pathlib.Path = tmp_path_factory.mktemp("prefix_ckpt")
    make_checkpoint(directory, "llama", seed=3, num_hidden_layers=2)
    return Checkpoint.open(directory)


def stage(checkpoint: Checkpoint, budget: int | None = None, limit: int = 1 << 30) -> StageModel:
    model = StageModel.load(checkpoint, 0, 2, device="cpu", kv_budget_bytes=budget)
    model.kv.cache_limit_bytes = limit
    return model


PROMPT = torch.arange(3, 67)  # 64 tokens


def test_an_entry_restores_the_prefix_and_the_rest_matches_a_cold_run(
    checkpoint: Checkpoint,
) -> None:
    model = stage(checkpoint)
    model.open_session("cold", 80)
    cold = model.forward("cold", 0, PROMPT[:32]).hidden
    cold_rest = model.forward("cold", 32, PROMPT[32:]).hidden
    assert model.kv.keep("cold", 11, 32)
    model.close_session("cold")
    assert model.kv.used_bytes == 0 and model.kv.entries == 1
    assert model.open_session("warm", 80, prefix=(11, 32)) == 32
    warm_rest = model.forward("warm", 32, PROMPT[32:]).hidden
    assert torch.equal(warm_rest, cold_rest)  # same windows, same bits
    assert cold.shape[0] == 32
    stats = model.kv.cache_stats
    assert (stats.hits, stats.reused_tokens, stats.kept) == (1, 32, 1)
    # An entry holds what was asked, no more: a longer prefix is a miss (an empty session).
    assert model.open_session("long", 80, prefix=(11, 40)) == 0
    assert model.open_session("gone", 80, prefix=(12, 8)) == 0
    assert model.kv.cache_stats.misses == 2


def test_live_sessions_evict_entries_and_closing_frees_every_byte(checkpoint: Checkpoint) -> None:
    per_position = stage(checkpoint).kv.layout.bytes_per_token
    model = stage(checkpoint, budget=per_position * 100)
    for n, entry in ((40, 1), (30, 2)):
        model.open_session("s", n)
        model.forward("s", 0, PROMPT[:n])
        assert model.kv.keep("s", entry, n)
        model.close_session("s")
    assert model.kv.cache_bytes == per_position * 70 and model.kv.entries == 2
    # A session of 50 positions needs the older entry's room; the newer one stays.
    model.open_session("live", 50)
    assert model.kv.entry_positions(1) == 0 and model.kv.entry_positions(2) == 30
    assert model.kv.cache_stats.evictions == 1
    # A session that needs all the room takes it; one that never fits is refused.
    model.close_session("live")
    model.open_session("big", 100)
    assert model.kv.entries == 0 and model.kv.cache_bytes == 0
    with pytest.raises(KVBudgetExceeded):
        model.open_session("more", 1)
    # An entry that does not fit beside the live sessions is not kept.
    model.close_session("big")
    model.open_session("a", 60)
    model.open_session("b", 30)
    model.forward("b", 0, PROMPT[:30])
    assert model.kv.keep("b", 3, 30)  # b's own room is freed with it
    model.close_session("b")
    model.open_session("c", 15)
    assert model.kv.entries == 0  # evicted for c: 60 + 15 + 30 > 100
    model.forward("c", 0, PROMPT[:15])
    model.forward("a", 0, PROMPT[:40])
    assert model.kv.keep("a", 4, 40)  # a's own 60 positions are freed with it
    # c's entry fits only without a's (a still live): the older entry goes.
    assert model.kv.keep("c", 5, 15)
    assert model.kv.entry_positions(4) == 0 and model.kv.entry_positions(5) == 15
    assert model.kv.used_bytes + model.kv.cache_bytes <= per_position * 100
    for session in ("a", "c"):
        model.close_session(session)
    assert model.kv.used_bytes == 0
    model.kv.clear_entries()
    assert model.kv.cache_bytes == 0 and model.kv.entries == 0


def test_the_cache_limit_evicts_least_recently_used(checkpoint: Checkpoint) -> None:
    per_position = stage(checkpoint).kv.layout.bytes_per_token
    model = stage(checkpoint, limit=per_position * 50)
    for entry in (1, 2, 3):
        model.open_session("s", 20)
        model.forward("s", 0, PROMPT[:20])
        assert model.kv.keep("s", entry, 20)
        model.close_session("s")
        if entry == 2:
            model.open_session("touch", 20, prefix=(1, 10))  # 1 is now the most recent
            model.close_session("touch")
    assert [model.kv.entry_positions(e) for e in (1, 2, 3)] == [20, 0, 20]
    # Too big for the limit, or more positions than written: not kept.
    model.open_session("s", 60)
    model.forward("s", 0, PROMPT[:60])
    assert not model.kv.keep("s", 9, 60)
    assert not model.kv.keep("s", 9, 61)
    assert model.kv.cache_stats.not_kept == 2
