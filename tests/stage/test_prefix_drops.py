"""A stage drops the prompt-cache entries a coordinator's index no longer names (`DropEntries`,
a close's `replaces`): only entries kept for that coordinator, unknown ids skipped."""

from __future__ import annotations

import pathlib

import pytest
import torch

from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.stage.host import StageHost
from protocol.messages import CloseSession, DropEntries, OpenSession
from tests.stage.outbox import Outbox

COORD = b"c" * 32
OTHER = b"o" * 32


@pytest.fixture
def host(model_dir: pathlib.Path) -> StageHost:
    stage = StageModel.load(Checkpoint.open(model_dir), 0, 3, device="cpu")
    host = StageHost(stage, Outbox(), use_thread=False)
    host.stage.kv.cache_limit_bytes = 1 << 30
    return host


def _keep(host: StageHost, sid: str, coordinator: bytes, entry: int, replaces: int = 0) -> None:
    """Open `sid` for `coordinator`, write 16 positions, and close it keeping them as `entry`."""
    message = OpenSession(sid, host.stage.model_id, 32, stage_index=0, coordinator=coordinator)
    host.handle(message, coordinator)
    host.stage.forward(sid, 0, torch.arange(3, 19))
    host.handle(CloseSession(sid, entry, 16, replaces), coordinator)


def _held(host: StageHost, *entries: int) -> list[int]:
    return [host.stage.kv.entry_positions(e) for e in entries]


async def test_a_coordinator_drops_its_own_entries_only_and_unknown_ids_are_skipped(
    host: StageHost,
) -> None:
    kv = host.stage.kv
    for sid, coordinator, entry in (("a", COORD, 1), ("b", COORD, 2), ("c", OTHER, 3)):
        _keep(host, sid, coordinator, entry)
    one = kv.cache_bytes // 3
    # Another node naming COORD's entry, and ids nobody kept: nothing happens.
    host.handle(DropEntries([1, 2]), OTHER)
    host.handle(DropEntries([99, 2**63 - 1]), COORD)
    assert _held(host, 1, 2, 3) == [16, 16, 16] and kv.cache_stats.dropped == 0
    host.handle(DropEntries([1, 3, 99]), COORD)
    assert _held(host, 1, 2, 3) == [0, 16, 16]
    host.handle(DropEntries([1, 2]), COORD)  # again: idempotent
    assert _held(host, 1, 2, 3) == [0, 0, 16]
    assert kv.entries == 1 and kv.cache_bytes == one
    assert (kv.cache_stats.dropped, kv.cache_stats.evictions) == (2, 0)


async def test_a_replaced_entry_is_dropped_even_when_the_new_one_is_not_kept(
    host: StageHost,
) -> None:
    kv = host.stage.kv
    _keep(host, "turn1", COORD, 1)
    _keep(host, "turn2", COORD, 2, replaces=1)
    assert _held(host, 1, 2) == [0, 16]
    # The new entry does not fit: the index has replaced entry 2 all the same.
    kv.cache_limit_bytes = kv.cache_bytes - 1
    _keep(host, "turn3", COORD, 3, replaces=2)
    assert _held(host, 2, 3) == [0, 0] and kv.cache_bytes == 0
    assert kv.cache_stats.not_kept == 1
    # A close whose session is gone (its lease lapsed) still drops what it replaces...
    kv.cache_limit_bytes = 1 << 30
    _keep(host, "turn4", COORD, 4)
    host.handle(CloseSession("gone", replaces=4), COORD)
    assert _held(host, 4) == [0]
    # ...but never another coordinator's entry.
    _keep(host, "theirs", OTHER, 5)
    host.handle(CloseSession("gone", replaces=5), COORD)
    assert _held(host, 5) == [16]
