"""A stage host: one `StageModel` serving verify windows for many sessions over lanes.

Messages arrive from the node's `LaneTable` through `handle()` (synchronous, cheap): session
opens/closes and rollbacks take effect at once, and every window raises its session's epoch on
arrival, so a window made stale by a later rollback is dropped *before* it is computed. One
worker computes in a thread (torch releases the GIL), so the trio loop keeps serving lanes —
pings, ACKs and other sessions — while a long prefill runs.

Batching: the worker takes every window queued at that moment, oldest first, up to
`max_batch_tokens` and one window per session (a session's next window waits for the next pass,
first in line), and runs them as ONE forward pass (`StageModel.forward_batch`): on a CPU the
weights stream from memory once per pass instead of once per session. The last stage then
verifies and drafts per session. Every reply says how many sessions shared its pass and how
many waited, which the coordinator's window policy reads as load.

Leases: a session's KV is held while its coordinator shows it is alive. It is freed when the
coordinator closes it (`CloseSession`), when the coordinator is lost (its lane died or
membership declared it dead: `free_coordinator`, which also drops the prefix-cache entries
that depend on a lost node), or when its lease lapses: `session_lease_s`
without a window, rollback or `SessionKeepAlive` for it (`meshd/stage/leases.py`). Sessions freed
without a close are counted by cause in `stats.sessions_expired`.

Prefix cache: a `CloseSession` may ask the stage to keep the session's first positions as a
cache entry, and an `OpenSession` may start from one (`meshd/model/kvcache.py` holds them,
within `prefix_cache_bytes` and the KV budget, live sessions first). An open whose entry is gone
opens empty at epoch 1 (its epoch-0 windows, sent for the hit, are dropped as stale before any
compute) and answers `StageError(code="prefix_miss")`, so the coordinator prefills in full.
`DropEntries` (and a close's `replaces`) frees entries their coordinator's index no longer names;
only the coordinator an entry was kept for (the sender's lane key) may drop it.

Admission: a new session is refused with `StageError(code="overloaded", retry_after_s=…)` when
the stage holds `max_sessions`, has `max_queued_windows` waiting, or its KV memory is full. The
windows of admitted sessions are never dropped (that would stall their generations).

Stage 0 takes token ids from the coordinator; every stage passes the residual stream on to the
next; the last stage verifies the drafts, runs the MTP depths, and replies to the coordinator
with token ids only. Logits never leave this process.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from meshd.model.errors import KVBudgetExceeded, ModelError
from meshd.model.stage import BatchItem, StageModel, StageOutput
from meshd.net.bulk import BulkGate
from meshd.stage.host_config import StageHostConfig as StageHostConfig  # re-exported
from meshd.stage.leases import SESSION_LEASE_S, Leases
from meshd.stage.mtp_drafter import MtpDrafter
from meshd.stage.verdict import WindowVerdict, window_verdict
from meshd.stage.wire import from_blob, to_blob
from protocol.messages import (
    PREFIX_MISS,
    PREFIX_MISS_EPOCH,
    CloseSession,
    DropEntries,
    Message,
    OpenSession,
    Rollback,
    SessionKeepAlive,
    StageError,
    StageHidden,
    StageTiming,
    VerifyReply,
    VerifyWindow,
)

log = logging.getLogger(__name__)


class Sender(Protocol):
    """What the host needs of the node's lane table."""

    async def send(self, key: bytes, message: Message, stream: int = ...) -> None: ...


# Why a session was freed without an explicit close (`StageHostStats.sessions_expired` keys).
COORDINATOR_LOST = "coordinator_lost"  # its lane died, or membership declared it dead
LEASE_LAPSED = "lease_lapsed"  # no window or keep-alive for `session_lease_s`
EXPIRY_CAUSES = (COORDINATOR_LOST, LEASE_LAPSED)
# The bulk gate (meshd/net/bulk.py) is held at most this long at a stretch while windows keep
# coming, then opened for BULK_SLICE_S: a busy stage slows the weight transfers it serves
# (to about a slice's worth of bytes per stretch) but never starves them into timeouts.
BULK_HOLD_MAX_S = 0.5
BULK_SLICE_S = 0.002


@dataclass
class _Session:
    info: OpenSession
    epoch: int = 0
    previous: bytes | None = None  # the stage before this one (the sender of its hidden rows)

    def peers(self) -> frozenset[bytes]:
        """The nodes a prefix-cache entry kept from this session depends on."""
        near = (self.info.coordinator, self.info.next_hop, self.previous)
        return frozenset(key for key in near if key is not None)


