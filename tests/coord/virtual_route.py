"""A route's stages behind a virtual network: a test double of the network, not of the stages.

Each stage is a real `StageModel` slice of the built-in model; the last stage verifies with the
real `verify` and drafts with the real `MtpDrafter`, as `StageHost` does, so replies carry the
tokens the model says. What is scripted is time: a window reaches the route `hop_s` after it
is sent, the stages compute it in arrival order (`compute_s` per stage, one window at a time),
and the reply reaches the coordinator `hop_s` later. A window is computed as soon as it
arrives, so a rollback sent after it is too late to save its compute: its reply still comes,
of an older epoch, as on a real high-latency route.
"""

from __future__ import annotations

import heapq
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from meshd.bench.single_node import generate
from meshd.coord.generation import Send
from meshd.coord.window_loop import WindowLoop
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.plan.route import Route, RouteStage
from meshd.stage.mtp_drafter import MtpDrafter
from meshd.stage.verdict import window_verdict
from protocol.messages import (
    CloseSession,
    OpenSession,
    Rollback,
    StageTiming,
    VerifyReply,
    VerifyWindow,
)


def load_stages(model_dir: pathlib.Path, splits: Sequence[tuple[int, int]]) -> list[StageModel]:
    """Fresh fp32 stage slices of the checkpoint (each test gets its own KV)."""
    checkpoint = Checkpoint.open(model_dir)
    return [StageModel.load(checkpoint, lo, hi, device="cpu") for lo, hi in splits]


