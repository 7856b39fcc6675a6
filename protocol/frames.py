"""Frames: the typed units inside a DATA packet's decrypted payload.

Every frame starts with a type byte; all integers are big-endian and fixed-width, so each
header is one pre-compiled `struct` call. Layouts (see docs/protocol.md):

    PADDING         0x00  the rest of the payload is padding (so it is always last)
    PING            0x01
    ACK             0x02  ack_delay_us u32, n u16, n x (start u64, stop u64)  [highest first]
    STREAM          0x03  stream_id u32, offset u64, length u32, data
    MAX_DATA        0x04  max_data u64
    MAX_STREAM_DATA 0x05  stream_id u32, max_stream_data u64
    CLOSE           0x06  error_code u16, reason_len u16, reason (UTF-8)

Decoders take the whole payload and the position just past the type byte, return the frame
and the position after it, and raise RemoteProtocolError (and nothing else) on bad input.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from protocol.errors import RemoteProtocolError

PADDING = 0x00
PING = 0x01
ACK = 0x02
STREAM = 0x03
MAX_DATA = 0x04
MAX_STREAM_DATA = 0x05
CLOSE = 0x06

# An ACK frame carries at most this many ranges; the receiver keeps no more than that.
MAX_ACK_RANGES = 64
MAX_CLOSE_REASON_BYTES = 1024
# Offsets and credits stay below 2**62 as in QUIC, which leaves room for sums without overflow.
MAX_OFFSET = 2**62 - 1

# Close error codes.
CLOSE_NO_ERROR = 0
CLOSE_PROTOCOL_ERROR = 1
# MAX_STREAM_DATA for this stream id sets the credit of every stream (see docs/protocol.md).
ALL_STREAMS = 0xFFFFFFFF

# Decoders read plaintexts as bytes or as memoryviews (the lane's case, to avoid copies).
Buffer = bytes | memoryview

_ACK_HEAD = struct.Struct(">BIH")
_ACK_RANGE = struct.Struct(">QQ")
_STREAM_HEAD = struct.Struct(">BIQI")
_MAX_DATA = struct.Struct(">BQ")
_MAX_STREAM_DATA = struct.Struct(">BIQ")
_CLOSE_HEAD = struct.Struct(">BHH")

STREAM_HEADER_BYTES = _STREAM_HEAD.size
ACK_HEADER_BYTES = _ACK_HEAD.size
ACK_RANGE_BYTES = _ACK_RANGE.size
MAX_DATA_BYTES = _MAX_DATA.size
MAX_STREAM_DATA_BYTES = _MAX_STREAM_DATA.size
PING_FRAME = bytes([PING])


@dataclass(frozen=True, slots=True)
class AckFrame:
    """Acknowledged packet numbers as `[start, stop)` ranges, highest first."""

    ack_delay_s: float
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class StreamFrame:
    """`data` of stream `stream_id` starting at byte `offset` of that stream."""

    stream_id: int
    offset: int
    data: Buffer


@dataclass(frozen=True, slots=True)
class MaxDataFrame:
    """The peer may send stream bytes up to this lane-wide total."""

    max_data: int


@dataclass(frozen=True, slots=True)
class MaxStreamDataFrame:
    """The peer may send stream `stream_id` up to this offset."""

    stream_id: int
    max_stream_data: int


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """The sender is closing the lane."""

    error_code: int
    reason: str


@dataclass(frozen=True, slots=True)
class PingFrame:
    """Asks for an acknowledgement and proves liveness; carries nothing."""


@dataclass(frozen=True, slots=True)
class PaddingFrame:
    """Fills the rest of the packet (PMTU probes)."""

    length: int


Frame = (
    AckFrame
    | StreamFrame
    | MaxDataFrame
    | MaxStreamDataFrame
    | CloseFrame
    | PingFrame
    | PaddingFrame
)

_PING = PingFrame()


# --- encoders ---------------------------------------------------------------------------


def encode_ack(ranges: list[tuple[int, int]], ack_delay_s: float) -> bytes:
    """An ACK frame for `ranges` (highest first, at most MAX_ACK_RANGES of them)."""
    delay_us = min(int(ack_delay_s * 1_000_000), 0xFFFFFFFF)
    parts = [_ACK_HEAD.pack(ACK, delay_us, len(ranges))]
    pack = _ACK_RANGE.pack
    parts.extend(pack(start, stop) for start, stop in ranges)
    return b"".join(parts)


def encode_stream_header(stream_id: int, offset: int, length: int) -> bytes:
    """The header of a STREAM frame; `length` bytes of data follow it."""
    return _STREAM_HEAD.pack(STREAM, stream_id, offset, length)


def encode_max_data(max_data: int) -> bytes:
    """A MAX_DATA frame."""
    return _MAX_DATA.pack(MAX_DATA, max_data)


def encode_max_stream_data(stream_id: int, max_stream_data: int) -> bytes:
    """A MAX_STREAM_DATA frame."""
    return _MAX_STREAM_DATA.pack(MAX_STREAM_DATA, stream_id, max_stream_data)


def encode_close(error_code: int, reason: str) -> bytes:
    """A CLOSE frame; the reason is cut to MAX_CLOSE_REASON_BYTES on a character boundary."""
    raw = reason.encode("utf-8")[:MAX_CLOSE_REASON_BYTES]
    raw = raw.decode("utf-8", "ignore").encode("utf-8")
    return _CLOSE_HEAD.pack(CLOSE, error_code, len(raw)) + raw


# --- decoders ---------------------------------------------------------------------------


def decode_ack(buf: Buffer, pos: int) -> tuple[AckFrame, int]:
    """Decode an ACK frame whose type byte sits at `pos`."""
    end = pos + _ACK_HEAD.size
    if end > len(buf):
        raise RemoteProtocolError("truncated ACK frame")
    _, delay_us, count = _ACK_HEAD.unpack_from(buf, pos)
    if count == 0 or count > MAX_ACK_RANGES:
        raise RemoteProtocolError(f"ACK frame with {count} ranges")
    stop_all = end + count * _ACK_RANGE.size
    if stop_all > len(buf):
        raise RemoteProtocolError("truncated ACK ranges")
    if count == 1:  # the common case, without building a format string
        ranges: tuple[tuple[int, int], ...] = (_ACK_RANGE.unpack_from(buf, end),)
    else:
        flat = struct.unpack_from(f">{2 * count}Q", buf, end)
        ranges = tuple(zip(flat[0::2], flat[1::2], strict=True))
    floor = MAX_OFFSET + 1
    for start, stop in ranges:
        # Highest first, non-empty, disjoint and not adjacent.
        if not start < stop < floor:
            raise RemoteProtocolError("ACK ranges out of order or empty")
        floor = start
    return AckFrame(delay_us / 1_000_000, ranges), stop_all


def decode_stream(buf: Buffer, pos: int) -> tuple[StreamFrame, int]:
    """Decode a STREAM frame whose type byte sits at `pos`."""
    end = pos + _STREAM_HEAD.size
    if end > len(buf):
        raise RemoteProtocolError("truncated STREAM frame")
    _, stream_id, offset, length = _STREAM_HEAD.unpack_from(buf, pos)
    stop = end + length
    if stop > len(buf):
        raise RemoteProtocolError("STREAM data runs past the packet")
    if offset + length > MAX_OFFSET:
        raise RemoteProtocolError("STREAM offset beyond 2**62")
    return StreamFrame(stream_id, offset, buf[end:stop]), stop


def decode_max_data(buf: Buffer, pos: int) -> tuple[MaxDataFrame, int]:
    """Decode a MAX_DATA frame whose type byte sits at `pos`."""
    end = pos + _MAX_DATA.size
    if end > len(buf):
        raise RemoteProtocolError("truncated MAX_DATA frame")
    _, value = _MAX_DATA.unpack_from(buf, pos)
    if value > MAX_OFFSET:
        raise RemoteProtocolError("MAX_DATA beyond 2**62")
    return MaxDataFrame(value), end


def decode_max_stream_data(buf: Buffer, pos: int) -> tuple[MaxStreamDataFrame, int]:
    """Decode a MAX_STREAM_DATA frame whose type byte sits at `pos`."""
    end = pos + _MAX_STREAM_DATA.size
    if end > len(buf):
        raise RemoteProtocolError("truncated MAX_STREAM_DATA frame")
    _, stream_id, value = _MAX_STREAM_DATA.unpack_from(buf, pos)
    if value > MAX_OFFSET:
        raise RemoteProtocolError("MAX_STREAM_DATA beyond 2**62")
    return MaxStreamDataFrame(stream_id, value), end


def decode_close(buf: Buffer, pos: int) -> tuple[CloseFrame, int]:
    """Decode a CLOSE frame whose type byte sits at `pos`."""
    end = pos + _CLOSE_HEAD.size
    if end > len(buf):
        raise RemoteProtocolError("truncated CLOSE frame")
    _, code, length = _CLOSE_HEAD.unpack_from(buf, pos)
    if length > MAX_CLOSE_REASON_BYTES or end + length > len(buf):
        raise RemoteProtocolError("CLOSE reason too long or truncated")
    try:
        reason = str(buf[end : end + length], "utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError("CLOSE reason is not UTF-8") from exc
    return CloseFrame(code, reason), end + length


def decode_frames(payload: Buffer) -> list[Frame]:
    """All frames of a decrypted payload, in order; an empty payload is an error."""
    if not payload:
        raise RemoteProtocolError("packet without frames")
    frames: list[Frame] = []
    pos, n = 0, len(payload)
    while pos < n:
        kind = payload[pos]
        frame: Frame
        if kind == STREAM:
            frame, pos = decode_stream(payload, pos)
        elif kind == ACK:
            frame, pos = decode_ack(payload, pos)
        elif kind == PING:
            frame, pos = _PING, pos + 1
        elif kind == PADDING:
            frame, pos = PaddingFrame(n - pos), n
        elif kind == MAX_DATA:
            frame, pos = decode_max_data(payload, pos)
        elif kind == MAX_STREAM_DATA:
            frame, pos = decode_max_stream_data(payload, pos)
        elif kind == CLOSE:
            frame, pos = decode_close(payload, pos)
        else:
            raise RemoteProtocolError(f"unknown frame type 0x{kind:02x}")
        frames.append(frame)
    return frames
