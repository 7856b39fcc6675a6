"""Membership gossip on the wire: SWIM probes, piggybacked updates, sync pages, signed capacity.

Every message is a `msgspec.Struct` in one tagged union, encoded as compact msgpack arrays (the
first element is an integer tag). `decode` enforces `MAX_GOSSIP_BYTES` and every per-field limit
and turns any malformed input into `RemoteProtocolError`, including the body of each signed
capacity record (signatures are checked by `open_record`, which takes the verifier as a callable
so this module stays sans-IO and crypto-agnostic).

A node is named by its 32-byte public key (`node_id`, the Ed25519 verify key of its capacity
signatures). The state machine that uses these messages is `meshd.mesh.membership`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Annotated

import msgspec

from protocol.errors import LocalProtocolError, RemoteProtocolError

# One gossip message fits a lane message with room to spare (lanes carry up to 16 MiB).
MAX_GOSSIP_BYTES = 64 * 1024
NODE_ID_BYTES = 32
# RTT rows name peers by a key prefix: 8 bytes keep a 256-entry row near 3 KiB, and a chance
# prefix collision among even a million nodes is ~3e-8 (a collision only blurs an RTT figure).
RTT_PREFIX_BYTES = 8
MAX_UPDATES = 1024
MAX_RECORDS = 64
MAX_WANT = 256
MAX_RECORD_BYTES = 8 * 1024
MAX_SIGNATURE_BYTES = 128
MAX_ADDRESS_CHARS = 256
MAX_MODEL_ID_CHARS = 128
MAX_MODEL_NAME_CHARS = 128
MAX_QUANTIZATION_CHARS = 16
MAX_MODELS = 16
MAX_RTT_ENTRIES = 256
MAX_U63 = (1 << 63) - 1
# Domain separation: a capacity signature can never be replayed as any other signed object.
RECORD_SIGNING_CONTEXT = b"meshd/capacity-record/v1\x00"

NodeId = Annotated[bytes, msgspec.Meta(min_length=NODE_ID_BYTES, max_length=NODE_ID_BYTES)]
# An id-space bound for sync pages: empty means "the start" (or "the end" as an upper bound).
IdBound = Annotated[bytes, msgspec.Meta(max_length=NODE_ID_BYTES)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_U63)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
# A scheme's name; unknown names decode (a newer node's scheme) and match no one else's plan.
Quantization = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_QUANTIZATION_CHARS, pattern="^[a-z0-9_]+$")
]


class Status(enum.IntEnum):
    """A member's state. At equal incarnation a higher value wins (alive < suspect < dead < left)."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


class MemberUpdate(msgspec.Struct, frozen=True, array_like=True):
    """What the sender believes about one member.

    `record_version` is the version of that member's capacity record the sender holds (0: none),
    so a receiver that holds an older one can ask for it with `Want`. `suspector` names who
    first suspected the member (None unless `status` is SUSPECT); Lifeguard counts distinct
    suspectors to shorten the suspicion timeout.
    """

    node_id: NodeId
    status: Status
    incarnation: U63
    record_version: U63 = 0
    suspector: NodeId | None = None


class SignedRecord(msgspec.Struct, frozen=True, array_like=True):
    """A capacity record as its owner encoded and signed it; relays forward the bytes as-is."""

    body: Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD_BYTES)]
    signature: Annotated[bytes, msgspec.Meta(max_length=MAX_SIGNATURE_BYTES)]


class ModelHolding(msgspec.Struct, frozen=True, array_like=True):
    """Layers [layer_start, layer_end) of a model that the node hosts (loaded) or can host."""

    model_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_ID_CHARS)]
    layer_start: U32
    layer_end: U32
    loaded: bool
    # Measured forward time of one layer for one token on this node (0: not measured yet).
    compute_ns_per_layer_token: U63 = 0
    # How the node holds the weights ("none", "gguf", "q8_0", or a later scheme's name): only
    # nodes holding the same quantization serve one plan (their tokens are the same).
    quantization: Quantization = "none"
    # What the loaded stage holds: weight bytes, and KV cache bytes per position (0: none).
    weight_bytes: U63 = 0
    kv_bytes_per_token: U63 = 0
    # The part of the record's memory budget this model may use on the node (0: all of it). A
    # node holding several models splits its budget among them, so each model's plan is made
    # from the view alone, whatever other models the node holds.
    memory_budget_bytes: U63 = 0
    # What the API calls the model (its directory or GGUF file name; "": the id only).
    name: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)] = ""
    # Loading [layer_start, layer_end) now (not serving them yet): planners keep the range
    # here as they keep a loaded stage, so a plan made meanwhile does not move it elsewhere.
    loading: bool = False


class RttEntry(msgspec.Struct, frozen=True, array_like=True):
    """The owner's measured round trip to one peer (named by its key prefix)."""

    peer_prefix: Annotated[
        bytes, msgspec.Meta(min_length=RTT_PREFIX_BYTES, max_length=RTT_PREFIX_BYTES)
    ]
    rtt_us: U32


class CapacityRecord(msgspec.Struct, frozen=True, array_like=True):
    """What a node offers the mesh; a higher `version` from the same node replaces a lower one."""

    node_id: NodeId
    version: U63
    address: Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)]
    memory_budget_bytes: U63
    models: Annotated[list[ModelHolding], msgspec.Meta(max_length=MAX_MODELS)]
    sessions: U32
    queue: U32
    rtt: Annotated[list[RttEntry], msgspec.Meta(max_length=MAX_RTT_ENTRIES)]


