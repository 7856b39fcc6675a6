"""Weights over the mesh: serve this node's artifacts, and fetch a `mesh:ID` node's stage.

Every node answers `ARTIFACT_STREAM` requests from the files it holds (`ArtifactServer`: a full
checkpoint directory, or the tensors a `mesh:ID` node fetched and verified). A node started
with `--model mesh:ID` knows its manifest and small files before it starts
(`meshd/node/bootstrap.py`), so it can be planned. `ArtifactService` then fetches, in the
background, exactly the tensors a planned stage needs (`stage_ready`; the stage loads when the
fetch ends) or a spare would take over (`prefetch`, `meshd/node/prefetch.py`) from the members
offering the model; a new job mid-fetch retargets it. The protocol and the fetch's decisions
(flow control, timeouts, resume, source choice, what a bad hash means, retargeting) are
`protocol.artifacts.Fetcher`'s; `FetchRun` only carries them out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import pathlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import msgspec
import trio

from meshd.model.checkpoint import Checkpoint
from meshd.model.config import ModelConfig
from meshd.model.errors import ModelError, ModelUnavailable
from meshd.model.llama import decoder_layer_shapes
from meshd.model.manifest import ModelStore, store_of
from meshd.model.mtp import mtp_shapes
from meshd.net.bulk import BulkGate
from meshd.net.endpoint import LaneClosedError
from meshd.net.lane_table import LaneTable, PeerUnreachable
from protocol import artifacts
from protocol.artifacts import (
    ArtifactKind,
    ArtifactRefusal,
    ChunkReply,
    ChunkRequest,
    FetchConfig,
    FetchEffect,
    Fetcher,
    FetchFailed,
    FetchWait,
    ManifestReply,
    ManifestRequest,
    SendRequest,
    VerifyArtifact,
    WriteChunk,
)
from protocol.streams import ARTIFACT_STREAM

if TYPE_CHECKING:
    from meshd.mesh.member import MemberInfo
    from meshd.node.stage_slot import LoadDisplay

log = logging.getLogger(__name__)

# Requests waiting to be served; beyond this a request is dropped (the asker times out and
# asks again, maybe elsewhere): a peer cannot queue unbounded work here.
SERVE_QUEUE = 256
PROGRESS_LOG_INTERVAL_S = 2.0
RATE_WINDOW_S = 2.0
# How often a running fetch looks for new sources in the membership view.
SOURCE_REFRESH_S = 0.5
FETCH_RETRY_S = 2.0
# A fetch waiting for a holder says why in the log this often (and at once in its status).
WAIT_LOG_INTERVAL_S = 10.0
SERVE_AHEAD_BYTES = 256 * 1024


class NoHolder(FetchFailed):
    """No member holding the model has been in view for `holder_wait_s`."""


def stage_tensor_names(config: ModelConfig, start: int, end: int) -> list[str]:
    """Every tensor a stage of layers [start, end) reads (`StageModel._weight_names`)."""
    names = [
        f"model.layers.{i}.{n}" for i in range(start, end) for n in decoder_layer_shapes(config)
    ]
    is_first, is_last = start == 0, end == config.num_layers
    n_mtp = config.num_mtp_layers if is_last else 0
    if is_first or (is_last and (config.tie_word_embeddings or n_mtp > 0)):
        names.append("model.embed_tokens.weight")
    if is_last:
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        names += [f"mtp.{k}.{n}" for k in range(n_mtp) for n in mtp_shapes(config)]
    return names


# ---- serving -------------------------------------------------------------------------------


class ArtifactServer:
    """Answers manifest and chunk requests from the files this node holds (and only those)."""

    def __init__(self, checkpoint: Checkpoint, name: str = "") -> None:
        self.checkpoint = checkpoint
        self.name = name  # what this node's API calls the model (sent with the manifest)
        self._manifest: tuple[str, bytes, artifacts.Manifest] | None = None
        self._unavailable = ""
        self.chunks_served = 0
        self.bytes_served = 0

    def _table(self) -> tuple[str, bytes, artifacts.Manifest] | None:
        if self._manifest is None and not self._unavailable:
            try:
                store = store_of(self.checkpoint)
                if store is not None:
                    self._manifest = (store.model_id, store.manifest_bytes, store.manifest)
                else:
                    self._manifest = self.checkpoint.manifest
            except ModelError as exc:
                self._unavailable = str(exc)
        return self._manifest

    def _locate(self, index: int) -> tuple[pathlib.Path, int, int] | None:
        """(path, offset, nbytes) of artifact `index` if this node holds it."""
        table = self._table()
        assert table is not None
        artifact = table[2].artifacts[index]
        checkpoint = self.checkpoint
        store = store_of(checkpoint)
        if store is not None:
            if not store.is_held(index):
                return None
            return store.path_of(index), store.data_offset(index), artifact.nbytes
        if artifact.kind == ArtifactKind.FILE:
            if table[2].format == "gguf":  # byte ranges of the GGUF file
                return self._gguf_files.get(artifact.name)
            return checkpoint.directory / artifact.name, 0, artifact.nbytes
        info = checkpoint.tensors.get(artifact.name)
        return (info.path, info.offset, info.nbytes) if info is not None else None

    @property
    def _gguf_files(self) -> dict[str, tuple[pathlib.Path, int, int]]:
        from meshd.model.gguf_checkpoint import GGUFCheckpoint

        assert isinstance(self.checkpoint, GGUFCheckpoint)
        return self.checkpoint.file_locations

    def prepare(self) -> None:
        """(blocking) What `answer` reads before its first reply: the manifest, and a GGUF
        holder's file locations (its shards' headers parsed: seconds for a large vocabulary).
        Called in a worker thread before serving, so the first request never stalls the
        node's trio loop (its lanes, gossip and pings)."""
        table = self._table()
        if table is not None and table[2].format == "gguf" and store_of(self.checkpoint) is None:
            log.debug("serving %d file artifacts of a GGUF file", len(self._gguf_files))

    def answer(
        self, message: ManifestRequest | ChunkRequest
    ) -> ManifestReply | ChunkReply | ArtifactRefusal:
        """(blocking: reads the file) The reply to one request."""
        table = self._table()
        rid = message.request_id
        if table is None:
            return ArtifactRefusal(rid, "unknown_model", self._unavailable[:200])
        model_id, data, manifest = table
        if isinstance(message, ManifestRequest):
            if not model_id.startswith(message.model_prefix):
                return ArtifactRefusal(rid, "unknown_model", f"this node holds {model_id}")
            return ManifestReply(rid, model_id, data, self.name)
        if message.model_id != model_id:
            return ArtifactRefusal(rid, "unknown_model", f"this node holds {model_id}")
        if message.index >= len(manifest.artifacts):
            return ArtifactRefusal(rid, "bad_range", "no such artifact")
        if message.offset + message.length > manifest.artifacts[message.index].nbytes:
            return ArtifactRefusal(rid, "bad_range", "beyond the artifact's end")
        where = self._locate(message.index)
        if where is None:
            return ArtifactRefusal(rid, "not_held", "")
        path, offset, _nbytes = where
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                chunk = os.pread(fd, message.length, offset + message.offset)
            finally:
                os.close(fd)
        except OSError as exc:
            return ArtifactRefusal(rid, "unreadable", (exc.strerror or str(exc))[:200])
        if len(chunk) != message.length:
            return ArtifactRefusal(rid, "unreadable", "the file is shorter than its manifest")
        self.chunks_served += 1
        self.bytes_served += len(chunk)
        return ChunkReply(rid, chunk)


