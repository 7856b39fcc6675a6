"""meshd's lane-opening handshake: Noise IKpsk2 in WireGuard's manner, sans-IO.

One round trip. The initiator sends INITIATION (Noise message 1 carrying a `HelloPayload`), the
responder answers RESPONSE (Noise message 2 carrying a `ResponsePayload`) or, when the versions
do not meet, a REFUSAL. Datagram layouts are in `protocol.datagram`; docs/protocol.md
(section "Handshake") is the full specification.

The responder does only cheap work for garbage: a length check, the kind byte and a keyed
BLAKE2s (mac1) come before any Diffie-Hellman, so a flood from anyone who does not know the
responder's public key costs one hash per datagram.

Outcomes, by the package's error contract:
- `RemoteProtocolError`: drop the datagram silently (and count it by its `drop_reason`).
- `HandshakeRejected` (a RemoteProtocolError) from `Responder.handle_initiation`: an
  initiation meant for us (mac1 holds) that we refuse; count it by its `refusal`, drop it.
- `InitiationRefused` (a HandshakeRejected): the same, and send its `.datagram`, a REFUSAL,
  back to the sender.
- `Initiator.handle_refusal` *returns* a `VersionRefused` (a LocalProtocolError naming the
  peer's versions) for the caller to raise or report; bad bytes raise RemoteProtocolError.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from protocol import noise
from protocol.datagram import KIND_INITIATION, KIND_REFUSAL, KIND_RESPONSE
from protocol.errors import (
    HandshakeRejected,
    LocalProtocolError,
    RemoteProtocolError,
    UndecryptableError,
)

HANDSHAKE_VERSION = 1
SUPPORTED_HANDSHAKE_VERSIONS: tuple[int, ...] = (HANDSHAKE_VERSION,)
PROLOGUE_LABEL = b"meshd lane v1"

MAC_BYTES = 16
INITIATION_HEADER_BYTES = 6  # kind, version, sender lane id
RESPONSE_HEADER_BYTES = 10  # kind, version, receiver lane id, sender lane id
REFUSAL_HEADER_BYTES = 7  # kind, flags, receiver lane id, version count
MAX_PAYLOAD_BYTES = 1024  # plaintext of either handshake payload
MAX_VERSIONS = 32
MAX_CAPABILITIES = 32
MAX_CAPABILITY_CHARS = 32
MAX_REASON_BYTES = 64
MAX_LANE_ID = 2**32 - 1
MAX_MESSAGE_BYTES_LIMIT = 2**32 - 1

# Sizes of the two Noise messages of IKpsk2 around their encrypted payloads.
_MSG1_FIXED = noise.DHLEN + (noise.DHLEN + noise.TAGLEN) + noise.TAGLEN
_MSG2_FIXED = noise.DHLEN + noise.TAGLEN
MIN_INITIATION_BYTES = INITIATION_HEADER_BYTES + _MSG1_FIXED + MAC_BYTES
MAX_INITIATION_BYTES = MIN_INITIATION_BYTES + MAX_PAYLOAD_BYTES
MIN_RESPONSE_BYTES = RESPONSE_HEADER_BYTES + _MSG2_FIXED + MAC_BYTES
MAX_RESPONSE_BYTES = MIN_RESPONSE_BYTES + MAX_PAYLOAD_BYTES

Version = Annotated[int, msgspec.Meta(ge=0, le=255)]
Capability = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CAPABILITY_CHARS)]
LaneId = Annotated[int, msgspec.Meta(ge=0, le=MAX_LANE_ID)]
MessageBytes = Annotated[int, msgspec.Meta(ge=1, le=MAX_MESSAGE_BYTES_LIMIT)]


class HelloPayload(msgspec.Struct, frozen=True):
    """Message 1 payload: what the initiator speaks. One-letter wire names keep it small."""

    timestamp_ns: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = msgspec.field(name="t")
    versions: Annotated[list[Version], msgspec.Meta(min_length=1, max_length=MAX_VERSIONS)] = (
        msgspec.field(name="v")
    )
    capabilities: Annotated[list[Capability], msgspec.Meta(max_length=MAX_CAPABILITIES)] = (
        msgspec.field(name="c")
    )
    max_message_bytes: MessageBytes = msgspec.field(name="m")


class ResponsePayload(msgspec.Struct, frozen=True):
    """Message 2 payload: the responder's choices, and its lane id (authenticated here)."""

    version: Version = msgspec.field(name="v")
    capabilities: Annotated[list[Capability], msgspec.Meta(max_length=MAX_CAPABILITIES)] = (
        msgspec.field(name="c")
    )
    max_message_bytes: MessageBytes = msgspec.field(name="m")
    lane_id: LaneId = msgspec.field(name="l")


