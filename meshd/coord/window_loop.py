"""One request's window loop, as a sans-IO state machine: events and `now` in, messages out.

`WindowLoop` owns everything a request's decoding decides: the token log, the proposer, the
windows in flight and their epoch, rollback, acceptance accounting and the route's measured
costs. It never reads a clock, sleeps or sends; the driver (`Coordinator.generate` in
`coordinator.py`) feeds it events with the time they happened and sends what each returns:

- `start(prompt, now)`: the session opens on every stage and the prompt is prefilled.
- `on_reply(reply, now)`: a `VerifyReply` or `StageError` for this session arrived.
- `on_stage_failed(node, now)`: the lane to a stage node died.
- `on_timer(now)`: the driver's wait reached `timer` (a reply is overdue).
- `on_streamed(now, stop=...)`: the driver delivered `tokens_to_stream` to the client, who may
  have asked to stop. Until then the loop holds back its next windows, so a client that stops
  never costs the stages a window nobody wants.

Each returns the `Send`s to make, in order. A failure (a stage error, a dead stage, an overdue
reply, a reply that breaks the protocol) raises `RouteFailed` holding the tokens committed so
far, and ends the loop.

Pipelining: window n+1 may leave before reply n arrives, assuming window n is accepted in full
and guessing its bonus token; a reply that disproves the assumption bumps the epoch, tells
every stage to drop older work (`Rollback`), and costs at most one extra round trip. Replies of
an older epoch are stale and ignored. KV is positional, so nothing on the stages needs undoing.
Randomness is keyed by seed and position, so the last stage samples statelessly.

Prefix cache: with a `prefix` hit (`prefix_index.py`), the session opens on every stage from the
cache entry's first p positions and the prefill sends only positions p.. . The prefill's chunks
are always cut at multiples of `prefill_chunk_tokens` from position 0, so a chunk is the same
window whichever request computes it. A stage that no longer holds the entry opens the session
empty at epoch 1 and answers `prefix_miss` (a stage of an older release answers the hit's first
window with a gap error instead): the loop then rolls every stage to epoch 1 and prefills from
position 0. Either way the request never fails because of the cache.

Costs: each reply's round trip and stage timings go to the route's `RouteCosts`; the time from
a reply that left nothing in flight to the next window's send (streaming, proposing, planning)
is the coordinator's turnaround, which every window pays, so it is charged too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NoReturn

from meshd.coord.generation import (
    GenerationRequest,
    GenerationResult,
    RouteFailed,
    Send,
    StageOverloaded,
    Window,
    prefill_timeout,
    prefill_windows,
)
from meshd.coord.prefix_index import PrefixHit
from meshd.coord.route_costs import RouteCosts
from meshd.plan.route import Route
from meshd.speculative.config import MTP_STRATEGIES
from meshd.speculative.policy import LinkModel, PolicyInputs, WindowPlan, choose
from meshd.speculative.proposer import Proposer
from meshd.speculative.sampling import clip_drafts
from meshd.speculative.telemetry import Recorder
from protocol.messages import (
    PREFIX_MISS,
    PREFIX_MISS_EPOCH,
    DType,
    OpenSession,
    Rollback,
    StageError,
    TokenLogprobs,
    VerifyReply,
    VerifyWindow,
)

_PLAIN = "speculation disabled"


class WindowLoop:
    """The decode loop of one request over one route (see the module docstring)."""

    def __init__(
        self,
        *,
        session: str,
        route: Route,
        request: GenerationRequest,
        proposer: Proposer,
        costs: RouteCosts,
        coordinator_key: bytes,
        link: Callable[[], LinkModel] | None = None,
        observe_load: Callable[[int], None] | None = None,
        prefill_chunk_tokens: int = 128,
        wire_dtype: DType = "f16",
        reply_timeout_s: float = 30.0,
        prefix: PrefixHit | None = None,
    ) -> None:
        """`link` is the policy's view of the route when a window is planned (default: the
        route's own costs at load 1); `observe_load` gets the stage load each reply reports.
        `prefix`: open from this prefix-cache entry (see the module docstring); the session
        then runs without MTP heads (their KV is not kept)."""
        self.session = session
        self.route = route
        self.request = request
        self.spec = request.spec
        self.proposer = proposer
        self.costs = costs
        self.coordinator_key = coordinator_key
        self._link = link if link is not None else costs.link_model
        self._observe_load = observe_load
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.wire_dtype = wire_dtype
        self.reply_timeout_s = reply_timeout_s
        # The hit until every stage has served it (the prefill's reply), or None.
        self.prefix = prefix
        self.prefix_missed = False  # a stage could not serve the hit: prefilled in full
        self._hit_windows: set[int] = set()  # prefill windows sent for the hit
        self._prompt: list[int] = []
        use_mtp = request.mtp_depth > 0 and proposer.uses_mtp and prefix is None
        # MTP depths the last stage runs per window; 0 once the proposer stops wanting them.
        self.mtp_tokens = min(request.mtp_depth, self.spec.mtp_depth) if use_mtp else 0
        self.recorder = Recorder(self.spec.strategy)
        self.epoch = 0
        self.finish_reason = "length"
        self._phase = "new"  # new → prefill → decode → done
        self._prompt_len = 0
        self._next_window_id = 0
        self._committed: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._last_token = -1
        self._in_flight: deque[Window] = deque()
        self._mtp_draft: list[int] = []
        self._prefill_id = 0
        self._prefill_start = 0.0
        self._decode_start = 0.0
        # When the last reply left nothing in flight: the coordinator's turnaround starts.
        self._idle_since: float | None = None
        # Of that turnaround, the proposer's own passes (`Proposer.last_observe_s`).
        self._observing_s = 0.0
        self._deadline: float | None = None
        # Committed tokens the driver has yet to stream, and what the loop does once it has.
        self._to_stream: list[int] = []
        self._logprobs_to_stream: list[TokenLogprobs] = []
        self._eos = False
        self._after_reply = False  # the commit came from a decode reply (not the prefill)
        self._rejected = False  # that reply disproved the windows still in flight
        self._width = 0  # the latest plan's drafts per window
        # Passes ahead pay where the coordinator's cores are idle while a window is out: not
        # when the route is this node alone (they would share the cores that verify).
        alone = len(route.stages) == 1 and route.stages[0].node_key == coordinator_key
        self._ahead = 0 if alone else self.spec.draft_ahead_tokens

    # -- what the driver reads -----------------------------------------------------------
    @property
    def done(self) -> bool:
        """Generation is over (finished, stopped, or failed)."""
        return self._phase == "done"

    @property
    def committed(self) -> list[int]:
        """Tokens committed so far, EOS excluded."""
        return list(self._committed)

    @property
    def tokens_to_stream(self) -> list[int]:
        """Committed tokens the driver must stream, then call `on_streamed` (empty: none)."""
        return list(self._to_stream)

    @property
    def logprobs_to_stream(self) -> list[TokenLogprobs]:
        """The log-probs of `tokens_to_stream`, one each (empty unless the request asked)."""
        return list(self._logprobs_to_stream)

    @property
    def windows_in_flight(self) -> int:
        """Verify windows sent and not yet answered in the current epoch."""
        return len(self._in_flight)

    @property
    def timer(self) -> float | None:
        """When a reply becomes overdue (call `on_timer` then); None when none is awaited."""
        if self._phase in ("prefill", "decode") and not self._to_stream:
            return self._deadline
        return None

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt."""
        return self._prompt_len

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV every stage holds at positions [0, len) once the loop is done: the
        prompt and the committed tokens run so far (the last one sampled was never run; an EOS
        was, after the last visible token)."""
        tokens = [*self._prompt, *self._committed]
        return tokens if self._eos else tokens[:-1]

    @property
    def cached_tokens(self) -> int:
        """Prompt positions served from the prefix cache (0 without a hit, or after a miss)."""
        return 0 if self.prefix is None else self.prefix.positions

    def result(self) -> GenerationResult:
        """What came out (the tokens so far while the loop is not done)."""
        return GenerationResult(
            self.committed,
            self.finish_reason,
            self.recorder.snapshot(),
            cached_tokens=self.cached_tokens,
            logprobs=list(self._logprobs),
        )

    # -- events --------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], now: float) -> list[Send]:
        """Open the session on every stage and send the prompt in prefill chunks."""
        if self._phase != "new":
            raise RuntimeError("a WindowLoop starts once")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if self.prefix is not None and not 0 < self.prefix.positions < len(prompt):
            raise ValueError("a prefix hit must leave at least one prompt token to compute")
        self._prompt = prompt
        self._prompt_len = len(prompt)
        out = self._open(len(prompt))
        self.proposer.reset(prompt)
        self.proposer.expect_tokens(self.request.max_tokens)
        if self.prefix is not None:
            self.proposer.stop_mtp()
        self._phase = "prefill"
        out += self._prefill(0 if self.prefix is None else self.prefix.positions, now)
        if self.prefix is not None:
            self._hit_windows = {m.window_id for _, m in out if isinstance(m, VerifyWindow)}
        return out

    def _prefill(self, start: int, now: float) -> list[Send]:
        """The prompt from `start`, in chunks cut at multiples of `prefill_chunk_tokens`; its
        reply is due by `prefill_timeout` from `now`."""
        prompt = self._prompt
        first_key = self.route.keys[0]
        out: list[Send] = []
        first_mask = self._masks((), (), ())
        for lo, hi in prefill_windows(
            len(prompt), start, self.request.replay_from, self.prefill_chunk_tokens
        ):
            self._prefill_id = self._window_id()
            window = VerifyWindow(
                session=self.session,
                epoch=self.epoch,
                window_id=self._prefill_id,
                base_pos=lo,
                tokens=prompt[lo:hi],
                sampling=self.request.sampling,
                n_draft=0,
                sample=hi == len(prompt),
                mtp_tokens=self.mtp_tokens,
                logprobs=self.request.logprobs if hi == len(prompt) else -1,
                mask=first_mask[1] if hi == len(prompt) else b"",
            )
            out.append(Send(first_key, window))
        self._prefill_start = now
        self._deadline = now + prefill_timeout(len(out), self.reply_timeout_s)
        return out

    def _prefix_missed(self, now: float) -> list[Send]:
        """A stage cannot serve the hit: every stage to epoch 1, and the whole prompt again."""
        self.prefix = None
        self.prefix_missed = True
        self.epoch = max(self.epoch, PREFIX_MISS_EPOCH)
        rollbacks = [Send(key, Rollback(self.session, self.epoch)) for key in self.route.keys]
        return rollbacks + self._prefill(0, now)

    def on_reply(self, reply: VerifyReply | StageError, now: float) -> list[Send]:
        """A reply or error from the route's last stage (replies of older epochs: ignored)."""
        if self._phase in ("new", "done"):
            return []
        if self._to_stream:
            raise RuntimeError("stream tokens_to_stream and call on_streamed first")
        if isinstance(reply, StageError):
            hit_window = reply.window_id in self._hit_windows
            if reply.code == PREFIX_MISS or hit_window:
                # A miss (or an older stage's gap error on a window sent for the hit).
                if self.prefix is not None and self._phase == "prefill":
                    return self._prefix_missed(now)
                if reply.code == PREFIX_MISS or self.prefix_missed:
                    return []  # another stage's answer to the same miss
            text = f"stage error {reply.code}: {reply.message}"
            if reply.code == "overloaded":
                self._fail(StageOverloaded(text, reply.retry_after_s, self._committed))
            self._fail(RouteFailed(text, self._committed))
        self._deadline = now + self.reply_timeout_s
        if reply.epoch != self.epoch:
            return []
        if self._phase == "prefill":
            if reply.window_id != self._prefill_id:
                return []
            self.recorder.prefill(self._prompt_len, now - self._prefill_start)
            self._hit_windows = set()  # every stage served the hit
            self._mtp_draft = list(reply.mtp_draft)
            self._phase = "decode"
            self._decode_start = now
            self._after_reply = False
            self._check_logprobs(reply, 1)
            return self._commit([reply.next_token], reply.next_token, now, reply.logprobs)
        return self._on_verdict(reply, now)

    def on_streamed(self, now: float, *, stop: bool = False) -> list[Send]:
        """The driver streamed `tokens_to_stream`; `stop`: the client wants no more."""
        if not self._to_stream:
            raise RuntimeError("nothing was waiting to be streamed")
        self._to_stream = []
        self._logprobs_to_stream = []
        self._deadline = now + self.reply_timeout_s
        return self._settle(now, stop)

    def on_stage_failed(self, node: bytes, now: float) -> list[Send]:
        """The lane to `node` died: the request fails if its route uses that node."""
        if self._phase in ("new", "done") or node not in self.route.keys:
            return []
        self._fail(RouteFailed("stage node unreachable", self._committed, node))

    def on_timer(self, now: float) -> list[Send]:
        """Time passed: the request fails if a reply is overdue."""
        timer = self.timer
        if timer is None or now < timer:
            return []
        self._fail(RouteFailed(f"no reply within {self.reply_timeout_s} s", self._committed))

    # -- session set-up ------------------------------------------------------------------
    def _open(self, prompt_len: int) -> list[Send]:
        route = self.route
        lookahead = (self.spec.window_max_tokens + 1) * max(1, self.spec.max_pipeline_depth)
        max_positions = prompt_len + self.request.max_tokens + lookahead + 8
        out: list[Send] = []
        for index, stage in enumerate(route.stages):
            last = index == len(route.stages) - 1
            message = OpenSession(
                session=self.session,
                model_id=route.model_id,
                max_positions=max_positions,
                stage_index=index,
                coordinator=self.coordinator_key,
                next_hop=None if last else route.stages[index + 1].node_key,
                wire_dtype=self.wire_dtype,
                mtp_depth=self.mtp_tokens if last else 0,
                layer_start=stage.layer_start,
                layer_end=stage.layer_end,
                quantization=route.quantization,
                prefix_entry=0 if self.prefix is None else self.prefix.entry,
                prefix_positions=0 if self.prefix is None else self.prefix.positions,
            )
            out.append(Send(stage.node_key, message))
        return out

    # -- the decode loop -----------------------------------------------------------------
    def _on_verdict(self, reply: VerifyReply, now: float) -> list[Send]:
        w = self._in_flight.popleft()
        if reply.window_id != w.window_id:
            self._fail(
                RouteFailed(
                    f"reply for window {reply.window_id}, expected {w.window_id}",
                    self._committed,
                )
            )
        timings = reply.stage_timings
        compute = sum(t.compute_s for t in timings)
        queue = sum(t.queue_s for t in timings)
        round_trip = max(0.0, now - w.sent_s - w.draft_s)
        self._idle_since = None if self._in_flight else now
        self._observing_s = 0.0
        # A batched pass is shared by its sessions: the cost model takes this session's share,
        # and the policy multiplies it back by the load (C_L = L·C). The rest of the pass was
        # spent on others' rows, so it counts as waiting, not as network.
        share = sum(t.compute_s / max(1, t.batch_sessions) for t in timings)
        mtp = sum(t.mtp_s for t in timings)
        self.costs.observe(len(w.tokens), round_trip, share, queue + compute - share, mtp)
        if self._observe_load is not None:
            self._observe_load(
                max((t.batch_sessions + t.queued_sessions for t in timings), default=1)
            )
        accepted = reply.accepted_len
        if not 0 <= accepted <= w.n_draft:
            self._fail(
                RouteFailed(f"reply accepts {accepted} of {w.n_draft} drafts", self._committed)
            )
        new = [*w.tokens[1 : 1 + accepted], reply.next_token]
        self._check_logprobs(reply, len(new))
        self.proposer.record(w.n_draft, accepted)
        self.recorder.verdict(
            self.proposer.active,
            w.n_draft,
            accepted,
            len(new),
            network_s=max(0.0, round_trip - compute - queue),
            compute_s=compute,
        )
        self._mtp_draft = list(reply.mtp_draft)
        self._after_reply = True
        self._rejected = bool(self._in_flight) and (
            accepted < w.n_draft or reply.next_token != self._in_flight[0].tokens[0]
        )
        return self._commit(new, reply.next_token, now, reply.logprobs)

    def _check_logprobs(self, reply: VerifyReply, committed: int) -> None:
        expected = committed if self.request.logprobs >= 0 else 0
        if len(reply.logprobs) != expected:
            self._fail(
                RouteFailed(
                    f"reply carries {len(reply.logprobs)} log-probs for {expected}",
                    self._committed,
                )
            )

    def _commit(
        self, tokens: list[int], last: int, now: float, logprobs: Sequence[TokenLogprobs] = ()
    ) -> list[Send]:
        """Add tokens to the log; hold back what follows until the visible ones are streamed."""
        self._last_token = last
        self._eos = last in self.request.eos_ids
        visible = tokens[:-1] if self._eos else tokens
        self._committed.extend(visible)
        if self.request.grammar is not None:
            self.request.grammar.commit(tokens)
        kept = list(logprobs[: len(visible)])
        self._logprobs.extend(kept)
        self.proposer.observe(tokens)
        self._observing_s += self.proposer.last_observe_s
        if visible:
            self._to_stream = list(visible)
            self._logprobs_to_stream = kept
            return []
        return self._settle(now, stop=False)

    def _settle(self, now: float, stop: bool) -> list[Send]:
        """After a commit was streamed: finish, or roll back what it disproved and fill."""
        grammar = self.request.grammar
        complete = grammar is not None and grammar.stopped
        done = self._eos or stop or complete or len(self._committed) >= self.request.max_tokens
        if self._eos or stop or complete:
            self.finish_reason = "stop"
        out: list[Send] = []
        if self._after_reply and self._in_flight:
            if done or self._rejected:
                out.extend(self._rollback())
            else:
                self._mtp_draft = []  # it was for a window that has already left
        if not done:
            out.extend(self._fill(self._plan(), now))
            done = not self._in_flight
        if self._after_reply:
            self.recorder.decode_elapsed(now - self._decode_start)
        if done:
            self._phase = "done"
        return out

    def _plan(self) -> WindowPlan:
        spec = self.spec
        if spec.strategy == "disabled" or spec.window_max_tokens == 0:
            return WindowPlan(0, 1, 1.0, 0.0, 0.0, _PLAIN)
        link = self._link()
        self.proposer.set_link(link)
        if self.mtp_tokens and not self.proposer.wants_mtp:
            # The proposer found that MTP drafts cost more than they save on this route: stop
            # the heads for the rest of the request (the stages skip them from the next window).
            self.mtp_tokens = 0
            self.proposer.stop_mtp()
        if self.proposer.active == "disabled":
            # The proposer already weighed every strategy against plain decoding; none paid.
            reason = self.proposer.reason
            plan = WindowPlan(0, 1, 1.0, 0.0, 0.0, reason)
            self.recorder.policy(plan, "disabled", reason)
            return plan
        if self.mtp_tokens and self.proposer.active in MTP_STRATEGIES:
            link = link.with_mtp_drafts()
        if self.proposer.draft_cost_s > 0:
            link = link.with_draft_cost(self.proposer.draft_cost_s)
        plan = choose(PolicyInputs(link, self.proposer.acceptance()), spec)
        self.recorder.policy(plan, self.proposer.active, self.proposer.reason)
        if plan.width == 0 and spec.strategy != "auto":
            # A fixed strategy keeps probing with its narrowest window, so its acceptance
            # estimate can recover; `auto` is the strategy that is allowed to stop.
            plan = WindowPlan(spec.window_min_tokens, 1, 1.0, 0.0, 0.0, plan.reason)
        return plan

    @property
    def thinks_ahead(self) -> bool:
        """Whether `think_ahead` may run a pass now (`spec.draft_ahead_tokens`, windows out)."""
        return bool(self._ahead) and self._phase == "decode" and bool(self._in_flight)

    def think_ahead(self) -> bool:
        """One pass the proposer runs toward its next proposal while windows are in flight
        (`Proposer.think_ahead`, assuming them accepted); False when there is none to run.
        The driver calls it while it waits for a reply."""
        if not self.thinks_ahead:
            return False
        return self.proposer.think_ahead(self._assumed(), min(self._ahead, self._width + 1))

    def _assumed(self) -> list[int]:
        """Everything in flight assumed right: the oldest window's drafts, then each later
        window's guessed bonus token and its drafts."""
        later = [t for w in list(self._in_flight)[1:] for t in w.tokens]
        return self._in_flight[0].tokens[1:] + later

    def _remaining(self) -> int:
        """Tokens that may still be committed beyond what windows in flight could commit."""
        pending = sum(w.n_draft + 1 for w in self._in_flight)
        return self.request.max_tokens - len(self._committed) - pending

    def _fill(self, plan: WindowPlan, now: float) -> list[Send]:
        out: list[Send] = []
        sent: list[Window] = []
        drafting = 0.0  # the draft model's time in this fill: every window here leaves after it
        depth = max(1, plan.depth)
        self._width = plan.width
        while len(self._in_flight) < depth:
            remaining = self._remaining()
            if remaining <= 0:
                break
            if not self._in_flight:
                base = self._prompt_len + len(self._committed) - 1
                # Even at width 0 the proposer sees the MTP draft, so `auto` keeps scoring
                # MTP strategies while it is not speculating.
                drafts = self.proposer.propose(plan.width, self._mtp_draft)
                clipped = clip_drafts(drafts, remaining)
                kept, mask = self._masks((), (), clipped)
                if kept < 0:
                    break  # the grammar is complete: nothing more to choose
                tokens = [self._last_token, *clipped[:kept]]
            else:
                assumed = self._assumed()
                guess = self.proposer.propose_after(assumed, plan.width + 1)
                if not guess:
                    break  # no guess for the bonus token: wait for the reply instead
                prev = self._in_flight[-1]
                base = prev.base_pos + len(prev.tokens)
                clipped = clip_drafts(guess[1:], remaining)
                kept, mask = self._masks(assumed, guess[:1], clipped)
                if kept < 0:
                    break  # the grammar refuses the guess: wait for the reply instead
                tokens = [guess[0], *clipped[:kept]]
            spent = self.proposer.last_draft_s
            if spent > 0:
                drafting += spent
                self.recorder.draft(spent, len(tokens) - 1, self.proposer.last_recalled)
            window = Window(self._window_id(), base, tokens, len(tokens) - 1, now, mask)
            sent.append(window)
            out.append(self._send_window(window))
        for window in sent:
            window.draft_s = drafting
        return out

    def _masks(
        self, assumed: Sequence[int], head: Sequence[int], drafts: Sequence[int]
    ) -> tuple[int, bytes]:
        """The drafts the grammar allows and the window's masks (`Constraint.window_masks`);
        all drafts and no masks without a grammar; (-1, b"") when no window can be right."""
        grammar = self.request.grammar
        if grammar is None:
            return len(drafts), b""
        found = grammar.window_masks(assumed, head, drafts)
        return (-1, b"") if found is None else found

    def _send_window(self, w: Window) -> Send:
        if self._idle_since is not None and not self._in_flight:
            self.costs.observe_local(w.sent_s - self._idle_since - self._observing_s)
        self._idle_since = None
        message = VerifyWindow(
            session=self.session,
            epoch=self.epoch,
            window_id=w.window_id,
            base_pos=w.base_pos,
            tokens=w.tokens,
            sampling=self.request.sampling,
            n_draft=w.n_draft,
            mtp_tokens=self.mtp_tokens,
            logprobs=self.request.logprobs,
            mask=w.mask,
        )
        self._in_flight.append(w)
        self.recorder.window_sent()
        return Send(self.route.keys[0], message)

    def _rollback(self) -> list[Send]:
        self.recorder.window_stale(len(self._in_flight))
        self._in_flight.clear()
        self.epoch += 1
        return [Send(key, Rollback(self.session, self.epoch)) for key in self.route.keys]

    def _window_id(self) -> int:
        self._next_window_id += 1
        return self._next_window_id

    def _fail(self, error: RouteFailed) -> NoReturn:
        self._phase = "done"
        self._to_stream = []
        raise error
