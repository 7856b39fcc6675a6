"""The coordinator: drives one request's verify windows through a route of stages.

It owns the session's token log, the proposer, the windows in flight and the sampling
configuration (randomness is keyed by seed and position, so the last stage samples
statelessly). Window n+1 may leave before reply n arrives, assuming window n is accepted in
full and guessing its bonus token; a reply that disproves the assumption bumps the epoch,
tells every stage to drop older work (`Rollback`), and costs at most one extra round trip.
KV is positional, so nothing on the stages needs undoing.

Stages hold a session only while its lease lasts (`meshd/stage/leases.py`): `keep_alive` renews
every open session's lease on each of its stages every third of `session_lease_s`, and every
way a request ends (done, client gone, error, cancelled) closes the session on every stage of
its route it can still reach; the stages free what it cannot reach when they lose it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from meshd.coord.costs import RouteCosts
from meshd.coord.route import Route
from meshd.spec.auto import AcceptanceBook, AutoProposer
from meshd.spec.config import SpecConfig
from meshd.spec.policy import LinkModel, PolicyInputs, WindowPlan, choose
from meshd.spec.proposers import make_proposer
from meshd.spec.sampling import clip_drafts
from meshd.spec.telemetry import Recorder, SpecTelemetry
from protocol.messages import (
    MAX_KEEPALIVE_SESSIONS,
    CloseSession,
    DType,
    Message,
    OpenSession,
    Rollback,
    Sampling,
    SessionKeepAlive,
    StageError,
    VerifyReply,
    VerifyWindow,
)

log = logging.getLogger(__name__)

MTP_STRATEGIES = frozenset({"mtp", "mtp-simple", "mtp-cache", "auto"})
# How long closing a session may wait on one stage (a dead one must not hold up the others).
CLOSE_TIMEOUT_S = 2.0

# Called with each batch of newly committed tokens; returning False stops generation early
# (a stop sequence matched, or the client went away).
OnTokens = Callable[[list[int]], Awaitable[bool | None]]


class RouteFailed(Exception):
    """A stage failed or became unreachable; `committed` holds what was generated so far."""

    def __init__(self, message: str, committed: Sequence[int] = (), node_key: bytes = b"") -> None:
        super().__init__(message)
        self.committed = list(committed)
        self.node_key = node_key


class StageOverloaded(RouteFailed):
    """A stage refused the session (its KV memory or queue is full): retry after a while.

    A `RouteFailed`, so callers that only know that type still fail fast; the API may answer
    429/503 with `Retry-After: retry_after_s`.
    """

    def __init__(
        self,
        message: str,
        retry_after_s: float,
        committed: Sequence[int] = (),
        node_key: bytes = b"",
    ) -> None:
        super().__init__(message, committed, node_key)
        self.retry_after_s = retry_after_s


class Sender(Protocol):
    """What the coordinator needs of the node's peer table."""

    async def send(self, key: bytes, message: Message, stream: int = ...) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt token ids, limits, sampling and speculation settings."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    spec: SpecConfig = field(default_factory=SpecConfig)
    eos_ids: frozenset[int] = frozenset()
    mtp_depth: int = 0  # MTP depths the model has (0: no MTP)


@dataclass
class GenerationResult:
    """What came out: generated token ids (no EOS), why it stopped, and telemetry."""

    tokens: list[int]
    finish_reason: str  # "stop" (EOS or asked to stop) or "length"
    telemetry: SpecTelemetry


@dataclass
class _Window:
    window_id: int
    base_pos: int
    tokens: list[int]
    n_draft: int
    sent_s: float


@dataclass
class _Live:
    session: str
    route: Route
    replies: trio.MemorySendChannel[VerifyReply | StageError | RouteFailed]
    inbox: trio.MemoryReceiveChannel[VerifyReply | StageError | RouteFailed]
    # Stage nodes the session's OpenSession has been sent to: only those get keep-alives (a
    # keep-alive overtaking the open would be answered "session_expired").
    opened: set[bytes] = field(default_factory=set)