_HELLO_DECODER = msgspec.msgpack.Decoder(HelloPayload)
_RESPONSE_DECODER = msgspec.msgpack.Decoder(ResponsePayload)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class HandshakeResult:
    """What a completed handshake gives a lane: transport keys and the negotiated terms."""

    send_key: bytes
    recv_key: bytes
    remote_static: bytes  # the peer's X25519 static public key
    remote_lane_id: int  # put this in the receiver lane id of every datagram to the peer
    version: int  # application protocol version: the highest both speak
    capabilities: tuple[str, ...]  # both offered, sorted
    max_message_bytes: int  # the smaller of the two sides' limits
    handshake_hash: bytes  # Noise h; equal on both sides, usable as a channel binding


class VersionRefused(LocalProtocolError):
    """The peer refused our handshake because it speaks none of our versions.

    Returned (not raised) by `Initiator.handle_refusal`, for the caller to raise or report.
    """

    def __init__(self, *, peer_versions: tuple[int, ...], reason: str, offered: str) -> None:
        self.peer_versions = peer_versions
        self.reason = reason
        super().__init__(
            f"peer refused the handshake ({reason!r}): it speaks versions "
            f"{list(peer_versions)}, we offered {offered}"
        )


class InitiationRefused(HandshakeRejected):
    """An INITIATION we cannot accept for version reasons; send `datagram` (a REFUSAL) back."""

    def __init__(self, reason: str, datagram: bytes) -> None:
        super().__init__(reason, refusal="version")
        self.reason = reason
        self.datagram = datagram


def psk_from_secret(secret: str | bytes) -> bytes:
    """The 32-byte Noise PSK for a mesh secret: keyed BLAKE2s under a domain label."""
    raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise LocalProtocolError("the mesh secret must not be empty")
    return hashlib.blake2s(raw, key=b"meshd mesh secret v1").digest()


def mac1(receiver_static_public: bytes, data: bytes) -> bytes:
    """WireGuard's mac1: BLAKE2s-128 of `data` keyed by HASH("mac1----" || receiver's key)."""
    key = hashlib.blake2s(b"mac1----" + receiver_static_public).digest()
    return hashlib.blake2s(data, key=key, digest_size=MAC_BYTES).digest()


def _check_mac1(receiver_static_public: bytes, datagram: bytes) -> None:
    expected = mac1(receiver_static_public, datagram[:-MAC_BYTES])
    if not hmac.compare_digest(expected, datagram[-MAC_BYTES:]):
        raise UndecryptableError("mac1 mismatch")


def _prologue(initiation_header: bytes) -> bytes:
    # Binding the INITIATION header makes its version byte and lane id part of the transcript.
    return PROLOGUE_LABEL + b"\x00" + initiation_header


def _check_offer(versions: Sequence[int], capabilities: Sequence[str], max_bytes: int) -> None:
    if not 1 <= len(versions) <= MAX_VERSIONS or not all(0 <= v <= 255 for v in versions):
        raise LocalProtocolError(f"versions must be 1..{MAX_VERSIONS} integers in 0..255")
    if len(capabilities) > MAX_CAPABILITIES or not all(
        1 <= len(c) <= MAX_CAPABILITY_CHARS for c in capabilities
    ):
        raise LocalProtocolError(
            f"at most {MAX_CAPABILITIES} capabilities of 1..{MAX_CAPABILITY_CHARS} characters"
        )
    if not 1 <= max_bytes <= MAX_MESSAGE_BYTES_LIMIT:
        raise LocalProtocolError("max_message_bytes out of range")


def _check_lane_id(lane_id: int) -> None:
    if not 0 <= lane_id <= MAX_LANE_ID:
        raise LocalProtocolError("a lane id is a u32")


def _encode_payload(payload: HelloPayload | ResponsePayload) -> bytes:
    data = _ENCODER.encode(payload)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError("handshake payload too large; offer fewer capabilities")
    return data


