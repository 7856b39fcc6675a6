"""Asking an address for its node key, proven by the mesh secret (sans-IO).

Noise IK needs the responder's static key before the first message, but a bootstrap address
(`--join host:port`) or an mDNS hint carries none. A KEY_QUERY asks for it; the KEY_ANSWER
returns the node's Ed25519 public key (the lane's X25519 static key derives from it). Both are
tagged with a key derived from the mesh PSK, so only mesh members can ask, only mesh members
can answer, and an outsider can neither scan for meshd nodes nor substitute its own key. The
answer is never larger than the query (queries are padded), so a spoofed query cannot turn a
node into an amplifier. The lane handshake that follows still proves the key and the secret.

    KEY_QUERY   [0x05][0x00][lane id u32 = 0][nonce 16][padding 32][tag 16]     70 bytes
    KEY_ANSWER  [0x06][0x00][lane id u32 = 0][nonce 16][ed25519 public 32][tag 16]  70 bytes
"""

from __future__ import annotations

import hashlib
import hmac

from protocol.datagram import KIND_KEY_ANSWER, KIND_KEY_QUERY
from protocol.errors import RemoteProtocolError, UndecryptableError

NONCE_BYTES = 16
KEY_BYTES = 32
TAG_BYTES = 16
HEADER = 6
DATAGRAM_BYTES = HEADER + NONCE_BYTES + KEY_BYTES + TAG_BYTES


def query_key(psk: bytes) -> bytes:
    """The tag key for queries and answers of the mesh with this PSK."""
    return hashlib.blake2s(b"meshd key query v1", key=psk).digest()


def _tag(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2s(data, key=key, digest_size=TAG_BYTES).digest()


def make_query(tag_key: bytes, nonce: bytes) -> bytes:
    """A KEY_QUERY datagram for a fresh random `nonce` (16 bytes)."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError("nonce must be 16 bytes")
    body = bytes([KIND_KEY_QUERY, 0]) + bytes(4) + nonce + bytes(KEY_BYTES)
    return body + _tag(tag_key, body)


def answer_query(tag_key: bytes, datagram: bytes, public_key: bytes) -> bytes:
    """The KEY_ANSWER to a valid query; UndecryptableError if its tag is wrong,
    RemoteProtocolError for anything else."""
    if len(datagram) != DATAGRAM_BYTES or datagram[0] != KIND_KEY_QUERY:
        raise RemoteProtocolError("not a key query")
    body, tag = datagram[:-TAG_BYTES], datagram[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(tag_key, body)):
        raise UndecryptableError("key query not tagged with this mesh's secret")
    nonce = datagram[HEADER : HEADER + NONCE_BYTES]
    answer = bytes([KIND_KEY_ANSWER, 0]) + bytes(4) + nonce + public_key
    return answer + _tag(tag_key, answer)


def read_answer(tag_key: bytes, datagram: bytes) -> tuple[bytes, bytes]:
    """(nonce, Ed25519 public key) of a valid answer; UndecryptableError if its tag is wrong,
    RemoteProtocolError otherwise."""
    if len(datagram) != DATAGRAM_BYTES or datagram[0] != KIND_KEY_ANSWER:
        raise RemoteProtocolError("not a key answer")
    body, tag = datagram[:-TAG_BYTES], datagram[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(tag_key, body)):
        raise UndecryptableError("key answer not tagged with this mesh's secret")
    nonce = datagram[HEADER : HEADER + NONCE_BYTES]
    return nonce, datagram[HEADER + NONCE_BYTES : HEADER + NONCE_BYTES + KEY_BYTES]
