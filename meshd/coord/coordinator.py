"""The coordinator: runs requests over routes of stages, one `WindowLoop` per request.

`WindowLoop` (`window_loop.py`) decides everything about a request's windows; this module is its
trio driver: it feeds the loop each reply, lost stage, overdue timer and streamed batch of
tokens with the time it happened, and sends what the loop returns. A send that fails because
the lane to a stage is gone (`LANE_ERRORS`) fails the route with `RouteFailed`; any other
exception is a bug and propagates.

Stages hold a session only while its lease lasts (`meshd/stage/leases.py`): `keep_alive` renews
every open session's lease on each of its stages every third of `session_lease_s`, and every
way a request ends (done, client gone, error, cancelled) closes the session on every stage of
its route it can still reach; the stages free what it cannot reach when they lose it.

Prefix cache: each route has a `PrefixIndex` of what its stages were asked to keep. A request
looks its prompt up there (the longest reusable prefix) and opens from it; a request that ends
normally asks every stage to keep its KV as a new entry when it closes. Where a request could
run over several routes (the plan's, and an earlier route whose stages still hold their
layers), `choose_route` takes the one holding the longest prefix of its prompt. A route that failed
forgets its index (a recovered stage holds nothing: the next request prefills in full), and so
does every route through a node whose lane died. Whatever leaves an index (evicted least recently
used, replaced by a longer prefix, missed on a stage, or its route forgotten) is named to every
stage of its route that can still be reached in a `DropEntries`, sent by the `keep_alive` task as
soon as it is dropped, so the stages free its KV instead of holding what no index names.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from meshd.coord.generation import (
    GenerationRequest,
    GenerationResult,
    RouteFailed,
    Send,
    StageOverloaded,
)
from meshd.coord.prefix_index import KeepPlan, PrefixCounters, PrefixHit, PrefixIndex
from meshd.coord.route_costs import RouteCosts
from meshd.coord.steps import Steps
from meshd.coord.window_loop import WindowLoop
from meshd.net.lane_table import PeerUnreachable
from meshd.net.peer_lane import LaneClosedError
from meshd.plan.route import Route
from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.draft_gate import pass_weights
from meshd.speculative.policy import LinkModel
from meshd.speculative.proposer import Proposer
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from meshd.stage.host_config import PREFIX_CACHE_ENTRIES
from meshd.stage.leases import SESSION_LEASE_S
from protocol.messages import (
    MAX_DROP_ENTRIES,
    MAX_ENTRY_ID,
    MAX_KEEPALIVE_SESSIONS,
    CloseSession,
    DropEntries,
    DType,
    Message,
    OpenSession,
    SessionKeepAlive,
    StageError,
    VerifyReply,
)

if TYPE_CHECKING:
    from meshd.model.config import ModelConfig

__all__ = [
    "CLOSE_TIMEOUT_S",
    "LANE_ERRORS",
    "Coordinator",
    "GenerationRequest",
    "GenerationResult",
    "OnTokens",
    "RouteFailed",
    "Sender",
    "StageOverloaded",
]

log = logging.getLogger(__name__)

# Routes whose prefix index the coordinator keeps (each holds at most `prefix_max_entries`
# entries' tokens).
MAX_PREFIX_ROUTES = 8
# How long closing a session may wait on one stage (a dead one must not hold up the others).
CLOSE_TIMEOUT_S = 2.0
# What sending to a stage raises when its lane is gone, closing or cannot be opened: the
# route failed. Anything else a send raises is a bug and must surface.
LANE_ERRORS: tuple[type[Exception], ...] = (PeerUnreachable, LaneClosedError)

# Called with each batch of newly committed tokens; returning False stops generation early
# (a stop sequence matched, or the client went away).
OnTokens = Callable[[list[int]], Awaitable[bool | None]]


class Sender(Protocol):
    """What the coordinator needs of the node's lane table."""

    async def send(self, key: bytes, message: Message, stream: int = ...) -> None: ...


@dataclass(frozen=True)
class _StageLost:
    node_key: bytes


_Inbox = VerifyReply | StageError | _StageLost