def encode_refusal(
    receiver_lane_id: int,
    versions: Sequence[int],
    reason: str,
    *,
    max_bytes: int = REFUSAL_HEADER_BYTES + 255 + MAX_REASON_BYTES,
) -> bytes:
    """A REFUSAL datagram: `versions` are those the refusing side speaks.

    The reason is cut (at a character boundary) to keep the datagram within `max_bytes`.
    """
    _check_lane_id(receiver_lane_id)
    if len(versions) > 255 or not all(0 <= v <= 255 for v in versions):
        raise LocalProtocolError("a refusal lists at most 255 versions in 0..255")
    room = min(MAX_REASON_BYTES, max_bytes - REFUSAL_HEADER_BYTES - len(versions))
    if room < 0:
        raise LocalProtocolError("a refusal does not fit in max_bytes")
    reason_bytes = reason.encode("utf-8")[:room]
    reason_bytes = reason_bytes.decode("utf-8", "ignore").encode("utf-8")  # whole characters
    return (
        bytes([KIND_REFUSAL, 0])
        + receiver_lane_id.to_bytes(4, "big")
        + bytes([len(versions), *versions])
        + reason_bytes
    )


def decode_refusal(datagram: bytes) -> tuple[int, tuple[int, ...], str]:
    """(receiver lane id, versions, reason) of a REFUSAL; RemoteProtocolError if malformed."""
    if len(datagram) < REFUSAL_HEADER_BYTES or datagram[0] != KIND_REFUSAL:
        raise RemoteProtocolError("not a refusal datagram")
    if datagram[1] != 0:
        raise RemoteProtocolError("refusal flags must be zero")
    count = datagram[6]
    end = REFUSAL_HEADER_BYTES + count
    if len(datagram) < end:
        raise RemoteProtocolError("refusal shorter than its version list")
    reason_bytes = datagram[end:]
    if len(reason_bytes) > MAX_REASON_BYTES:
        raise RemoteProtocolError("refusal reason too long")
    try:
        reason = reason_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError("refusal reason is not UTF-8") from exc
    return int.from_bytes(datagram[2:6], "big"), tuple(datagram[REFUSAL_HEADER_BYTES:end]), reason