@dataclass
class StageHostStats:
    """What the host did (for status, metrics and tests)."""

    windows_computed: int = 0
    tokens_computed: int = 0  # rows of the windows computed (prefill and decode)
    windows_stale: int = 0
    errors: int = 0
    compute_s: float = 0.0
    sessions_open: int = 0
    stale_by_session: dict[str, int] = field(default_factory=dict)
    passes: int = 0
    largest_batch: int = 0
    sessions_refused: int = 0
    sessions_expired: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(EXPIRY_CAUSES, 0)
    )


@dataclass
class _Work:
    window: VerifyWindow
    hidden: StageHidden | None
    arrived_s: float


# What computing one window gives: hidden states for the next stage, the last stage's verdict
# (`WindowVerdict`), nothing (a prefill chunk), or its own error.
_Result = torch.Tensor | WindowVerdict | None | ModelError


class StageHost:
    """Serve `stage` to coordinators and neighbouring stages."""

    def __init__(
        self,
        stage: StageModel,
        sender: Sender,
        *,
        eos_ids: frozenset[int] = frozenset(),
        use_thread: bool = True,
        config: StageHostConfig | None = None,
        session_lease_s: float = SESSION_LEASE_S,
        gate: BulkGate | None = None,
        on_pass: Callable[[float], None] | None = None,
    ) -> None:
        """`session_lease_s`: a session is freed after this long without a window or
        keep-alive from its coordinator (the daemon's `session_lease_s`, which its
        coordinator's keep-alives share). `gate` is held from taking a window until its
        result is sent: the node's bulk transfers wait meanwhile. `on_pass` is told the
        seconds of each forward pass (a batch of windows) as it ends (the daemon's metrics)."""
        self.computing = False  # a forward pass runs now
        self.gate = gate or BulkGate()
        self.stage = stage
        self.sender = sender
        self.eos_ids = eos_ids
        self.use_thread = use_thread
        self.config = config or StageHostConfig()
        # Switchable at run time (benchmarks compare both in one process).
        self.batching = self.config.batching
        self.stats = StageHostStats()
        self.on_pass = on_pass
        stage.kv.cache_limit_bytes = self.config.prefix_cache_bytes
        self.drafter = MtpDrafter(stage) if stage.is_last and stage.mtp else None
        # Seconds the last pass spent in the MTP heads, by session (worker thread writes, the
        # trio task reads after the pass; never both at once).
        self._mtp_s: dict[str, float] = {}
        self._sessions: dict[str, _Session] = {}
        self._queue: deque[_Work] = deque()
        self._errors: deque[tuple[bytes, StageError]] = deque()
        self._ready = trio.Event()
        self.leases = Leases(session_lease_s)
        self._lease_wake = trio.Event()
        self._empty = trio.Event()
        self._empty.set()

    @property
    def queued_windows(self) -> int:
        """Windows waiting for the worker."""
        return len(self._queue)

    @property
    def sessions(self) -> int:
        """Sessions open here."""
        return len(self._sessions)

    def has_session(self, session_id: str) -> bool:
        """True while `session_id` is open here."""
        return session_id in self._sessions

    def session_coordinators(self) -> dict[str, bytes]:
        """Each open session's coordinator (its lane key)."""
        return {sid: s.info.coordinator for sid, s in self._sessions.items()}

    async def wait_empty(self) -> None:
        """Return once no session is open here."""
        await self._empty.wait()

    # -- arrival (synchronous) ----------------------------------------------------------
    def handle(self, message: Message, sender_key: bytes) -> None:
        """Take one message addressed to this stage."""
        if isinstance(message, OpenSession):
            self._open(message, sender_key)
        elif isinstance(message, CloseSession):
            session = self._sessions.get(message.session)
            if message.keep_entry and session is not None:
                self.stage.kv.keep(
                    message.session,
                    message.keep_entry,
                    message.keep_positions,
                    peers=session.peers(),
                    coordinator=session.info.coordinator,
                )
            if message.replaces and message.replaces != message.keep_entry:
                # Kept or not, the coordinator's index no longer names the entry replaced.
                self.stage.kv.drop_entries([message.replaces], sender_key)
            self._close(message.session)
        elif isinstance(message, DropEntries):
            self.stage.kv.drop_entries(message.entries, sender_key)
        elif isinstance(message, SessionKeepAlive):
            self._keep_alive(message, sender_key)
        elif isinstance(message, Rollback):
            session = self._sessions.get(message.session)
            if session is not None:
                session.epoch = max(session.epoch, message.epoch)
                self.leases.touch(message.session, trio.current_time())
        elif isinstance(message, VerifyWindow | StageHidden):
            window = message if isinstance(message, VerifyWindow) else message.window
            hidden = message if isinstance(message, StageHidden) else None
            session = self._sessions.get(window.session)
            if session is not None:
                if hidden is not None:
                    session.previous = sender_key
                session.epoch = max(session.epoch, window.epoch)
                self.leases.touch(window.session, trio.current_time())
            self._queue.append(_Work(window, hidden, time.perf_counter()))
            self._ready.set()

    def _keep_alive(self, message: SessionKeepAlive, sender_key: bytes) -> None:
        now = trio.current_time()
        for session_id in message.sessions:
            if session_id in self._sessions:
                self.leases.touch(session_id, now)
            else:
                # Freed here (lease lapsed, stage restarted): the coordinator re-plans at once
                # instead of waiting for a reply that will never come.
                error = StageError(
                    session_id, "session_expired", "this stage holds no such session"
                )
                self._errors.append((sender_key, error))
                self._ready.set()

    def _open(self, message: OpenSession, sender_key: bytes) -> None:
        if message.session in self._sessions:
            self._close(message.session)
        if message.model_id != self.stage.model_id:
            self._fail(
                message.session,
                message.coordinator,
                "model_mismatch",
                f"stage holds model {self.stage.model_id}, session wants {message.model_id}",
            )
            return
        busy = self._busy_reason()
        if busy:
            self._refuse(message, busy)
            return
        prefix = None
        if message.prefix_entry and not (self.drafter is not None and message.mtp_depth > 0):
            # (A session with MTP heads needs their KV and hidden rows too: never a hit.)
            prefix = (message.prefix_entry, message.prefix_positions)
        try:
            reused = self.stage.open_session(message.session, message.max_positions, prefix=prefix)
        except KVBudgetExceeded as exc:
            if self._fits_when_empty(message.max_positions):
                self._refuse(message, str(exc))  # memory frees as other sessions close
            else:
                self._fail(message.session, message.coordinator, type(exc).__name__, str(exc))
            return
        except ModelError as exc:
            self._fail(message.session, message.coordinator, type(exc).__name__, str(exc))
            return
        if self.drafter is not None and message.mtp_depth > 0:
            self.drafter.open(message.session)
        session = self._sessions[message.session] = _Session(message)
        if message.prefix_entry and not reused:
            if prefix is None:
                self.stage.kv.cache_stats.misses += 1
            session.epoch = PREFIX_MISS_EPOCH
            miss = StageError(
                message.session,
                PREFIX_MISS,
                f"this stage no longer holds {message.prefix_positions} positions of prefix "
                f"entry {message.prefix_entry}",
            )
            self._errors.append((message.coordinator, miss))
            self._ready.set()
        self.stats.sessions_open = len(self._sessions)
        self.leases.touch(message.session, trio.current_time())
        self._empty = trio.Event()
        self._lease_wake.set()

    def _busy_reason(self) -> str:
        config = self.config
        if len(self._sessions) >= config.max_sessions:
            return f"stage holds {len(self._sessions)} sessions (limit {config.max_sessions})"
        if len(self._queue) >= config.max_queued_windows:
            return f"{len(self._queue)} windows queued (limit {config.max_queued_windows})"
        return ""

    def _fits_when_empty(self, max_positions: int) -> bool:
        budget = self.stage.kv.budget_bytes
        return budget is None or self.stage.kv_bytes_per_token * max_positions <= budget

    def _refuse(self, message: OpenSession, reason: str) -> None:
        self.stats.sessions_refused += 1
        retry = self.config.overload_retry_after_s
        error = StageError(message.session, "overloaded", reason, retry_after_s=retry)
        self._errors.append((message.coordinator, error))
        self._ready.set()

    def _close(self, session_id: str, cause: str = "") -> bool:
        """Free a session's KV; `cause` (an EXPIRY_CAUSES entry) counts a free without a close."""
        self.leases.drop(session_id)
        found = self._sessions.pop(session_id, None) is not None
        if found:
            self.stage.close_session(session_id)
            if self.drafter is not None:
                self.drafter.close(session_id)
            if cause:
                self.stats.sessions_expired[cause] += 1
        self.stats.sessions_open = len(self._sessions)
        if not self._sessions:
            self._empty.set()
        return found

    def close_all(self) -> None:
        """Free every session and prefix-cache entry (the stage is being stopped)."""
        for session_id in list(self._sessions):
            self._close(session_id)
        self.stage.kv.clear_entries()

    def free_coordinator(self, coordinator: bytes) -> list[str]:
        """Free every session of `coordinator` (a node whose lane died, or declared dead) and every
        prefix-cache entry that depends on it: the index naming the entry went with it, or its
        coordinator forgot the route through it."""
        mine = [sid for sid, s in self._sessions.items() if s.info.coordinator == coordinator]
        for session_id in mine:
            self._close(session_id, COORDINATOR_LOST)
        entries = self.stage.kv.drop_entries_of(coordinator)
        if mine or entries:
            log.info(
                "freed %d sessions and %d prefix-cache entries of lost node %s",
                len(mine),
                entries,
                coordinator.hex()[:16],
            )
        return mine

    def expire(self, now: float) -> list[str]:
        """Free every session whose lease lapsed by `now`."""
        lapsed = [sid for sid in self.leases.expired(now) if self._close(sid, LEASE_LAPSED)]
        if lapsed:
            log.info("freed %d sessions whose lease lapsed", len(lapsed))
        return lapsed

    def _fail(self, session_id: str, coordinator: bytes, code: str, message: str) -> None:
        self.stats.errors += 1
        self._errors.append((coordinator, StageError(session_id, code, message)))
        self._ready.set()

    # -- the worker ---------------------------------------------------------------------
    async def run(self) -> None:
        """Compute queued windows and free lapsed sessions until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_leases)
            await self._work()

    async def _expire_leases(self) -> None:
        """Sleep until the earliest lease deadline (or a new session), then free what lapsed."""
        while True:
            deadline = self.leases.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._lease_wake.wait()
            self._lease_wake = trio.Event()
            self.expire(trio.current_time())

    async def _work(self) -> None:
        """Compute queued windows, oldest first, a batch per pass, until cancelled."""
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            while self._errors:
                key, error = self._errors.popleft()
                await self._send(key, error)
            while self._queue:
                # Windows pending or computing, and their results until sent: bulk work waits.
                async with self.gate.hold():
                    until = trio.current_time() + BULK_HOLD_MAX_S
                    while self._queue and trio.current_time() < until:
                        batch = self._take_batch()
                        if batch:
                            await self._process(batch)
                        while self._errors:
                            key, error = self._errors.popleft()
                            await self._send(key, error)
                if self._queue:  # a queue that never empties still lets transfers through
                    await trio.sleep(BULK_SLICE_S)

    def _take_batch(self) -> list[tuple[_Work, _Session]]:
        """Pop the next pass's windows: FIFO, one per session, within the token budget.

        Stale and orphaned windows are dropped here, before any compute. A window held back
        (its session already in this pass, or no room left) keeps its place at the front.
        """
        batch: list[tuple[_Work, _Session]] = []
        held: list[_Work] = []
        tokens = 0
        limit = self.config.max_batch_tokens if self.batching else 0
        while self._queue:
            work = self._queue.popleft()
            window = work.window
            session = self._sessions.get(window.session)
            if session is None:
                continue  # closed (or never opened here): nothing to compute
            if window.epoch < session.epoch:
                self.stats.windows_stale += 1
                stale = self.stats.stale_by_session
                stale[window.session] = stale.get(window.session, 0) + 1
                continue
            size = len(window.tokens)
            if batch and tokens + size > limit:
                held.append(work)
                break
            if any(w.window.session == window.session for w, _ in batch):
                held.append(work)
                continue
            batch.append((work, session))
            tokens += size
        self._queue.extendleft(reversed(held))
        return batch

    async def _process(self, batch: list[tuple[_Work, _Session]]) -> None:
        start = time.perf_counter()
        in_pass = {work.window.session for work, _ in batch}
        queued = len({w.window.session for w in self._queue} - in_pass)
        self.computing = True
        try:
            if self.use_thread:
                results = await trio.to_thread.run_sync(self._compute_batch, batch)
            else:
                results = self._compute_batch(batch)
        finally:
            self.computing = False
        compute_s = time.perf_counter() - start
        self.stats.passes += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        self.stats.compute_s += compute_s
        if self.on_pass is not None:
            self.on_pass(compute_s)
        now = trio.current_time()
        for (work, session), result in zip(batch, results, strict=True):
            if work.window.session in self._sessions:
                # A pass longer than the lease (a huge prefill) must not cost the session.
                self.leases.touch(work.window.session, now)
            timing = StageTiming(
                session.info.stage_index,
                start - work.arrived_s,
                compute_s,
                len(batch),
                queued,
                self._mtp_s.pop(work.window.session, 0.0),
            )
            await self._deliver(work, session.info, result, timing)

    async def _deliver(
        self, work: _Work, info: OpenSession, result: _Result, timing: StageTiming
    ) -> None:
        window = work.window
        if isinstance(result, ModelError):
            self.stats.errors += 1
            error = StageError(window.session, type(result).__name__, str(result), window.window_id)
            await self._send(info.coordinator, error)
            return
        self.stats.windows_computed += 1
        self.stats.tokens_computed += len(window.tokens)
        timings = [*(work.hidden.timings if work.hidden else []), timing]
        if isinstance(result, torch.Tensor):
            assert info.next_hop is not None
            blob = to_blob(result, info.wire_dtype)
            await self._send(info.next_hop, StageHidden(window, blob, timings))
        elif result is not None:
            accepted, next_token, drafts, logprobs = result
            reply = VerifyReply(
                session=window.session,
                window_id=window.window_id,
                epoch=window.epoch,
                accepted_len=accepted,
                next_token=next_token,
                mtp_draft=drafts,
                stage_timings=timings,
                logprobs=logprobs,
            )
            await self._send(info.coordinator, reply)

    def _compute_batch(self, batch: list[tuple[_Work, _Session]]) -> list[_Result]:
        """Run one pass over `batch` (in the worker thread); a result or error per window."""
        results: list[_Result] = [None] * len(batch)
        items: dict[int, BatchItem] = {}
        for i, (work, _) in enumerate(batch):
            try:
                items[i] = self._item(work)
            except ModelError as exc:
                results[i] = exc
        outputs = self._forward(list(items.values()))
        for i, out in zip(items, outputs, strict=True):
            if isinstance(out, ModelError):
                results[i] = out
                continue
            try:
                results[i] = self._finish(batch[i][1].info, batch[i][0].window, out)
            except ModelError as exc:
                results[i] = exc
        return results

    def _item(self, work: _Work) -> BatchItem:
        w = work.window
        if self.stage.is_first:
            inputs = torch.tensor(w.tokens, dtype=torch.int64)
        else:
            if work.hidden is None:
                raise ModelError("a non-first stage needs hidden states, got a bare window")
            inputs = from_blob(work.hidden.hidden)
        return BatchItem(w.session, w.base_pos, inputs, w.n_draft + 1)

    def _forward(self, items: list[BatchItem]) -> list[StageOutput | ModelError]:
        """One batched pass; if it is refused (one bad window), each window alone."""
        if len(items) > 1:
            try:
                return list(self.stage.forward_batch(items))
            except ModelError:
                pass  # forward_batch checks before computing: nothing was written
        outputs: list[StageOutput | ModelError] = []
        for item in items:
            try:
                outputs.append(
                    self.stage.forward(
                        item.session_id,
                        item.base_pos,
                        item.inputs,
                        logits_last_n=item.logits_last_n,
                    )
                )
            except ModelError as exc:
                outputs.append(exc)
        return outputs

    def _finish(
        self, info: OpenSession, w: VerifyWindow, out: StageOutput
    ) -> torch.Tensor | WindowVerdict | None:
        """After the pass: hidden states to pass on, or the last stage's verdict and drafts."""
        if not self.stage.is_last:
            return out.hidden
        # The drafter runs for every window of a session that uses MTP, so each depth's
        # positional KV keeps up with the main model's. A window with `mtp_tokens == 0` in such a
        # session means the coordinator has stopped MTP for good (`auto` found it does not pay):
        # the depths then stop too, and their time is saved.
        drafting = self.drafter is not None and info.mtp_depth > 0 and w.mtp_tokens > 0
        result, mtp_s = window_verdict(w, out, self.eos_ids, self.drafter if drafting else None)
        if drafting:
            self._mtp_s[w.session] = mtp_s
        return result

    async def _send(self, key: bytes, message: Message) -> None:
        try:
            await self.sender.send(key, message)
        except Exception as exc:  # PeerUnreachable and lane errors: the coordinator re-plans
            log.warning(
                "stage could not send %s to %s: %s", type(message).__name__, key.hex()[:16], exc
            )
