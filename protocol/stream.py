"""Streams: ordered byte streams that carry length-prefixed messages, with flow control.

Each message on a stream is `[length u32 big-endian][length bytes]`; the receiver delivers
whole messages, in order, once each. A stream id names one direction's stream: stream 3 from
A to B and stream 3 from B to A are independent.
"""

from __future__ import annotations

import heapq
import struct
from collections import deque
from dataclasses import dataclass

from protocol.errors import RemoteProtocolError
from protocol.ranges import RangeSet

MESSAGE_HEADER = struct.Struct(">I")
MESSAGE_HEADER_BYTES = MESSAGE_HEADER.size

Piece = bytes | memoryview

# Credit every sender may assume before the first MAX_DATA / MAX_STREAM_DATA arrives; a
# receiver never grants less. Larger windows are announced right after the handshake.
INITIAL_MAX_DATA_BYTES = 1024 * 1024
INITIAL_MAX_STREAM_DATA_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """Bytes `[offset, offset + length)` of a stream, as the pieces they were queued in."""

    stream_id: int
    offset: int
    length: int
    pieces: tuple[Piece, ...]


def split_pieces(pieces: tuple[Piece, ...], n: int) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """The first `n` bytes of `pieces` and the rest, without copying the bytes."""
    head: list[Piece] = []
    for i, piece in enumerate(pieces):
        size = len(piece)
        if n >= size:
            head.append(piece)
            n -= size
            if n == 0:
                return tuple(head), pieces[i + 1 :]
            continue
        view = memoryview(piece)
        head.append(view[:n])
        return tuple(head), (view[n:], *pieces[i + 1 :])
    return tuple(head), ()


class SendStream:
    """The sending half of one stream: queued bytes, retransmissions, peer credit, acks."""

    __slots__ = (
        "_acked",
        "_acked_bytes",
        "_next_offset",
        "_queue",
        "_queued_bytes",
        "_retransmit",
        "_total_bytes",
        "max_stream_data",
        "stream_id",
    )

    def __init__(self, stream_id: int, max_stream_data: int) -> None:
        self.stream_id = stream_id
        self.max_stream_data = max_stream_data
        self._queue: deque[Piece] = deque()
        self._queued_bytes = 0
        self._next_offset = 0
        self._total_bytes = 0
        self._retransmit: list[tuple[int, int, StreamChunk]] = []
        self._acked = RangeSet()
        self._acked_bytes = 0

    def queue_message(self, data: bytes) -> None:
        """Frame and queue one message (the data is referenced, not copied)."""
        header = MESSAGE_HEADER.pack(len(data))
        self._queue.append(header)
        if data:
            self._queue.append(data)
        size = MESSAGE_HEADER_BYTES + len(data)
        self._queued_bytes += size
        self._total_bytes += size

    @property
    def unacked_bytes(self) -> int:
        """Bytes queued here that the peer has not acknowledged yet."""
        return self._total_bytes - self._acked_bytes

    def has_retransmit(self) -> bool:
        """Whether lost bytes wait to be resent (they need no new credit)."""
        return bool(self._retransmit)

    def sendable_new_bytes(self) -> int:
        """New bytes the peer's stream credit allows now."""
        return min(self._queued_bytes, self.max_stream_data - self._next_offset)

    def blocked_on_credit(self) -> bool:
        """Whether queued bytes wait for MAX_STREAM_DATA from the peer."""
        return self._queued_bytes > 0 and self._next_offset >= self.max_stream_data

    def take_retransmit(self, budget: int) -> StreamChunk | None:
        """Up to `budget` bytes of the lowest lost chunk, splitting it if it does not fit."""
        while self._retransmit:
            offset, length, chunk = self._retransmit[0]
            if self._is_acked(offset, offset + length):
                heapq.heappop(self._retransmit)
                continue
            heapq.heappop(self._retransmit)
            if length <= budget:
                return chunk
            head, tail = split_pieces(chunk.pieces, budget)
            rest = StreamChunk(self.stream_id, offset + budget, length - budget, tail)
            heapq.heappush(self._retransmit, (rest.offset, rest.length, rest))
            return StreamChunk(self.stream_id, offset, budget, head)
        return None

    def take_new(self, budget: int) -> StreamChunk | None:
        """Up to `budget` new bytes (the caller already applied lane-wide credit)."""
        n = min(budget, self.sendable_new_bytes())
        if n <= 0:
            return None
        queue = self._queue
        pieces: list[Piece] = []
        remaining = n
        while remaining:
            piece = queue[0]
            size = len(piece)
            if size <= remaining:
                pieces.append(queue.popleft())
                remaining -= size
            else:
                view = memoryview(piece)
                pieces.append(view[:remaining])
                queue[0] = view[remaining:]
                remaining = 0
        chunk = StreamChunk(self.stream_id, self._next_offset, n, tuple(pieces))
        self._next_offset += n
        self._queued_bytes -= n
        return chunk

    def on_acked(self, chunk: StreamChunk) -> int:
        """The peer acknowledged a chunk; returns how many bytes that newly acknowledged."""
        new = self._acked.add(chunk.offset, chunk.offset + chunk.length)
        self._acked_bytes += new
        return new

    def on_lost(self, chunk: StreamChunk) -> None:
        """A chunk's packet was lost: resend it unless another copy was acked meanwhile."""
        if not self._is_acked(chunk.offset, chunk.offset + chunk.length):
            heapq.heappush(self._retransmit, (chunk.offset, chunk.length, chunk))

    def _is_acked(self, start: int, stop: int) -> bool:
        return self._acked.covers(start, stop)


