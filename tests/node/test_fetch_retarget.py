"""A `mesh:ID` node's fetch runs in the background over real loopback lanes: asking for a
stage's tensors returns at once (the planning loop never waits for a transfer), and a new
stage asked for mid-fetch retargets the transfer: what was verified stays stored, the old
stage's other tensors are never fetched, and the new stage's arrive. A fetch that ends
unfinished, stopped or cancelled, deletes its part files."""

from __future__ import annotations

import contextlib
import pathlib
import shutil

import trio
import trio.lowlevel

from meshd.bench.fetch import artifact_nodes
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import ModelUnavailable
from meshd.model.manifest import ModelStore, StoreCheckpoint
from meshd.node.fetch import stage_tensor_names
from protocol.artifacts import FetchConfig

CONFIG = FetchConfig(chunk_bytes=16 * 1024, window_bytes=32 * 1024, timeout_s=5.0)


def _empty_store(tmp: pathlib.Path, holder: Checkpoint) -> StoreCheckpoint:
    """A `mesh:ID` node's store after its start: the manifest and small files, no tensor."""
    model_id, data, manifest = holder.manifest
    store = ModelStore(tmp / "cache", model_id, data, manifest)
    for index in store.file_indices():
        name = manifest.artifacts[index].name
        shutil.copy(holder.directory / name, store.path_of(index))
    assert store.held(store.file_indices()) == set(store.file_indices())
    return StoreCheckpoint.over(store)


def _two_stages(
    tmp: pathlib.Path,
) -> tuple[Checkpoint, StoreCheckpoint, ModelStore, list[int], list[int]]:
    """The built-in model's holder, an empty store of it, and the artifact indices of the
    stages [0, 2) and [2, 4)."""
    holder = Checkpoint.open(builtin_model_dir())
    fetching = _empty_store(tmp, holder)
    store = fetching.store
    assert store is not None
    first = store.tensor_indices(stage_tensor_names(fetching.config, 0, 2))
    second = store.tensor_indices(stage_tensor_names(fetching.config, 2, 4))
    return holder, fetching, store, first, second


async def test_a_stage_fetch_runs_in_the_background_and_retargets_keeping_what_arrived(
    tmp_path: pathlib.Path,
) -> None:
    holder, fetching, store, first, second = _two_stages(tmp_path)
    async with artifact_nodes([holder, fetching], CONFIG) as (holding, node):
        service = node.service
        ended: list[bool] = []
        done = trio.Event()
        notes: list[tuple[str, str]] = []

        def on_fetch_end(ok: bool) -> None:
            ended.append(ok)
            done.set()

        service.on_fetch_end = on_fetch_end
        service._note = lambda kind, detail: notes.append((kind, detail))
        first_arrived = trio.Event()

        def on_progress(_done: int, _total: int) -> None:  # told after every chunk and hash
            if sum(store.is_held(i) for i in first) >= 3:
                first_arrived.set()

        service.load_display = lambda _what: contextlib.nullcontext(on_progress)

        # Asked for, not waited for: it returns before a single tensor arrived.
        assert not await service.stage_ready((0, 2))
        assert not any(store.is_held(i) for i in first)
        # Some of the first stage arrives; then the plan moves while the holder is paused.
        with trio.fail_after(30):
            await first_arrived.wait()
        # Paused: the holder's bulk gate held, as while its stage computes a window.
        async with holding.gate.hold():
            run = service._run
            assert run is not None
            kept = {i for i in first if store.is_held(i)}
            assert kept != set(first), "the first stage finished before the plan moved"
            assert not await service.stage_ready((2, 4))
        with trio.fail_after(30):
            await done.wait()

    assert ended == [True]
    held = store.held(first + second)
    assert set(second) <= held  # the new stage's tensors arrived
    assert kept <= held  # what was verified before the move stayed
    # The first stage's other tensors were dropped, not fetched (those that had arrived whole
    # and were being hashed are kept). What crossed for nothing is the part of the tensors in
    # progress when the plan moved: with a window of two chunks, at most two tensors.
    assert held & set(first) != set(first)
    useful = sum(store.manifest.artifacts[i].nbytes for i in held)
    dropped = sorted(store.manifest.artifacts[i].nbytes for i in set(first) - held)
    assert useful <= run.fetcher.received_bytes <= useful + sum(dropped[-2:])
    assert [kind for kind, _ in notes] == ["fetch", "fetch", "fetched"]
    assert notes[1][1].startswith("layers [2, 4): retargeted")
    assert service.status() is not None and service.status().state == "done"  # type: ignore[union-attr]
    assert service.job is None
    # The part files of the tensors retargeted away from went with the run.
    assert not _parts(store)