# ---- progress ------------------------------------------------------------------------------


class FetchStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A fetch as `meshctl status` shows it (`fetch` in its JSON)."""

    model_id: str
    # "fetching", "done", "failed" (retrying), "waiting" (no holder in view, or the holders do
    # not answer: `waiting` says which), "stopped" (the plan no longer needs it)
    state: str
    what: str  # e.g. "layers [0, 3)", "prefetch layers [3, 6)"
    done_bytes: int
    total_bytes: int
    rate_bytes_s: float
    eta_s: float | None
    error: str = ""
    waiting: str = ""  # why it waits (state "waiting")


class ProgressMeter:
    """Bytes, rate and ETA of one fetch: logged every few seconds, shown on a bar."""

    def __init__(self, model_id: str, what: str, total_bytes: int) -> None:
        self.model_id, self.what, self.total_bytes = model_id, what, total_bytes
        self.state = "fetching"
        self.error = ""
        self.waiting = ""
        self.done_bytes = 0
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._received = 0
        self._logged_at = time.monotonic()
        self.display: Callable[[int, int], None] | None = None

    def received(self, nbytes: int, verified_bytes: int) -> None:
        """`nbytes` more arrived; `verified_bytes` of the total are stored and checked."""
        now = time.monotonic()
        self._received += nbytes
        self._samples.append((now, self._received))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        self.done_bytes = verified_bytes
        if self.display is not None:
            self.display(verified_bytes, self.total_bytes)
        if now - self._logged_at >= PROGRESS_LOG_INTERVAL_S:
            self._logged_at = now
            self.log()

    @property
    def rate_bytes_s(self) -> float:
        """Bytes per second over the last few seconds."""
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate (None: no rate yet)."""
        rate = self.rate_bytes_s
        return (self.total_bytes - self.done_bytes) / rate if rate > 0 else None

    def log(self) -> None:
        """One progress line."""
        eta = self.eta_s
        log.info(
            "fetch %s %s: %.1f/%.1f MB, %.1f MB/s, ETA %s",
            self.model_id[:16],
            self.what,
            self.done_bytes / 1e6,
            self.total_bytes / 1e6,
            self.rate_bytes_s / 1e6,
            f"{eta:.1f} s" if eta is not None else "-",
        )

    def status(self) -> FetchStatus:
        """The figures for `meshctl status`."""
        return FetchStatus(
            model_id=self.model_id,
            state=self.state,
            what=self.what,
            done_bytes=self.done_bytes,
            total_bytes=self.total_bytes,
            rate_bytes_s=self.rate_bytes_s,
            eta_s=self.eta_s,
            error=self.error,
            waiting=self.waiting if self.state == "waiting" else "",
        )


