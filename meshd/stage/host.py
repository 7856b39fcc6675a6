"""A stage host: one `StageModel` serving verify windows for many sessions over lanes.

Messages arrive from the node's `PeerTable` through `handle()` (synchronous, cheap): session
opens/closes and rollbacks take effect at once, and every window raises its session's epoch on
arrival, so a window made stale by a later rollback is dropped *before* it is computed. One
worker computes windows in arrival order in a thread (torch releases the GIL), so the trio loop
keeps serving lanes — pings, ACKs and other sessions — while a long prefill runs.

Stage 0 takes token ids from the coordinator; every stage passes the residual stream on to the
next; the last stage verifies the drafts, runs the MTP depths, and replies to the coordinator
with token ids only. Logits never leave this process.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from meshd.model.errors import ModelError
from meshd.model.stage import StageModel
from meshd.spec.sampling import SamplingParams, verify
from meshd.stage.mtp_drafter import MtpDrafter
from meshd.stage.wire import from_blob, to_blob
from protocol.messages import (
    CloseSession,
    Message,
    OpenSession,
    Rollback,
    StageError,
    StageHidden,
    StageTiming,
    VerifyReply,
    VerifyWindow,
)

log = logging.getLogger(__name__)


class Sender(Protocol):
    """What the host needs of the node's peer table."""

    async def send(self, key: bytes, message: Message, stream: int = ...) -> None: ...


@dataclass
class _Session:
    info: OpenSession
    epoch: int = 0


@dataclass
class StageHostStats:
    """What the host did (for status, metrics and tests)."""

    windows_computed: int = 0
    windows_stale: int = 0
    errors: int = 0
    compute_s: float = 0.0
    sessions_open: int = 0
    stale_by_session: dict[str, int] = field(default_factory=dict)


@dataclass
class _Work:
    window: VerifyWindow
    hidden: StageHidden | None
    arrived_s: float