class Initiator:
    """One attempt to open a lane to a known peer. Retry with a new Initiator (new timestamp)."""

    def __init__(
        self,
        *,
        static_private: bytes,
        remote_static: bytes,
        psk: bytes,
        local_lane_id: int,
        versions: Sequence[int],
        capabilities: Sequence[str],
        max_message_bytes: int,
        now_wall_ns: int,
        ephemeral_private: bytes | None = None,
    ) -> None:
        _check_lane_id(local_lane_id)
        _check_offer(versions, capabilities, max_message_bytes)
        if not 0 <= now_wall_ns < 2**63:
            raise LocalProtocolError("now_wall_ns must be nanoseconds since the epoch, in 0..2^63")
        if len(static_private) != noise.DHLEN or len(remote_static) != noise.DHLEN:
            raise LocalProtocolError("X25519 keys are 32 bytes")
        self._local_lane_id = local_lane_id
        self._versions = tuple(versions)
        self._capabilities = frozenset(capabilities)
        self._max_message_bytes = max_message_bytes
        self._static_public = noise.x25519_public(static_private)
        self._remote_static = remote_static
        header = bytes([KIND_INITIATION, HANDSHAKE_VERSION]) + local_lane_id.to_bytes(4, "big")
        self._noise = noise.HandshakeState(
            initiator=True,
            static_private=static_private,
            psk=psk,
            remote_static=remote_static,
            prologue=_prologue(header),
            ephemeral_private=ephemeral_private,
        )
        hello = HelloPayload(
            timestamp_ns=now_wall_ns,
            versions=list(versions),
            capabilities=list(capabilities),
            max_message_bytes=max_message_bytes,
        )
        body = header + self._noise.write_message(_encode_payload(hello))
        self._initiation = body + mac1(remote_static, body)

    @property
    def local_lane_id(self) -> int:
        """The lane id this attempt asked the peer to address us by."""
        return self._local_lane_id

    def initiation_datagram(self) -> bytes:
        """The INITIATION datagram to send (the same bytes on every call)."""
        return self._initiation

    def handle_response(self, datagram: bytes) -> HandshakeResult:
        """Complete the handshake from a RESPONSE; RemoteProtocolError leaves us waiting."""
        if self._noise.complete:
            raise RemoteProtocolError("response after the handshake completed")
        if not MIN_RESPONSE_BYTES <= len(datagram) <= MAX_RESPONSE_BYTES:
            raise RemoteProtocolError("response datagram of impossible length")
        if datagram[0] != KIND_RESPONSE or datagram[1] != HANDSHAKE_VERSION:
            raise RemoteProtocolError("not a version-1 response")
        if int.from_bytes(datagram[2:6], "big") != self._local_lane_id:
            raise RemoteProtocolError("response for another lane")
        _check_mac1(self._static_public, datagram)
        sender_lane_id = int.from_bytes(datagram[6:10], "big")
        # Work on a copy and keep it only if everything checks out, so that no forged or
        # altered response (e.g. a re-sealed copy with another lane id) ends this attempt.
        attempt = copy.deepcopy(self._noise)
        plaintext = attempt.read_message(datagram[RESPONSE_HEADER_BYTES:-MAC_BYTES])
        try:
            reply = _RESPONSE_DECODER.decode(plaintext)
        except msgspec.DecodeError as exc:
            raise RemoteProtocolError(f"bad response payload: {exc}") from exc
        if reply.lane_id != sender_lane_id:
            raise RemoteProtocolError("response lane id does not match its header")
        if reply.version not in self._versions:
            raise RemoteProtocolError("peer chose a version we did not offer")
        if not self._capabilities.issuperset(reply.capabilities):
            raise RemoteProtocolError("peer chose a capability we did not offer")
        self._noise = attempt
        send_key, recv_key = attempt.split()
        return HandshakeResult(
            send_key=send_key,
            recv_key=recv_key,
            remote_static=self._remote_static,
            remote_lane_id=sender_lane_id,
            version=reply.version,
            capabilities=tuple(sorted(set(reply.capabilities))),
            max_message_bytes=min(reply.max_message_bytes, self._max_message_bytes),
            handshake_hash=attempt.handshake_hash,
        )

    def handle_refusal(self, datagram: bytes) -> VersionRefused:
        """Turn a REFUSAL for our lane id into a VersionRefused to raise or report.

        REFUSALs are unauthenticated (only the 32-bit lane id must match), so a caller may
        prefer to keep waiting for a RESPONSE until its own timeout before giving up.
        """
        if self._noise.complete:
            raise RemoteProtocolError("refusal after the handshake completed")
        lane_id, versions, reason = decode_refusal(datagram)
        if lane_id != self._local_lane_id:
            raise RemoteProtocolError("refusal for another lane")
        offered = f"handshake v{HANDSHAKE_VERSION}, application versions {list(self._versions)}"
        return VersionRefused(peer_versions=versions, reason=reason, offered=offered)


