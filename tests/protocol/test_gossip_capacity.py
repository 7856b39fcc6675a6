"""Capacity records carry each holding's quantization and the bytes its stage holds."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.gossip import (
    CapacityRecord,
    Gossip,
    ModelHolding,
    SignedRecord,
    decode,
    encode,
    open_record,
    sign_record,
)

KEY = Ed25519PrivateKey.generate()
NODE_ID = KEY.public_key().public_bytes_raw()


def _verify(public: bytes, data: bytes, signature: bytes) -> bool:
    Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    return True


def _record(*holdings: ModelHolding) -> CapacityRecord:
    return CapacityRecord(NODE_ID, 7, "127.0.0.2:7391", 1 << 30, list(holdings), 0, 0, [])


def test_quantization_and_bytes_held_survive_signing_and_gossip() -> None:
    held = ModelHolding(
        "m", 0, 6, True, 1234, quantization="int8", weight_bytes=15_385_600, kv_bytes_per_token=8192
    )
    spare = ModelHolding("m", 0, 6, False, 1234, quantization="none")
    loading = ModelHolding("m", 2, 4, False, 1234, quantization="none", loading=True)
    signed = sign_record(_record(held, spare, loading), KEY.sign)
    message = decode(encode(Gossip(updates=[], records=[signed])))
    assert isinstance(message, Gossip)
    record = open_record(message.records[0], _verify)
    assert record.models == [held, spare, loading]


def test_a_record_from_before_the_fields_reads_as_unquantized_with_nothing_held() -> None:
    old_holding = ("m", 0, 6, True, 1234)  # the five fields a holding had before
    body = msgspec.msgpack.encode([NODE_ID, 7, "", 1 << 30, [old_holding], 0, 0, []])
    record = open_record(
        SignedRecord(body, KEY.sign(b"meshd/capacity-record/v1\x00" + body)), _verify
    )
    assert record.models[0].quantization == "none"
    assert (record.models[0].weight_bytes, record.models[0].kv_bytes_per_token) == (0, 0)
    assert not record.models[0].loading


def test_a_later_schemes_name_reads_and_garbage_is_refused() -> None:
    later = ModelHolding("m", 0, 6, False, quantization="fp8_e4m3")
    assert open_record(sign_record(_record(later), KEY.sign), _verify).models == [later]
    for bad in (
        ModelHolding("m", 0, 6, False, quantization="INT8"),
        ModelHolding("m", 0, 6, False, quantization=""),
        ModelHolding("m", 0, 6, False, quantization="x" * 17),
        # Bytes held without a loaded stage: a record that contradicts itself.
        ModelHolding("m", 0, 6, False, weight_bytes=1),
        ModelHolding("m", 0, 6, True, loading=True),
    ):
        with pytest.raises(LocalProtocolError):
            sign_record(_record(bad), KEY.sign)
        body = msgspec.msgpack.encode(_record(bad))
        forged = SignedRecord(body, KEY.sign(b"meshd/capacity-record/v1\x00" + body))
        with pytest.raises(RemoteProtocolError):
            open_record(forged, _verify)
