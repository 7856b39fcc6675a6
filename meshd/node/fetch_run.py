"""`FetchRun`: one fetch of a model's artifacts carried out, and its progress (`ProgressMeter`,
shown as `FetchStatus`). The fetch's decisions are `protocol.artifacts.Fetcher`'s; a run only
carries out what it returns."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import trio

from meshd.model.manifest import ModelStore
from meshd.net.lane_table import PeerUnreachable
from meshd.net.peer_lane import LaneClosedError
from protocol import artifacts
from protocol.artifacts import (
    ArtifactRefusal,
    ChunkReply,
    FetchEffect,
    Fetcher,
    FetchFailed,
    FetchWait,
    SendRequest,
    VerifyArtifact,
    WriteChunk,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

PROGRESS_LOG_INTERVAL_S = 2.0
RATE_WINDOW_S = 2.0
# How often a running fetch looks for new sources in the membership view.
SOURCE_REFRESH_S = 0.5
# A fetch waiting for a holder says why in the log this often (and at once in its status).
WAIT_LOG_INTERVAL_S = 10.0


class NoHolder(FetchFailed):
    """No member holding the model has been in view for `holder_wait_s`."""


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
