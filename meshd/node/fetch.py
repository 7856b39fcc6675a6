"""Weights over the mesh: serve this node's artifacts, and fetch a `mesh:ID` node's stage.

Every node answers `ARTIFACT_STREAM` requests from the files it holds (`ArtifactServer`,
`meshd/node/artifact_server.py`: a full checkpoint directory, or the tensors a `mesh:ID` node
fetched and verified). A node started with `--model mesh:ID` knows its manifest and small
files before it starts (`meshd/node/bootstrap.py`), so it can be planned. `ArtifactService`
then fetches, in the background, exactly the tensors a planned stage needs (`stage_ready`; the
stage loads when the fetch ends) or a spare would take over (`prefetch`,
`meshd/node/prefetch.py`) from the members offering the model; a new job mid-fetch retargets
it. The protocol and the fetch's decisions (flow control, timeouts, resume, source choice, what
a bad hash means, retargeting) are `protocol.artifacts.Fetcher`'s; `FetchRun`
(`meshd/node/fetch_run.py`) only carries them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import trio

from meshd.model.checkpoint import Checkpoint
from meshd.model.config import ModelConfig
from meshd.model.errors import ModelUnavailable
from meshd.model.llama import decoder_layer_shapes
from meshd.model.manifest import store_of
from meshd.model.mtp import mtp_shapes
from meshd.net.bulk import BulkGate
from meshd.net.lane_table import LaneTable, PeerUnreachable
from meshd.node.artifact_server import ArtifactServer
from meshd.node.fetch_run import FetchRun, FetchStatus, NoHolder, ProgressMeter
from protocol import artifacts
from protocol.artifacts import (
    ArtifactRefusal,
    ChunkReply,
    ChunkRequest,
    FetchConfig,
    Fetcher,
    FetchFailed,
    ManifestRequest,
)
from protocol.streams import ARTIFACT_STREAM

if TYPE_CHECKING:
    from meshd.mesh.member import MemberInfo
    from meshd.node.stage_slot import LoadDisplay

log = logging.getLogger(__name__)

# Requests waiting to be served; beyond this a request is dropped (the asker times out and
# asks again, maybe elsewhere): a peer cannot queue unbounded work here.
SERVE_QUEUE = 256
FETCH_RETRY_S = 2.0
SERVE_AHEAD_BYTES = 256 * 1024


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
        self._run: FetchRun | None = None
        self.meter: ProgressMeter | None = None
        self._next_request_id = 1
        self._job: FetchJob | None = None
        self._job_changed = trio.Event()

    # -- lanes ------------------------------------------------------------------------------
    def on_message(self, message: artifacts.ArtifactMessage, sender: bytes) -> None:
        """A message on the artifact stream (from the lane reader: must not block)."""
        if isinstance(message, ManifestRequest | ChunkRequest):
            # A full queue drops the request: the fetcher's timeout asks again.
            with contextlib.suppress(trio.WouldBlock):
                self._requests_in.send_nowait((message, sender))
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
        self._run = run
        outcome = _Outcome(job)
        try:
            await self._follow(run, meter, outcome)
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
                log.info(
                    "fetch of %s: removed %d part files it left", outcome.current.what, removed
                )
            checkpoint.refresh()
        return await self._ended(outcome, run, meter, time.monotonic() - t0)

    async def _follow(self, run: FetchRun, meter: ProgressMeter, outcome: _Outcome) -> None:
        """Run `run`, retargeting it to each job that replaces `outcome.current`; none, or one
        with nothing to fetch, ends it. `outcome` says how it ended."""
        fetcher = run.fetcher

        async def follow(cancel: trio.CancelScope) -> None:
            while True:
                changed = self._job_changed
                new = self._job
                if new is None or not new.indices:
                    outcome.current = new or outcome.current
                    cancel.cancel()
                    return
                if new != outcome.current:
                    await run.retarget(list(new.indices))
                    meter.what, meter.total_bytes = new.what, fetcher.total_bytes
                    self._note(_kind(new), f"{new.what}: retargeted, what arrived is kept")
                    outcome.current = new
                    continue
                await changed.wait()

        job = outcome.current
        display = self.load_display or (lambda _what: contextlib.nullcontext(None))
        with display(f"{'pre' if job.prefetch else ''}fetching {job.what}") as bar:
            meter.display = bar
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, nursery.cancel_scope)
                try:
                    await run.run()
                    outcome.finished = True
                except FetchFailed as exc:
                    outcome.failure, outcome.gave_up = str(exc), isinstance(exc, NoHolder)
                nursery.cancel_scope.cancel()

    async def _ended(
        self, outcome: _Outcome, run: FetchRun, meter: ProgressMeter, elapsed: float
    ) -> tuple[bool | None, FetchJob]:
        """How a run that ended as `outcome` says so: on the meter, in the log and events."""
        current, failure, store = outcome.current, outcome.failure, run.store
        if outcome.gave_up and not current.prefetch:
            # Nothing to serve without the stage, and no member to fetch it from: the daemon
            # ends (exit status 2, one line), as with a model file it cannot open.
            meter.state, meter.error = "failed", failure or ""
            raise ModelUnavailable(f"mesh:{store.model_id[:16]}: {failure}")
        if failure is not None:
            meter.state, meter.error = "failed", failure
            log.error("fetch failed (retrying in %.0f s): %s", FETCH_RETRY_S, failure)
            self._note("fetch-failed", failure)
            return False, current
        total = run.fetcher.total_bytes
        if not outcome.finished:
            # Dropped because nothing it wants is missing (a re-plan's `_missing` saw its last
            # tensors stored before the run heard their hashes, or it was replaced by a job
            # with nothing to fetch): done, not stopped.
            held = await trio.to_thread.run_sync(store.held, current.indices)
            if not held.issuperset(current.indices):
                meter.state = "stopped"
                log.info("fetch of %s stopped: the plan no longer needs it", current.what)
                return None, current
            total = run.fetcher.verified_bytes if not current.indices else total
            meter.what = current.what
        meter.state = "done"
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


@dataclasses.dataclass
class _Outcome:
    """How a fetch run ended: the job it last followed, and finished, failed or dropped."""

    current: FetchJob
    finished: bool = False
    failure: str | None = None
    gave_up: bool = False  # no member holding the model came into view (`NoHolder`)


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
