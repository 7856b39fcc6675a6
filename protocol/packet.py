"""DATA packets: header layout, AEAD protection, key update and the replay window.

    DATA  [0x04][flags u8][receiver lane id u32][packet number u64] ciphertext [tag 16 B]

The 14-byte header is the AEAD associated data; the packet number is the AEAD counter, so a
packet number is never reused under one key (retransmitted frames travel in new packets).
Flags bit 0 is the key phase; the other bits are reserved and must be zero.
"""

from __future__ import annotations

import struct
from typing import Any

from protocol.datagram import KIND_DATA, MAX_DATAGRAM_BYTES
from protocol.errors import RemoteProtocolError, UndecryptableError
from protocol.noise import aead_decrypt, aead_encrypt, hkdf

try:
    # PyNaCl's cffi handle to libsodium. The public wrappers re-check and re-format their
    # arguments on every call, which costs as much as encrypting 64 KiB; packets take this
    # direct path. Same construction as noise.aead_*: ChaCha20-Poly1305 (IETF), nonce =
    # 4 zero bytes + little-endian counter (tests check the two agree byte for byte).
    from nacl._sodium import ffi as _ffi
    from nacl._sodium import lib as _lib

    _FAST: Any = _lib
except ImportError:  # pragma: no cover - other PyNaCl builds: the public API still works
    _FAST = None

HEADER = struct.Struct(">BBIQ")
HEADER_BYTES = HEADER.size
TAG_BYTES = 16
# Bytes a DATA packet spends on anything but frames.
PACKET_OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
FLAG_KEY_PHASE = 0x01
_RESERVED_FLAGS = 0xFF & ~FLAG_KEY_PHASE
_KEY_UPDATE_LABEL = b"meshd key update"


_NONCE_PREFIX = bytes(4)
_COUNTER = struct.Struct("<Q")


def _nonce(counter: int) -> bytes:
    return _NONCE_PREFIX + _COUNTER.pack(counter)


def protect(key: bytes, header: bytes, number: int, plaintext: bytes) -> bytes:
    """`header` followed by the AEAD ciphertext of `plaintext` (header as associated data)."""
    if _FAST is None:
        return header + aead_encrypt(key, number, header, plaintext)
    size = len(plaintext)
    head = len(header)
    out = _ffi.new("unsigned char[]", head + size + TAG_BYTES)
    _ffi.memmove(out, header, head)
    _FAST.crypto_aead_chacha20poly1305_ietf_encrypt(
        out + head, _ffi.NULL, plaintext, size, header, head, _ffi.NULL, _nonce(number), key
    )
    return _ffi.buffer(out)[:]  # type: ignore[no-any-return]


def unprotect(key: bytes, data: bytes, number: int) -> memoryview:
    """The plaintext of a DATA datagram, as a view (no copy); RemoteProtocolError if forged."""
    if _FAST is None:
        header = data[:HEADER_BYTES]
        return memoryview(aead_decrypt(key, number, header, data[HEADER_BYTES:]))
    size = len(data) - HEADER_BYTES - TAG_BYTES
    if size < 0:
        raise RemoteProtocolError("ciphertext shorter than its tag")
    out = _ffi.new("unsigned char[]", max(size, 1))
    with memoryview(data) as view:
        ok = _FAST.crypto_aead_chacha20poly1305_ietf_decrypt(
            out,
            _ffi.NULL,
            _ffi.NULL,
            _ffi.from_buffer(view[HEADER_BYTES:]),
            size + TAG_BYTES,
            _ffi.from_buffer(view[:HEADER_BYTES]),
            HEADER_BYTES,
            _nonce(number),
            key,
        )
    if ok != 0:
        raise UndecryptableError("AEAD authentication failed")
    return memoryview(_ffi.buffer(out, size))


def next_key(key: bytes) -> bytes:
    """The key of the next key phase, derived one way from the current one."""
    return hkdf(key, _KEY_UPDATE_LABEL, 2)[0]


def parse_header(data: bytes) -> tuple[int, int, int]:
    """`(flags, receiver lane id, packet number)` of a DATA datagram, checked for shape only."""
    if len(data) < PACKET_OVERHEAD_BYTES + 1:
        raise RemoteProtocolError("DATA datagram too short")
    if len(data) > MAX_DATAGRAM_BYTES:
        raise RemoteProtocolError("DATA datagram larger than any UDP payload")
    kind, flags, lane_id, number = HEADER.unpack_from(data)
    if kind != KIND_DATA:
        raise RemoteProtocolError("not a DATA datagram")
    if flags & _RESERVED_FLAGS:
        raise RemoteProtocolError("reserved DATA flags set")
    return flags, lane_id, number