class Coordinator:
    """Runs requests over routes; `handle` takes the replies the node's peer table receives."""

    def __init__(
        self,
        sender: Sender,
        own_key: bytes,
        *,
        prefill_chunk_tokens: int = 256,
        wire_dtype: DType = "f16",
        reply_timeout_s: float = 30.0,
        session_lease_s: float = 30.0,
    ) -> None:
        self.sender = sender
        self.own_key = own_key
        self.session_lease_s = session_lease_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.wire_dtype = wire_dtype
        self.reply_timeout_s = reply_timeout_s
        self._live: dict[str, _Live] = {}
        self._costs: dict[tuple[bytes, ...], RouteCosts] = {}
        self._load: dict[tuple[bytes, ...], float] = {}
        self._books: dict[tuple[str, tuple[object, ...]], AcceptanceBook] = {}

    @property
    def sessions_in_flight(self) -> int:
        """Requests being generated now."""
        return len(self._live)

    def handle(self, message: Message, sender_key: bytes) -> None:
        """A reply or error from a stage: hand it to its session (unknown sessions: dropped)."""
        if isinstance(message, VerifyReply | StageError):
            live = self._live.get(message.session)
            if live is not None:
                live.replies.send_nowait(message)

    def peer_lost(self, key: bytes) -> None:
        """A lane died: fail at once every session whose route uses that node."""
        for live in self._live.values():
            if key in live.route.keys:
                live.replies.send_nowait(RouteFailed("stage node unreachable", node_key=key))

    async def generate(
        self, route: Route, request: GenerationRequest, on_tokens: OnTokens
    ) -> GenerationResult:
        """Generate for `request` over `route`, reporting tokens as they commit.

        Raises RouteFailed (with the tokens committed so far) if a stage fails or dies.
        """
        send, receive = trio.open_memory_channel[VerifyReply | StageError | RouteFailed](math.inf)
        live = _Live(secrets.token_hex(8), route, send, receive)
        self._live[live.session] = live
        try:
            return await _Run(self, live, request, on_tokens).run()
        finally:
            del self._live[live.session]
            # Shielded: a cancelled request (client gone, shutdown) closes its session too.
            with trio.CancelScope(shield=True):
                await self.close_session(live.session, route)

    async def close_session(self, session: str, route: Route) -> None:
        """Close `session` on every stage of `route` at once, each bounded by CLOSE_TIMEOUT_S.

        In parallel, so a stage that died (or whose lane is closing) cannot keep the close from
        the stages after it; a stage it cannot reach frees the session when it loses this node
        or when the lease lapses.
        """

        async def close_on(key: bytes) -> None:
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    await self.sender.send(key, CloseSession(session))
                except Exception as exc:  # the node may be gone; its KV went with it
                    log.debug("close on %s failed: %s", key.hex()[:16], exc)

        async with trio.open_nursery() as nursery:
            for key in dict.fromkeys(route.keys):
                nursery.start_soon(close_on, key)

    async def keep_alive(self) -> None:
        """Renew the leases of every open session every third of the lease, until cancelled."""
        while True:
            await trio.sleep(self.session_lease_s / 3)
            await self.renew_leases()

    async def renew_leases(self) -> None:
        """One `SessionKeepAlive` per stage node, naming this coordinator's sessions there."""
        by_key: dict[bytes, list[str]] = {}
        for live in list(self._live.values()):
            for key in live.opened:
                by_key.setdefault(key, []).append(live.session)

        async def renew(key: bytes, sessions: list[str]) -> None:
            with trio.move_on_after(self.session_lease_s / 3):
                try:
                    await self.sender.send(key, SessionKeepAlive(sessions))
                except Exception as exc:  # a lost stage fails its sessions another way
                    log.debug("keep-alive to %s failed: %s", key.hex()[:16], exc)

        async with trio.open_nursery() as nursery:
            for key, sessions in by_key.items():
                for lo in range(0, len(sessions), MAX_KEEPALIVE_SESSIONS):
                    nursery.start_soon(renew, key, sessions[lo : lo + MAX_KEEPALIVE_SESSIONS])

    def stage_load(self, route: Route) -> float:
        """Sessions sharing the route's busiest stage, as its replies report (smoothed; ≥ 1)."""
        return self._load.get(route.keys, 1.0)

    def observe_load(self, route: Route, sessions: int) -> None:
        """Fold one reply's stage load into `stage_load` (fast to rise, a few replies to fall)."""
        old = self._load.get(route.keys, 1.0)
        self._load[route.keys] = max(
            1.0, sessions if sessions > old else 0.7 * old + 0.3 * sessions
        )

    def link_model(self, route: Route) -> LinkModel:
        """The policy's view of `route` now: its measured costs and the load on its stages.

        Load is what the stages report (sessions of every coordinator sharing a pass or queued
        behind it), and at least this coordinator's own requests in flight.
        """
        load = max(1, self.sessions_in_flight, round(self.stage_load(route)))
        return self.costs(route).link_model(concurrent_sessions=load)

    def book(self, model_id: str, spec: SpecConfig) -> AcceptanceBook:
        """`auto`'s acceptance estimates for a model, shared by its requests (and the settings
        the estimates depend on: a request with another window or prior starts its own)."""
        key = (
            model_id,
            (spec.window_max_tokens, spec.ewma_alpha, spec.prior_acceptance, spec.mtp_depth),
        )
        found = self._books.get(key)
        if found is None:
            found = self._books[key] = AcceptanceBook(spec)
        return found

    def costs(self, route: Route) -> RouteCosts:
        """Measured costs of a route (kept across requests)."""
        key = route.keys
        if key not in self._costs:
            self._costs[key] = RouteCosts(stages=len(route.stages))
        return self._costs[key]


