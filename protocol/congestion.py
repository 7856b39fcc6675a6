"""NewReno congestion control (RFC 9002 section 7), counted in bytes."""

from __future__ import annotations

# RFC 9002 7.2: the window never falls below two full datagrams; a loss halves it.
MINIMUM_WINDOW_PACKETS = 2
LOSS_REDUCTION_FACTOR = 0.5


class NewReno:
    """Slow start until the first loss, then additive increase; halve once per recovery period.

    The window only limits *new* ack-eliciting packets; ACKs and PMTU probes never wait for it.
    On a loss-free path slow start doubles the window every round trip without a cap, so a
    clean loopback path is never throttled by it.
    """

    __slots__ = (
        "_datagram_bytes",
        "_initial_packets",
        "_recovery_start_s",
        "_ssthresh",
        "bytes_in_flight",
        "cwnd_bytes",
    )

    def __init__(self, *, max_datagram_bytes: int, initial_window_packets: int) -> None:
        self._datagram_bytes = max_datagram_bytes
        self._initial_packets = initial_window_packets
        self.cwnd_bytes = initial_window_packets * max_datagram_bytes
        self.bytes_in_flight = 0
        self._ssthresh: float = float("inf")
        self._recovery_start_s = -1.0

    @property
    def in_slow_start(self) -> bool:
        """Whether the window still grows by every acknowledged byte."""
        return self.cwnd_bytes < self._ssthresh

    def available_bytes(self) -> int:
        """How many more in-flight bytes the window allows now (never negative)."""
        return max(self.cwnd_bytes - self.bytes_in_flight, 0)

    def set_datagram_bytes(self, size: int) -> None:
        """The path carries bigger datagrams now; keep the window worth at least its floor.

        While still in slow start the initial window scales with the datagram size too, since
        the path showed no sign of congestion yet.
        """
        self._datagram_bytes = size
        floor = MINIMUM_WINDOW_PACKETS * size
        if self.in_slow_start:
            floor = max(floor, self._initial_packets * size)
        self.cwnd_bytes = max(self.cwnd_bytes, floor)

    def on_sent(self, size: int) -> None:
        """A packet that counts in flight left."""
        self.bytes_in_flight += size

    def on_acked(self, size: int, sent_time_s: float) -> None:
        """A packet in flight was acknowledged."""
        self.bytes_in_flight -= size
        if sent_time_s <= self._recovery_start_s:
            return  # acked data sent before the last reduction does not grow the window
        if self.in_slow_start:
            self.cwnd_bytes += size
        else:
            self.cwnd_bytes += max(self._datagram_bytes * size // self.cwnd_bytes, 1)

    def on_forgotten(self, size: int) -> None:
        """A packet stopped counting in flight without telling us anything about congestion."""
        self.bytes_in_flight -= size

    def on_lost(self, size: int, sent_time_s: float, now: float) -> None:
        """A packet in flight was declared lost: one window reduction per recovery period."""
        self.bytes_in_flight -= size
        if sent_time_s <= self._recovery_start_s:
            return
        self._recovery_start_s = now
        self.cwnd_bytes = max(
            int(self.cwnd_bytes * LOSS_REDUCTION_FACTOR),
            MINIMUM_WINDOW_PACKETS * self._datagram_bytes,
        )
        self._ssthresh = self.cwnd_bytes

    def on_persistent_congestion(self) -> None:
        """RFC 9002 7.6: every packet over several probe timeouts was lost; start over."""
        self.cwnd_bytes = MINIMUM_WINDOW_PACKETS * self._datagram_bytes
