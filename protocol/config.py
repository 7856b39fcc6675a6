"""Typed, validated configuration of one lane (every tunable number, with its unit in its name)."""

from __future__ import annotations

import itertools

import msgspec

from protocol.errors import InvalidConfig
from protocol.stream import INITIAL_MAX_DATA_BYTES, INITIAL_MAX_STREAM_DATA_BYTES

MiB = 1024 * 1024

# RFC 8899 calls this BASE_PLPMTU: a size every IPv4/IPv6 path of interest carries unfragmented
# (1500-byte Ethernet MTU less IPv6 40 B and UDP 8 B headers).
BASE_DATAGRAM_BYTES = 1452
# The largest UDP payload over IPv4; the probe ladder never goes past it.
MAX_UDP_PAYLOAD_BYTES = 65507


class LaneConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Behaviour of one lane; both sides may use different values unless noted.

    Validated on construction: a bad value raises InvalidConfig (a LocalProtocolError and a
    ValueError) naming the field.
    """

    # Liveness: a PING goes out when nothing was sent for ping_interval_s, and the peer is
    # declared dead after dead_after_s without a single authenticated packet from it.
    ping_interval_s: float = 0.25
    dead_after_s: float = 1.5
    # Handshake: the initiator resends a fresh INITIATION after handshake_retry_s, doubling
    # up to handshake_retry_max_s, and gives up after handshake_timeout_s. A responder lane
    # that never sees authenticated DATA from the initiator ends after the same timeout.
    handshake_timeout_s: float = 3.0
    handshake_retry_s: float = 0.25
    handshake_retry_max_s: float = 1.0
    # Largest message a stream carries; the lane uses the smaller of both sides' values.
    max_message_bytes: int = 16 * MiB
    # Path MTU: start at max_datagram_bytes and probe upwards through the ladder, never past
    # max_datagram_bytes_ceiling. Probing off means the lane stays at max_datagram_bytes.
    max_datagram_bytes: int = BASE_DATAGRAM_BYTES
    max_datagram_bytes_ceiling: int = 65000
    pmtu_probe_ladder_bytes: tuple[int, ...] = (8192, 16384, 32768, 65000)
    pmtu_probing: bool = True
    pmtu_probe_attempts: int = 3
    # Flow control credit this side grants the peer (per stream, and for the lane as a whole).
    initial_max_stream_data_bytes: int = 8 * MiB
    initial_max_data_bytes: int = 32 * MiB
    # Highest stream id the peer may open (stream ids are 0..max_stream_id).
    max_stream_id: int = 1023
    # Key update (QUIC style): after this many packets or seconds under one send key.
    key_rotation_after_packets: int = 1 << 24
    key_rotation_after_s: float = 120.0
    # How long previous receive keys stay usable for packets reordered across an update.
    old_key_retention_s: float = 1.0
    # ACKs: at most max_ack_delay_s late, or at once after ack_every_packets ack-eliciting ones.
    max_ack_delay_s: float = 0.005
    ack_every_packets: int = 2
    # Recovery: RTT assumed before the first sample (seeds the PTO), congestion window floor.
    initial_rtt_s: float = 0.1
    initial_window_packets: int = 10
    # Received packet numbers remembered for replay protection (WireGuard uses 8128).
    replay_window_packets: int = 8192
    # Graceful close: CLOSE is resent on each probe timeout, at most this many times.
    close_retransmits: int = 3

    def __post_init__(self) -> None:
        positive_s = (
            "ping_interval_s",
            "dead_after_s",
            "handshake_timeout_s",
            "handshake_retry_s",
            "handshake_retry_max_s",
            "key_rotation_after_s",
            "old_key_retention_s",
            "initial_rtt_s",
        )
        for name in positive_s:
            value = getattr(self, name)
            if not value > 0.0 or value == float("inf"):
                raise InvalidConfig(f"{name} must be a positive finite time")
        if not 0.0 <= self.max_ack_delay_s < 1.0:
            raise InvalidConfig("max_ack_delay_s must be in [0, 1) seconds")
        if self.ping_interval_s >= self.dead_after_s:
            raise InvalidConfig("ping_interval_s must be below dead_after_s")
        if self.handshake_retry_max_s < self.handshake_retry_s:
            raise InvalidConfig("handshake_retry_max_s is below handshake_retry_s")
        if not 1 <= self.max_message_bytes <= 2**31:
            raise InvalidConfig("max_message_bytes must be in 1..2**31")
        if not 1200 <= self.max_datagram_bytes <= self.max_datagram_bytes_ceiling:
            raise InvalidConfig("max_datagram_bytes must be in 1200..ceiling")
        if self.max_datagram_bytes_ceiling > MAX_UDP_PAYLOAD_BYTES:
            raise InvalidConfig("max_datagram_bytes_ceiling exceeds UDP's limit")
        ladder = self.pmtu_probe_ladder_bytes
        if any(b <= a for a, b in itertools.pairwise(ladder)):
            raise InvalidConfig("pmtu_probe_ladder_bytes must increase")
        at_least_one = (
            "pmtu_probe_attempts",
            "ack_every_packets",
            "initial_window_packets",
            "close_retransmits",
            "key_rotation_after_packets",
        )
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise InvalidConfig(f"{name} must be at least 1")
        if (
            self.initial_max_stream_data_bytes < INITIAL_MAX_STREAM_DATA_BYTES
            or self.initial_max_data_bytes < INITIAL_MAX_DATA_BYTES
        ):
            raise InvalidConfig(
                "initial_max_stream_data_bytes and initial_max_data_bytes must be at least the "
                "protocol floor"
            )
        if not 0 <= self.max_stream_id < 0xFFFFFFFF:  # 0xFFFFFFFF means ALL_STREAMS
            raise InvalidConfig("max_stream_id must be in 0..0xFFFFFFFE")
        if not 64 <= self.replay_window_packets <= 1 << 20:
            raise InvalidConfig("replay_window_packets must be in 64..2**20")

    def probe_sizes(self) -> tuple[int, ...]:
        """The PMTU probe sizes above the starting size, in order, capped by the ceiling."""
        if not self.pmtu_probing:
            return ()
        low, ceiling = self.max_datagram_bytes, self.max_datagram_bytes_ceiling
        sizes = [s for s in self.pmtu_probe_ladder_bytes if low < s <= ceiling]
        # A ceiling that falls between two rungs is itself worth a probe.
        top = sizes[-1] if sizes else low
        if ceiling > top and any(s > ceiling for s in self.pmtu_probe_ladder_bytes):
            sizes.append(ceiling)
        return tuple(sizes)
