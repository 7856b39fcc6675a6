"""The lane end to end on a virtual clock: handshake, delivery under loss, liveness, close."""

from __future__ import annotations

import random

import pytest

from meshd.sim.lane_pair import CAPABILITIES, PSK, LinkProfile, Network, pair
from protocol.config import LaneConfig
from protocol.datagram import KIND_DATA, KIND_INITIATION
from protocol.errors import LocalProtocolError
from protocol.lane import (
    Lane,
    LaneEstablished,
    LaneTerminated,
    MessageReceived,
    TerminationReason,
)
from protocol.packet import parse_header
from protocol.streams import ARTIFACT_STREAM, GOSSIP_STREAM, PIPELINE_STREAM


def send_batch(lane: Lane, rng: random.Random, count: int) -> dict[int, list[bytes]]:
    """Queue `count` messages of 1 B .. 300 KiB on four streams; returns them by stream."""
    sent: dict[int, list[bytes]] = {}
    for _ in range(count):
        stream_id = rng.randrange(4)
        data = rng.randbytes(rng.choice([1, 17, 1400, 5000, 65536, 300_000]))
        lane.send_message(stream_id, data)
        sent.setdefault(stream_id, []).append(data)
    return sent


def by_stream(messages: list[tuple[int, int, bytes]]) -> dict[int, list[bytes]]:
    got: dict[int, list[bytes]] = {}
    for _, stream_id, data in messages:
        got.setdefault(stream_id, []).append(data)
    return got


# --- handshake --------------------------------------------------------------------------


def test_both_sides_report_the_established_lane() -> None:
    net, lane_a, lane_b = pair()
    (event_a,) = [e for _, e in net.nodes["a"].events if isinstance(e, LaneEstablished)]
    (event_b,) = [e for _, e in net.nodes["b"].events if isinstance(e, LaneEstablished)]
    assert event_a.remote_static == net.nodes["b"].static_public
    assert event_b.remote_static == net.nodes["a"].static_public
    assert event_a.version == event_b.version == 1
    assert event_a.capabilities == event_b.capabilities == CAPABILITIES
    assert lane_a.remote_lane_id == lane_b.local_lane_id
    assert lane_b.remote_lane_id == lane_a.local_lane_id


def test_initiation_is_retried_with_backoff_then_times_out() -> None:
    net = Network()
    net.add_node("a")
    net.add_node("b")
    sent_at: list[float] = []
    net.tap = lambda src, dst, data: sent_at.append(net.now) if data[0] == KIND_INITIATION else None
    net.blackholed.add("a")
    lane = net.connect("a", "b")
    net.run(until=10.0)
    assert sent_at == pytest.approx([0.0, 0.25, 0.75, 1.75, 2.75])
    (ended,) = net.terminations("a")
    assert ended.reason is TerminationReason.HANDSHAKE_TIMEOUT
    assert lane.is_terminated and lane.get_timer() is None


def test_a_lost_initiation_is_recovered_by_a_retry() -> None:
    net = Network()
    net.add_node("a")
    net.add_node("b")
    initiations = 0

    def drop_first(src: str, dst: str, data: bytes) -> bool:
        nonlocal initiations
        if data[0] == KIND_INITIATION:
            initiations += 1
            return initiations == 1
        return False

    net.drop_if = drop_first
    lane = net.connect("a", "b")
    net.run(until=5.0, stop=lambda: net.established_lane("b") is not None)
    assert lane.is_established and initiations == 2
    assert 0.25 <= net.now < 0.3


def test_version_refusal_ends_the_lane_naming_the_peer_versions() -> None:
    net = Network()
    net.add_node("a")
    b = net.add_node("b")
    b.responder = type(b.responder)(
        static_private=b.static_private,
        psk=PSK,
        admit=lambda _key: True,
        versions=(7, 9),
        capabilities=(),
        max_message_bytes=1000,
    )
    net.connect("a", "b")
    net.run(until=5.0)
    (ended,) = net.terminations("a")
    assert ended.reason is TerminationReason.REFUSED
    assert "[7, 9]" in ended.detail


