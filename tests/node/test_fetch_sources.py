"""Fetching over real loopback lanes from peers that serve what they hold: a peer whose file
changed under it (its bytes no longer match the manifest) is refused and another source used;
with no other source, the fetch fails with a clear error. A fetch whose holder's lane dies goes
on from another holder, or from the same one on a new lane when the view still lists it."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import trio

from meshd.bench.fetch import artifact_nodes
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.manifest import ModelStore, StoreCheckpoint
from meshd.node.fetch_run import FetchRun, ProgressMeter
from protocol.artifacts import ArtifactKind, FetchConfig, Fetcher, FetchFailed

CONFIG = FetchConfig(chunk_bytes=64 * 1024, window_bytes=256 * 1024, timeout_s=5.0)


def _holders(tmp: pathlib.Path) -> tuple[Checkpoint, Checkpoint, str]:
    good_dir, bad_dir = tmp / "good", tmp / "bad"
    shutil.copytree(builtin_model_dir(), good_dir)
    shutil.copytree(builtin_model_dir(), bad_dir)
    good, bad = Checkpoint.open(good_dir), Checkpoint.open(bad_dir)
    assert good.model_id == bad.model_id  # computed now, before the file changes
    # The bad holder's weights change under it: a byte in every chunk of the embedding, so
    # whichever chunks it serves carry one.
    info = bad.tensors["model.embed_tokens.weight"]
    with (bad_dir / "model.safetensors").open("r+b") as f:
        for at in range(info.offset, info.offset + info.nbytes, CONFIG.chunk_bytes):
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
    return good, bad, "model.embed_tokens.weight"


def _run(
    store: ModelStore, sources: list[bytes], node_send: object, indices: list[int]
) -> FetchRun:
    fetcher = Fetcher(store.model_id, store.manifest, indices, CONFIG)
    meter = ProgressMeter(
        store.model_id, "test", sum(store.manifest.artifacts[i].nbytes for i in indices)
    )
    return FetchRun(fetcher, store, node_send, sources.copy, meter)  # type: ignore[arg-type]


def _into_transfer(run: FetchRun, nbytes: int = 1024 * 1024) -> trio.Event:
    """An event set once `run` has received `nbytes` (its meter is told after every chunk)."""
    event = trio.Event()

    def on_progress(_done: int, _total: int) -> None:
        if run.fetcher.received_bytes >= nbytes:
            event.set()

    assert run.meter is not None
    run.meter.display = on_progress
    return event


async def test_a_peer_serving_changed_bytes_is_refused_and_another_used(
    tmp_path: pathlib.Path,
) -> None:
    good, bad, changed = _holders(tmp_path)
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    names = sorted(a.name for a in manifest.artifacts if a.kind == ArtifactKind.TENSOR)
    everything = list(range(len(manifest.artifacts)))  # files and tensors
    async with artifact_nodes([bad, good, good], CONFIG) as (bad_node, good_node, fetching):
        # The bad holder is listed first: it is asked first, and for everything.
        run = _run(store, [bad_node.key, good_node.key], fetching.service._send, everything)
        fetching.service._run = run
        await run.run()
    assert run.bad_artifacts >= 1
    assert run.fetcher.done and set(store.held(store.tensor_indices(names))) == set(
        store.tensor_indices(names)
    )
    checkpoint = StoreCheckpoint.over(store)
    ((_, fetched),) = list(checkpoint.load([changed]))
    ((_, expected),) = list(good.load([changed]))
    assert fetched.equal(expected)  # the manifest's bytes, not the changed ones
    assert bad_node.service.server.chunks_served > 0 and good_node.service.server.chunks_served > 0


async def test_with_only_a_changed_source_the_fetch_fails_clearly(tmp_path: pathlib.Path) -> None:
    good, bad, changed = _holders(tmp_path)
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    async with artifact_nodes([bad, bad], CONFIG) as (bad_node, fetching):
        wanted = store.tensor_indices([changed, "model.norm.weight"])
        run = _run(store, [bad_node.key], fetching.service._send, wanted)
        fetching.service._run = run
        with pytest.raises(FetchFailed, match=f"{changed}: every peer that holds model"):
            await run.run()
    (index,) = store.tensor_indices([changed])
    assert not store.path_of(index).exists()  # nothing unverified is ever stored


async def test_a_fetch_resumes_from_another_holder_when_a_lane_dies(tmp_path: pathlib.Path) -> None:
    good = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    everything = list(range(len(manifest.artifacts)))
    async with artifact_nodes([good, good, good], CONFIG) as (first, second, fetching):
        run = _run(store, [first.key, second.key], fetching.service._send, everything)
        fetching.service._run = run
        into_transfer = _into_transfer(run, 2 * 1024 * 1024)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.run)
            await into_transfer.wait()
            # The first holder goes away: its lane closes and it cannot be dialled again.
            del fetching.table.addresses[first.key]
            lane = fetching.table.lane(first.key)
            assert lane is not None
            lane.close("gone")
            closed_at = trio.current_time()
        # Resumed at once from the other holder, not after a request timed out.
        assert trio.current_time() - closed_at < CONFIG.timeout_s
    assert run.fetcher.done
    total = run.fetcher.total_bytes
    # What had arrived was kept: at most what the lost holder still owed is fetched twice.
    assert run.fetcher.received_bytes <= total + CONFIG.window_bytes
    assert store.held(everything) == set(everything)


async def test_a_fetch_takes_its_only_holder_back_when_a_new_lane_opens(
    tmp_path: pathlib.Path,
) -> None:
    # The lane dies, the holder does not (a closed lid, a broken path): the membership view
    # still lists it, and membership's next probe opens a new lane. The fetch takes the
    # holder back at once and goes on over it (the view's list, unchanged, would never offer
    # it again).
    good = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    everything = list(range(len(manifest.artifacts)))
    async with artifact_nodes([good, good], CONFIG) as (holder, fetching):
        run = _run(store, [holder.key], fetching.service._send, everything)
        fetching.service._run = run
        into_transfer = _into_transfer(run)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.run)
            await into_transfer.wait()
            lane = fetching.table.lane(holder.key)
            assert lane is not None
            lane.close("its peer slept")
            closed_at = trio.current_time()
            await lane.terminated()
            await fetching.table.lane_to(holder.key)  # as membership's next probe dials it
        # Resumed on the new lane at once, not after a request timed out (nor the stall).
        assert trio.current_time() - closed_at < CONFIG.timeout_s
    assert run.fetcher.done
    assert store.held(everything) == set(everything)


async def test_a_fetch_asks_again_what_a_replaced_lane_carried(tmp_path: pathlib.Path) -> None:
    # The holder's lane to the fetcher died on its side only (the fetcher's lid was closed
    # for a moment) and it dialled a new one, which replaces the fetcher's: no lane died
    # there, yet what was asked and answered on the old lane is gone. It is asked again at
    # once, not after a chunk's timeout.
    good = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    everything = list(range(len(manifest.artifacts)))
    async with artifact_nodes([good, good], CONFIG) as nodes:
        # A lane dialled by the smaller key's side replaces one the other side dialled.
        holder, fetching = sorted(nodes, key=lambda n: n.key)
        run = _run(store, [holder.key], fetching.service._send, everything)
        fetching.service._run = run
        into_transfer = _into_transfer(run)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.run)
            await into_transfer.wait()
            # Mid-transfer: requests and replies in flight on the old lane are lost with it.
            old = fetching.table.lane(holder.key)
            await holder.table._dial_address(fetching.key)
            with trio.fail_after(10):
                while fetching.table.lane(holder.key) in (None, old):  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.001)
            replaced_at = trio.current_time()
        assert trio.current_time() - replaced_at < CONFIG.timeout_s
    assert run.fetcher.done
    assert store.held(everything) == set(everything)


async def test_a_holder_computing_a_window_serves_no_chunk_until_its_reply_is_out(
    tmp_path: pathlib.Path,
) -> None:
    good = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = good.manifest
    store = ModelStore(tmp_path / "cache", model_id, data, manifest)
    everything = list(range(len(manifest.artifacts)))
    async with artifact_nodes([good, good], CONFIG) as (holder, fetching):
        run = _run(store, [holder.key], fetching.service._send, everything)
        fetching.service._run = run
        into_transfer = _into_transfer(run)
        server = holder.service.server
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.run)
            await into_transfer.wait()
            async with holder.gate.hold():  # a stage on the holder computes a window
                served = server.chunks_served
                # The fetcher's requests keep coming (what was sent before lands, and it
                # asks for more): they wait, none is answered.
                with trio.fail_after(10):
                    while holder.service._requests_out.statistics().current_buffer_used < 2:  # noqa: ASYNC110 (no event: a queue's length)
                        await trio.sleep(0.001)
                assert server.chunks_served == served
                assert not run.fetcher.done
        assert run.fetcher.done  # released: the fetch completes
    assert store.held(everything) == set(everything)