class RecvStream:
    """The receiving half of one stream: reassembly, message framing, credit to grant.

    Contiguous bytes are kept as views into the decrypted packets until a message is whole;
    then one join copies them out, so each message byte is copied once on the way in.
    """

    __slots__ = (
        "_header",
        "_heap",
        "_max_message_bytes",
        "_need",
        "_parts",
        "_parts_bytes",
        "_pending",
        "_window",
        "consumed",
        "highest_offset",
        "max_stream_data",
        "stream_id",
    )

    def __init__(self, stream_id: int, window: int, max_message_bytes: int) -> None:
        self.stream_id = stream_id
        self._window = window
        self.max_stream_data = window
        self._max_message_bytes = max_message_bytes
        self.consumed = 0  # contiguous bytes taken into message framing
        self.highest_offset = 0  # highest byte offset seen, for lane-wide flow control
        self._pending: dict[int, Piece] = {}
        self._heap: list[int] = []
        self._header = b""  # a message header split across packets
        self._need = -1  # bytes of the current message, or -1 while reading its header
        self._parts: list[Piece] = []
        self._parts_bytes = 0

    def receive(self, offset: int, data: Piece) -> list[bytes]:
        """Take a STREAM frame's data; returns the messages it completed, in order."""
        end = offset + len(data)
        if end > self.max_stream_data:
            raise RemoteProtocolError(f"stream {self.stream_id} exceeded its flow control credit")
        if end > self.highest_offset:
            self.highest_offset = end
        if end <= self.consumed or not data:
            return []  # a duplicate of bytes already delivered
        if offset > self.consumed:
            known = self._pending.get(offset)
            if known is None or len(known) < len(data):
                if known is None:
                    heapq.heappush(self._heap, offset)
                self._pending[offset] = data
            return []
        if offset < self.consumed:
            data = data[self.consumed - offset :]
        messages: list[bytes] = []
        self._feed(data, messages)
        self._drain_pending(messages)
        return messages

    def _drain_pending(self, messages: list[bytes]) -> None:
        heap, pending = self._heap, self._pending
        while heap and heap[0] <= self.consumed:
            offset = heapq.heappop(heap)
            data = pending.pop(offset)
            if offset + len(data) > self.consumed:
                self._feed(data[self.consumed - offset :], messages)

    def _feed(self, data: Piece, messages: list[bytes]) -> None:
        """Contiguous bytes in; whole messages appended to `messages`."""
        self.consumed += len(data)
        pos, n = 0, len(data)
        while pos < n or self._need == 0:
            if self._need < 0:
                if not self._header and n - pos >= MESSAGE_HEADER_BYTES:
                    (length,) = MESSAGE_HEADER.unpack_from(data, pos)
                    pos += MESSAGE_HEADER_BYTES
                else:
                    take = min(MESSAGE_HEADER_BYTES - len(self._header), n - pos)
                    self._header += bytes(data[pos : pos + take])
                    pos += take
                    if len(self._header) < MESSAGE_HEADER_BYTES:
                        return
                    (length,) = MESSAGE_HEADER.unpack(self._header)
                    self._header = b""
                if length > self._max_message_bytes:
                    raise RemoteProtocolError(
                        f"message of {length} bytes on stream {self.stream_id} "
                        f"exceeds {self._max_message_bytes}"
                    )
                self._need = length
            need = self._need - self._parts_bytes
            if n - pos < need:
                if pos < n:
                    self._parts.append(data[pos:])
                    self._parts_bytes += n - pos
                return
            if self._parts:
                self._parts.append(data[pos : pos + need])
                messages.append(b"".join(self._parts))
                self._parts = []
                self._parts_bytes = 0
            else:
                messages.append(bytes(data[pos : pos + need]))
            pos += need
            self._need = -1

    def credit_update(self) -> int | None:
        """A new MAX_STREAM_DATA to grant once half the window was consumed, else None."""
        if self.max_stream_data - self.consumed <= self._window // 2:
            self.max_stream_data = self.consumed + self._window
            return self.max_stream_data
        return None