def test_unconfirmed_responder_lane_times_out_quietly() -> None:
    net = Network()
    net.add_node("a")
    net.add_node("b")
    from_b: list[bytes] = []
    net.tap = lambda src, dst, data: from_b.append(data) if src == "b" else None
    # Everything a sends after its INITIATION is lost, so b never sees authenticated DATA.
    net.drop_if = lambda src, dst, data: src == "a" and data[0] == KIND_DATA
    net.connect("a", "b")
    net.run(until=1.0)
    (lane_b,) = net.nodes["b"].lanes.values()
    assert not lane_b.is_established and len(from_b) == 1  # the RESPONSE, nothing else
    net.run(until=3.5)
    assert [e.reason for e in net.terminations("b")] == [TerminationReason.HANDSHAKE_TIMEOUT]
    assert not any(isinstance(e, LaneEstablished) for _, e in net.nodes["b"].events)
    assert len(from_b) == 1


# --- delivery ---------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [0.0, 0.01, 0.05, 0.20])
def test_messages_arrive_once_in_order_and_intact_under_loss(loss: float) -> None:
    link = LinkProfile(delay_s=0.002, jitter_s=0.002, loss=loss, duplicate=0.05, reorder=0.05)
    net, lane_a, lane_b = pair(seed=int(loss * 100) + 1, link=link)
    rng = random.Random(42)
    sent_ab = send_batch(lane_a, rng, 40)
    sent_ba = send_batch(lane_b, rng, 20)
    net.run(
        until=net.now + 60.0,
        stop=lambda: len(net.messages("b")) == 40 and len(net.messages("a")) == 20,
    )
    assert by_stream(net.messages("b")) == sent_ab
    assert by_stream(net.messages("a")) == sent_ba
    assert net.terminations("a") == net.terminations("b") == []
    net.run(until=net.now + 2.0)  # nothing is delivered twice later either
    assert len(net.messages("b")) == 40 and len(net.messages("a")) == 20
    assert lane_a.pending_send_bytes == lane_b.pending_send_bytes == 0
    if loss >= 0.05:
        assert lane_a.stats.packets_lost > 0


def test_a_clean_path_loses_nothing_and_is_not_throttled() -> None:
    net, lane_a, _ = pair(link=LinkProfile(delay_s=0.0005))
    payload = bytes(8 * 1024 * 1024)
    lane_a.send_message(0, payload)
    start = net.now
    net.run(until=start + 10.0, stop=lambda: len(net.messages("b")) == 1)
    assert net.messages("b")[0][2] == payload
    stats = lane_a.stats
    assert stats.packets_lost == 0 and stats.max_datagram_bytes == 65000
    # 8 MiB over a 1 ms RTT path: slow start gets there in a handful of round trips.
    assert net.now - start < 0.025
    assert stats.cwnd_bytes > 4 * 1024 * 1024  # grew from 10 datagrams, never cut


def test_messages_larger_than_the_flow_control_windows_still_flow() -> None:
    small = LaneConfig(initial_max_data_bytes=1 << 20, initial_max_stream_data_bytes=1 << 18)
    net, lane_a, _ = pair(config_a=small, config_b=small)
    payload = random.Random(1).randbytes(3 * 1024 * 1024)
    lane_a.send_message(5, payload)
    net.run(until=net.now + 10.0, stop=lambda: len(net.messages("b")) == 1)
    assert net.messages("b") == [(net.established_lane("b").local_lane_id, 5, payload)]  # type: ignore[union-attr]


def test_held_bulk_streams_wait_while_the_other_streams_flow() -> None:
    # A node computing a window holds bulk (a weight transfer) on its lanes: the transfer's
    # bytes wait while gossip and pipeline messages go at once; released, it completes.
    net, lane_a, _ = pair(link=LinkProfile(delay_s=0.0005, loss=0.02), seed=3)
    net.run(until=net.now + 1.0)  # path MTU probing is over
    lane_b_id = net.established_lane("b").local_lane_id  # type: ignore[union-attr]
    lane_a.hold_bulk(True)
    assert lane_a.bulk_held
    sent_before = lane_a.stats.bytes_sent
    chunk = random.Random(2).randbytes(2 * 1024 * 1024)
    window = b"w" * 65536
    lane_a.send_message(ARTIFACT_STREAM, chunk)
    lane_a.send_message(PIPELINE_STREAM, window)
    lane_a.send_message(GOSSIP_STREAM, b"g" * 300)
    net.run(until=net.now + 5.0)  # longer than a lane's idle timeouts: it stays up
    assert sorted((s, d) for _, s, d in net.messages("b")) == [
        (GOSSIP_STREAM, b"g" * 300),
        (PIPELINE_STREAM, window),
    ]
    # While held, a sent those two (and any retransmission of them), ACKs and pings.
    assert lane_a.stats.bytes_sent - sent_before < 3 * 65536
    assert lane_a.pending_send_bytes >= len(chunk)
    assert net.terminations("a") == net.terminations("b") == []
    lane_a.hold_bulk(False)
    net.run(until=net.now + 5.0, stop=lambda: len(net.messages("b")) == 3)
    assert net.messages("b")[2] == (lane_b_id, ARTIFACT_STREAM, chunk)
    net.run(until=net.now + 1.0)
    assert lane_a.pending_send_bytes == 0


