"""What a lane reports to its driver: events (frozen values) and a statistics snapshot."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TerminationReason(enum.Enum):
    """Why a lane ended."""

    CLOSED_LOCALLY = "closed_locally"  # close() was called here
    CLOSED_BY_PEER = "closed_by_peer"  # the peer sent CLOSE
    PEER_DEAD = "peer_dead"  # no authenticated packet for dead_after_s
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # no RESPONSE (or, responder: no first DATA) in time
    REFUSED = "refused"  # the peer answered with a version REFUSAL
    PROTOCOL_ERROR = "protocol_error"  # the peer broke the protocol; we sent CLOSE with why


@dataclass(frozen=True, slots=True)
class LaneEstablished:
    """The lane is open: both sides proved their keys; messages flow."""

    version: int
    capabilities: tuple[str, ...]
    remote_static: bytes


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole message, delivered once and in order on its stream."""

    stream_id: int
    data: bytes


@dataclass(frozen=True, slots=True)
class LaneTerminated:
    """The lane is over; it sends nothing more (after any final datagram already queued)."""

    reason: TerminationReason
    detail: str


LaneEvent = LaneEstablished | MessageReceived | LaneTerminated


@dataclass(frozen=True, slots=True)
class LaneStats:
    """A snapshot of one lane's counters and estimates (times in seconds)."""

    smoothed_rtt_s: float
    rttvar_s: float
    min_rtt_s: float
    latest_rtt_s: float
    pto_s: float
    packets_sent: int
    packets_received: int
    packets_lost: int
    packets_replayed: int  # duplicates and replays dropped by the replay window
    packets_dropped: int  # datagrams that failed to parse or authenticate
    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int
    cwnd_bytes: int
    bytes_in_flight: int
    max_datagram_bytes: int
    key_phase: int  # the key phase bit in use for sending
    key_updates: int  # how many key updates the send side went through
    pmtu_probes_sent: int
    pmtu_probes_lost: int

    @classmethod
    def before_handshake(
        cls, max_datagram_bytes: int, initial_rtt_s: float, packets_dropped: int
    ) -> LaneStats:
        """The snapshot of a lane that has no keys yet: estimates at their initial values."""
        return cls(
            smoothed_rtt_s=initial_rtt_s,
            rttvar_s=initial_rtt_s / 2,
            min_rtt_s=0.0,
            latest_rtt_s=0.0,
            pto_s=0.0,
            packets_sent=0,
            packets_received=0,
            packets_lost=0,
            packets_replayed=0,
            packets_dropped=packets_dropped,
            bytes_sent=0,
            bytes_received=0,
            messages_sent=0,
            messages_received=0,
            cwnd_bytes=0,
            bytes_in_flight=0,
            max_datagram_bytes=max_datagram_bytes,
            key_phase=0,
            key_updates=0,
            pmtu_probes_sent=0,
            pmtu_probes_lost=0,
        )