def _parts(store: ModelStore) -> list[str]:
    return sorted(p.name for p in store.directory.rglob("*.part"))


async def test_a_fetch_stopped_or_cancelled_mid_way_leaves_no_part_file(
    tmp_path: pathlib.Path,
) -> None:
    # Stopped: the plan no longer needs it. Cancelled: the daemon's graceful stop (SIGTERM)
    # cancels every task. Either way what had not arrived whole is deleted at once (verified
    # tensors stay); only a SIGKILL leaves parts, for the next start to delete.
    holder, fetching, store, first, second = _two_stages(tmp_path)
    for stop in ("stop_fetching", "cancel"):
        async with artifact_nodes([holder, fetching], CONFIG) as (holding, node):
            service = node.service
            ended: list[bool] = []
            service.on_fetch_end = ended.append
            wanted = first if stop == "cancel" else second
            layers = (0, 2) if stop == "cancel" else (2, 4)
            assert not await service.stage_ready(layers)
            with trio.fail_after(30):
                while not (_parts(store) and any(store.is_held(i) for i in wanted)):  # noqa: ASYNC110 (files on disk: no event)
                    await trio.sleep(0.005)
            async with holding.gate.hold():  # paused mid-transfer
                assert _parts(store)
                if stop == "stop_fetching":
                    service.stop_fetching()
                    with trio.fail_after(10):
                        while service.carrying_out:  # noqa: ASYNC110 (no event for it)
                            await trio.sleep(0.005)
                    assert ended == [] and service.status().state == "stopped"  # type: ignore[union-attr]
                    assert not _parts(store), stop
        # Leaving `artifact_nodes` cancelled the service, as a daemon's stop does.
        assert not _parts(store), stop
        held = store.held(wanted)
        assert held and held != set(wanted), stop  # verified tensors stay; the rest went


async def test_a_stage_already_held_needs_no_fetch(tmp_path: pathlib.Path) -> None:
    holder = Checkpoint.open(builtin_model_dir())
    async with artifact_nodes([holder, holder], CONFIG) as (_, node):
        assert await node.service.stage_ready((0, 6))  # a holder of the files: nothing to do
        assert node.service.job is None and node.service.status() is None


async def test_a_prefetch_takes_at_most_prefetch_max_bytes_of_disk(tmp_path: pathlib.Path) -> None:
    holder, fetching, store, first, second = _two_stages(tmp_path)
    size = {i: store.manifest.artifacts[i].nbytes for i in first + second}
    # Room for the first stage it would take over and about half of the second.
    budget = sum(size[i] for i in first) + sum(size[i] for i in second) // 2
    async with artifact_nodes([holder, fetching], CONFIG) as (_, node):
        service = node.service
        done = trio.Event()
        service.on_fetch_end = lambda _ok: done.set()
        await service.prefetch([(0, 2), (2, 4)], max_bytes=budget)
        with trio.fail_after(30):
            await done.wait()
    held = store.held(first + second)
    assert set(first) <= held  # the most likely take-over whole
    taken = [i for i in second if i in held]
    assert 0 < len(taken) < len(second)
    assert taken == second[: len(taken)]  # in the order it would load them
    assert sum(size[i] for i in held) <= budget
    assert sum(size[i] for i in held) + size[second[len(taken)]] > budget  # nothing more fit


