"""RFC 9002 loss detection, RTT estimation, probe timeout and NewReno."""

import pytest

from protocol.congestion import NewReno
from protocol.recovery import GRANULARITY_S, Recovery, SentPacket
from protocol.stream import StreamChunk

DATAGRAM = 1200


def make(initial_rtt_s: float = 0.1) -> Recovery:
    cc = NewReno(max_datagram_bytes=DATAGRAM, initial_window_packets=10)
    return Recovery(initial_rtt_s=initial_rtt_s, max_ack_delay_s=0.025, congestion=cc)


def send(recovery: Recovery, number: int, now: float, *, data: bool = True) -> SentPacket:
    chunks = [StreamChunk(0, number * 10, 10, (b"x" * 10,))] if data else []
    packet = SentPacket(number, now, DATAGRAM, chunks=chunks)
    recovery.on_packet_sent(packet)
    return packet


def test_first_sample_then_smoothing_with_ack_delay() -> None:
    rec = make()
    send(rec, 0, 0.0)
    rec.on_ack(((0, 1),), 0.0, 0.1)
    assert (rec.smoothed_rtt_s, rec.rttvar_s, rec.min_rtt_s) == pytest.approx((0.1, 0.05, 0.1))
    send(rec, 1, 1.0)
    rec.on_ack(((0, 2),), 0.02, 1.12)  # 120 ms, of which 20 ms was the peer's ack delay
    assert rec.latest_rtt_s == pytest.approx(0.12)
    assert rec.smoothed_rtt_s == pytest.approx(0.875 * 0.1 + 0.125 * 0.1)
    assert rec.pto_s() == pytest.approx(rec.smoothed_rtt_s + 4 * rec.rttvar_s + 0.025)


def test_packet_threshold_declares_a_packet_lost_after_three_newer_acks() -> None:
    rec = make()
    for number in range(5):
        send(rec, number, 0.0)
    _, lost = rec.on_ack(((2, 3),), 0.0, 0.01)
    assert lost == []  # only 2 newer than packet 0 so far, and not yet 9/8 RTT overdue
    _, lost = rec.on_ack(((2, 4),), 0.0, 0.0101)
    assert [p.number for p in lost] == [0]
    _, lost = rec.on_ack(((2, 5),), 0.0, 0.0102)
    assert [p.number for p in lost] == [1]


def test_time_threshold_declares_loss_at_nine_eighths_rtt() -> None:
    rec = make()
    send(rec, 0, 0.0)
    send(rec, 1, 0.001)
    _, lost = rec.on_ack(((1, 2),), 0.0, 0.051)  # sample 50 ms from packet 1
    assert lost == []
    deadline = rec.deadline()
    assert deadline == pytest.approx(0.0 + 9 / 8 * 0.05)
    assert deadline is not None
    lost, probe = rec.on_timeout(deadline)
    assert [p.number for p in lost] == [0] and not probe


def test_probe_timeout_backs_off_exponentially_and_hands_back_the_oldest_data() -> None:
    rec = make(initial_rtt_s=0.1)
    send(rec, 0, 0.0)
    send(rec, 1, 0.0)
    pto = rec.pto_s()
    assert rec.deadline() == pytest.approx(pto)
    lost, probe = rec.on_timeout(pto)
    assert probe and [p.number for p in lost] == [0]
    send(rec, 2, pto, data=False)  # the probe
    assert rec.deadline() == pytest.approx(pto + 2 * pto)
    assert rec.congestion.cwnd_bytes == 10 * DATAGRAM  # a PTO is not a congestion event


def test_newreno_halves_once_per_recovery_period_and_never_below_two_datagrams() -> None:
    cc = NewReno(max_datagram_bytes=DATAGRAM, initial_window_packets=10)
    for _ in range(3):
        cc.on_sent(DATAGRAM)
    cc.on_lost(DATAGRAM, sent_time_s=1.0, now=2.0)
    cc.on_lost(DATAGRAM, sent_time_s=1.5, now=2.1)  # same period: no second cut
    assert cc.cwnd_bytes == 5 * DATAGRAM and not cc.in_slow_start
    for _ in range(10):
        cc.on_lost(DATAGRAM, sent_time_s=10.0 + _, now=10.5 + _)
        cc.on_sent(DATAGRAM)
    assert cc.cwnd_bytes == 2 * DATAGRAM


def test_slow_start_doubles_per_round_trip_on_a_clean_path() -> None:
    rec = make()
    now, number = 0.0, 0
    for _ in range(12):
        burst = rec.congestion.cwnd_bytes // DATAGRAM
        for _ in range(burst):
            send(rec, number, now)
            number += 1
        now += 0.001
        rec.on_ack(((0, number),), 0.0, now)
    assert rec.congestion.cwnd_bytes == 10 * DATAGRAM * 2**12
    assert rec.congestion.bytes_in_flight == 0


def test_huge_ack_ranges_cost_only_the_outstanding_packets() -> None:
    rec = make()
    send(rec, 10**9, 0.0)
    acked, _ = rec.on_ack(((0, 10**9 + 1),), 0.0, 0.01)
    assert [p.number for p in acked] == [10**9]
    assert rec.latest_rtt_s == pytest.approx(0.01)
    assert GRANULARITY_S == 0.001
