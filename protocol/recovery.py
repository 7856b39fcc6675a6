"""Loss detection and RTT estimation after RFC 9002 (one packet number space).

The lane records every ack-eliciting packet it sends; ACK-only packets are not recorded (they
are never retransmitted and nothing waits for them). Acknowledged packets free their window;
lost ones hand their frames back to the lane, which resends them in new packets.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from protocol.congestion import NewReno
from protocol.stream import StreamChunk

# RFC 9002 constants.
PACKET_THRESHOLD = 3
TIME_THRESHOLD = 9 / 8
GRANULARITY_S = 0.001
PERSISTENT_CONGESTION_THRESHOLD = 3

# Control frames a packet carried, as bits, so a loss can re-arm exactly those.
CARRIED_MAX_DATA = 1
CARRIED_CLOSE = 2


@dataclass(slots=True)
class SentPacket:
    """What one sent ack-eliciting packet carried, kept until it is acked or lost.

    A mutable record (not a frozen value) because it is created on the hot path and touched
    by nothing but recovery and the lane.
    """

    number: int
    sent_time_s: float
    size: int
    in_flight: bool = True
    is_probe: bool = False
    chunks: list[StreamChunk] = field(default_factory=list)
    controls: int = 0
    credit_streams: tuple[int, ...] = ()
    largest_ack: int = -1


class Recovery:
    """RTT estimate, sent-packet bookkeeping, loss detection and the probe timeout."""

    def __init__(self, *, initial_rtt_s: float, max_ack_delay_s: float, congestion: NewReno):
        self.congestion = congestion
        self.max_ack_delay_s = max_ack_delay_s
        self.sent: dict[int, SentPacket] = {}
        self.largest_acked = -1
        self.latest_rtt_s = 0.0
        self.smoothed_rtt_s = initial_rtt_s
        self.rttvar_s = initial_rtt_s / 2
        self.min_rtt_s = 0.0
        self.has_rtt_sample = False
        self.pto_count = 0
        self._first_sample_time_s = 0.0
        self._last_ack_eliciting_sent_s = 0.0
        self._loss_time_s: float | None = None

    # --- sending ----------------------------------------------------------------------

    def on_packet_sent(self, packet: SentPacket) -> None:
        """Track a sent ack-eliciting packet."""
        self.sent[packet.number] = packet
        self._last_ack_eliciting_sent_s = packet.sent_time_s
        if packet.in_flight:
            self.congestion.on_sent(packet.size)

    def pto_s(self) -> float:
        """The probe timeout without backoff: srtt + max(4·rttvar, 1 ms) + max_ack_delay."""
        return self.smoothed_rtt_s + max(4 * self.rttvar_s, GRANULARITY_S) + self.max_ack_delay_s

    def deadline(self) -> float | None:
        """When `on_timeout` must run next: the loss time, else the probe timeout."""
        if self._loss_time_s is not None:
            return self._loss_time_s
        if not self.sent:
            return None
        return self._last_ack_eliciting_sent_s + self.pto_s() * float(1 << self.pto_count)

    # --- acknowledgements -------------------------------------------------------------

    def on_ack(
        self, ranges: tuple[tuple[int, int], ...], ack_delay_s: float, now: float
    ) -> tuple[list[SentPacket], list[SentPacket]]:
        """Apply an ACK frame; returns (newly acked packets, packets now declared lost)."""
        acked = self._pop_acked(ranges)
        if not acked:
            return acked, []
        largest = ranges[0][1] - 1
        if largest > self.largest_acked:
            self.largest_acked = largest
        newest = acked[-1]
        if newest.number == largest:
            self._update_rtt(now - newest.sent_time_s, ack_delay_s, now)
        cc = self.congestion
        for packet in acked:
            if packet.in_flight:
                cc.on_acked(packet.size, packet.sent_time_s)
        self.pto_count = 0
        return acked, self._detect_loss(now)

    def _pop_acked(self, ranges: tuple[tuple[int, int], ...]) -> list[SentPacket]:
        sent = self.sent
        if not sent:
            return []
        lowest = next(iter(sent))
        acked: list[SentPacket] = []
        numbers: list[int] | None = None
        # Lowest range first, so `acked` ends with the highest packet.
        for start, stop in reversed(ranges):
            lo = max(start, lowest)
            if stop <= lo:
                continue
            if stop - lo <= 4 * len(sent):
                for number in range(lo, stop):
                    packet = sent.pop(number, None)
                    if packet is not None:
                        acked.append(packet)
            else:
                # A huge range over few outstanding packets: visit those, not the range.
                if numbers is None:
                    numbers = list(sent)
                i, j = bisect_left(numbers, lo), bisect_left(numbers, stop)
                for number in numbers[i:j]:
                    packet = sent.pop(number, None)
                    if packet is not None:
                        acked.append(packet)
        return acked

    def _update_rtt(self, latest_s: float, ack_delay_s: float, now: float) -> None:
        latest_s = max(latest_s, GRANULARITY_S / 1000)
        self.latest_rtt_s = latest_s
        if not self.has_rtt_sample:
            self.has_rtt_sample = True
            self._first_sample_time_s = now
            self.min_rtt_s = latest_s
            self.smoothed_rtt_s = latest_s
            self.rttvar_s = latest_s / 2
            return
        self.min_rtt_s = min(self.min_rtt_s, latest_s)
        ack_delay_s = min(ack_delay_s, self.max_ack_delay_s)
        adjusted = latest_s
        if latest_s >= self.min_rtt_s + ack_delay_s:
            adjusted = latest_s - ack_delay_s
        self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.smoothed_rtt_s - adjusted)
        self.smoothed_rtt_s = 0.875 * self.smoothed_rtt_s + 0.125 * adjusted

    # --- loss -------------------------------------------------------------------------

    def _detect_loss(self, now: float) -> list[SentPacket]:
        """RFC 9002 6.1: lost if 3 newer packets were acked or it is 9/8 RTT overdue."""
        loss_delay = max(
            TIME_THRESHOLD * max(self.latest_rtt_s, self.smoothed_rtt_s), GRANULARITY_S
        )
        number_limit = self.largest_acked - PACKET_THRESHOLD
        lost: list[SentPacket] = []
        self._loss_time_s = None
        for number, packet in self.sent.items():
            if number > self.largest_acked:
                break
            # One expression for both tests, so rounding cannot leave a deadline at `now`.
            when = packet.sent_time_s + loss_delay
            if number <= number_limit or when <= now:
                lost.append(packet)
            elif self._loss_time_s is None or when < self._loss_time_s:
                self._loss_time_s = when
        if lost:
            self._declare_lost(lost, now, congestion_event=True)
        return lost

    def _declare_lost(self, lost: list[SentPacket], now: float, *, congestion_event: bool) -> None:
        cc = self.congestion
        for packet in lost:
            del self.sent[packet.number]
            if not packet.in_flight:
                continue
            if congestion_event and not packet.is_probe:
                cc.on_lost(packet.size, packet.sent_time_s, now)
            else:
                cc.on_forgotten(packet.size)
        if congestion_event and self._persistent_congestion(lost):
            cc.on_persistent_congestion()

    def _persistent_congestion(self, lost: list[SentPacket]) -> bool:
        """RFC 9002 7.6.2, conservatively: a contiguous run of losses spanning 3 PTOs."""
        if not self.has_rtt_sample:
            return False
        duration = self.pto_s() * PERSISTENT_CONGESTION_THRESHOLD
        previous = -2
        start: float | None = None
        for packet in lost:
            if packet.number != previous + 1:
                start = None
            previous = packet.number
            if packet.is_probe or packet.sent_time_s <= self._first_sample_time_s:
                continue
            if start is None:
                start = packet.sent_time_s
            elif packet.sent_time_s - start > duration:
                return True
        return False

    def on_timeout(self, now: float) -> tuple[list[SentPacket], bool]:
        """Run when `deadline()` passes: returns (packets to resend, whether to send a probe).

        A loss-time expiry declares the overdue packets lost. A probe timeout backs off and
        hands back the oldest packet that carried frames, to be resent in the probe (RFC
        9002 6.2.4), without treating it as congestion: a PTO is not evidence of loss.
        """
        if self._loss_time_s is not None:
            return self._detect_loss(now), False
        self.pto_count += 1
        for packet in self.sent.values():
            if packet.chunks or packet.controls or packet.credit_streams:
                self._declare_lost([packet], now, congestion_event=False)
                return [packet], True
        return [], True