class ReplayWindow:
    """Which packet numbers were already accepted, over the last `size` of them.

    A number at or below `largest - size` counts as seen: it is too old to tell, so it is
    refused (WireGuard does the same with its 8128-packet bitmap). Only packets that
    authenticated are recorded, so forgeries cannot poison the window.
    """

    __slots__ = ("_largest", "_seen", "_size")

    def __init__(self, size: int) -> None:
        self._size = size
        self._largest = -1
        self._seen: set[int] = set()

    @property
    def largest(self) -> int:
        """The highest packet number accepted so far (-1 before any)."""
        return self._largest

    def is_fresh(self, number: int) -> bool:
        """Whether `number` was never accepted and is still inside the window."""
        if number > self._largest:
            return True
        return number > self._largest - self._size and number not in self._seen

    def record(self, number: int) -> None:
        """Remember `number` as accepted."""
        self._seen.add(number)
        if number > self._largest:
            self._largest = number
            # Prune lazily: only once the set has grown to twice the window.
            if len(self._seen) > 2 * self._size:
                floor = number - self._size
                self._seen = {n for n in self._seen if n > floor}


class KeySchedule:
    """Send and receive keys of one lane across QUIC-style key updates.

    Each direction's keys form a one-way chain (`next_key`). Generation g uses key phase
    bit g & 1. A side starts an update only once the peer has followed the previous one
    (send and receive generations equal), so the receiver never has to guess more than one
    step ahead; it keeps the previous receive key for `retention_s` for reordered packets.
    """

    def __init__(self, send_key: bytes, recv_key: bytes, now: float, retention_s: float) -> None:
        self.send_key = send_key
        self.send_generation = 0
        self.send_phase_started_s = now
        self.send_packets_in_phase = 0
        self._recv_key = recv_key
        self.recv_generation = 0
        self._recv_phase_first_number = 0
        self._prev_recv_key: bytes | None = None
        self._prev_expires_s = 0.0
        self._next_recv_key: bytes | None = None
        self._retention_s = retention_s

    @property
    def send_phase_bit(self) -> int:
        """The key phase flag for packets sent now."""
        return self.send_generation & 1

    def may_update(self) -> bool:
        """Whether the peer followed our last update, so another one is allowed."""
        return self.send_generation == self.recv_generation

    def update_send(self, now: float) -> None:
        """Move the send side to the next key (initiating or following an update)."""
        self.send_key = next_key(self.send_key)
        self.send_generation += 1
        self.send_phase_started_s = now
        self.send_packets_in_phase = 0

    def seal(self, header: bytes, number: int, plaintext: bytes) -> bytes:
        """The datagram: `header`, then `plaintext` encrypted under the current send key."""
        self.send_packets_in_phase += 1
        return protect(self.send_key, header, number, plaintext)

    def open(self, data: bytes, flags: int, number: int, now: float) -> memoryview:
        """Authenticate and decrypt one packet; raises RemoteProtocolError if it does not.

        A packet that authenticates under the next receive key moves the receive side one
        generation on (and the send side too, if it had not moved already).
        """
        phase = flags & FLAG_KEY_PHASE
        if phase == self.recv_generation & 1:
            return unprotect(self._recv_key, data, number)
        if number < self._recv_phase_first_number:
            # Older than the current phase: sent under the previous key.
            if self._prev_recv_key is None or now > self._prev_expires_s:
                self._prev_recv_key = None
                raise UndecryptableError("packet under a discarded key phase")
            return unprotect(self._prev_recv_key, data, number)
        if self._next_recv_key is None:
            self._next_recv_key = next_key(self._recv_key)
        plaintext = unprotect(self._next_recv_key, data, number)
        self._prev_recv_key = self._recv_key
        self._prev_expires_s = now + self._retention_s
        self._recv_key = self._next_recv_key
        self._next_recv_key = None
        self.recv_generation += 1
        self._recv_phase_first_number = number
        if self.send_generation < self.recv_generation:
            self.update_send(now)
        return plaintext


def seal_packet(keys: KeySchedule, receiver_lane_id: int, number: int, plaintext: bytes) -> bytes:
    """A complete DATA datagram carrying `plaintext` (the encoded frames)."""
    header = HEADER.pack(KIND_DATA, keys.send_phase_bit, receiver_lane_id, number)
    return keys.seal(header, number, plaintext)
