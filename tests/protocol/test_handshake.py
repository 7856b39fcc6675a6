"""The lane-opening handshake: negotiation, admission, replay, refusal, and the cheap-drop rule."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import datagram, noise
from protocol import handshake as hs
from protocol.errors import LocalProtocolError, RemoteProtocolError

NOW = 1_700_000_000 * 10**9  # a wall-clock instant in ns
SECOND = 10**9


def key(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


ALICE = key("alice static")  # initiator
BOB = key("bob static")  # responder
ALICE_PUB = noise.x25519_public(ALICE)
BOB_PUB = noise.x25519_public(BOB)
PSK = hs.psk_from_secret("correct horse battery staple")


def responder(**overrides: Any) -> hs.Responder:
    args: dict[str, Any] = {
        "static_private": BOB,
        "psk": PSK,
        "admit": lambda pub: pub == ALICE_PUB,
        "versions": [1, 2, 3],
        "capabilities": ["mtp", "f16", "relay"],
        "max_message_bytes": 1 << 20,
    }
    return hs.Responder(**(args | overrides))


def initiator(**overrides: Any) -> hs.Initiator:
    args: dict[str, Any] = {
        "static_private": ALICE,
        "remote_static": BOB_PUB,
        "psk": PSK,
        "local_lane_id": 0xA1A1A1A1,
        "versions": [2, 3, 4],
        "capabilities": ["f16", "mtp", "zstd"],
        "max_message_bytes": 1 << 16,
        "now_wall_ns": NOW,
        "ephemeral_private": key("alice ephemeral"),
    }
    return hs.Initiator(**(args | overrides))


def with_mac1(body: bytes, receiver_public: bytes) -> bytes:
    """Re-seal a datagram's mac1, as an attacker who knows the receiver's public key can."""
    return body + hs.mac1(receiver_public, body)


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


def test_handshake_agrees_on_keys_and_negotiates_terms() -> None:
    alice, bob = initiator(), responder()
    response, bob_result = bob.handle_initiation(
        alice.initiation_datagram(), local_lane_id=0xB0B, now_wall_ns=NOW
    )
    alice_result = alice.handle_response(response)
    assert alice_result.send_key == bob_result.recv_key
    assert alice_result.recv_key == bob_result.send_key
    assert alice_result.send_key != alice_result.recv_key
    assert alice_result.handshake_hash == bob_result.handshake_hash
    assert alice_result.remote_static == BOB_PUB and bob_result.remote_static == ALICE_PUB
    assert alice_result.remote_lane_id == 0xB0B and bob_result.remote_lane_id == 0xA1A1A1A1
    for result in (alice_result, bob_result):
        assert result.version == 3  # highest common of [2,3,4] and [1,2,3]
        assert result.capabilities == ("f16", "mtp")
        assert result.max_message_bytes == 1 << 16
    # The keys carry data both ways.
    sealed = noise.aead_encrypt(alice_result.send_key, 0, b"hdr", b"tokens")
    assert noise.aead_decrypt(bob_result.recv_key, 0, b"hdr", sealed) == b"tokens"
    sealed = noise.aead_encrypt(bob_result.send_key, 0, b"", b"reply")
    assert noise.aead_decrypt(alice_result.recv_key, 0, b"", sealed) == b"reply"


def test_datagrams_follow_the_shared_layout() -> None:
    alice, bob = initiator(), responder()
    init = alice.initiation_datagram()
    assert datagram.peek_kind(init) == datagram.KIND_INITIATION
    assert init[1] == hs.HANDSHAKE_VERSION and init[2:6] == (0xA1A1A1A1).to_bytes(4, "big")
    response, _ = bob.handle_initiation(init, local_lane_id=7, now_wall_ns=NOW)
    assert datagram.peek_receiver_lane_id(response) == 0xA1A1A1A1
    assert response[6:10] == (7).to_bytes(4, "big")
    # Small enough to never fragment; sizes quoted in docs/protocol.md.
    assert len(init) < 200 and len(response) < 100


def test_wrong_psk_fails_the_initiator_and_never_confirms_the_responder() -> None:
    alice = initiator(psk=hs.psk_from_secret("a guess"))
    # IKpsk2 mixes the PSK into message 2, so the responder cannot tell yet ...
    response, bob_result = responder().handle_initiation(
        alice.initiation_datagram(), local_lane_id=1, now_wall_ns=NOW
    )
    with pytest.raises(RemoteProtocolError):
        alice.handle_response(response)
    # ... and no key the outsider holds opens data under the responder's receive key.
    forged = noise.aead_encrypt(hs.psk_from_secret("a guess"), 0, b"", b"hi")
    with pytest.raises(RemoteProtocolError):
        noise.aead_decrypt(bob_result.recv_key, 0, b"", forged)


def test_initiator_expecting_another_responder_key_is_dropped_cheaply() -> None:
    alice = initiator(remote_static=noise.x25519_public(key("mallory")))
    with pytest.raises(RemoteProtocolError, match="mac1"):
        responder().handle_initiation(alice.initiation_datagram(), local_lane_id=1, now_wall_ns=NOW)


def test_unadmitted_key_never_gets_a_response() -> None:
    seen: list[bytes] = []

    def admit(pub: bytes) -> bool:
        seen.append(pub)
        return False

    bob = responder(admit=admit)
    with pytest.raises(RemoteProtocolError, match="admitted"):
        bob.handle_initiation(initiator().initiation_datagram(), local_lane_id=1, now_wall_ns=NOW)
    assert seen == [ALICE_PUB]  # admission judges the initiator's X25519 static key


def test_every_tampered_initiation_byte_is_rejected() -> None:
    init = initiator().initiation_datagram()
    for i in range(len(init)):
        with pytest.raises(RemoteProtocolError):
            responder().handle_initiation(flip(init, i), local_lane_id=1, now_wall_ns=NOW)
        # Even with mac1 re-sealed (the attacker knows the public key), nothing gets through.
        resealed = with_mac1(flip(init, i)[: -hs.MAC_BYTES], BOB_PUB)
        if i < len(init) - hs.MAC_BYTES:
            with pytest.raises(RemoteProtocolError):
                responder().handle_initiation(resealed, local_lane_id=1, now_wall_ns=NOW)


def test_every_tampered_response_byte_is_rejected_and_the_real_one_still_works() -> None:
    alice = initiator()
    response, bob_result = responder().handle_initiation(
        alice.initiation_datagram(), local_lane_id=9, now_wall_ns=NOW
    )
    for i in range(len(response)):
        with pytest.raises(RemoteProtocolError):
            alice.handle_response(flip(response, i))
        if i < len(response) - hs.MAC_BYTES:
            with pytest.raises(RemoteProtocolError):
                alice.handle_response(with_mac1(flip(response, i)[: -hs.MAC_BYTES], ALICE_PUB))
    assert alice.handle_response(response).send_key == bob_result.recv_key
    with pytest.raises(RemoteProtocolError, match="completed"):
        alice.handle_response(response)


def test_byte_exact_replay_is_rejected() -> None:
    bob = responder()
    init = initiator().initiation_datagram()
    bob.handle_initiation(init, local_lane_id=1, now_wall_ns=NOW)
    with pytest.raises(RemoteProtocolError, match="replay"):
        bob.handle_initiation(init, local_lane_id=2, now_wall_ns=NOW + SECOND)
    # A fresh attempt with a newer timestamp is fine.
    newer = initiator(now_wall_ns=NOW + 1, ephemeral_private=None)
    bob.handle_initiation(newer.initiation_datagram(), local_lane_id=3, now_wall_ns=NOW + SECOND)


def test_older_timestamp_is_rejected() -> None:
    bob = responder()
    older = initiator(now_wall_ns=NOW - SECOND).initiation_datagram()
    bob.handle_initiation(initiator().initiation_datagram(), local_lane_id=1, now_wall_ns=NOW)
    with pytest.raises(RemoteProtocolError, match="replay"):
        bob.handle_initiation(older, local_lane_id=2, now_wall_ns=NOW)


def test_timestamps_beyond_clock_skew_are_rejected_so_replays_after_restart_fail() -> None:
    init = initiator().initiation_datagram()
    for now in (NOW + 121 * SECOND, NOW - 121 * SECOND):
        with pytest.raises(RemoteProtocolError, match="skew"):
            responder().handle_initiation(init, local_lane_id=1, now_wall_ns=now)
    # Inside the window a fresh responder (one that restarted) accepts it once.
    responder().handle_initiation(init, local_lane_id=1, now_wall_ns=NOW + 119 * SECOND)
    strict = responder(max_clock_skew_s=1.0)
    with pytest.raises(RemoteProtocolError, match="skew"):
        strict.handle_initiation(init, local_lane_id=1, now_wall_ns=NOW + 2 * SECOND)


def test_unadmitted_keys_cannot_evict_replay_memory() -> None:
    bob = responder(replay_table_size=1)
    init = initiator().initiation_datagram()
    bob.handle_initiation(init, local_lane_id=1, now_wall_ns=NOW)
    for n in range(5):
        intruder = initiator(static_private=key(f"intruder {n}"), now_wall_ns=NOW + n + 1)
        with pytest.raises(RemoteProtocolError, match="admitted"):
            bob.handle_initiation(intruder.initiation_datagram(), local_lane_id=1, now_wall_ns=NOW)
    with pytest.raises(RemoteProtocolError, match="replay"):
        bob.handle_initiation(init, local_lane_id=1, now_wall_ns=NOW)


def future_initiation(version: int, *, body: bytes | None = None) -> bytes:
    """An initiation from a peer speaking another handshake wire version, mac1 intact."""
    inner = body if body is not None else bytes(range(100))
    header = bytes([datagram.KIND_INITIATION, version]) + (0xC0FFEE).to_bytes(4, "big")
    return with_mac1(header + inner, BOB_PUB)


def test_future_wire_version_gets_a_refusal_naming_our_versions() -> None:
    init = future_initiation(2)
    with pytest.raises(hs.InitiationRefused) as refused:
        responder().handle_initiation(init, local_lane_id=1, now_wall_ns=NOW)
    refusal = refused.value.datagram
    assert datagram.peek_kind(refusal) == datagram.KIND_REFUSAL
    assert datagram.peek_receiver_lane_id(refusal) == 0xC0FFEE
    assert hs.decode_refusal(refusal)[1] == (1,)
    assert len(refusal) <= len(init)  # no amplification for spoofed sources
    # A refusal to a tiny initiation is cut to fit it.
    tiny = future_initiation(9, body=b"")
    with pytest.raises(hs.InitiationRefused) as refused_tiny:
        responder().handle_initiation(tiny, local_lane_id=1, now_wall_ns=NOW)
    assert len(refused_tiny.value.datagram) <= len(tiny)


def test_future_version_without_mac1_gets_no_reply() -> None:
    init = bytearray(future_initiation(2))
    init[-1] ^= 0xFF
    with pytest.raises(RemoteProtocolError) as caught:
        responder().handle_initiation(bytes(init), local_lane_id=1, now_wall_ns=NOW)
    assert not isinstance(caught.value, hs.InitiationRefused)


def test_initiator_turns_a_refusal_into_a_clear_error() -> None:
    alice = initiator(local_lane_id=0xC0FFEE)
    with pytest.raises(hs.InitiationRefused) as refused:
        responder().handle_initiation(future_initiation(2), local_lane_id=1, now_wall_ns=NOW)
    error = alice.handle_refusal(refused.value.datagram)
    assert isinstance(error, hs.VersionRefused) and isinstance(error, LocalProtocolError)
    assert error.peer_versions == (1,)
    assert "handshake version 2 not supported" in str(error) and "[1]" in str(error)


def test_no_common_application_version_is_refused() -> None:
    alice = initiator(versions=[7, 8])
    with pytest.raises(hs.InitiationRefused) as refused:
        responder().handle_initiation(alice.initiation_datagram(), local_lane_id=1, now_wall_ns=NOW)
    error = alice.handle_refusal(refused.value.datagram)
    assert error.peer_versions == (1, 2, 3)
    assert "[1, 2, 3]" in str(error) and "[7, 8]" in str(error)


def test_refusal_for_another_lane_or_after_completion_is_ignored() -> None:
    refusal = hs.encode_refusal(0xDEAD, [1], "nope")
    with pytest.raises(RemoteProtocolError, match="another lane"):
        initiator().handle_refusal(refusal)
    alice = initiator(local_lane_id=0xDEAD)
    response, _ = responder().handle_initiation(
        alice.initiation_datagram(), local_lane_id=1, now_wall_ns=NOW
    )
    alice.handle_response(response)
    with pytest.raises(RemoteProtocolError, match="completed"):
        alice.handle_refusal(refusal)


def test_mac1_failure_costs_no_diffie_hellman(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"dh": 0}

    def counting(original: Callable[..., bytes]) -> Callable[..., bytes]:
        def wrapper(*args: Any) -> bytes:
            calls["dh"] += 1
            return original(*args)

        return wrapper

    init = initiator().initiation_datagram()
    bob = responder()
    for name in ("dh", "x25519_public", "x25519_generate"):
        monkeypatch.setattr(noise, name, counting(getattr(noise, name)))
    for bad in (flip(init, 10), flip(init, len(init) - 1), init[:-1] + b"\x00", bytes(150)):
        with pytest.raises(RemoteProtocolError):
            bob.handle_initiation(bad, local_lane_id=1, now_wall_ns=NOW)
    assert calls["dh"] == 0
    bob.handle_initiation(init, local_lane_id=1, now_wall_ns=NOW)
    assert calls["dh"] >= 4  # the genuine one does es, ss, ee, se (the counter works)


def test_psk_from_secret() -> None:
    assert hs.psk_from_secret("mesh") == hs.psk_from_secret(b"mesh")
    assert len(hs.psk_from_secret("mesh")) == 32
    assert hs.psk_from_secret("mesh") != hs.psk_from_secret("mesh2")
    assert hs.psk_from_secret("mesh") != hashlib.blake2s(b"mesh").digest()  # domain-separated
    with pytest.raises(LocalProtocolError):
        hs.psk_from_secret("")


def test_bad_local_arguments_are_local_errors() -> None:
    for overrides in (
        {"versions": []},
        {"versions": [256]},
        {"capabilities": ["x" * 100]},
        {"max_message_bytes": 0},
        {"local_lane_id": 2**32},
        {"now_wall_ns": -1},
    ):
        with pytest.raises(LocalProtocolError):
            initiator(**overrides)
    with pytest.raises(LocalProtocolError):
        responder(psk=b"short")


# --- forging authenticated payloads: a peer that holds the keys but sends nonsense ------------


def forge_initiation(payload: bytes, lane_id: int = 5) -> bytes:
    header = bytes([datagram.KIND_INITIATION, hs.HANDSHAKE_VERSION]) + lane_id.to_bytes(4, "big")
    state = noise.HandshakeState(
        initiator=True,
        static_private=ALICE,
        psk=PSK,
        remote_static=BOB_PUB,
        prologue=hs.PROLOGUE_LABEL + b"\x00" + header,
    )
    return with_mac1(header + state.write_message(payload), BOB_PUB)


def forge_response(alice: hs.Initiator, payload: bytes, sender_lane_id: int = 9) -> bytes:
    """Answer `alice` as Bob would, but with an arbitrary payload."""
    init = alice.initiation_datagram()
    state = noise.HandshakeState(
        initiator=False,
        static_private=BOB,
        psk=PSK,
        prologue=hs.PROLOGUE_LABEL + b"\x00" + init[:6],
    )
    state.read_message(init[6:-16])
    header = bytes([datagram.KIND_RESPONSE, 1]) + init[2:6] + sender_lane_id.to_bytes(4, "big")
    return with_mac1(header + state.write_message(payload), ALICE_PUB)


def encode(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


def test_responder_cannot_pick_terms_the_initiator_did_not_offer() -> None:
    cases = {
        "version we did not offer": encode(v=1, c=[], m=100, l=9),
        "capability we did not offer": encode(v=3, c=["relay"], m=100, l=9),
        "lane id does not match": encode(v=3, c=[], m=100, l=10),
        "bad response payload": encode(v=3, c=[]),
    }
    for message, payload in cases.items():
        with pytest.raises(RemoteProtocolError, match=message):
            initiator().handle_response(forge_response(initiator(), payload))
    result = initiator().handle_response(forge_response(initiator(), encode(v=2, c=[], m=9, l=9)))
    assert (result.version, result.max_message_bytes) == (2, 9)


def test_authenticated_garbage_initiation_payload_is_rejected() -> None:
    for payload in (b"", b"\xc1", encode(t=NOW, v=[], c=[], m=1), encode(t=-1, v=[1], c=[], m=1)):
        with pytest.raises(RemoteProtocolError, match="payload"):
            responder().handle_initiation(
                forge_initiation(payload), local_lane_id=1, now_wall_ns=NOW
            )


# --- fuzzing: remote bytes raise only RemoteProtocolError ------------------------------------

INIT = initiator().initiation_datagram()
RESPONSE, _ = responder().handle_initiation(INIT, local_lane_id=9, now_wall_ns=NOW)
REFUSAL = hs.encode_refusal(0xA1A1A1A1, [1, 2], "no")


def mutated(base: bytes, reseal_for: bytes | None) -> st.SearchStrategy[bytes]:
    """`base` with bytes changed, cut or extended; optionally with mac1 re-sealed."""

    def apply(edits: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
        data = bytearray(base)
        for pos, value in edits:
            data[pos % len(data)] = value
        out = bytes(data[: max(len(data) - cut, 0)]) + tail
        if reseal_for is not None and len(out) > hs.MAC_BYTES:
            out = with_mac1(out[: -hs.MAC_BYTES], reseal_for)
        return out

    return st.builds(
        apply,
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3),
        st.integers(0, 20),
        st.binary(max_size=8),
    )


def any_of(base: bytes, receiver: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300), mutated(base, None), mutated(base, receiver), st.just(base)
    )


@settings(max_examples=200)
@given(any_of(INIT, BOB_PUB))
def test_fuzz_handle_initiation(data: bytes) -> None:
    try:
        _, result = responder().handle_initiation(data, local_lane_id=2, now_wall_ns=NOW)
    except hs.InitiationRefused as refused:
        assert len(refused.datagram) <= len(data)
        return
    except RemoteProtocolError:
        return
    assert data == INIT and result.remote_static == ALICE_PUB


@settings(max_examples=200)
@given(any_of(RESPONSE, ALICE_PUB))
def test_fuzz_handle_response(data: bytes) -> None:
    try:
        initiator().handle_response(data)
    except RemoteProtocolError:
        return
    assert data == RESPONSE


@settings(max_examples=200)
@given(st.one_of(st.binary(max_size=100), mutated(REFUSAL, None)))
def test_fuzz_handle_refusal(data: bytes) -> None:
    try:
        error = initiator().handle_refusal(data)
    except RemoteProtocolError:
        return
    assert isinstance(error, hs.VersionRefused)


@settings(max_examples=200)
@given(st.binary(max_size=120))
def test_fuzz_authenticated_initiation_payload(payload: bytes) -> None:
    try:
        responder().handle_initiation(forge_initiation(payload), local_lane_id=1, now_wall_ns=NOW)
    except RemoteProtocolError:
        return