class Responder:
    """Answers INITIATIONs for one endpoint, and remembers the newest timestamp per peer key."""

    def __init__(
        self,
        *,
        static_private: bytes,
        psk: bytes,
        admit: Callable[[bytes], bool],
        versions: Sequence[int],
        capabilities: Sequence[str],
        max_message_bytes: int,
        max_clock_skew_s: float = 120.0,
        replay_table_size: int = 4096,
    ) -> None:
        _check_offer(versions, capabilities, max_message_bytes)
        if len(static_private) != noise.DHLEN or len(psk) != noise.PSKLEN:
            raise LocalProtocolError("the static key and PSK are 32 bytes")
        if max_clock_skew_s <= 0 or replay_table_size < 1:
            raise LocalProtocolError("max_clock_skew_s and replay_table_size must be positive")
        self._static_private = static_private
        self._static_public = noise.x25519_public(static_private)
        self._psk = psk
        self._admit = admit
        self._versions = tuple(versions)
        self._capabilities = frozenset(capabilities)
        self._max_message_bytes = max_message_bytes
        self._max_skew_ns = int(max_clock_skew_s * 1e9)
        self._replay_table_size = replay_table_size
        # Newest accepted timestamp per initiator static key, least recently used first.
        self._newest: OrderedDict[bytes, int] = OrderedDict()

    @property
    def static_public(self) -> bytes:
        """Our X25519 static public key (what initiators must know, and mac1's key)."""
        return self._static_public

    def handle_initiation(
        self,
        datagram: bytes,
        *,
        local_lane_id: int,
        now_wall_ns: int,
        ephemeral_private: bytes | None = None,
    ) -> tuple[bytes, HandshakeResult]:
        """Answer an INITIATION: (RESPONSE datagram, result) for an admitted, fresh peer.

        Raises InitiationRefused (send its `.datagram`) on a version mismatch, and
        RemoteProtocolError (drop silently) for everything else.
        """
        _check_lane_id(local_lane_id)
        # Version-independent checks first: the kind, the sender lane id and a trailing mac1
        # keyed by our public key are the same in every handshake wire version.
        if not INITIATION_HEADER_BYTES + MAC_BYTES <= len(datagram) <= MAX_INITIATION_BYTES:
            raise RemoteProtocolError("initiation datagram of impossible length")
        if datagram[0] != KIND_INITIATION:
            raise RemoteProtocolError("not an initiation")
        _check_mac1(self._static_public, datagram)
        sender_lane_id = int.from_bytes(datagram[2:6], "big")
        if datagram[1] not in SUPPORTED_HANDSHAKE_VERSIONS:
            reason = f"handshake version {datagram[1]} not supported"
            raise self._refusal(sender_lane_id, SUPPORTED_HANDSHAKE_VERSIONS, reason, datagram)
        if len(datagram) < MIN_INITIATION_BYTES:
            raise HandshakeRejected("initiation too short", refusal="malformed")
        state = noise.HandshakeState(
            initiator=False,
            static_private=self._static_private,
            psk=self._psk,
            prologue=_prologue(datagram[:INITIATION_HEADER_BYTES]),
            ephemeral_private=ephemeral_private,
        )
        try:
            plaintext = state.read_message(datagram[INITIATION_HEADER_BYTES:-MAC_BYTES])
        except RemoteProtocolError as exc:
            raise HandshakeRejected(str(exc), refusal=exc.drop_reason) from exc
        remote_static = state.remote_static
        assert remote_static is not None  # message 1 always carries it
        if not self._admit(remote_static):
            raise HandshakeRejected("initiator key not admitted", refusal="not_admitted")
        try:
            hello = _HELLO_DECODER.decode(plaintext)
        except msgspec.DecodeError as exc:
            raise HandshakeRejected(f"bad initiation payload: {exc}", refusal="malformed") from exc
        self._check_fresh(remote_static, hello.timestamp_ns, now_wall_ns)
        common = set(hello.versions) & set(self._versions)
        if not common:
            reason = "no common application version"
            raise self._refusal(sender_lane_id, self._versions, reason, datagram)
        reply = ResponsePayload(
            version=max(common),
            capabilities=sorted(self._capabilities.intersection(hello.capabilities)),
            max_message_bytes=min(hello.max_message_bytes, self._max_message_bytes),
            lane_id=local_lane_id,
        )
        header = (
            bytes([KIND_RESPONSE, HANDSHAKE_VERSION])
            + sender_lane_id.to_bytes(4, "big")
            + local_lane_id.to_bytes(4, "big")
        )
        body = header + state.write_message(_encode_payload(reply))
        recv_key, send_key = state.split()
        result = HandshakeResult(
            send_key=send_key,
            recv_key=recv_key,
            remote_static=remote_static,
            remote_lane_id=sender_lane_id,
            version=reply.version,
            capabilities=tuple(reply.capabilities),
            max_message_bytes=reply.max_message_bytes,
            handshake_hash=state.handshake_hash,
        )
        return body + mac1(remote_static, body), result

    @staticmethod
    def _refusal(
        lane_id: int, versions: Sequence[int], reason: str, initiation: bytes
    ) -> RemoteProtocolError:
        """A refusal no larger than the initiation, so a spoofed source gains no amplification."""
        if REFUSAL_HEADER_BYTES + len(versions) > len(initiation):
            return HandshakeRejected(
                f"{reason} (initiation too small to answer)", refusal="version"
            )
        refusal = encode_refusal(lane_id, versions, reason, max_bytes=len(initiation))
        return InitiationRefused(reason, refusal)

    def _check_fresh(self, remote_static: bytes, timestamp_ns: int, now_wall_ns: int) -> None:
        """Reject replays: the timestamp must be near our clock and newer than any seen."""
        if abs(timestamp_ns - now_wall_ns) > self._max_skew_ns:
            raise HandshakeRejected(
                "initiation timestamp outside the allowed clock skew", refusal="clock_skew"
            )
        newest = self._newest.get(remote_static)
        if newest is not None and timestamp_ns <= newest:
            raise HandshakeRejected("replayed or stale initiation", refusal="replayed")
        self._newest[remote_static] = timestamp_ns
        self._newest.move_to_end(remote_static)
        while len(self._newest) > self._replay_table_size:
            self._newest.popitem(last=False)