async def test_a_prefetch_whose_new_ranges_are_all_stored_ends_done(
    tmp_path: pathlib.Path,
) -> None:
    # Mid-prefetch a re-plan narrows the spare's ranges to ones it already stores (the first
    # range arrived first): nothing is left to fetch, so the prefetch ends done, for the new
    # ranges. It once ended `stopped` for good (no later re-plan restarts a fetch with nothing
    # missing), and a spare waiting to show its prefetch done waited forever.
    holder, fetching, store, first, second = _two_stages(tmp_path)
    async with artifact_nodes([holder, fetching], CONFIG) as (holding, node):
        service = node.service
        ended: list[bool] = []
        service.on_fetch_end = ended.append
        first_stored = trio.Event()

        def on_progress(_done: int, _total: int) -> None:  # told after every chunk and hash
            if all(store.is_held(i) for i in first):
                first_stored.set()

        service.load_display = lambda _what: contextlib.nullcontext(on_progress)
        await service.prefetch([(0, 2), (2, 4)])
        with trio.fail_after(30):
            await first_stored.wait()
        async with holding.gate.hold():  # the second range still arriving
            assert service._run is not None and not all(store.is_held(i) for i in second)
            await service.prefetch([(0, 2)])
            with trio.fail_after(10):
                while service.carrying_out:  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.005)
        status = service.status()
        assert status is not None
        assert (status.state, status.what) == ("done", "prefetch layers [0, 2)"), status
        assert status.done_bytes == status.total_bytes > 0
        assert ended == [True] and service.job is None
        assert not _parts(store)  # what arrived of the second range went


async def _dropped_as_stored(tmp: pathlib.Path, holder: Checkpoint) -> str:
    """Fetch stage [0, 1) into an empty store and drop the job (as a re-plan that finds
    nothing missing does) as soon as every tensor it wants is stored, which the store says
    (in the hashing thread) before the run hears it; the state the fetch ended in."""
    fetching = _empty_store(tmp, holder)
    store = fetching.store
    assert store is not None
    wanted = store.tensor_indices(stage_tensor_names(fetching.config, 0, 1))
    async with artifact_nodes([holder, fetching], CONFIG) as (_, node):
        service = node.service
        ended: list[bool] = []
        service.on_fetch_end = ended.append
        assert not await service.stage_ready((0, 1))
        with trio.fail_after(30):
            # Every scheduling round: the thread's hash lands between two.
            while not all(store.is_held(i) for i in wanted):
                await trio.lowlevel.checkpoint()
            service.stop_fetching()
            # Until the fetch is no longer carried out, its end (part files removed, the
            # store asked what it holds, in threads) may still be on its way to `status()`.
            while service.carrying_out:  # noqa: ASYNC110 (no event for it)
                await trio.sleep(0.005)
        status = service.status()
        assert status is not None
        assert (status.state == "done") == (ended == [True]), (status, ended)
        return status.state


async def test_a_fetch_dropped_just_as_its_last_tensor_is_stored_ends_done(
    tmp_path: pathlib.Path,
) -> None:
    # The run has not yet seen its own last hash when the job is dropped: every tensor it
    # wanted is stored, so it ends done, not `stopped`. Which of the two the run sees first
    # is the scheduler's choice (trio shuffles): several rounds.
    holder = Checkpoint.open(builtin_model_dir())
    states = [await _dropped_as_stored(tmp_path / str(n), holder) for n in range(6)]
    assert states == ["done"] * len(states)


async def test_a_stage_fetch_with_no_holder_in_view_waits_then_ends_the_node(
    tmp_path: pathlib.Path,
) -> None:
    # The view lists no member holding the model (the holder left, or never came): the fetch
    # shows why it waits, and after fetch.holder_wait_s it ends the node with a ModelError,
    # which `meshd serve` prints as one line with exit status 2.
    holder, fetching, store, _first, _second = _two_stages(tmp_path)
    config = FetchConfig(
        chunk_bytes=16 * 1024, window_bytes=32 * 1024, timeout_s=5.0, holder_wait_s=1.0
    )
    waiting: list[str] = []
    ended: list[BaseException] = []
    try:
        with trio.fail_after(30):
            async with artifact_nodes([holder, fetching], config) as (_holding, node):
                service = node.service
                service.sources = list  # nobody in view holds it
                assert not await service.stage_ready((0, 2))
                while True:
                    status = service.status()
                    if status is not None and status.state == "waiting":
                        waiting.append(status.waiting)
                    await trio.sleep(0.05)
    except* ModelUnavailable as group:
        ended += _leaves(group)
    assert waiting and waiting[0].startswith("no member holding model"), waiting
    assert [str(e) for e in ended] == [
        f"mesh:{store.model_id[:16]}: no member holding model {store.model_id[:16]} is in "
        "view for 1 s"
    ]


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions in `error`, its groups flattened."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]