def test_replayed_datagram_is_dropped_and_counted() -> None:
    net, lane_a, lane_b = pair()
    captured: list[bytes] = []
    net.tap = lambda src, dst, data: captured.append(data) if src == "a" else None
    lane_a.send_message(1, b"pay once")
    net.run(until=net.now + 0.5)
    assert [m[2] for m in net.messages("b")] == [b"pay once"]
    replayed_before = lane_b.stats.packets_replayed
    replay = list(captured)
    for data in replay:
        net.deliver("b", data, "a")
    assert lane_b.stats.packets_replayed == replayed_before + len(replay)
    net.run(until=net.now + 0.5)
    assert [m[2] for m in net.messages("b")] == [b"pay once"]
    assert lane_b.is_established


def test_message_size_limit_is_negotiated_and_enforced_locally() -> None:
    net, lane_a, lane_b = pair(config_b=LaneConfig(max_message_bytes=1000))
    assert lane_a.max_message_bytes == lane_b.max_message_bytes == 1000
    lane_a.send_message(0, bytes(1000))
    with pytest.raises(LocalProtocolError, match="exceeds"):
        lane_a.send_message(0, bytes(1001))
    with pytest.raises(LocalProtocolError, match="stream id"):
        lane_a.send_message(1 << 20, b"x")
    net.run(until=net.now + 0.5)
    assert len(net.messages("b")) == 1


def test_oversized_message_from_the_peer_closes_the_lane_with_a_reason() -> None:
    net, lane_a, _lane_b = pair(config_b=LaneConfig(max_message_bytes=1000))
    # Play a peer that ignores the negotiated limit: lift it on a's data path only.
    lane_a._transport.max_message_bytes = 10**6  # type: ignore[union-attr]
    lane_a.send_message(0, bytes(5000))
    net.run(until=net.now + 1.0)
    (ended_b,) = net.terminations("b")
    assert ended_b.reason is TerminationReason.PROTOCOL_ERROR and "exceeds 1000" in ended_b.detail
    (ended_a,) = net.terminations("a")
    assert ended_a.reason is TerminationReason.CLOSED_BY_PEER and "exceeds 1000" in ended_a.detail
    assert net.messages("b") == []


def test_sending_is_refused_once_the_lane_is_closing() -> None:
    _, lane_a, _ = pair()
    lane_a.close("done")
    with pytest.raises(LocalProtocolError):
        lane_a.send_message(0, b"late")


# --- liveness, close, keys, path --------------------------------------------------------


def test_an_idle_lane_stays_up_on_pings() -> None:
    net, lane_a, lane_b = pair()
    net.run(until=net.now + 1.0)  # let PMTU probing finish
    sent_before = lane_a.stats.packets_sent + lane_b.stats.packets_sent
    net.run(until=net.now + 10.0)
    assert lane_a.is_established and lane_b.is_established
    assert net.terminations("a") == net.terminations("b") == []
    # A PING and its ACK per ping_interval_s, from one side or (when both idle timers fall
    # due at once on this jitter-free link) from both: 80 to 160 packets in 10 s.
    sent = lane_a.stats.packets_sent + lane_b.stats.packets_sent - sent_before
    assert 76 <= sent <= 164


@pytest.mark.parametrize("dead_after_s", [1.5, 0.5])
def test_a_silent_peer_is_declared_dead_on_time(dead_after_s: float) -> None:
    config = LaneConfig(dead_after_s=dead_after_s, ping_interval_s=min(0.25, dead_after_s / 3))
    net, lane_a, _ = pair(config_a=config, config_b=config)
    last_from_b = [net.now]

    def note(src: str, dst: str, data: bytes) -> bool:
        if src == "b":
            last_from_b.append(net.now)  # only datagrams that actually leave b
        return False

    net.drop_if = note
    lane_a.send_message(0, b"still there?")
    net.run(until=net.now + 0.3)
    net.blackholed.add("b")
    net.run(until=net.now + 5.0, stop=lambda: bool(net.terminations("a")))
    (ended,) = net.terminations("a")
    assert ended.reason is TerminationReason.PEER_DEAD
    silence = net.now - (last_from_b[-1] + LinkProfile().delay_s)
    assert dead_after_s <= silence <= dead_after_s + 0.001