Updates = Annotated[list[MemberUpdate], msgspec.Meta(max_length=MAX_UPDATES)]
Records = Annotated[list[SignedRecord], msgspec.Meta(max_length=MAX_RECORDS)]
Wants = Annotated[list[NodeId], msgspec.Meta(max_length=MAX_WANT)]


class Ping(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """A SWIM probe; the receiver answers `Ack(seq)` to the sender."""

    seq: U63
    updates: Updates


class Ack(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """The answer to `Ping(seq)`, direct or forwarded by a relay for a `PingReq`."""

    seq: U63
    updates: Updates


class PingReq(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """Ask the receiver to probe `target` and forward its `Ack(seq)` to the sender."""

    seq: U63
    target: NodeId
    updates: Updates


class Gossip(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """A gossip round's piggyback, or records answering a `Want` or a sync reply."""

    updates: Updates
    records: Records


class Want(msgspec.Struct, frozen=True, array_like=True, tag=5):
    """Ask the receiver for the capacity records it holds of these members."""

    node_ids: Wants


class SyncDigest(msgspec.Struct, frozen=True, array_like=True, tag=6):
    """Push-pull anti-entropy: the sender's state of every member with start <= id < end.

    An empty `end` means the end of the id space. The receiver merges the entries and replies
    `SyncReply` for the same range.
    """

    start: IdBound
    end: IdBound
    entries: Updates


class SyncReply(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """What the digest's sender lacks in [start, end), and what the replier wants from it.

    When the reply had to stop early to respect the size limit, `resume` is the first id it
    did not cover (the next digest should start there); empty means the range is complete.
    """

    start: IdBound
    end: IdBound
    updates: Updates
    records: Records
    want: Wants
    resume: IdBound


GossipMessage = Ping | Ack | PingReq | Gossip | Want | SyncDigest | SyncReply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GossipMessage)
_record_decoder = msgspec.msgpack.Decoder(CapacityRecord)


def encode(message: GossipMessage) -> bytes:
    """Encode a message; LocalProtocolError if it breaks a limit (our bug, not the peer's)."""
    try:
        _check(message)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from None
    data = _encoder.encode(message)
    if len(data) > MAX_GOSSIP_BYTES:
        raise LocalProtocolError(f"gossip message of {len(data)} bytes exceeds {MAX_GOSSIP_BYTES}")
    return data


def decode(data: bytes) -> GossipMessage:
    """Decode and validate one message; anything malformed raises RemoteProtocolError."""
    if len(data) > MAX_GOSSIP_BYTES:
        raise RemoteProtocolError(f"gossip message of {len(data)} bytes exceeds {MAX_GOSSIP_BYTES}")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed gossip message: {exc}") from None
    _check(message)
    return message


def encoded_size(value: MemberUpdate | SignedRecord) -> int:
    """Bytes `value` adds to an encoded message (for packing messages under a size budget)."""
    return len(_encoder.encode(value))


def sign_record(record: CapacityRecord, sign: Callable[[bytes], bytes]) -> SignedRecord:
    """Encode `record` and sign it with the owner's key (`sign(data) -> signature`)."""
    body = _encoder.encode(record)
    if len(body) > MAX_RECORD_BYTES:
        raise LocalProtocolError(f"capacity record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        read_record(SignedRecord(body=body, signature=b""))  # the limits a receiver enforces
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from None
    return SignedRecord(body=body, signature=sign(RECORD_SIGNING_CONTEXT + body))


def read_record(signed: SignedRecord) -> CapacityRecord:
    """Decode a record's body WITHOUT checking its signature (RemoteProtocolError if garbage).

    Use it to look at the version before paying for a signature check; trust nothing in it
    until `open_record` succeeds.
    """
    try:
        record = _record_decoder.decode(signed.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed capacity record: {exc}") from None
    _check_record(record, RemoteProtocolError)
    return record


def open_record(
    signed: SignedRecord, verify: Callable[[bytes, bytes, bytes], bool]
) -> CapacityRecord:
    """Decode a record and check its signature by its own node_id.

    `verify(public_key, data, signature) -> bool`. RemoteProtocolError if the body is garbage
    or the signature does not verify.
    """
    record = read_record(signed)
    try:
        ok = verify(record.node_id, RECORD_SIGNING_CONTEXT + signed.body, signed.signature)
    except Exception:  # a verifier may raise on a malformed signature instead of returning
        ok = False
    if not ok:
        raise RemoteProtocolError(f"bad signature on capacity record of {record.node_id.hex()}")
    return record


def _check_record(record: CapacityRecord, error: type[Exception]) -> None:
    for model in record.models:
        if model.layer_start >= model.layer_end:
            raise error(f"model {model.model_id!r}: empty layer range")
        if not model.loaded and (model.weight_bytes or model.kv_bytes_per_token):
            raise error(f"model {model.model_id!r}: bytes held without a loaded stage")
        if model.loaded and model.loading:
            raise error(f"model {model.model_id!r}: a stage both loaded and loading")


def _check(message: GossipMessage) -> None:
    if isinstance(message, Gossip | SyncReply):
        for signed in message.records:
            read_record(signed)
