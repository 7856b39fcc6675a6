"""A lane: meshd's encrypted, reliable, multiplexed connection between two nodes (sans-IO).

In the manner of aioquic's `QuicConnection`: the driver feeds `receive_datagram(data, addr,
now)`, sends what `datagrams_to_send(now)` returns, calls `handle_timer(now)` once
`get_timer()` passes, and drains `next_event()`. Nothing here reads a clock or a socket.

Lifecycle (all transitions live in this file):

    connect() -> HANDSHAKE --RESPONSE--> ESTABLISHED --close()--> CLOSING --> TERMINATED
    accept()  -> UNCONFIRMED --first authenticated DATA--> ESTABLISHED
    any state --timeout / REFUSAL / CLOSE from peer / dead peer / violation--> TERMINATED

The data path (keys, acks, recovery, streams) is `protocol.transport.Transport`.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from protocol.config import LaneConfig
from protocol.datagram import KIND_DATA, KIND_REFUSAL, KIND_RESPONSE, peek_kind
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.events import (
    LaneEstablished,
    LaneEvent,
    LaneStats,
    LaneTerminated,
    MessageReceived,
    TerminationReason,
)
from protocol.frames import CLOSE_NO_ERROR, CLOSE_PROTOCOL_ERROR, CloseFrame
from protocol.handshake import HandshakeResult, Initiator
from protocol.transport import Transport

__all__ = [
    "Lane",
    "LaneConfig",
    "LaneEstablished",
    "LaneEvent",
    "LaneStats",
    "LaneTerminated",
    "MessageReceived",
    "TerminationReason",
]

# Handshake attempts remembered, so a RESPONSE to an earlier INITIATION still completes.
_ATTEMPTS_KEPT = 4


class _State(enum.Enum):
    HANDSHAKE = "handshake"
    UNCONFIRMED = "unconfirmed"
    ESTABLISHED = "established"
    CLOSING = "closing"
    TERMINATED = "terminated"


class Lane:
    """One lane to one peer. Build it with `Lane.connect` or `Lane.accept`."""

    def __init__(
        self, *, config: LaneConfig, local_lane_id: int, addr: Hashable, now: float
    ) -> None:
        """Internal: use `connect` (initiator) or `accept` (responder)."""
        self._config = config
        self._local_lane_id = local_lane_id
        self._addr = addr
        self._state = _State.HANDSHAKE
        self._events: deque[LaneEvent] = deque()
        self._transport: Transport | None = None
        self._result: HandshakeResult | None = None
        self._outbox: list[bytes] = []  # handshake datagrams and last words
        self._handshake_deadline_s = now + config.handshake_timeout_s
        self._last_recv_s = now
        self._last_send_s = now
        self._packets_dropped = 0
        self._bulk_held = False
        # Initiator only.
        self._attempts: list[Initiator] = []
        self._make_attempt: Callable[[int], Initiator] | None = None
        self._remote_static_expected: bytes | None = None
        self._started_s = now
        self._started_wall_ns = 0
        self._retry_interval_s = config.handshake_retry_s
        self._next_retry_s: float | None = None
        # Closing.
        self._close_reason = ""
        self._close_sends_left = 0
        self._close_next_s: float | None = None

    # --- construction -----------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        *,
        config: LaneConfig,
        static_private: bytes,
        remote_static: bytes,
        psk: bytes,
        local_lane_id: int,
        addr: Hashable,
        versions: Sequence[int],
        capabilities: Sequence[str],
        now: float,
        now_wall_ns: int,
    ) -> Lane:
        """Start opening a lane to `addr` (the initiator); the INITIATION is queued to send."""
        lane = cls(config=config, local_lane_id=local_lane_id, addr=addr, now=now)
        versions, capabilities = tuple(versions), tuple(capabilities)

        def make_attempt(now_wall_ns: int) -> Initiator:
            return Initiator(
                static_private=static_private,
                remote_static=remote_static,
                psk=psk,
                local_lane_id=local_lane_id,
                versions=versions,
                capabilities=capabilities,
                max_message_bytes=config.max_message_bytes,
                now_wall_ns=now_wall_ns,
            )

        lane._make_attempt = make_attempt
        lane._remote_static_expected = remote_static
        lane._started_wall_ns = now_wall_ns
        lane._new_attempt(now)
        return lane

    @classmethod
    def accept(
        cls,
        *,
        config: LaneConfig,
        result: HandshakeResult,
        local_lane_id: int,
        addr: Hashable,
        now: float,
    ) -> Lane:
        """The responder's lane after `Responder.handle_initiation` (its RESPONSE is the
        driver's to send). It stays unconfirmed, sending nothing, until the initiator's
        first authenticated DATA arrives; without one it ends after handshake_timeout_s."""
        lane = cls(config=config, local_lane_id=local_lane_id, addr=addr, now=now)
        lane._state = _State.UNCONFIRMED
        lane._start_transport(result, now)
        return lane

    def _new_attempt(self, now: float) -> None:
        assert self._make_attempt is not None
        # Each attempt carries a fresh timestamp: the responder refuses a repeated one.
        elapsed_ns = int((now - self._started_s) * 1e9)
        attempt = self._make_attempt(self._started_wall_ns + elapsed_ns)
        self._attempts = [*self._attempts[-(_ATTEMPTS_KEPT - 1) :], attempt]
        self._outbox.append(attempt.initiation_datagram())
        self._next_retry_s = now + self._retry_interval_s
        self._retry_interval_s = min(2 * self._retry_interval_s, self._config.handshake_retry_max_s)

    def _start_transport(self, result: HandshakeResult, now: float) -> None:
        self._result = result
        self._transport = Transport(
            config=self._config,
            send_key=result.send_key,
            recv_key=result.recv_key,
            local_lane_id=self._local_lane_id,
            remote_lane_id=result.remote_lane_id,
            max_message_bytes=min(result.max_message_bytes, self._config.max_message_bytes),
            now=now,
        )
        self._transport.bulk_held = self._bulk_held

    def _establish(self, now: float) -> None:
        assert self._result is not None
        self._state = _State.ESTABLISHED
        self._next_retry_s = None
        self._last_recv_s = now
        result = self._result
        self._events.append(
            LaneEstablished(result.version, result.capabilities, result.remote_static)
        )

    # --- properties -------------------------------------------------------------------

    @property
    def local_lane_id(self) -> int:
        """The id the peer puts in datagrams to us."""
        return self._local_lane_id

    @property
    def remote_lane_id(self) -> int | None:
        """The id we put in datagrams to the peer (None until the handshake completes)."""
        return None if self._result is None else self._result.remote_lane_id

    @property
    def remote_static(self) -> bytes | None:
        """The peer's X25519 static key (None until the handshake completes)."""
        if self._result is not None:
            return self._result.remote_static
        return self._remote_static_expected

    @property
    def addr(self) -> Hashable:
        """Where datagrams go; follows the peer when its authenticated packets move."""
        return self._addr

    @property
    def is_established(self) -> bool:
        """Whether messages flow (established and not closing or over)."""
        return self._state is _State.ESTABLISHED

    @property
    def is_terminated(self) -> bool:
        """Whether the lane is over."""
        return self._state is _State.TERMINATED

    @property
    def max_message_bytes(self) -> int:
        """The largest message `send_message` accepts (negotiated once established)."""
        if self._transport is not None:
            return self._transport.max_message_bytes
        return self._config.max_message_bytes

    @property
    def pending_send_bytes(self) -> int:
        """Stream bytes accepted by send_message and not yet acknowledged (backpressure)."""
        return 0 if self._transport is None else self._transport.unacked_send_bytes

    @property
    def packets_replayed(self) -> int:
        """Replayed or duplicated DATA datagrams dropped so far (without a stats snapshot)."""
        return 0 if self._transport is None else self._transport.packets_replayed

    @property
    def stats(self) -> LaneStats:
        """A snapshot of counters and estimates."""
        t = self._transport
        if t is None:
            return LaneStats.before_handshake(
                self._config.max_datagram_bytes, self._config.initial_rtt_s, self._packets_dropped
            )
        rec = t.recovery
        return LaneStats(
            smoothed_rtt_s=rec.smoothed_rtt_s,
            rttvar_s=rec.rttvar_s,
            min_rtt_s=rec.min_rtt_s,
            latest_rtt_s=rec.latest_rtt_s,
            pto_s=rec.pto_s(),
            packets_sent=t.packets_sent,
            packets_received=t.packets_received,
            packets_lost=t.packets_lost,
            packets_replayed=t.packets_replayed,
            packets_dropped=self._packets_dropped,
            bytes_sent=t.bytes_sent,
            bytes_received=t.bytes_received,
            messages_sent=t.messages_sent,
            messages_received=t.messages_received,
            cwnd_bytes=t.cc.cwnd_bytes,
            bytes_in_flight=t.cc.bytes_in_flight,
            max_datagram_bytes=t.pmtu.current_bytes,
            key_phase=t.keys.send_phase_bit,
            key_updates=t.keys.send_generation,
            pmtu_probes_sent=t.pmtu_probes_sent,
            pmtu_probes_lost=t.pmtu_probes_lost,
        )

    # --- the driver's calls -----------------------------------------------------------

    def receive_datagram(self, data: bytes, addr: Hashable, now: float) -> str | None:
        """Take one datagram addressed to this lane; the reason it was dropped, or None.

        Malformed or unauthenticated bytes raise RemoteProtocolError and change nothing.
        Well-formed datagrams that change nothing are dropped under a reason the driver counts
        (every dropped datagram is counted somewhere): "replayed" for a replayed or duplicated
        DATA or RESPONSE, "lane_closed" for anything after termination. A protocol violation
        inside an authenticated packet closes the lane (an event).
        """
        if self._state is _State.TERMINATED:
            return "lane_closed"
        try:
            kind = peek_kind(data)
            if kind == KIND_DATA:
                return self._receive_data(data, addr, now)
            if kind == KIND_RESPONSE:
                return self._receive_response(data, addr, now)
            if kind == KIND_REFUSAL:
                self._receive_refusal(data)
                return None
            raise RemoteProtocolError("a lane takes no INITIATION")
        except RemoteProtocolError:
            self._packets_dropped += 1
            raise

    def _receive_response(self, data: bytes, addr: Hashable, now: float) -> str | None:
        if self._state is not _State.HANDSHAKE:
            if self._attempts:
                return "replayed"  # a duplicate RESPONSE after we completed: harmless
            raise RemoteProtocolError("RESPONSE to a responder lane")
        error: RemoteProtocolError | None = None
        for attempt in reversed(self._attempts):
            try:
                result = attempt.handle_response(data)
            except RemoteProtocolError as exc:
                error = exc
                continue
            self._addr = addr
            self._start_transport(result, now)
            self._establish(now)
            assert self._transport is not None
            # Confirms the lane to the responder at once, and starts the RTT estimate.
            self._transport.ping_pending = True
            return None
        assert error is not None
        raise error

    def _receive_refusal(self, data: bytes) -> None:
        if self._state is not _State.HANDSHAKE:
            raise RemoteProtocolError("REFUSAL outside the handshake")
        refused = self._attempts[-1].handle_refusal(data)
        self._terminate(TerminationReason.REFUSED, str(refused))

    def _receive_data(self, data: bytes, addr: Hashable, now: float) -> str | None:
        transport = self._transport
        if transport is None:
            raise RemoteProtocolError("DATA before the handshake completed")
        authenticated = transport.authenticate(data, now)
        if authenticated is None:
            return "replayed"  # replayed or duplicated: counted, no effect
        number, payload = authenticated
        self._last_recv_s = now
        if transport.newest and addr != self._addr:
            self._addr = addr  # the peer moved (NAT rebinding); follow its newest packet
        if self._state is _State.UNCONFIRMED:
            self._establish(now)
        try:
            messages, close = transport.process(number, payload, now)
        except RemoteProtocolError as exc:
            self._violation(str(exc), now)  # taken: it closed the lane
            return None
        if self._state is _State.ESTABLISHED:
            for stream_id, message in messages:
                self._events.append(MessageReceived(stream_id, message))
        if close is not None:
            self._peer_closed(close, now)
        elif self._state is _State.CLOSING and transport.close_acked:
            self._terminate(TerminationReason.CLOSED_LOCALLY, self._close_reason)
        return None

    def _peer_closed(self, close: CloseFrame, now: float) -> None:
        assert self._transport is not None
        last = self._transport.build_ack_only(now)
        if last is not None:
            self._outbox.append(last)
        if self._state is _State.CLOSING:
            self._terminate(TerminationReason.CLOSED_LOCALLY, self._close_reason)
            return
        detail = close.reason
        if close.error_code != CLOSE_NO_ERROR:
            detail = f"error {close.error_code}: {close.reason}"
        self._terminate(TerminationReason.CLOSED_BY_PEER, detail)

    def _violation(self, reason: str, now: float) -> None:
        """The authenticated peer broke the protocol: tell it why, once, and end."""
        assert self._transport is not None
        self._outbox.append(self._transport.build_close(CLOSE_PROTOCOL_ERROR, reason, now))
        self._terminate(TerminationReason.PROTOCOL_ERROR, reason)

    def send_message(self, stream_id: int, data: bytes) -> None:
        """Queue one whole message on a stream; it arrives once, in order, or the lane ends.

        Raises LocalProtocolError if the lane is not established (or is closing/over), the
        message exceeds the negotiated max_message_bytes, or the stream id is out of range.
        """
        if self._state is not _State.ESTABLISHED or self._transport is None:
            raise LocalProtocolError(f"cannot send on a lane that is {self._state.value}")
        self._transport.send_message(stream_id, bytes(data))

    def hold_bulk(self, held: bool) -> None:
        """While held, bulk streams (`BULK_STREAMS`) send nothing, new or retransmitted;
        every other stream, ACKs and timers go on. The owner holds bulk while its node
        computes a window, so a transfer's encryption and sends do not take the CPU (and the
        GIL) from it. Released, the queued bulk bytes go with the next `datagrams_to_send`."""
        self._bulk_held = held
        if self._transport is not None:
            self._transport.bulk_held = held

    @property
    def bulk_held(self) -> bool:
        """Whether bulk streams are held (`hold_bulk`)."""
        return self._bulk_held

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Hashable]]:
        """Everything that should go on the wire now, each with its destination."""
        out = self._outbox
        self._outbox = []
        state = self._state
        if state is _State.ESTABLISHED:
            assert self._transport is not None
            out.extend(self._transport.datagrams(now))
        elif state is _State.CLOSING and self._close_next_s is None:
            self._send_close(now, out)
        if out:
            self._last_send_s = now
        addr = self._addr
        return [(datagram, addr) for datagram in out]

    def get_timer(self) -> float | None:
        """The next time `handle_timer` must run (None: nothing scheduled)."""
        state = self._state
        if state is _State.TERMINATED:
            return None
        if state is _State.HANDSHAKE:
            if self._next_retry_s is None:
                return self._handshake_deadline_s
            return min(self._handshake_deadline_s, self._next_retry_s)
        if state is _State.UNCONFIRMED:
            return self._handshake_deadline_s
        if state is _State.CLOSING:
            return self._close_next_s
        assert self._transport is not None
        transport = self._transport
        deadline = self._last_recv_s + self._config.dead_after_s
        if not transport.ping_pending:
            deadline = min(deadline, self._last_active_s() + self._config.ping_interval_s)
        own = transport.deadline()
        return deadline if own is None else min(deadline, own)

    def handle_timer(self, now: float) -> None:
        """Run everything due by `now`. Afterwards get_timer() is later than `now` (or None)."""
        state = self._state
        if state is _State.HANDSHAKE:
            if now >= self._handshake_deadline_s:
                self._terminate(TerminationReason.HANDSHAKE_TIMEOUT, "no response from the peer")
            elif self._next_retry_s is not None and now >= self._next_retry_s:
                self._new_attempt(now)
        elif state is _State.UNCONFIRMED:
            if now >= self._handshake_deadline_s:
                self._terminate(
                    TerminationReason.HANDSHAKE_TIMEOUT, "the initiator never confirmed the lane"
                )
        elif state is _State.CLOSING:
            if self._close_next_s is not None and now >= self._close_next_s:
                if self._close_sends_left > 0:
                    self._close_next_s = None  # datagrams_to_send resends CLOSE
                else:
                    self._terminate(TerminationReason.CLOSED_LOCALLY, self._close_reason)
        elif state is _State.ESTABLISHED:
            self._timer_established(now)

    def _timer_established(self, now: float) -> None:
        assert self._transport is not None
        config = self._config
        if now >= self._last_recv_s + config.dead_after_s:
            silent = now - self._last_recv_s
            self._terminate(
                TerminationReason.PEER_DEAD, f"no authenticated packet for {silent:.3f} s"
            )
            return
        self._transport.on_timer(now)
        if now >= self._last_active_s() + config.ping_interval_s:
            self._transport.ping_pending = True

    def _last_active_s(self) -> float:
        # Idle means nothing sent *and* nothing received: a peer that just heard from us, or
        # that we just answered, knows we are alive, so only one side of a quiet lane pings.
        return max(self._last_send_s, self._last_recv_s)

    def request_key_update(self) -> None:
        """Move to the next send key with the next packet (once the peer followed the last
        update); updates also happen on their own after key_rotation_after_packets/_s."""
        if self._transport is not None:
            self._transport.key_update_requested = True

    def next_event(self) -> LaneEvent | None:
        """The oldest undelivered event, or None."""
        return self._events.popleft() if self._events else None

    def close(self, reason: str = "") -> None:
        """Close gracefully: CLOSE goes out (resent until acked, a few times at most), then
        LaneTerminated(CLOSED_LOCALLY) here and LaneTerminated(CLOSED_BY_PEER) there.

        Queued messages not yet sent are abandoned: wait for pending_send_bytes == 0 first
        to be sure they arrived.
        """
        state = self._state
        if state in (_State.TERMINATED, _State.CLOSING):
            return
        if state is not _State.ESTABLISHED:
            self._outbox.clear()  # e.g. an INITIATION not yet sent
            self._terminate(TerminationReason.CLOSED_LOCALLY, reason)
            return
        self._state = _State.CLOSING
        self._close_reason = reason
        self._close_sends_left = 1 + self._config.close_retransmits
        self._close_next_s = None

    def _send_close(self, now: float, out: list[bytes]) -> None:
        assert self._transport is not None
        out.append(self._transport.build_close(CLOSE_NO_ERROR, self._close_reason, now))
        self._close_sends_left -= 1
        self._close_next_s = now + self._transport.recovery.pto_s()

    def _terminate(self, reason: TerminationReason, detail: str) -> None:
        self._state = _State.TERMINATED
        self._next_retry_s = self._close_next_s = None
        self._events.append(LaneTerminated(reason, detail))