def test_graceful_close_reaches_the_other_side_even_under_loss() -> None:
    net, lane_a, _ = pair(seed=3, link=LinkProfile(loss=0.2, delay_s=0.002))
    lane_a.close("maintenance")
    net.run(until=net.now + 3.0)
    (ended_a,) = net.terminations("a")
    (ended_b,) = net.terminations("b")
    assert ended_a.reason is TerminationReason.CLOSED_LOCALLY
    assert (ended_b.reason, ended_b.detail) == (TerminationReason.CLOSED_BY_PEER, "maintenance")


def test_close_to_a_dead_peer_still_ends_in_bounded_time() -> None:
    net, lane_a, _ = pair()
    net.blackholed.add("b")
    lane_a.close("bye")
    net.run(until=net.now + 2.0)
    assert [e.reason for e in net.terminations("a")] == [TerminationReason.CLOSED_LOCALLY]


def test_keys_rotate_often_without_losing_a_message() -> None:
    config = LaneConfig(key_rotation_after_packets=8, old_key_retention_s=0.2)
    link = LinkProfile(delay_s=0.002, jitter_s=0.003, loss=0.05, reorder=0.1)
    net, lane_a, lane_b = pair(seed=9, link=link, config_a=config, config_b=config)
    rng = random.Random(3)
    sent = send_batch(lane_a, rng, 30)
    back = send_batch(lane_b, rng, 10)
    net.run(
        until=net.now + 60.0,
        stop=lambda: len(net.messages("b")) == 30 and len(net.messages("a")) == 10,
    )
    assert by_stream(net.messages("b")) == sent and by_stream(net.messages("a")) == back
    assert lane_a.stats.key_updates >= 5 and lane_b.stats.key_updates >= 5
    assert abs(lane_a.stats.key_updates - lane_b.stats.key_updates) <= 1


def test_keys_rotate_on_time_and_on_request() -> None:
    config = LaneConfig(key_rotation_after_s=1.0)
    net, lane_a, lane_b = pair(config_a=config, config_b=config)
    net.run(until=net.now + 3.2)
    assert lane_a.stats.key_updates >= 2 and lane_a.is_established
    before = lane_b.stats.key_updates
    assert lane_a.stats.key_updates == before
    lane_b.request_key_update()
    lane_b.send_message(0, b"x")
    net.run(until=net.now + 0.1)
    assert lane_b.stats.key_updates == lane_a.stats.key_updates == before + 1  # a followed
    assert [m[2] for m in net.messages("a")] == [b"x"]


def test_path_mtu_rises_to_what_the_path_carries_and_probe_loss_is_not_congestion() -> None:
    net, lane_a, _lane_b = pair(link=LinkProfile(mtu_bytes=9000))
    net.run(until=net.now + 2.0)
    stats = lane_a.stats
    assert stats.max_datagram_bytes == 8192
    assert stats.pmtu_probes_lost == 3  # 16384 tried three times, then the search stops
    assert stats.packets_lost == 0
    lane_a.send_message(0, bytes(100_000))
    net.run(until=net.now + 1.0)
    assert len(net.messages("b")) == 1


def test_pmtu_probing_can_be_turned_off() -> None:
    config = LaneConfig(pmtu_probing=False, max_datagram_bytes=1400)
    net, lane_a, _ = pair(config_a=config)
    sizes: list[int] = []
    net.tap = lambda src, dst, data: sizes.append(len(data)) if src == "a" else None
    lane_a.send_message(0, bytes(50_000))
    net.run(until=net.now + 1.0)
    assert max(sizes) <= 1400 and lane_a.stats.pmtu_probes_sent == 0


def test_lane_follows_its_peer_to_a_new_address() -> None:
    net, lane_a, lane_b = pair()
    lane_b.send_message(0, b"from elsewhere")
    (data, _), *_ = lane_b.datagrams_to_send(net.now)
    lane_a.receive_datagram(data, "b-after-nat-rebinding", net.now)
    assert lane_a.addr == "b-after-nat-rebinding"
    assert parse_header(data)[1] == lane_a.local_lane_id