# ---- fetching ------------------------------------------------------------------------------

SendBytes = Callable[[bytes, bytes], Awaitable[None]]


class FetchRun:
    """Carries out one `Fetcher` into a `ModelStore` until every wanted artifact is verified.

    `send(source, data)` sends an encoded request; `sources()` lists who may hold the model
    now (polled); replies come in through `on_reply`, dead lanes through `on_source_lost`.
    """

    def __init__(
        self,
        fetcher: Fetcher,
        store: ModelStore,
        send: SendBytes,
        sources: Callable[[], list[bytes]],
        meter: ProgressMeter | None = None,
    ) -> None:
        self.fetcher = fetcher
        self.store = store
        self._send = send
        self._sources = sources
        self.meter = meter
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.bad_artifacts = 0  # artifacts whose bytes did not match and were fetched again
        # The source list last given to the fetcher (None: give it again at the next refresh).
        self._offered: list[bytes] | None = None
        self._refresh_now = False
        self._sent_to: set[bytes] = set()  # sources a request went to (over a lane)
        self._lost: set[bytes] = set()  # sources whose lane died (not asked since)
        self._wait_logged: float | None = None  # when the reason it waits was last logged

    async def run(self) -> None:
        """Fetch until done; FetchFailed when an artifact has no usable source left, NoHolder
        (a FetchFailed) when no source has been listed for `holder_wait_s`. While a source is
        listed it waits for it, however long, saying why (`Fetcher.wait`)."""
        fetcher = self.fetcher
        wanted = list(fetcher._wanted)

        def begin_all() -> None:
            for i in wanted:
                self.store.begin(i)

        await trio.to_thread.run_sync(begin_all)
        failure: str | None = None
        gave_up: str | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            refreshed = -1.0
            while not fetcher.done:
                now = trio.current_time()
                if now - refreshed >= SOURCE_REFRESH_S or self._refresh_now:
                    refreshed, self._refresh_now = now, False
                    sources = self._sources()
                    if sources != self._offered:
                        fetcher.set_sources(sources)
                        self._offered = sources
                for effect in fetcher.poll(now):
                    await self._apply(effect)
                failure = fetcher.failure()
                wait = fetcher.wait(now)
                self._show_wait(wait, now)
                if wait is not None and wait.give_up:
                    gave_up = wait.reason(fetcher.model_id, now)
                    break
                if failure is not None or fetcher.done:
                    break
                self._wake = trio.Event()
                deadline = fetcher.next_deadline()
                wake_at = now + SOURCE_REFRESH_S
                if deadline is not None:
                    wake_at = min(wake_at, deadline)
                with trio.move_on_at(wake_at):
                    await self._wake.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None
        if gave_up is not None:  # raised out here: not wrapped in the nursery's group
            raise NoHolder(gave_up)
        if failure is not None:
            raise FetchFailed(failure)

    def _show_wait(self, wait: FetchWait | None, now: float) -> None:
        """The reason the fetch waits, on the meter (`meshctl status`) and in the log (when it
        begins, and every `WAIT_LOG_INTERVAL_S`)."""
        reason = wait.reason(self.fetcher.model_id, now) if wait is not None else ""
        if self.meter is not None:
            self.meter.state = "waiting" if wait is not None else "fetching"
            self.meter.waiting = reason
        if wait is None:
            self._wait_logged = None
        elif self._wait_logged is None or now - self._wait_logged >= WAIT_LOG_INTERVAL_S:
            self._wait_logged = now
            log.info("fetch %s: waiting: %s", self.fetcher.model_id[:16], reason)

    async def retarget(self, indices: list[int]) -> None:
        """Fetch `indices` from now on (`Fetcher.retarget`: what arrived of those still
        wanted, and what was verified, is kept)."""
        # Newly wanted artifacts start afresh (so does the fetcher's count of their chunks).
        fresh = [i for i in indices if not self.fetcher.wants(i)]
        store = self.store

        def begin_fresh() -> None:
            for i in fresh:
                store.begin(i)

        await trio.to_thread.run_sync(begin_fresh)
        self.fetcher.retarget(indices)
        self._wake.set()

    def on_reply(self, message: ChunkReply | ArtifactRefusal, source: bytes) -> None:
        """A reply on the artifact stream from `source`."""
        for effect in self.fetcher.on_reply(source, message):
            if isinstance(effect, WriteChunk):
                # A page-cache write of one chunk: cheaper than a thread hop.
                self.store.write(effect.index, effect.offset, effect.data)
                if self.meter is not None:
                    self.meter.received(len(effect.data), self.fetcher.verified_bytes)
            elif isinstance(effect, VerifyArtifact) and self._nursery is not None:
                self._nursery.start_soon(self._verify, effect.index)
        self._wake.set()

    def on_source_lost(self, source: bytes) -> None:
        """`source`'s lane died (or could not be opened): what it owed is asked of others,
        and it is not asked again until the view's list changes or a new lane to it opens
        (`on_source_up`): dialling a peer that just died would hold this loop for a
        handshake timeout."""
        self.fetcher.on_source_lost(source)
        self._lost.add(source)
        self._wake.set()

    def on_source_up(self, source: bytes) -> None:
        """A new lane to `source` opened. One that replaced a lane this run sent on (the
        peer, or this node, woke from a closed lid; a path broke and healed): what was asked
        on the old lane, and the replies it carried, are lost with it, so they are asked
        again now, not after `timeout_s`. One to a source lost with a dead lane: offered
        again at once (if the view still lists it), not only when the view's list changes,
        which it never does when both ends stayed members throughout (the fetch would wait
        with no source meanwhile). A first lane (this run's own dial) changes nothing."""
        if source not in self._sent_to and source not in self._lost:
            return
        self.fetcher.on_source_lost(source)
        self._lost.discard(source)
        self._sent_to.discard(source)
        self._offered = None
        self._refresh_now = True
        self._wake.set()

    async def _apply(self, effect: FetchEffect) -> None:
        if isinstance(effect, SendRequest):
            try:
                await self._send(effect.source, artifacts.encode(effect.request))
                self._sent_to.add(effect.source)
            except (PeerUnreachable, LaneClosedError) as exc:
                log.info("fetch: source %s unreachable: %s", effect.source.hex()[:16], exc)
                self.on_source_lost(effect.source)
        elif isinstance(effect, VerifyArtifact):
            assert self._nursery is not None
            self._nursery.start_soon(self._verify, effect.index)

    async def _verify(self, index: int) -> None:
        store = self.store

        def check() -> bool:
            ok = store.finish(index)
            if not ok and self.fetcher.wants(index):
                store.begin(index)
            return ok

        ok = await trio.to_thread.run_sync(check)
        if not ok:
            self.bad_artifacts += 1
            name = store.manifest.artifacts[index].name
            log.warning("fetch: %s does not match the manifest; fetching it again elsewhere", name)
        self.fetcher.on_verified(index, ok)
        if self.meter is not None:
            self.meter.received(0, self.fetcher.verified_bytes)
        self._wake.set()