class StageHost:
    """Serve `stage` to coordinators and neighbouring stages."""

    def __init__(
        self,
        stage: StageModel,
        sender: Sender,
        *,
        eos_ids: frozenset[int] = frozenset(),
        use_thread: bool = True,
    ) -> None:
        self.stage = stage
        self.sender = sender
        self.eos_ids = eos_ids
        self.use_thread = use_thread
        self.stats = StageHostStats()
        self.drafter = MtpDrafter(stage) if stage.is_last and stage.mtp else None
        self._sessions: dict[str, _Session] = {}
        self._queue: deque[_Work] = deque()
        self._errors: deque[tuple[bytes, StageError]] = deque()
        self._ready = trio.Event()

    # -- arrival (synchronous) ----------------------------------------------------------
    def handle(self, message: Message, sender_key: bytes) -> None:
        """Take one message addressed to this stage."""
        if isinstance(message, OpenSession):
            self._open(message, sender_key)
        elif isinstance(message, CloseSession):
            self._close(message.session)
        elif isinstance(message, Rollback):
            session = self._sessions.get(message.session)
            if session is not None:
                session.epoch = max(session.epoch, message.epoch)
        elif isinstance(message, VerifyWindow | StageHidden):
            window = message if isinstance(message, VerifyWindow) else message.window
            hidden = message if isinstance(message, StageHidden) else None
            session = self._sessions.get(window.session)
            if session is not None:
                session.epoch = max(session.epoch, window.epoch)
            self._queue.append(_Work(window, hidden, time.perf_counter()))
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
        try:
            self.stage.open_session(message.session, message.max_positions)
        except ModelError as exc:
            self._fail(message.session, message.coordinator, type(exc).__name__, str(exc))
            return
        if self.drafter is not None and message.mtp_depth > 0:
            self.drafter.open(message.session)
        self._sessions[message.session] = _Session(message)
        self.stats.sessions_open = len(self._sessions)

    def _close(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is not None:
            self.stage.close_session(session_id)
            if self.drafter is not None:
                self.drafter.close(session_id)
        self.stats.sessions_open = len(self._sessions)

    def close_all(self) -> None:
        """Free every session (the stage is being stopped)."""
        for session_id in list(self._sessions):
            self._close(session_id)

    def _fail(self, session_id: str, coordinator: bytes, code: str, message: str) -> None:
        self.stats.errors += 1
        self._errors.append((coordinator, StageError(session_id, code, message)))
        self._ready.set()

    # -- the worker ---------------------------------------------------------------------
    async def run(self) -> None:
        """Compute queued windows in order until cancelled."""
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            while self._errors:
                key, error = self._errors.popleft()
                await self._send(key, error)
            while self._queue:
                await self._process(self._queue.popleft())

    async def _process(self, work: _Work) -> None:
        window = work.window
        session = self._sessions.get(window.session)
        if session is None:
            return  # closed (or never opened here): nothing to compute
        if window.epoch < session.epoch:
            self.stats.windows_stale += 1
            stale = self.stats.stale_by_session
            stale[window.session] = stale.get(window.session, 0) + 1
            return
        queue_s = time.perf_counter() - work.arrived_s
        t0 = time.perf_counter()
        try:
            if self.use_thread:
                result = await trio.to_thread.run_sync(self._compute, session.info, work)
            else:
                result = self._compute(session.info, work)
        except ModelError as exc:
            self.stats.errors += 1
            error = StageError(window.session, type(exc).__name__, str(exc), window.window_id)
            await self._send(session.info.coordinator, error)
            return
        compute_s = time.perf_counter() - t0
        self.stats.windows_computed += 1
        self.stats.compute_s += compute_s
        timings = [
            *(work.hidden.timings if work.hidden else []),
            StageTiming(session.info.stage_index, queue_s, compute_s),
        ]
        if isinstance(result, torch.Tensor):
            assert session.info.next_hop is not None
            blob = to_blob(result, session.info.wire_dtype)
            await self._send(session.info.next_hop, StageHidden(window, blob, timings))
        elif result is not None:
            accepted, next_token, drafts = result
            reply = VerifyReply(
                session=window.session,
                window_id=window.window_id,
                epoch=window.epoch,
                accepted_len=accepted,
                next_token=next_token,
                mtp_draft=drafts,
                stage_timings=timings,
            )
            await self._send(session.info.coordinator, reply)

    def _compute(
        self, info: OpenSession, work: _Work
    ) -> torch.Tensor | tuple[int, int, list[int]] | None:
        """Run one window; hidden states for the next stage, or the verdict on the last."""
        w = work.window
        if self.stage.is_first:
            inputs = torch.tensor(w.tokens, dtype=torch.int64)
        else:
            if work.hidden is None:
                raise ModelError("a non-first stage needs hidden states, got a bare window")
            inputs = from_blob(work.hidden.hidden)
        out = self.stage.forward(w.session, w.base_pos, inputs, logits_last_n=w.n_draft + 1)
        if not self.stage.is_last:
            return out.hidden
        # The drafter runs for every window of a session that uses MTP (even when this window
        # wants no draft), so each depth's positional KV keeps up with the main model's.
        drafting = self.drafter is not None and info.mtp_depth > 0
        if not w.sample:
            if drafting:
                assert self.drafter is not None
                self.drafter.after_window(w.session, w.base_pos, w.tokens, out.hidden, None, 0)
            return None
        assert out.logits is not None
        s = w.sampling
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed
        )
        verdict = verify(out.logits, w.tokens, w.n_draft, w.base_pos, params, self.eos_ids)
        drafts: list[int] = []
        if drafting:
            assert self.drafter is not None
            known = w.tokens[: len(w.tokens) - w.n_draft + verdict.accepted_len]
            drafts = self.drafter.after_window(
                w.session, w.base_pos, known, out.hidden, verdict.next_token, w.mtp_tokens
            )
        return verdict.accepted_len, verdict.next_token, drafts

    async def _send(self, key: bytes, message: Message) -> None:
        try:
            await self.sender.send(key, message)
        except Exception as exc:  # PeerUnreachable and lane errors: the coordinator re-plans
            log.warning(
                "stage could not send %s to %s: %s", type(message).__name__, key.hex()[:16], exc
            )
