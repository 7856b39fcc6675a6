"""The data path of an open lane: protect packets, process frames, build what to send.

`Lane` owns the lifecycle (handshake, liveness, close) and hands this class authenticated
work. Everything here runs per packet, so it avoids per-byte Python loops and needless copies:
message bytes are referenced from the caller's `bytes` until one `join` builds the plaintext.
"""

from __future__ import annotations

from protocol.config import LaneConfig
from protocol.congestion import NewReno
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.frames import (
    ACK,
    ALL_STREAMS,
    CLOSE,
    MAX_ACK_RANGES,
    MAX_DATA,
    MAX_STREAM_DATA,
    PADDING,
    PING,
    PING_FRAME,
    STREAM,
    STREAM_HEADER_BYTES,
    AckFrame,
    CloseFrame,
    StreamFrame,
    decode_ack,
    decode_close,
    decode_max_data,
    decode_max_stream_data,
    decode_stream,
    encode_ack,
    encode_close,
    encode_max_data,
    encode_max_stream_data,
    encode_stream_header,
)
from protocol.packet import PACKET_OVERHEAD_BYTES, KeySchedule, ReplayWindow, parse_header
from protocol.packet import seal_packet as _seal
from protocol.pmtu import PathMtu
from protocol.ranges import RangeSet
from protocol.recovery import CARRIED_CLOSE, CARRIED_MAX_DATA, Recovery, SentPacket
from protocol.stream import (
    INITIAL_MAX_DATA_BYTES,
    INITIAL_MAX_STREAM_DATA_BYTES,
    MESSAGE_HEADER_BYTES,
    Piece,
    RecvStream,
    SendStream,
    StreamChunk,
)
from protocol.streams import BULK_STREAMS

CARRIED_STREAM_DEFAULT = 4
_NO_STREAMS: tuple[int, ...] = ()
# A runaway guard: one datagrams() call never builds more packets than this.
MAX_PACKETS_PER_CALL = 4096
# Bulk streams send only while the congestion window is less full than this: the rest is
# headroom for other streams' packets.
BULK_CWND_SHARE = 0.75


