"""A hypothesis state machine over two lanes and a hostile network between them.

Rules send messages, deliver / drop / duplicate / reorder datagrams, move time, request key
updates and close. Invariants: every stream delivers a prefix of what was sent (nothing twice,
nothing out of order, nothing altered), only allowed exceptions escape, and timers are never
in the past after handle_timer. A final `settle` checks that a healthy network then delivers
everything still owed.
"""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshd.sim.lane_pair import pair
from protocol.config import LaneConfig
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.lane import Lane, LaneTerminated, MessageReceived

CONFIG = LaneConfig(key_rotation_after_packets=6, old_key_retention_s=0.5)
SIDES = st.sampled_from(["a", "b"])


class LanePair(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        net, lane_a, lane_b = pair(config_a=CONFIG, config_b=CONFIG)
        self.now = net.now
        self.lanes: dict[str, Lane] = {"a": lane_a, "b": lane_b}
        self.sent: dict[str, dict[int, list[bytes]]] = {"a": {}, "b": {}}
        self.got: dict[str, dict[int, list[bytes]]] = {"a": {}, "b": {}}
        self.wire: list[tuple[str, bytes]] = []  # (destination side, datagram), in flight
        self.ended: dict[str, LaneTerminated] = {}
        self.closed_by_rule = False
        self.counter = 0

    def other(self, side: str) -> str:
        return "b" if side == "a" else "a"

    def pump(self) -> None:
        """Collect datagrams and events from both lanes (no delivery: rules decide that)."""
        for side, lane in self.lanes.items():
            for data, _ in lane.datagrams_to_send(self.now):
                self.wire.append((self.other(side), data))
            while (event := lane.next_event()) is not None:
                if isinstance(event, MessageReceived):
                    self.got[side].setdefault(event.stream_id, []).append(event.data)
                elif isinstance(event, LaneTerminated):
                    assert side not in self.ended, "terminated twice"
                    self.ended[side] = event

    def deliver(self, index: int) -> None:
        side, data = self.wire.pop(index % len(self.wire))
        with contextlib.suppress(RemoteProtocolError):
            self.lanes[side].receive_datagram(data, self.other(side), self.now)

    @rule(side=SIDES, stream=st.integers(0, 3), size=st.sampled_from([0, 1, 100, 3000, 70000]))
    def send(self, side: str, stream: int, size: int) -> None:
        self.counter += 1
        data = self.counter.to_bytes(4, "big") * (size // 4) + b"\x01" * (size % 4)
        try:
            self.lanes[side].send_message(stream, data)
        except LocalProtocolError:
            assert not self.lanes[side].is_established
            return
        self.sent[side].setdefault(stream, []).append(data)
        self.pump()

    @precondition(lambda self: self.wire)
    @rule(index=st.integers(0, 1000))
    def deliver_one(self, index: int) -> None:
        self.deliver(index)
        self.pump()

    @precondition(lambda self: self.wire)
    @rule(index=st.integers(0, 1000))
    def drop_one(self, index: int) -> None:
        self.wire.pop(index % len(self.wire))

    @precondition(lambda self: self.wire)
    @rule(index=st.integers(0, 1000))
    def duplicate_one(self, index: int) -> None:
        self.wire.append(self.wire[index % len(self.wire)])

    @precondition(lambda self: self.wire)
    @rule()
    def deliver_all_reversed(self) -> None:
        while self.wire:
            self.deliver(len(self.wire) - 1)
        self.pump()

    @rule(dt=st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.run_timers()
        self.pump()

    @rule(side=SIDES)
    def request_key_update(self, side: str) -> None:
        self.lanes[side].request_key_update()
        self.pump()

    @rule(side=SIDES)
    def close(self, side: str) -> None:
        self.closed_by_rule = True
        self.lanes[side].close("rule")
        self.pump()

    def run_timers(self) -> None:
        for lane in self.lanes.values():
            timer = lane.get_timer()
            if timer is not None and timer <= self.now:
                lane.handle_timer(self.now)
                after = lane.get_timer()
                assert after is None or after > self.now, "timer in the past after handle_timer"

    @invariant()
    def delivered_a_prefix_of_what_was_sent(self) -> None:
        for side in ("a", "b"):
            sent = self.sent[self.other(side)]
            for stream, messages in self.got[side].items():
                assert messages == sent.get(stream, [])[: len(messages)]

    @rule()
    def settle(self) -> None:
        """A healthy network from here on: everything owed arrives unless a lane ended."""
        for _ in range(20_000):
            if self.wire:
                self.deliver(0)
                self.pump()
                continue
            timers = [t for lane in self.lanes.values() if (t := lane.get_timer()) is not None]
            if not timers or all(lane.pending_send_bytes == 0 for lane in self.lanes.values()):
                break
            self.now = max(self.now, min(timers))
            self.run_timers()
            self.pump()
        if not self.ended:
            for side in ("a", "b"):
                owed = self.sent[self.other(side)]
                got = self.got[side]
                assert {s: m for s, m in got.items() if m} == {s: m for s, m in owed.items() if m}
        elif not self.closed_by_rule:
            # Only silence long enough to be a dead peer may end a lane on its own.
            assert all(e.reason.value == "peer_dead" for e in self.ended.values())


LanePair.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLanePair = LanePair.TestCase