def plain_decode(model_dir: pathlib.Path, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy single-node decoding: what any window loop must reproduce."""
    layers = Checkpoint.open(model_dir).config.num_layers
    stage = StageModel.load(Checkpoint.open(model_dir), 0, layers, device="cpu")
    return list(generate([stage], prompt, n).tokens)


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    reply: VerifyReply = field(compare=False)


class VirtualRoute:
    """Stages of one route, reached over a network whose delays the test sets."""

    def __init__(
        self,
        stages: Sequence[StageModel],
        *,
        hop_s: float = 0.001,
        compute_s: float = 0.002,
        eos_ids: frozenset[int] = frozenset(),
        name: bytes = b"n",
    ) -> None:
        self.stages = list(stages)
        self.keys = [name + bytes([i]) * 31 for i in range(len(stages))]
        self.route = Route(
            self.stages[0].model_id,
            tuple(
                RouteStage(key, s.layer_start, s.layer_end)
                for key, s in zip(self.keys, self.stages, strict=True)
            ),
        )
        self.hop_s = hop_s
        self.compute_s = compute_s
        self.eos_ids = eos_ids
        last = self.stages[-1]
        self.drafter = MtpDrafter(last) if last.mtp else None
        self.sent: list[Send] = []  # every message the coordinator sent, in order
        self.open: dict[bytes, set[str]] = {key: set() for key in self.keys}
        self.epoch: dict[str, int] = {}
        self.mtp_depth: dict[str, int] = {}
        self.computed = 0
        self.stale_dropped = 0
        self._busy_until = 0.0
        self._due: list[_Due] = []
        self._seq = 0

    @property
    def replies_pending(self) -> int:
        """Replies on their way to the coordinator."""
        return len(self._due)

    def deliver(self, sends: Iterable[Send], now: float) -> None:
        """The coordinator sends `sends` at `now`."""
        for send in sends:
            self.sent.append(send)
            key, message = send
            if key not in self.open:
                raise AssertionError(f"message to a node off the route: {message!r}")
            if isinstance(message, OpenSession):
                stage = self.stages[message.stage_index]
                assert key == self.keys[message.stage_index]
                assert (message.layer_start, message.layer_end) == (
                    stage.layer_start,
                    stage.layer_end,
                )
                stage.open_session(message.session, message.max_positions)
                self.open[key].add(message.session)
                self.epoch.setdefault(message.session, 0)
                if stage.is_last and self.drafter is not None and message.mtp_depth > 0:
                    self.drafter.open(message.session)
                    self.mtp_depth[message.session] = message.mtp_depth
            elif isinstance(message, Rollback):
                if message.session in self.open[key]:
                    self.epoch[message.session] = max(self.epoch[message.session], message.epoch)
            elif isinstance(message, CloseSession):
                self.open[key].discard(message.session)
            elif isinstance(message, VerifyWindow):
                assert key == self.keys[0], "windows enter the route at its first stage"
                self._arrive(message, now + self.hop_s)
            else:
                raise AssertionError(f"unexpected message {message!r}")

    def next_reply(self) -> tuple[float, VerifyReply]:
        """The next reply to reach the coordinator, and when it does."""
        if not self._due:
            raise AssertionError("the coordinator waits for a reply that no window will bring")
        due = heapq.heappop(self._due)
        return due.at, due.reply

    def _arrive(self, w: VerifyWindow, at: float) -> None:
        if not all(w.session in self.open[key] for key in self.keys):
            raise AssertionError("a window for a session not open on every stage")
        if w.epoch < self.epoch[w.session]:
            self.stale_dropped += 1  # the rollback arrived first: dropped before compute
            return
        self.epoch[w.session] = w.epoch
        start = max(at, self._busy_until)
        self._busy_until = start + self.compute_s * len(self.stages)
        self.computed += 1
        reply = self._compute(w)
        if reply is not None:
            self._seq += 1
            heapq.heappush(self._due, _Due(self._busy_until + self.hop_s, self._seq, reply))

    def _compute(self, w: VerifyWindow) -> VerifyReply | None:
        x: torch.Tensor = torch.tensor(w.tokens, dtype=torch.int64)
        out = None
        for stage in self.stages:
            out = stage.forward(w.session, w.base_pos, x, logits_last_n=w.n_draft + 1)
            x = out.hidden
        assert out is not None
        drafting = self.drafter is not None and self.mtp_depth.get(w.session, 0) > 0
        drafting = drafting and w.mtp_tokens > 0
        result, _ = window_verdict(w, out, self.eos_ids, self.drafter if drafting else None)
        if result is None:
            return None
        accepted_len, next_token, drafts, logprobs = result
        timings = [StageTiming(i, 0.0, self.compute_s) for i in range(len(self.stages))]
        return VerifyReply(
            session=w.session,
            window_id=w.window_id,
            epoch=w.epoch,
            accepted_len=accepted_len,
            next_token=next_token,
            mtp_draft=drafts,
            stage_timings=timings,
            logprobs=logprobs,
        )


@dataclass
class Run:
    """What a driven loop did: tokens streamed, the clock at the end, the most windows that
    were in flight at once, and the replies it ignored as stale."""

    streamed: list[int] = field(default_factory=list)
    now: float = 0.0
    most_in_flight: int = 0
    stale_replies: int = 0


def drive(
    loop: WindowLoop,
    net: VirtualRoute,
    prompt: Sequence[int],
    *,
    now: float = 0.0,
    stream_s: float = 0.0,
    stop_after: int | None = None,
) -> Run:
    """Do what the trio driver does, on a virtual clock: feed each reply at the time it
    arrives, stream committed tokens (taking `stream_s`), send what the loop returns.
    `stop_after`: the client asks to stop once it has that many tokens."""
    run = Run(now=now)
    net.deliver(loop.start(prompt, run.now), run.now)
    while not loop.done:
        at, reply = net.next_reply()
        run.now = max(run.now, at)
        epoch = loop.epoch
        net.deliver(loop.on_reply(reply, run.now), run.now)
        if reply.epoch != epoch:
            run.stale_replies += 1
        tokens = loop.tokens_to_stream
        if tokens:
            run.streamed.extend(tokens)
            run.now += stream_s
            stop = stop_after is not None and len(run.streamed) >= stop_after
            net.deliver(loop.on_streamed(run.now, stop=stop), run.now)
        run.most_in_flight = max(run.most_in_flight, loop.windows_in_flight)
    return run