class Transport:
    """Keys, replay window, acknowledgements, recovery, flow control and streams of one lane."""

    def __init__(
        self,
        *,
        config: LaneConfig,
        send_key: bytes,
        recv_key: bytes,
        local_lane_id: int,
        remote_lane_id: int,
        max_message_bytes: int,
        now: float,
    ) -> None:
        self._config = config
        self.local_lane_id = local_lane_id
        self.remote_lane_id = remote_lane_id
        self.max_message_bytes = max_message_bytes
        self.keys = KeySchedule(send_key, recv_key, now, config.old_key_retention_s)
        self.replay = ReplayWindow(config.replay_window_packets)
        self.pmtu = PathMtu(
            base_bytes=config.max_datagram_bytes,
            ladder=config.probe_sizes(),
            attempts=config.pmtu_probe_attempts,
        )
        self.cc = NewReno(
            max_datagram_bytes=config.max_datagram_bytes,
            initial_window_packets=config.initial_window_packets,
        )
        self.recovery = Recovery(
            initial_rtt_s=config.initial_rtt_s,
            max_ack_delay_s=config.max_ack_delay_s,
            congestion=self.cc,
        )
        self._next_number = 0
        # Receive side: what to acknowledge, and when.
        self._ack_ranges = RangeSet()
        self._ack_pending = False
        self._ack_now = False
        self._ack_at: float | None = None
        self._ack_eliciting_unacked = 0
        self._largest_received_s = now
        self._previous_largest = -1
        self.newest = False
        # Streams and flow control.
        self._send_streams: dict[int, SendStream] = {}
        self._sendable: dict[int, SendStream] = {}  # insertion order is the round-robin order
        # Set by the lane's owner while its node computes a window: bulk streams send nothing.
        self.bulk_held = False
        self._recv_streams: dict[int, RecvStream] = {}
        self._peer_max_data = INITIAL_MAX_DATA_BYTES
        self._peer_stream_default = INITIAL_MAX_STREAM_DATA_BYTES
        self._sent_new_bytes = 0
        self._max_data_granted = config.initial_max_data_bytes
        self._recv_highest_total = 0
        self._recv_consumed_total = 0
        self._send_max_data = config.initial_max_data_bytes > INITIAL_MAX_DATA_BYTES
        self._send_stream_default = (
            config.initial_max_stream_data_bytes > INITIAL_MAX_STREAM_DATA_BYTES
        )
        self._credit_streams: set[int] = set()
        self.ping_pending = False
        self.key_update_requested = False
        self._probe_pending = False
        self.unacked_send_bytes = 0
        self.close_acked = False
        # Counters for LaneStats.
        self.packets_sent = 0
        self.bytes_sent = 0
        self.packets_received = 0
        self.bytes_received = 0
        self.packets_lost = 0
        self.packets_replayed = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.pmtu_probes_sent = 0
        self.pmtu_probes_lost = 0

    # --- receiving --------------------------------------------------------------------

    def authenticate(self, data: bytes, now: float) -> tuple[int, memoryview] | None:
        """(packet number, plaintext) of a DATA datagram; None for a replay (counted).

        `newest` tells afterwards whether this packet carried the highest number yet.

        Raises RemoteProtocolError for anything malformed or unauthenticated; nothing changes.
        """
        flags, lane_id, number = parse_header(data)
        if lane_id != self.local_lane_id:
            raise RemoteProtocolError("DATA for another lane")
        if not self.replay.is_fresh(number):
            self.packets_replayed += 1
            return None
        payload = self.keys.open(data, flags, number, now)
        self._previous_largest = self.replay.largest
        self.newest = number > self._previous_largest
        self.replay.record(number)
        self.packets_received += 1
        self.bytes_received += len(data)
        return number, payload

    def process(
        self, number: int, payload: memoryview, now: float
    ) -> tuple[list[tuple[int, bytes]], CloseFrame | None]:
        """Apply an authenticated packet's frames: (messages completed, CLOSE if any).

        A RemoteProtocolError here means the authenticated peer broke the protocol.
        """
        if not payload:
            raise RemoteProtocolError("packet without frames")
        messages: list[tuple[int, bytes]] = []
        close: CloseFrame | None = None
        eliciting = ping = False
        pos, n = 0, len(payload)
        while pos < n:
            kind = payload[pos]
            if kind == STREAM:
                stream_frame, pos = decode_stream(payload, pos)
                self._on_stream(stream_frame, messages)
                eliciting = True
            elif kind == ACK:
                ack_frame, pos = decode_ack(payload, pos)
                self._on_ack(ack_frame, now)
            elif kind == PING:
                pos += 1
                eliciting = ping = True
            elif kind == PADDING:
                pos = n
            elif kind == MAX_DATA:
                max_data, pos = decode_max_data(payload, pos)
                self._on_max_data(max_data.max_data)
                eliciting = True
            elif kind == MAX_STREAM_DATA:
                credit, pos = decode_max_stream_data(payload, pos)
                self._on_max_stream_data(credit.stream_id, credit.max_stream_data)
                eliciting = True
            elif kind == CLOSE:
                close, pos = decode_close(payload, pos)
                eliciting = ping = True
            else:
                raise RemoteProtocolError(f"unknown frame type 0x{kind:02x}")
        self.messages_received += len(messages)
        self._note_received(number, now, eliciting=eliciting, urgent=ping)
        return messages, close

    def _note_received(self, number: int, now: float, *, eliciting: bool, urgent: bool) -> None:
        """Schedule the ACK: at once for PINGs, gaps and every Nth packet, else delayed."""
        in_order = number == self._previous_largest + 1
        ranges = self._ack_ranges
        ranges.add(number, number + 1)
        if len(ranges) > MAX_ACK_RANGES:
            ranges.drop_lowest(MAX_ACK_RANGES)
        if self.newest:
            self._largest_received_s = now
        if not eliciting:
            return
        self._ack_pending = True
        self._ack_eliciting_unacked += 1
        if urgent or not in_order or self._ack_eliciting_unacked >= self._config.ack_every_packets:
            self._ack_now = True
        elif self._ack_at is None:
            self._ack_at = now + self._config.max_ack_delay_s

    def _on_stream(self, frame: StreamFrame, messages: list[tuple[int, bytes]]) -> None:
        stream_id = frame.stream_id
        stream = self._recv_streams.get(stream_id)
        if stream is None:
            if stream_id > self._config.max_stream_id:
                raise RemoteProtocolError(f"stream id {stream_id} above the limit")
            stream = RecvStream(
                stream_id, self._config.initial_max_stream_data_bytes, self.max_message_bytes
            )
            self._recv_streams[stream_id] = stream
        grow = frame.offset + len(frame.data) - stream.highest_offset
        if grow > 0 and self._recv_highest_total + grow > self._max_data_granted:
            raise RemoteProtocolError("lane flow control credit exceeded")
        consumed = stream.consumed
        for data in stream.receive(frame.offset, frame.data):
            messages.append((stream_id, data))
        if grow > 0:
            self._recv_highest_total += grow
        if stream.consumed != consumed:
            self._recv_consumed_total += stream.consumed - consumed
            if stream.credit_update() is not None:
                self._credit_streams.add(stream_id)
            window = self._config.initial_max_data_bytes
            if self._max_data_granted - self._recv_consumed_total <= window // 2:
                self._max_data_granted = self._recv_consumed_total + window
                self._send_max_data = True

    def _on_ack(self, frame: AckFrame, now: float) -> None:
        if frame.ranges[0][1] > self._next_number:
            raise RemoteProtocolError("ACK for a packet never sent")
        acked, lost = self.recovery.on_ack(frame.ranges, frame.ack_delay_s, now)
        seen_ack = -1
        streams = self._send_streams
        for packet in acked:
            if packet.is_probe:
                if self.pmtu.on_probe_acked(packet.size):
                    self.cc.set_datagram_bytes(self.pmtu.current_bytes)
                continue
            for chunk in packet.chunks:
                self.unacked_send_bytes -= streams[chunk.stream_id].on_acked(chunk)
            if packet.largest_ack > seen_ack:
                seen_ack = packet.largest_ack
            if packet.controls & CARRIED_CLOSE:
                self.close_acked = True
        if seen_ack >= 0:
            # The peer saw those ACKs; it need not hear about the packets they covered again.
            self._ack_ranges.subtract(0, seen_ack + 1)
        if lost:
            self._requeue(lost)

    def _requeue(self, lost: list[SentPacket]) -> None:
        """Hand a lost packet's frames back to be sent again, in new packets."""
        for packet in lost:
            if packet.is_probe:
                self.pmtu_probes_lost += 1
                self.pmtu.on_probe_lost(packet.size)
                continue
            self.packets_lost += 1
            for chunk in packet.chunks:
                stream = self._send_streams[chunk.stream_id]
                stream.on_lost(chunk)
                if stream.has_retransmit():
                    self._sendable.setdefault(chunk.stream_id, stream)
            if packet.controls & CARRIED_MAX_DATA:
                self._send_max_data = True
            if packet.controls & CARRIED_STREAM_DEFAULT:
                self._send_stream_default = True
            self._credit_streams.update(packet.credit_streams)

    def _on_max_data(self, value: int) -> None:
        if value > self._peer_max_data:
            self._peer_max_data = value
            for stream_id, stream in self._send_streams.items():
                if stream.sendable_new_bytes() > 0:
                    self._sendable.setdefault(stream_id, stream)

    def _on_max_stream_data(self, stream_id: int, value: int) -> None:
        if stream_id == ALL_STREAMS:
            self._peer_stream_default = max(self._peer_stream_default, value)
            targets = list(self._send_streams.values())
        else:
            # Credit for a stream we never used needs no state: ignore it.
            known = self._send_streams.get(stream_id)
            targets = [] if known is None else [known]
        for stream in targets:
            if value > stream.max_stream_data:
                stream.max_stream_data = value
                if stream.sendable_new_bytes() > 0:
                    self._sendable.setdefault(stream.stream_id, stream)

    # --- sending ----------------------------------------------------------------------

    def send_message(self, stream_id: int, data: bytes) -> None:
        """Queue one message on a stream (LocalProtocolError if it is too big)."""
        if len(data) > self.max_message_bytes:
            raise LocalProtocolError(
                f"message of {len(data)} bytes exceeds the lane's limit of {self.max_message_bytes}"
            )
        if not 0 <= stream_id <= self._config.max_stream_id:
            raise LocalProtocolError(
                f"stream id {stream_id} outside 0..{self._config.max_stream_id}"
            )
        stream = self._send_streams.get(stream_id)
        if stream is None:
            stream = SendStream(stream_id, self._peer_stream_default)
            self._send_streams[stream_id] = stream
        stream.queue_message(data)
        self.unacked_send_bytes += MESSAGE_HEADER_BYTES + len(data)
        self.messages_sent += 1
        self._sendable.setdefault(stream_id, stream)

    def datagrams(self, now: float) -> list[bytes]:
        """Every packet that may go now: a PMTU probe, then ACKs, control frames and data."""
        out: list[bytes] = []
        probe = self.pmtu.next_probe_bytes()
        if probe is not None:
            out.append(self._build_probe(probe, now))
        for _ in range(MAX_PACKETS_PER_CALL):
            datagram = self._build_packet(now)
            if datagram is None:
                break
            out.append(datagram)
        return out

    def _ack_frame(self, now: float) -> tuple[bytes, int]:
        ranges = self._ack_ranges.descending()
        return encode_ack(ranges, now - self._largest_received_s), ranges[0][1] - 1

    def _has_work(self, now: float) -> bool:
        """Cheap test run before each packet: is there anything at all to put in one?"""
        if self.ping_pending or self._probe_pending or self._send_max_data:
            return True
        if self._send_stream_default or self._credit_streams:
            return True
        if self._sendable and self.cc.bytes_in_flight < self.cc.cwnd_bytes:
            return True
        return self._ack_pending and (
            self._ack_now or (self._ack_at is not None and self._ack_at <= now)
        )

    def _build_packet(self, now: float) -> bytes | None:
        if not self._has_work(now):
            return None
        budget = self.pmtu.current_bytes - PACKET_OVERHEAD_BYTES
        ack, largest_ack = b"", -1
        if self._ack_pending and self._ack_ranges:
            ack, largest_ack = self._ack_frame(now)
            budget -= len(ack)
        parts: list[Piece] = [ack]
        controls, credit_streams = 0, _NO_STREAMS
        if self._send_max_data or self._send_stream_default or self._credit_streams:
            controls, credit_streams = self._control_frames(parts)
            budget -= sum(len(p) for p in parts) - len(ack)
        eliciting = bool(controls or credit_streams)
        if self.ping_pending or self._probe_pending:
            parts.append(PING_FRAME)
            budget -= 1
            eliciting = True
        chunks: list[StreamChunk] = []
        cc = self.cc
        if self._sendable and (self._probe_pending or cc.bytes_in_flight < cc.cwnd_bytes):
            self._fill_streams(parts, chunks, budget)
            eliciting = eliciting or bool(chunks)
        if not eliciting:
            due = self._ack_now or (self._ack_at is not None and self._ack_at <= now)
            if not (ack and due):
                return None
        self.ping_pending = self._probe_pending = False
        number = self._next_number
        self._next_number += 1
        datagram = self._seal(number, b"".join(parts), now)
        if ack:
            self._ack_pending = self._ack_now = False
            self._ack_at = None
            self._ack_eliciting_unacked = 0
        if eliciting:
            self.recovery.on_packet_sent(
                SentPacket(
                    number,
                    now,
                    len(datagram),
                    True,
                    False,
                    chunks,
                    controls,
                    credit_streams,
                    largest_ack,
                )
            )
        return datagram

    def _control_frames(self, parts: list[Piece]) -> tuple[int, tuple[int, ...]]:
        """Append pending credit frames; they are tiny, so they always fit."""
        controls = 0
        if self._send_max_data:
            self._send_max_data = False
            parts.append(encode_max_data(self._max_data_granted))
            controls |= CARRIED_MAX_DATA
        if self._send_stream_default:
            self._send_stream_default = False
            window = self._config.initial_max_stream_data_bytes
            parts.append(encode_max_stream_data(ALL_STREAMS, window))
            controls |= CARRIED_STREAM_DEFAULT
        credit_streams: tuple[int, ...] = ()
        if self._credit_streams:
            # Bounded so control frames never crowd a packet out: 32 x 13 bytes.
            credit_streams = tuple(sorted(self._credit_streams)[:32])
            for stream_id in credit_streams:
                self._credit_streams.discard(stream_id)
                value = self._recv_streams[stream_id].max_stream_data
                parts.append(encode_max_stream_data(stream_id, value))
        return controls, credit_streams

    def _fill_streams(self, parts: list[Piece], chunks: list[StreamChunk], budget: int) -> None:
        """Fill the packet from the streams in round-robin order: lost bytes first, then new.

        Bulk streams (`BULK_STREAMS`: model artifacts) come after every other stream and only
        while the congestion window is less than `BULK_CWND_SHARE` full, so gossip and verify
        windows never wait behind a transfer's bytes, in the queue or in flight; and not at
        all while `bulk_held` (the node's CPU goes to a window it computes).
        """
        sendable = self._sendable
        cc = self.cc
        bulk_ok = not self.bulk_held and cc.bytes_in_flight < cc.cwnd_bytes * BULK_CWND_SHARE
        order = [s for s in sendable if s not in BULK_STREAMS]
        if bulk_ok:
            order += [s for s in sendable if s in BULK_STREAMS]
        for stream_id in order:
            if budget <= STREAM_HEADER_BYTES:
                break
            stream = sendable.pop(stream_id)
            while budget > STREAM_HEADER_BYTES and (
                stream.has_retransmit() or stream.sendable_new_bytes() > 0
            ):
                room = budget - STREAM_HEADER_BYTES
                chunk = stream.take_retransmit(room)
                if chunk is None:
                    lane_room = self._peer_max_data - self._sent_new_bytes
                    chunk = stream.take_new(min(room, lane_room)) if lane_room > 0 else None
                    if chunk is None:
                        break
                    self._sent_new_bytes += chunk.length
                parts.append(encode_stream_header(stream_id, chunk.offset, chunk.length))
                parts.extend(chunk.pieces)
                chunks.append(chunk)
                budget -= STREAM_HEADER_BYTES + chunk.length
            if stream.has_retransmit() or stream.sendable_new_bytes() > 0:
                sendable[stream_id] = stream  # back of the queue

    def _build_probe(self, size: int, now: float) -> bytes:
        """A PING padded to exactly `size` bytes on the wire (PADDING fills the rest)."""
        number = self._next_number
        self._next_number += 1
        plaintext = PING_FRAME + bytes(size - PACKET_OVERHEAD_BYTES - len(PING_FRAME))
        datagram = self._seal(number, plaintext, now)
        self.recovery.on_packet_sent(
            SentPacket(number, now, len(datagram), in_flight=False, is_probe=True)
        )
        self.pmtu.on_probe_sent()
        self.pmtu_probes_sent += 1
        return datagram

    def build_close(self, error_code: int, reason: str, now: float) -> bytes:
        """A packet carrying CLOSE (and an ACK if one is pending); recorded so its ACK shows."""
        parts: list[Piece] = []
        largest_ack = -1
        if self._ack_ranges:
            ack, largest_ack = self._ack_frame(now)
            parts.append(ack)
        parts.append(encode_close(error_code, reason))
        number = self._next_number
        self._next_number += 1
        datagram = self._seal(number, b"".join(parts), now)
        record = SentPacket(number, now, len(datagram), in_flight=False, controls=CARRIED_CLOSE)
        record.largest_ack = largest_ack
        self.recovery.on_packet_sent(record)
        return datagram

    def build_ack_only(self, now: float) -> bytes | None:
        """A bare ACK of everything received (the last word after the peer's CLOSE)."""
        if not self._ack_ranges:
            return None
        ack, _ = self._ack_frame(now)
        number = self._next_number
        self._next_number += 1
        return self._seal(number, ack, now)

    def _seal(self, number: int, plaintext: bytes, now: float) -> bytes:
        config = self._config
        schedule = self.keys
        if schedule.may_update() and (
            self.key_update_requested
            or schedule.send_packets_in_phase >= config.key_rotation_after_packets
            or now - schedule.send_phase_started_s >= config.key_rotation_after_s
        ):
            schedule.update_send(now)
            self.key_update_requested = False
        datagram = _seal(schedule, self.remote_lane_id, number, plaintext)
        self.packets_sent += 1
        self.bytes_sent += len(datagram)
        return datagram

    # --- timers -----------------------------------------------------------------------

    def deadline(self) -> float | None:
        """The earliest time `on_timer` has work: a delayed ACK or loss detection."""
        ack_at = None if self._ack_now else self._ack_at
        loss = None if self._probe_pending else self.recovery.deadline()
        if ack_at is None:
            return loss
        return ack_at if loss is None else min(ack_at, loss)

    def on_timer(self, now: float) -> None:
        """Run whatever is due by `now`; afterwards `deadline()` is later than `now`."""
        if self._ack_at is not None and self._ack_at <= now:
            self._ack_now = True
            self._ack_at = None
        for _ in range(4):
            if self._probe_pending:
                break
            due = self.recovery.deadline()
            if due is None or due > now:
                break
            lost, probe = self.recovery.on_timeout(now)
            self._requeue(lost)
            self._probe_pending = probe