@dataclass
class _Live:
    session: str
    route: Route
    replies: trio.MemorySendChannel[_Inbox]
    inbox: trio.MemoryReceiveChannel[_Inbox]
    # Stage nodes the session's OpenSession has been sent to: only those get keep-alives (a
    # keep-alive overtaking the open would be answered "session_expired").
    opened: set[bytes] = field(default_factory=set)
    # What the stages keep when the session closes (set once it ended normally).
    keep: tuple[int, KeepPlan] | None = None


class Coordinator:
    """Runs requests over routes; `handle` takes the replies the node's lane table receives."""

    def __init__(
        self,
        sender: Sender,
        own_key: bytes,
        *,
        prefill_chunk_tokens: int = 128,
        wire_dtype: DType = "f16",
        reply_timeout_s: float = 30.0,
        session_lease_s: float = SESSION_LEASE_S,
        draft: DraftModel | None = None,
        draft_quantization: str = "none",
        prefix_cache: bool = True,
        prefix_exact: bool = True,
        prefix_max_entries: int = PREFIX_CACHE_ENTRIES,
        target_config: ModelConfig | None = None,
    ) -> None:
        """`draft` is the node's draft model, loaded at start (`spec.draft_model`); a request
        naming another draft path loads it here once, at `draft_quantization`.
        `prefix_cache`: reuse and keep prompt prefixes on the stages; `prefix_exact`: reuse
        only positions a cold run computes with the same bits (`prefix_index.py`);
        `prefix_max_entries`: entries each route's index holds (least recently used dropped).
        `target_config`: the served model's shape, which prices the draft beside it before
        the draft's passes were timed (`AcceptanceBook.draft_size_ratio`)."""
        self.sender = sender
        self._drafts: dict[str, DraftModel] = {} if draft is None else {draft.path: draft}
        # False where the node's draft does not fit this coordinator's model (another
        # tokenizer: a further model of the node's); its requests then draft with nothing.
        self.drafts_allowed = True
        self.draft_quantization = draft_quantization
        self.own_key = own_key
        self.session_lease_s = session_lease_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.wire_dtype = wire_dtype
        self.reply_timeout_s = reply_timeout_s
        self._live: dict[str, _Live] = {}
        self._steps = Steps()  # one window-loop step at a time (`meshd/coord/steps.py`)
        self._costs: dict[tuple[bytes, ...], RouteCosts] = {}
        self._load: dict[tuple[bytes, ...], float] = {}
        self._books: dict[tuple[str, tuple[object, ...]], AcceptanceBook] = {}
        self.prefix_cache = prefix_cache
        self.prefix_exact = prefix_exact
        self.target_config = target_config
        self.prefix_max_entries = prefix_max_entries
        self._prefixes: dict[Route, PrefixIndex] = {}
        self.prefix_counters = PrefixCounters()
        # Entries the indexes dropped, by the stage node still to be told (`send_drops`).
        self._dropped: dict[bytes, set[int]] = {}
        # Entries whose keeping close is not out yet: a drop of one waits for it (a drop that
        # overtook the close would find nothing, and the close would then keep the entry).
        self._keeping: set[int] = set()
        self._drops_ready = trio.Event()

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
                live.replies.send_nowait(_StageLost(key))
        self.forget_prefixes(key)
        # Its lane died: it dropped the entries kept for this node already (`free_coordinator`).
        self._dropped.pop(key, None)

    # -- prefix cache ----------------------------------------------------------------------
    def prefix_index(self, route: Route) -> PrefixIndex:
        """The prefixes `route`'s stages were asked to keep."""
        found = self._prefixes.pop(route, None)
        if found is None:
            found = PrefixIndex(
                chunk_tokens=self.prefill_chunk_tokens,
                exact=self.prefix_exact,
                max_entries=self.prefix_max_entries,
            )
            while len(self._prefixes) >= MAX_PREFIX_ROUTES:
                # Plans change: the route used least recently is the one least likely to return.
                self._forget_route(next(iter(self._prefixes)))
        self._prefixes[route] = found  # most recently used last
        return found

    def forget_prefixes(self, node_key: bytes | None = None) -> None:
        """Forget the prefixes of every route through `node_key` (None: of every route); the
        route's other stages are told to drop them."""
        for route in list(self._prefixes):
            if node_key is None or node_key in route.keys:
                self._forget_route(route, lost=node_key)

    def _forget_route(self, route: Route, lost: bytes | None = None) -> None:
        """Forget `route`'s index and have its stages (but `lost`) drop what it named."""
        index = self._prefixes.pop(route, None)
        if index is not None:
            self._drop_on_stages(route, index.clear(), lost=lost)

    def _drop_on_stages(
        self, route: Route, entry_ids: Sequence[int], lost: bytes | None = None
    ) -> None:
        """Queue `entry_ids` for every stage of `route` but `lost`; `keep_alive` sends them."""
        if not entry_ids:
            return
        for key in route.keys:
            if key != lost:
                self._dropped.setdefault(key, set()).update(entry_ids)
        self._drops_ready.set()

    async def send_drops(self) -> None:
        """Send each stage node the entries queued for it (`DropEntries`, at most
        MAX_DROP_ENTRIES ids each), all nodes at once, each bounded by CLOSE_TIMEOUT_S; fire
        and forget: a node it cannot reach dropped them when it lost this one. An entry whose
        keeping close is not out yet stays queued until it is."""
        queued, self._dropped = self._dropped, {}
        for key, ids in queued.items():
            waiting = ids & self._keeping
            if waiting:
                self._dropped[key] = waiting
                ids -= waiting

        async def drop_on(key: bytes, ids: list[int]) -> None:
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    for lo in range(0, len(ids), MAX_DROP_ENTRIES):
                        await self.sender.send(key, DropEntries(ids[lo : lo + MAX_DROP_ENTRIES]))
                except LANE_ERRORS as exc:
                    log.debug("dropping entries on %s failed: %s", key.hex()[:16], exc)
                except Exception:  # a bug, logged: the other stages are told all the same
                    log.exception("dropping entries on %s failed", key.hex()[:16])

        async with trio.open_nursery() as nursery:
            for key, ids in queued.items():
                if ids:
                    nursery.start_soon(drop_on, key, sorted(ids))

    def cached_prefix(self, route: Route, prompt: Sequence[int]) -> int:
        """Prompt positions `route`'s stages would serve from their cache (0: none known)."""
        if not self.prefix_cache or route not in self._prefixes:
            return 0
        hit = self._prefixes[route].lookup(prompt)
        return 0 if hit is None else hit.positions

    def prefer_route(self, routes: Sequence[Route], prompt: Sequence[int]) -> Route:
        """Of `routes` (best first by the planner), the one whose stages hold the longest
        reusable prefix of `prompt`; the first where none holds any."""
        if not routes:
            raise ValueError("no route to choose from")
        best = max(range(len(routes)), key=lambda i: (self.cached_prefix(routes[i], prompt), -i))
        return routes[best]

    def choose_route(
        self, planned: Route, prompt: Sequence[int], serves: Callable[[Route], bool]
    ) -> Route:
        """The route to run `prompt` over: `planned` (the node's plan now), or an earlier route
        of the same model and quantization whose stages hold a longer reusable prefix of it,
        where `serves(route)` says its stages still hold those layers (the membership view)."""
        if not self.prefix_cache:
            return planned
        others = [
            route
            for route in reversed(self._prefixes)  # most recently used first
            if route != planned
            and route.model_id == planned.model_id
            and route.quantization == planned.quantization
            and serves(route)
        ]
        return self.prefer_route([planned, *others], prompt)

    async def generate(
        self, route: Route, request: GenerationRequest, on_tokens: OnTokens
    ) -> GenerationResult:
        """Generate for `request` over `route`, reporting tokens as they commit.

        Raises RouteFailed (with the tokens committed so far) if a stage fails or dies.
        """
        send, receive = trio.open_memory_channel[_Inbox](math.inf)
        live = _Live(secrets.token_hex(8), route, send, receive)
        self._live[live.session] = live
        try:
            return await self._drive(live, request, on_tokens)
        except RouteFailed:
            # What this route's stages kept is no longer known (a stage may be re-planned).
            self._forget_route(route)
            self._closed_keep(live)
            live.keep = None
            raise
        finally:
            del self._live[live.session]
            # Shielded: a cancelled request (client gone, shutdown) closes its session too.
            with trio.CancelScope(shield=True):
                await self.close_session(live.session, route, live.keep)
            self._closed_keep(live)

    def _closed_keep(self, live: _Live) -> None:
        """`live`'s close is out (or will keep nothing): a drop of its entry may follow now."""
        if live.keep is not None:
            self._keeping.discard(live.keep[0])
            if self._dropped:
                self._drops_ready.set()

    async def _drive(
        self, live: _Live, request: GenerationRequest, on_tokens: OnTokens
    ) -> GenerationResult:
        """Feed `live`'s events to its `WindowLoop` and send what it returns, until done."""
        route = live.route
        sampling = request.sampling
        proposer = make_proposer(
            request.spec.strategy,
            request.spec,
            book=self.book(route.model_id, request.spec),
            link=self.costs(route).link_model(),
            draft=self.draft_model(request.spec),
            sampling=SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=sampling.seed,
            ),
        )
        try:
            return await self._drive_loop(live, request, on_tokens, proposer)
        finally:
            await self._steps.close(proposer)

    async def _drive_loop(
        self, live: _Live, request: GenerationRequest, on_tokens: OnTokens, proposer: Proposer
    ) -> GenerationResult:
        route = live.route
        hit: PrefixHit | None = None
        index: PrefixIndex | None = None
        if self.prefix_cache:
            index = self.prefix_index(route)
            hit = index.lookup(request.prompt)
            counters = self.prefix_counters
            counters.lookups += 1
            counters.prompt_tokens += len(request.prompt)
        loop = WindowLoop(
            session=live.session,
            route=route,
            request=request,
            proposer=proposer,
            costs=self.costs(route),
            coordinator_key=self.own_key,
            link=lambda: self.link_model(route),
            observe_load=lambda sessions: self.observe_load(route, sessions),
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            wire_dtype=self.wire_dtype,
            reply_timeout_s=self.reply_timeout_s,
            prefix=hit,
        )
        step = self._steps.run
        now = trio.current_time()
        await self._send_all(live, loop, await step(proposer, loop.start, request.prompt, now))
        while not loop.done:
            item, now = await self._steps.receive(live.inbox, loop, proposer)
            if item is None:
                sends = loop.on_timer(now)
            elif isinstance(item, _StageLost):
                sends = loop.on_stage_failed(item.node_key, now)
            else:
                sends = await step(proposer, loop.on_reply, item, now)
            await self._send_all(live, loop, sends)
            tokens = loop.tokens_to_stream
            if tokens:
                if request.on_logprobs is not None:
                    request.on_logprobs(loop.logprobs_to_stream)
                stop = await on_tokens(tokens) is False
                streamed = functools.partial(loop.on_streamed, stop=stop)
                now = trio.current_time()
                await self._send_all(live, loop, await step(proposer, streamed, now))
        if index is not None:
            self._after_prefix(index, loop, hit, live)
        return loop.result()

    def _after_prefix(
        self, index: PrefixIndex, loop: WindowLoop, hit: PrefixHit | None, live: _Live
    ) -> None:
        """Count what the hit saved, plan what the stages keep at the close, and have them
        drop what the index no longer names."""
        counters = self.prefix_counters
        if hit is not None and loop.prefix_missed:
            counters.misses += 1
            if index.forget(hit.entry):  # at least one stage no longer holds it
                self._drop_on_stages(live.route, [hit.entry])
        served = loop.prefix
        if served is not None:
            counters.hits += 1
            counters.reused_tokens += served.positions
        if self._prefixes.get(live.route) is not index:
            return  # the route's index was forgotten meanwhile: nothing would name the entry
        plan = index.plan_keep(loop.kv_tokens, loop.prompt_len, served)
        if plan is not None:
            entry_id = secrets.randbelow(MAX_ENTRY_ID) + 1
            self._drop_on_stages(live.route, index.record(entry_id, plan))
            counters.kept += 1
            live.keep = (entry_id, plan)
            self._keeping.add(entry_id)

    async def _send_all(self, live: _Live, loop: WindowLoop, sends: list[Send]) -> None:
        for key, message in sends:
            try:
                await self.sender.send(key, message)
            except LANE_ERRORS as exc:
                raise RouteFailed(f"cannot reach stage: {exc}", loop.committed, key) from exc
            if isinstance(message, OpenSession):
                live.opened.add(key)

    async def close_session(
        self, session: str, route: Route, keep: tuple[int, KeepPlan] | None = None
    ) -> None:
        """Close `session` on every stage of `route` at once, each bounded by CLOSE_TIMEOUT_S.

        In parallel, so a stage that died (or whose lane is closing) cannot keep the close from
        the stages after it; a stage it cannot reach frees the session when it loses this node
        or when the lease lapses. `keep` = (entry id, plan): each stage first keeps the KV of
        the plan's tokens as that prefix-cache entry.
        """
        close = CloseSession(session)
        if keep is not None:
            entry_id, plan = keep
            close = CloseSession(session, entry_id, len(plan.tokens), plan.replaces)

        async def close_on(key: bytes) -> None:
            with trio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    await self.sender.send(key, close)
                except LANE_ERRORS as exc:  # the node may be gone; its KV went with it
                    log.debug("close on %s failed: %s", key.hex()[:16], exc)
                except Exception:  # a bug, logged: it must not hide why the request ended
                    log.exception("closing session %s on %s failed", session, key.hex()[:16])

        async with trio.open_nursery() as nursery:
            for key in dict.fromkeys(route.keys):
                nursery.start_soon(close_on, key)

    async def keep_alive(self) -> None:
        """Until cancelled: renew the leases of every open session every third of the lease,
        and send the stages the prefix-cache entries the indexes drop as they drop them."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drop_when_queued)
            while True:
                await trio.sleep(self.session_lease_s / 3)
                await self.renew_leases()

    async def _drop_when_queued(self) -> None:
        while True:
            await self._drops_ready.wait()
            self._drops_ready = trio.Event()
            await self.send_drops()

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
                except LANE_ERRORS as exc:  # a lost stage fails its sessions another way
                    log.debug("keep-alive to %s failed: %s", key.hex()[:16], exc)
                except Exception:  # a bug, logged: renewing the other stages goes on
                    log.exception("keep-alive to %s failed", key.hex()[:16])

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

    def draft_model(self, spec: SpecConfig) -> DraftModel | None:
        """The draft model `spec` names (loaded once per path), or None when it names none."""
        if not spec.draft_model or not self.drafts_allowed:
            return None
        found = self._drafts.get(spec.draft_model)
        if found is None:
            found = self._drafts[spec.draft_model] = DraftModel.load(
                spec.draft_model, quantization=self.draft_quantization
            )
        return found

    def book(self, model_id: str, spec: SpecConfig) -> AcceptanceBook:
        """`auto`'s acceptance estimates for a model, shared by its requests (and the settings
        the estimates depend on: a request with another window or prior starts its own)."""
        key = (
            model_id,
            (
                spec.window_max_tokens,
                spec.ewma_alpha,
                spec.prior_acceptance,
                spec.mtp_depth,
                spec.draft_model,
            ),
        )
        found = self._books.get(key)
        if found is None:
            found = self._books[key] = AcceptanceBook(spec)
            draft = self.draft_model(spec)
            if draft is not None and self.target_config is not None:
                rows = draft.scored_rows(spec.draft_vocab_tokens)
                found.draft_size_ratio = pass_weights(draft.stage.config, rows) / pass_weights(
                    self.target_config
                )
        return found

    def costs(self, route: Route) -> RouteCosts:
        """Measured costs of a route (kept across requests)."""
        key = route.keys
        if key not in self._costs:
            self._costs[key] = RouteCosts(stages=len(route.stages))
        return self._costs[key]
