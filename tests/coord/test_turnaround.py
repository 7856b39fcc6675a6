"""The trio driver around `WindowLoop`, on trio's MockClock against a virtual network.

The coordinator's own turnaround between a reply and its next window is a per-window cost: a
slow stream consumer (or a slow coordinator) makes every window dearer, plain decoding
included, so the policy must see it beside the network. The driver must also turn a dead lane
into `RouteFailed` (with the tokens so far), let every other exception through, fail an
overdue reply on its timer, and close the session on every stage however the request ends.
"""

from __future__ import annotations

import pathlib

import pytest
import trio
import trio.testing

from meshd.coord.coordinator import Coordinator, GenerationRequest, RouteFailed
from meshd.coord.generation import Send
from meshd.model.builtin import builtin_model_dir
from meshd.net.lane_table import PeerUnreachable
from meshd.net.peer_lane import LaneClosedError
from meshd.speculative.config import SpecConfig
from protocol.events import TerminationReason
from protocol.messages import CloseSession, Message, OpenSession, VerifyWindow
from tests.coord.virtual_route import VirtualRoute, load_stages, plain_decode

MODEL: pathlib.Path = builtin_model_dir()
PROMPT = list(range(100, 116))
OWN_KEY = b"c" * 32


class VirtualLanes:
    """The coordinator's sender: messages go into a `VirtualRoute` at the (mock) time they are
    sent; `pump` hands each reply to the coordinator at the time the network says it arrives.
    `fail` makes sends of one message type to one node raise what a lane raises."""

    def __init__(self, net: VirtualRoute) -> None:
        self.net = net
        self.fail: tuple[type[Message], bytes, Exception] | None = None
        self.silent = False  # the stages never answer
        self._wake = trio.Event()

    async def send(self, key: bytes, message: Message, stream: int = 0) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail is not None:
            kind, node, error = self.fail
            if isinstance(message, kind) and key == node:
                raise error
        self.net.deliver([Send(key, message)], trio.current_time())
        self._wake.set()

    async def pump(self, coordinator: Coordinator) -> None:
        while True:
            if not self.net.replies_pending or self.silent:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            at, reply = self.net.next_reply()
            await trio.sleep_until(at)
            coordinator.handle(reply, self.net.keys[-1])


async def generate(
    lanes: VirtualLanes,
    request: GenerationRequest,
    *,
    consumer_s: float = 0.0,
    stop_after: int | None = None,
    lose_after: int | None = None,
) -> tuple[Coordinator, list[int], object]:
    """Run one request through a Coordinator; returns it, the streamed tokens and the result
    (or the exception the request raised)."""
    coordinator = Coordinator(lanes, OWN_KEY, wire_dtype="f32", reply_timeout_s=5.0)
    streamed: list[int] = []

    async def on_tokens(tokens: list[int]) -> bool:
        streamed.extend(tokens)
        await trio.sleep(consumer_s)
        if lose_after is not None and len(streamed) >= lose_after:
            coordinator.peer_lost(lanes.net.keys[1])
        return stop_after is None or len(streamed) < stop_after

    outcome: object
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lanes.pump, coordinator)
        try:
            outcome = await coordinator.generate(lanes.net.route, request, on_tokens)
        except RouteFailed as exc:
            outcome = exc
        nursery.cancel_scope.cancel()
    return coordinator, streamed, outcome


def plain(n: int) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, max_tokens=n, spec=SpecConfig(strategy="disabled"))


def lanes_for(hop_s: float = 0.001) -> VirtualLanes:
    return VirtualLanes(VirtualRoute(load_stages(MODEL, [(0, 3), (3, 6)]), hop_s=hop_s))


async def test_a_slow_consumer_counts_as_fixed_cost_per_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rtts = []
    for consumer_s in (0.0, 0.03):
        lanes = lanes_for()
        coordinator, streamed, _ = await generate(lanes, plain(12), consumer_s=consumer_s)
        assert streamed == plain_decode(MODEL, PROMPT, 12)
        rtts.append(coordinator.link_model(lanes.net.route).rtt_s)
    fast, slow = rtts
    assert fast == pytest.approx(0.002)  # two hops of 1 ms, nothing else
    assert slow == pytest.approx(fast + 0.03)  # 30 ms of streaming before every window


async def test_every_way_a_request_ends_closes_it_on_every_stage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lanes = lanes_for()
    _, streamed, result = await generate(lanes, plain(6))
    closed = [k for k, m in lanes.net.sent if isinstance(m, CloseSession)]
    assert sorted(closed) == sorted(lanes.net.keys)  # in parallel: any order
    assert not any(lanes.net.open.values())

    lanes = lanes_for(hop_s=0.02)
    spec = SpecConfig(strategy="ngram-simple", window_max_tokens=4)
    request = GenerationRequest(prompt=PROMPT, max_tokens=30, spec=spec)
    _, streamed, result = await generate(lanes, request, stop_after=3)
    assert getattr(result, "finish_reason", None) == "stop" and len(streamed) >= 3
    assert not any(lanes.net.open.values())
    # The stop came before the next window: nothing was sent after the streamed batch but
    # rollbacks and closes.
    last = max(i for i, (_, m) in enumerate(lanes.net.sent) if isinstance(m, VerifyWindow))
    assert all(not isinstance(m, VerifyWindow) for _, m in lanes.net.sent[last + 1 :])


@pytest.mark.parametrize(
    "error",
    [
        PeerUnreachable("no lane"),
        LaneClosedError(TerminationReason.PEER_DEAD),
        LaneClosedError(TerminationReason.CLOSED_LOCALLY, "the lane is closing"),
    ],
    ids=["unreachable", "dead", "closing"],
)
async def test_a_dead_lane_fails_the_route_with_the_tokens_so_far(
    autojump_clock: trio.testing.MockClock, error: Exception
) -> None:
    lanes = lanes_for()
    lanes.fail = (OpenSession, lanes.net.keys[1], error)
    _, _, outcome = await generate(lanes, plain(6))
    assert isinstance(outcome, RouteFailed) and outcome.node_key == lanes.net.keys[1]
    assert outcome.committed == [] and "cannot reach stage" in str(outcome)
    # The stage that did open the session has it closed again.
    assert not lanes.net.open[lanes.net.keys[0]]


async def test_a_bug_in_a_send_is_not_taken_for_a_dead_route(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lanes = lanes_for()
    lanes.fail = (VerifyWindow, lanes.net.keys[0], ValueError("a bug"))
    with pytest.raises(ExceptionGroup) as raised:  # from the helper's nursery
        await generate(lanes, plain(6))
    assert raised.group_contains(ValueError, match="a bug", depth=1)
    assert not raised.group_contains(RouteFailed)


async def test_a_lost_stage_fails_the_route_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lanes = lanes_for()
    _, streamed, outcome = await generate(lanes, plain(20), lose_after=4)
    assert isinstance(outcome, RouteFailed) and "unreachable" in str(outcome)
    assert outcome.node_key == lanes.net.keys[1]
    assert outcome.committed == streamed == plain_decode(MODEL, PROMPT, 20)[: len(streamed)]


async def test_an_overdue_reply_fails_after_the_reply_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lanes = lanes_for()
    lanes.silent = True
    started = trio.current_time()
    _, streamed, outcome = await generate(lanes, plain(6))
    assert isinstance(outcome, RouteFailed) and "no reply within 5.0 s" in str(outcome)
    assert trio.current_time() - started == pytest.approx(5.0)
    assert streamed == []