def test_config_rejects_nonsense() -> None:
    with pytest.raises(LocalProtocolError, match="dead_after_s"):
        LaneConfig(dead_after_s=0.0)
    with pytest.raises(LocalProtocolError, match="ping_interval_s"):
        LaneConfig(ping_interval_s=2.0, dead_after_s=1.5)
    with pytest.raises(LocalProtocolError, match="max_datagram_bytes"):
        LaneConfig(max_datagram_bytes=100)
    with pytest.raises(LocalProtocolError, match="floor"):
        LaneConfig(initial_max_data_bytes=4096)
    assert LaneConfig(max_datagram_bytes_ceiling=20000).probe_sizes() == (8192, 16384, 20000)
    assert LaneConfig(pmtu_probing=False).probe_sizes() == ()


def test_events_and_datagrams_after_termination_are_inert() -> None:
    net, lane_a, lane_b = pair()
    lane_a.close()
    net.run(until=net.now + 1.0)
    assert lane_b.is_terminated and lane_b.get_timer() is None
    lane_b.receive_datagram(b"\x04" + bytes(40), "a", net.now)  # dropped silently
    assert lane_b.datagrams_to_send(net.now) == []
    assert not any(isinstance(e, MessageReceived) for _, e in net.nodes["b"].events)


def test_closing_during_the_handshake_ends_at_once_and_sends_nothing() -> None:
    net = Network()
    net.add_node("a")
    net.add_node("b")
    lane = net.connect("a", "b")
    lane.close("changed my mind")
    assert lane.datagrams_to_send(net.now) == []
    assert lane.next_event() == LaneTerminated(TerminationReason.CLOSED_LOCALLY, "changed my mind")
    assert lane.stats.packets_sent == 0 and lane.get_timer() is None


def test_one_node_holds_lanes_to_two_peers_at_once() -> None:
    net = Network(seed=4, link=LinkProfile(loss=0.05, delay_s=0.003))
    for name in "abc":
        net.add_node(name)
    to_b, to_c = net.connect("a", "b"), net.connect("a", "c")
    net.run(until=5.0, stop=lambda: to_b.is_established and to_c.is_established)
    to_b.send_message(0, b"for b")
    to_c.send_message(0, b"for c")
    net.run(until=net.now + 2.0)
    assert [m[2] for m in net.messages("b")] == [b"for b"]
    assert [m[2] for m in net.messages("c")] == [b"for c"]
    assert to_b.remote_static == net.nodes["b"].static_public


def test_a_peer_that_ignores_flow_control_is_cut_off() -> None:
    floor = LaneConfig(initial_max_data_bytes=1 << 20, initial_max_stream_data_bytes=1 << 18)
    net, lane_a, _ = pair(config_b=floor)
    net.run(until=net.now + 0.1)  # big datagrams and a big window on a's side
    # Play a peer that ignores the credit b granted: lift a's view of it.
    transport = lane_a._transport
    assert transport is not None
    transport._peer_max_data = transport._peer_stream_default = 1 << 40
    # Lose the first data packet: b cannot consume past the hole, so its credit stays put.
    dropped: list[bytes] = []

    def drop_first_big(src: str, dst: str, data: bytes) -> bool:
        if src == "a" and len(data) > 60_000 and not dropped:
            dropped.append(data)
            return True
        return False

    net.drop_if = drop_first_big
    lane_a.send_message(0, bytes(4 << 20))
    net.run(until=net.now + 1.0)
    (ended_b,) = net.terminations("b")
    assert ended_b.reason is TerminationReason.PROTOCOL_ERROR
    assert "flow control" in ended_b.detail
    assert [e.reason for e in net.terminations("a")] == [TerminationReason.CLOSED_BY_PEER]


def test_a_datagram_that_changes_nothing_is_dropped_under_a_reason() -> None:
    net, lane_a, lane_b = pair()
    sent: list[bytes] = []
    net.tap = lambda src, dst, data: sent.append(data) if src == "a" else None
    lane_a.send_message(PIPELINE_STREAM, b"once")
    net.run(until=net.now + 1.0, stop=lambda: bool(net.messages("b")))
    data = next(d for d in sent if d[0] == KIND_DATA)
    assert lane_b.receive_datagram(data, "a", net.now) == "replayed"
    lane_a.close("done")
    net.run(until=net.now + 5.0, stop=lambda: lane_b.is_terminated and lane_a.is_terminated)
    assert lane_b.is_terminated
    assert lane_b.receive_datagram(data, "a", net.now) == "lane_closed"
