"""The outermost layout every meshd datagram shares, so one socket can demultiplex them.

Byte 0 is the kind. Every kind except INITIATION carries the *receiver's* lane id (chosen by
the receiver, as QUIC connection ids are) as a big-endian u32 at bytes 2..6, so an endpoint
routes a datagram to its lane without parsing further. Byte 1 is the handshake wire version
on handshake kinds and kind-specific flags on DATA.

    INITIATION  [0x01][version u8][sender lane id u32] noise msg 1 ... [mac1 16B]
    RESPONSE    [0x02][version u8][receiver lane id u32][sender lane id u32] noise msg 2 [mac1]
    REFUSAL     [0x03][0x00][receiver lane id u32][n u8][n x supported version u8][reason]
    DATA        [0x04][flags u8][receiver lane id u32] packet number, AEAD ciphertext ...
    KEY_QUERY   [0x05][0x00][0 u32] nonce, padding, tag    (protocol/keyquery.py; no lane)
    KEY_ANSWER  [0x06][0x00][0 u32] nonce, Ed25519 key, tag
    PROBE       [0x07][0x00][0 u32] nonce, tag               (protocol/punch.py; no lane)
    RELAY       [0x08][0x00][relay session id u32] inner datagram, to the relay
    RELAYED     [0x09][0x00][relay session id u32] inner datagram, from the relay
    (0x0A..0x0F reserved for later kinds.)
"""

from __future__ import annotations

from protocol.errors import RemoteProtocolError

KIND_INITIATION = 0x01
KIND_RESPONSE = 0x02
KIND_REFUSAL = 0x03
KIND_DATA = 0x04
KIND_KEY_QUERY = 0x05
KIND_KEY_ANSWER = 0x06
KIND_PROBE = 0x07
KIND_RELAY = 0x08
KIND_RELAYED = 0x09

KNOWN_KINDS = frozenset(
    {
        KIND_INITIATION,
        KIND_RESPONSE,
        KIND_REFUSAL,
        KIND_DATA,
        KIND_KEY_QUERY,
        KIND_KEY_ANSWER,
        KIND_PROBE,
        KIND_RELAY,
        KIND_RELAYED,
    }
)

# Largest UDP payload we will ever accept or emit (IPv4 limit); anything larger is garbage.
MAX_DATAGRAM_BYTES = 65507


def peek_kind(data: bytes) -> int:
    """The kind byte of a datagram; raises RemoteProtocolError if it is empty or unknown."""
    if not data:
        raise RemoteProtocolError("empty datagram")
    if len(data) > MAX_DATAGRAM_BYTES:
        raise RemoteProtocolError("datagram larger than any UDP payload")
    kind = data[0]
    if kind not in KNOWN_KINDS:
        raise RemoteProtocolError(f"unknown datagram kind 0x{kind:02x}")
    return kind


def peek_receiver_lane_id(data: bytes) -> int:
    """The receiver lane id of any non-INITIATION datagram."""
    kind = peek_kind(data)
    if kind == KIND_INITIATION:
        raise RemoteProtocolError("an initiation carries no receiver lane id")
    if len(data) < 6:
        raise RemoteProtocolError("datagram too short for a lane id")
    return int.from_bytes(data[2:6], "big")