class _Run:
    """One request's decode loop (state that lives exactly as long as the request)."""

    def __init__(
        self, coord: Coordinator, live: _Live, request: GenerationRequest, on_tokens: OnTokens
    ) -> None:
        self.coord = coord
        self.live = live
        self.req = request
        self.on_tokens = on_tokens
        self.spec = request.spec
        self.use_mtp = request.mtp_depth > 0 and self.spec.strategy in MTP_STRATEGIES
        self.mtp_tokens = min(request.mtp_depth, self.spec.mtp_depth) if self.use_mtp else 0
        self.costs = coord.costs(live.route)
        self.proposer = make_proposer(
            self.spec.strategy,
            self.spec,
            book=coord.book(live.route.model_id, self.spec),
            link=self.costs.link_model(),
        )
        self.recorder = Recorder(self.spec.strategy)
        self.epoch = 0
        self.next_window_id = 0
        self.generated: list[int] = []
        self.last_token = -1
        self.in_flight: deque[_Window] = deque()
        self.mtp_draft: list[int] = []
        self.finish_reason = "length"
        # When the last reply left nothing in flight: the coordinator's turnaround starts.
        self.idle_since: float | None = None

    async def run(self) -> GenerationResult:
        prompt = list(self.req.prompt)
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        await self._open(len(prompt))
        self.proposer.reset(prompt)
        first = await self._prefill(prompt)
        decode_start = time.perf_counter()
        done = await self._commit([first], eos=first in self.req.eos_ids)
        while not done:
            plan = self._plan()
            await self._fill(plan)
            if not self.in_flight:
                break
            done = await self._on_reply(await self._reply())
            self.recorder.decode_elapsed(time.perf_counter() - decode_start)
        return GenerationResult(self.generated, self.finish_reason, self.recorder.snapshot())

    # -- session set-up -----------------------------------------------------------------
    async def _open(self, prompt_len: int) -> None:
        route = self.live.route
        lookahead = (self.spec.window_max_tokens + 1) * max(1, self.spec.max_pipeline_depth)
        max_positions = prompt_len + self.req.max_tokens + lookahead + 8
        for index, stage in enumerate(route.stages):
            last = index == len(route.stages) - 1
            message = OpenSession(
                session=self.live.session,
                model_id=route.model_id,
                max_positions=max_positions,
                stage_index=index,
                coordinator=self.coord.own_key,
                next_hop=None if last else route.stages[index + 1].node_key,
                wire_dtype=self.coord.wire_dtype,
                mtp_depth=self.mtp_tokens if last else 0,
                layer_start=stage.layer_start,
                layer_end=stage.layer_end,
                quantization=route.quantization,
            )
            await self._send(stage.node_key, message)
            self.live.opened.add(stage.node_key)

    async def _prefill(self, prompt: list[int]) -> int:
        chunk = self.coord.prefill_chunk_tokens
        t0 = time.perf_counter()
        last_id = -1
        for lo in range(0, len(prompt), chunk):
            hi = min(len(prompt), lo + chunk)
            last_id = self._window_id()
            window = VerifyWindow(
                session=self.live.session,
                epoch=self.epoch,
                window_id=last_id,
                base_pos=lo,
                tokens=prompt[lo:hi],
                sampling=self.req.sampling,
                n_draft=0,
                sample=hi == len(prompt),
                mtp_tokens=self.mtp_tokens,
            )
            await self._send(self.live.route.keys[0], window)
        while True:
            reply = await self._reply()
            if reply.window_id == last_id:
                break
        self.recorder.prefill(len(prompt), time.perf_counter() - t0)
        self.mtp_draft = list(reply.mtp_draft)
        return reply.next_token

    # -- the decode loop ----------------------------------------------------------------
    def _plan(self) -> WindowPlan:
        if self.spec.strategy == "disabled" or self.spec.window_max_tokens == 0:
            return WindowPlan(0, 1, 1.0, 0.0, 0.0, "speculation disabled")
        link = self.coord.link_model(self.live.route)
        setter = getattr(self.proposer, "set_link", None)
        if setter is not None:
            setter(link)
        if (
            isinstance(self.proposer, AutoProposer)
            and self.mtp_tokens
            and not self.proposer.wants_mtp
        ):
            # `auto` found that MTP drafts cost more than they save on this route: stop the
            # heads for the rest of the request (the stages skip them from the next window).
            self.mtp_tokens = 0
            self.proposer.stop_mtp()
        if isinstance(self.proposer, AutoProposer) and self.proposer.active == "disabled":
            # `auto` already weighed every strategy against plain decoding and none paid.
            reason = self.proposer.reason
            plan = WindowPlan(0, 1, 1.0, 0.0, 0.0, reason)
            self.recorder.policy(plan, "disabled", reason)
            return plan
        if self.mtp_tokens and self.proposer.active in MTP_STRATEGIES:
            link = link.with_mtp_drafts()
        plan = choose(PolicyInputs(link, self.proposer.acceptance()), self.spec)
        reason = getattr(self.proposer, "reason", "")
        self.recorder.policy(plan, self.proposer.active, reason)
        if plan.width == 0 and self.spec.strategy != "auto":
            # A fixed strategy keeps probing with its narrowest window, so its acceptance
            # estimate can recover; `auto` is the strategy that is allowed to stop.
            plan = WindowPlan(self.spec.window_min_tokens, 1, 1.0, 0.0, 0.0, plan.reason)
        return plan

    def _remaining(self) -> int:
        """Tokens that may still be committed beyond what windows in flight could commit."""
        pending = sum(w.n_draft + 1 for w in self.in_flight)
        return self.req.max_tokens - len(self.generated) - pending

    async def _fill(self, plan: WindowPlan) -> None:
        depth = max(1, plan.depth)
        while len(self.in_flight) < depth:
            remaining = self._remaining()
            if remaining <= 0:
                return
            if not self.in_flight:
                base = len(self.req.prompt) + len(self.generated) - 1
                # Even at width 0 the proposer sees the MTP draft, so `auto` keeps scoring
                # MTP strategies while it is not speculating.
                drafts = self.proposer.propose(plan.width, self.mtp_draft)
                tokens = [self.last_token, *clip_drafts(drafts, remaining)]
            else:
                # Everything in flight is assumed right: the oldest window's drafts, then
                # each later window's guessed bonus token and its drafts.
                assumed = self.in_flight[0].tokens[1:] + [
                    t for w in list(self.in_flight)[1:] for t in w.tokens
                ]
                guess = self.proposer.propose_after(assumed, plan.width + 1)
                if not guess:
                    return  # no guess for the bonus token: wait for the reply instead
                prev = self.in_flight[-1]
                base = prev.base_pos + len(prev.tokens)
                tokens = [guess[0], *clip_drafts(guess[1:], remaining)]
            window = _Window(self._window_id(), base, tokens, len(tokens) - 1, 0.0)
            await self._send_window(window)

    async def _send_window(self, w: _Window) -> None:
        w.sent_s = time.perf_counter()
        if self.idle_since is not None and not self.in_flight:
            self.costs.observe_local(w.sent_s - self.idle_since)
        self.idle_since = None
        message = VerifyWindow(
            session=self.live.session,
            epoch=self.epoch,
            window_id=w.window_id,
            base_pos=w.base_pos,
            tokens=w.tokens,
            sampling=self.req.sampling,
            n_draft=w.n_draft,
            mtp_tokens=self.mtp_tokens,
        )
        self.in_flight.append(w)
        self.recorder.window_sent()
        await self._send(self.live.route.keys[0], message)

    async def _on_reply(self, reply: VerifyReply) -> bool:
        w = self.in_flight.popleft()
        if reply.window_id != w.window_id:
            raise RouteFailed(
                f"reply for window {reply.window_id}, expected {w.window_id}", self.generated
            )
        timings = reply.stage_timings
        compute = sum(t.compute_s for t in timings)
        queue = sum(t.queue_s for t in timings)
        replied = time.perf_counter()
        round_trip = replied - w.sent_s
        self.idle_since = None if self.in_flight else replied
        # A batched pass is shared by its sessions: the cost model takes this session's share,
        # and the policy multiplies it back by the load (C_L = L·C). The rest of the pass was
        # spent on others' rows, so it counts as waiting, not as network.
        share = sum(t.compute_s / max(1, t.batch_sessions) for t in timings)
        mtp = sum(t.mtp_s for t in timings)
        self.costs.observe(len(w.tokens), round_trip, share, queue + compute - share, mtp)
        load = max((t.batch_sessions + t.queued_sessions for t in timings), default=1)
        self.coord.observe_load(self.live.route, load)
        accepted = reply.accepted_len
        if not 0 <= accepted <= w.n_draft:
            raise RouteFailed(f"reply accepts {accepted} of {w.n_draft} drafts", self.generated)
        new = [*w.tokens[1 : 1 + accepted], reply.next_token]
        self.proposer.record(w.n_draft, accepted)
        self.recorder.verdict(
            self.proposer.active,
            w.n_draft,
            accepted,
            len(new),
            network_s=max(0.0, round_trip - compute - queue),
            compute_s=compute,
        )
        self.mtp_draft = list(reply.mtp_draft)
        done = await self._commit(new, eos=reply.next_token in self.req.eos_ids)
        if self.in_flight:
            nxt = self.in_flight[0]
            if done or accepted < w.n_draft or reply.next_token != nxt.tokens[0]:
                await self._rollback()
            else:
                self.mtp_draft = []  # it was for a window that has already left
        return done

    async def _commit(self, tokens: list[int], *, eos: bool) -> bool:
        """Add tokens to the log and report them; True when generation is over."""
        self.last_token = tokens[-1]
        visible = tokens[:-1] if eos else tokens
        self.generated.extend(visible)
        self.proposer.observe(tokens)
        keep_going = await self.on_tokens(visible) if visible else True
        if eos or keep_going is False:
            self.finish_reason = "stop"
            return True
        return len(self.generated) >= self.req.max_tokens

    async def _rollback(self) -> None:
        stale = len(self.in_flight)
        self.in_flight.clear()
        self.recorder.window_stale(stale)
        self.epoch += 1
        for key in self.live.route.keys:
            await self._send(key, Rollback(self.live.session, self.epoch))

    # -- plumbing -----------------------------------------------------------------------
    def _window_id(self) -> int:
        self.next_window_id += 1
        return self.next_window_id

    async def _reply(self) -> VerifyReply:
        """The next reply of the current epoch (older epochs' replies are stale: skipped)."""
        while True:
            try:
                with trio.fail_after(self.coord.reply_timeout_s):
                    item = await self.live.inbox.receive()
            except trio.TooSlowError:
                raise RouteFailed(
                    f"no reply within {self.coord.reply_timeout_s} s", self.generated
                ) from None
            if isinstance(item, RouteFailed):
                item.committed = list(self.generated)
                raise item
            if isinstance(item, StageError):
                text = f"stage error {item.code}: {item.message}"
                if item.code == "overloaded":
                    raise StageOverloaded(text, item.retry_after_s, self.generated)
                raise RouteFailed(text, self.generated)
            if item.epoch == self.epoch:
                return item

    async def _send(self, key: bytes, message: Message) -> None:
        try:
            await self.coord.sender.send(key, message)
        except Exception as exc:
            raise RouteFailed(f"cannot reach stage: {exc}", self.generated, key) from exc