@dataclasses.dataclass(frozen=True, slots=True)
class FetchJob:
    """What the node wants fetched now: manifest `indices` (the most wanted first), shown as
    `what`; for the stage it is assigned (it loads once they are held) or, `prefetch`, for
    the stages a spare would take over."""

    what: str
    indices: tuple[int, ...]
    prefetch: bool = False


def describe_layers(ranges: list[tuple[int, int]]) -> str:
    """`layers [a, b)` (`, [c, d)` ...): how progress, logs and events name a fetch."""
    return "layers " + ", ".join(f"[{lo}, {hi})" for lo, hi in ranges)


class ArtifactService:
    """A node's side of `ARTIFACT_STREAM`: serve what it holds, fetch what its stage needs.

    Fetching runs in the background (`run`'s task), one `FetchJob` at a time: the planning
    loop never waits for it. A new job while one runs retargets the fetch (`FetchRun.retarget`:
    what arrived is kept); `on_fetch_end(ok)` is called when a job ends (done or failed).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        peers: LaneTable,
        sources: Callable[[], list[bytes]],
        *,
        config: FetchConfig | None = None,
        load_display: LoadDisplay | None = None,
        note: Callable[[str, str], None] | None = None,
        gate: BulkGate | None = None,
        name: str = "",
        on_fetch_end: Callable[[bool], None] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.server = ArtifactServer(checkpoint, name)
        self.peers = peers
        self.sources = sources
        self.config = config or FetchConfig()
        self.load_display = load_display
        self._note = note or (lambda _kind, _detail: None)
        self.on_fetch_end = on_fetch_end or (lambda _ok: None)
        self._carrying = False
        # Held while this node's stage computes a window: serving chunks waits meanwhile, the
        # CPU and the GIL go to the window first.
        self.gate = gate or BulkGate()
        send, receive = trio.open_memory_channel[tuple[ManifestRequest | ChunkRequest, bytes]](
            SERVE_QUEUE
        )
        self._requests_in, self._requests_out = send, receive
        self.requests_dropped = 0
        self._run: FetchRun | None = None
        self.meter: ProgressMeter | None = None
        self._next_request_id = 1
        self._job: FetchJob | None = None
        self._job_changed = trio.Event()

    # -- lanes ------------------------------------------------------------------------------
    def on_message(self, message: artifacts.ArtifactMessage, sender: bytes) -> None:
        """A message on the artifact stream (from the lane reader: must not block)."""
        if isinstance(message, ManifestRequest | ChunkRequest):
            try:
                self._requests_in.send_nowait((message, sender))
            except trio.WouldBlock:
                self.requests_dropped += 1
        elif isinstance(message, ChunkReply | ArtifactRefusal) and self._run is not None:
            self._run.on_reply(message, sender)

    def on_lane_lost(self, lane_key: bytes) -> None:
        """A lane died: a fetch from that peer continues elsewhere."""
        if self._run is not None:
            self._run.on_source_lost(lane_key)

    def on_lane_up(self, lane_key: bytes) -> None:
        """A lane opened (or replaced one): a fetch asks that peer again what it had asked
        on the old lane, and takes it back as a source (`FetchRun.on_source_up`)."""
        if self._run is not None:
            self._run.on_source_up(lane_key)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests, one at a time, and carry out fetch jobs, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fetch_loop)
            task_status.started()
            await self._serve()

    async def _serve(self) -> None:
        gate = self.gate
        await trio.to_thread.run_sync(self.server.prepare)
        async for message, sender in self._requests_out:
            # No chunk while the gate is held (a window computes here), nor while the lane
            # still holds `SERVE_AHEAD_BYTES` unsent or unacked (what is queued is encrypted
            # and sent in this loop, beside the stage's thread). Both are waited for as events:
            # a poll would wake this loop (and take the GIL) throughout every window.
            while isinstance(message, ChunkRequest):
                await gate.wait_open()
                lane = self.peers.lane(sender)
                if lane is not None:
                    await lane.wait_unacked(SERVE_AHEAD_BYTES)
                if not gate.held:
                    break
            reply = self.server.answer(message)
            with contextlib.suppress(PeerUnreachable):
                await self.peers.send_bytes(sender, ARTIFACT_STREAM, artifacts.encode(reply))

    # -- fetching ---------------------------------------------------------------------------
    def status(self) -> FetchStatus | None:
        """The last fetch's figures (None: this node never fetched)."""
        return self.meter.status() if self.meter is not None else None

    @property
    def fetches(self) -> bool:
        """Whether this node fetches its weights (a `mesh:ID` node) rather than holding them."""
        return store_of(self.checkpoint) is not None

    @property
    def job(self) -> FetchJob | None:
        """The fetch wanted now (None: none)."""
        return self._job

    async def stage_ready(self, layers: tuple[int, int]) -> bool:
        """Whether this node holds every tensor a stage of `layers` needs (always true for a
        node holding the checkpoint's files). If not, their fetch starts in the background
        (an ongoing one retargets to them, keeping what arrived), and `on_fetch_end` says when
        it ended: a failed fetch says why in the log, the event log and `meshctl status`."""
        missing = await self._missing([layers])
        if not missing:
            return True
        self._want(FetchJob(describe_layers([layers]), tuple(missing)))
        return False

    async def prefetch(self, ranges: list[tuple[int, int]], max_bytes: int = 0) -> None:
        """A spare's prefetch: fetch in the background the tensors of `ranges` (the stages it
        would take over, the most likely first) that it does not hold; replaces any other
        job. Nothing to fetch (or no ranges) ends the job in progress. `max_bytes` (0: no
        limit) bounds the disk it takes: the tensors of `ranges`, in order, held ones
        included, up to the first that would pass it (`prefetch_max_bytes`)."""
        missing = await self._missing(ranges, max_bytes) if ranges else []
        job = FetchJob("prefetch " + describe_layers(ranges), tuple(missing), prefetch=True)
        if not missing and not (ranges and self._job is not None):
            self._want(None)
        else:
            # With nothing missing, the job in progress is replaced by one with nothing to
            # fetch: it ends done for these ranges (what it fetched of others goes), not
            # `stopped` (no later re-plan would start a fetch with nothing missing).
            self._want(job)

    def stop_fetching(self) -> None:
        """No fetch is wanted now: one in progress ends (what it verified stays stored)."""
        self._want(None)

    async def _missing(self, ranges: list[tuple[int, int]], max_bytes: int = 0) -> list[int]:
        """Manifest indices of the tensors stages of `ranges` read and this node does not hold,
        in the order of `ranges` (none for a node holding the checkpoint's files); with
        `max_bytes`, of those among the first tensors whose bytes add up to at most that."""
        checkpoint = self.checkpoint
        store = store_of(checkpoint)
        if store is None:
            return []
        names = dict.fromkeys(
            n for lo, hi in ranges for n in stage_tensor_names(checkpoint.config, lo, hi)
        )
        indices = store.tensor_indices(names)
        if max_bytes:
            sizes = itertools.accumulate(store.manifest.artifacts[i].nbytes for i in indices)
            indices = [i for i, total in zip(indices, sizes, strict=True) if total <= max_bytes]
        held = await trio.to_thread.run_sync(store.held, indices)
        checkpoint.refresh()
        return [i for i in indices if i not in held]

    def _want(self, job: FetchJob | None) -> None:
        current = self._job
        if job == current or (
            job is not None
            and current is not None
            and (job.what, job.prefetch) == (current.what, current.prefetch)
            and set(job.indices) <= set(current.indices)
        ):
            return  # the same job (with less of it left)
        self._job = job
        self._job_changed.set()
        self._job_changed = trio.Event()

    async def _fetch_loop(self) -> None:
        while True:
            job = self._job
            if job is None:
                await self._job_changed.wait()
                continue
            self._carrying = True
            try:
                ok, last = await self._carry_out(job)
            finally:
                self._carrying = False
            if self._job == last:
                self._job = None
            if ok is not None:
                self.on_fetch_end(ok)

    @property
    def carrying_out(self) -> bool:
        """Whether a fetch is under way: until it is false, `status()` may not yet say how the
        last one ended (it ends with thread calls after its run stops taking replies)."""
        return self._carrying

    async def _carry_out(self, job: FetchJob) -> tuple[bool | None, FetchJob]:
        """Fetch `job`, following the jobs that replace it, until done (True), failed (False)
        or no longer wanted (None); with the last job followed."""
        checkpoint = self.checkpoint
        store = store_of(checkpoint)
        assert store is not None
        held = await trio.to_thread.run_sync(store.held, job.indices)
        missing = [i for i in job.indices if i not in held]
        if not missing:
            return True, job
        total = sum(store.manifest.artifacts[i].nbytes for i in missing)
        meter = self.meter = ProgressMeter(store.model_id, job.what, total)
        fetcher = Fetcher(
            store.model_id,
            store.manifest,
            missing,
            self.config,
            first_request_id=self._next_request_id,
        )
        run = FetchRun(fetcher, store, self._send, self.sources, meter)
        self._note(_kind(job), f"{job.what}: {len(missing)} tensors, {total / 1e6:.1f} MB")
        t0 = time.monotonic()
        display = self.load_display or (lambda _what: contextlib.nullcontext(None))
        self._run = run
        current = job
        failure: str | None = None
        gave_up = False
        finished = False

        async def follow(cancel: trio.CancelScope) -> None:
            """Retarget the run to each job that replaces `current`; none, or one with nothing
            to fetch: end it."""
            nonlocal current
            while True:
                changed = self._job_changed
                new = self._job
                if new is None or not new.indices:
                    current = new or current
                    cancel.cancel()
                    return
                if new != current:
                    await run.retarget(list(new.indices))
                    meter.what, meter.total_bytes = new.what, fetcher.total_bytes
                    self._note(_kind(new), f"{new.what}: retargeted, what arrived is kept")
                    current = new
                    continue
                await changed.wait()

        try:
            with display(f"{'pre' if job.prefetch else ''}fetching {job.what}") as bar:
                meter.display = bar
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(follow, nursery.cancel_scope)
                    try:
                        await run.run()
                        finished = True
                    except FetchFailed as exc:
                        failure, gave_up = str(exc), isinstance(exc, NoHolder)
                    nursery.cancel_scope.cancel()
        finally:
            self._run = None  # later replies are dropped: nothing writes into the store now
            self._next_request_id = fetcher._next_id
            meter.display = None
            # Every part file is this run's (one run at a time) and now useless: unfinished
            # (stopped, failed, or the daemon's graceful stop cancelling it) or retargeted
            # away from. Shielded: a SIGTERM's cancellation must not leave them for the next
            # start to find.
            with trio.CancelScope(shield=True):
                removed = await trio.to_thread.run_sync(store.remove_parts)
            if removed:
                log.info("fetch of %s: removed %d part files it left", current.what, removed)
            checkpoint.refresh()
        if gave_up and not current.prefetch:
            # Nothing to serve without the stage, and no member to fetch it from: the daemon
            # ends (exit status 2, one line), as with a model file it cannot open.
            meter.state, meter.error = "failed", failure or ""
            raise ModelUnavailable(f"mesh:{store.model_id[:16]}: {failure}")
        if failure is not None:
            meter.state, meter.error = "failed", failure
            log.error("fetch failed (retrying in %.0f s): %s", FETCH_RETRY_S, failure)
            self._note("fetch-failed", failure)
            return False, current
        total = fetcher.total_bytes
        if not finished:
            # Dropped because nothing it wants is missing (a re-plan's `_missing` saw its last
            # tensors stored before the run heard their hashes, or it was replaced by a job
            # with nothing to fetch): done, not stopped.
            held = await trio.to_thread.run_sync(store.held, current.indices)
            if not held.issuperset(current.indices):
                meter.state = "stopped"
                log.info("fetch of %s stopped: the plan no longer needs it", current.what)
                return None, current
            total = fetcher.verified_bytes if not current.indices else total
            meter.what = current.what
        meter.state = "done"
        elapsed = time.monotonic() - t0
        meter.done_bytes = meter.total_bytes = total
        log.info(
            "fetched %s: %.1f MB in %.2f s (%.1f MB/s), %d artifact(s) fetched again",
            current.what,
            total / 1e6,
            elapsed,
            total / 1e6 / max(elapsed, 1e-9),
            run.bad_artifacts,
        )
        self._note(
            _kind(current) + "ed", f"{current.what}: {total / 1e6:.1f} MB in {elapsed:.2f} s"
        )
        return True, current

    async def _send(self, source: bytes, data: bytes) -> None:
        await self.peers.send_bytes(source, ARTIFACT_STREAM, data)


def _kind(job: FetchJob) -> str:
    """The event a job's start is noted as (`fetch` or `prefetch`; `...ed` when it ends)."""
    return "prefetch" if job.prefetch else "fetch"


def model_sources(
    view: Mapping[bytes, MemberInfo],
    model_id: str,
    own: bytes,
    lane_key_of: Callable[[bytes], bytes],
) -> list[bytes]:
    """Lane keys of the healthy members (not `own`) offering `model_id`, in id order: who may
    hold its files (each answers only for what it holds)."""
    from meshd.node.planning import holding_of

    return [
        lane_key_of(node_id)
        for node_id, info in sorted(view.items())
        if node_id != own and info.healthy and holding_of(info, model_id) is not None
    ]
