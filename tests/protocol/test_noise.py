"""Noise IKpsk2 against the independent `noiseprotocol` package, plus its failure contract."""

from __future__ import annotations

import hashlib
import random
import warnings

import nacl.signing
import pytest
from cryptography.exceptions import InvalidTag
from hypothesis import given, settings
from hypothesis import strategies as st
from noise.connection import Keypair, NoiseConnection

from protocol import noise
from protocol.errors import LocalProtocolError, RemoteProtocolError

NAME = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s"
PROLOGUE = b"test prologue"


def key(label: str) -> bytes:
    """A deterministic 32-byte key per label."""
    return hashlib.sha256(label.encode()).digest()


INITIATOR_S = key("initiator static")
RESPONDER_S = key("responder static")
PSK = key("psk")


def theirs(
    *,
    initiator: bool,
    static: bytes,
    psk: bytes = PSK,
    remote_static: bytes | None = None,
    ephemeral: bytes | None = None,
) -> NoiseConnection:
    conn = NoiseConnection.from_name(NAME)
    if initiator:
        conn.set_as_initiator()
    else:
        conn.set_as_responder()
    conn.set_psks(psk)
    conn.set_prologue(PROLOGUE)
    conn.set_keypair_from_private_bytes(Keypair.STATIC, static)
    if remote_static is not None:
        conn.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, remote_static)
    if ephemeral is not None:
        conn.set_keypair_from_private_bytes(Keypair.EPHEMERAL, ephemeral)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that a fixed ephemeral is for tests only
        conn.start_handshake()
    return conn


def ours_initiator(**overrides: bytes) -> noise.HandshakeState:
    args = {
        "static_private": INITIATOR_S,
        "psk": PSK,
        "remote_static": noise.x25519_public(RESPONDER_S),
    } | overrides
    return noise.HandshakeState(initiator=True, prologue=PROLOGUE, **args)


def ours_responder(**overrides: bytes) -> noise.HandshakeState:
    args = {"static_private": RESPONDER_S, "psk": PSK} | overrides
    return noise.HandshakeState(initiator=False, prologue=PROLOGUE, **args)


def exchange_transport(
    send: bytes, recv: bytes, peer: NoiseConnection, rounds: int = 5
) -> list[bytes]:
    """Several messages each way; returns what each side decrypted."""
    seen = []
    for i in range(rounds):
        ct = noise.aead_encrypt(send, i, b"", f"ours {i}".encode() * (i + 1))
        seen.append(bytes(peer.decrypt(ct)))
        seen.append(noise.aead_decrypt(recv, i, b"", peer.encrypt(f"theirs {i}".encode())))
    return seen


def test_ours_initiator_interoperates_with_noiseprotocol_responder() -> None:
    ours = ours_initiator()
    peer = theirs(initiator=False, static=RESPONDER_S)
    assert peer.read_message(ours.write_message(b"hello responder")) == b"hello responder"
    assert ours.read_message(peer.write_message(b"hello initiator")) == b"hello initiator"
    assert ours.complete and peer.handshake_finished
    assert ours.handshake_hash == peer.get_handshake_hash()
    i2r, r2i = ours.split()
    seen = exchange_transport(i2r, r2i, peer)
    assert seen[:4] == [b"ours 0", b"theirs 0", b"ours 1ours 1", b"theirs 1"]
    assert len(seen) == 10


def test_noiseprotocol_initiator_interoperates_with_ours_responder() -> None:
    peer = theirs(
        initiator=True, static=INITIATOR_S, remote_static=noise.x25519_public(RESPONDER_S)
    )
    ours = ours_responder()
    assert ours.read_message(bytes(peer.write_message(b"from them"))) == b"from them"
    assert ours.remote_static == noise.x25519_public(INITIATOR_S)
    assert peer.read_message(ours.write_message(b"from us")) == b"from us"
    assert ours.handshake_hash == peer.get_handshake_hash()
    i2r, r2i = ours.split()
    seen = exchange_transport(r2i, i2r, peer)
    assert seen[1] == b"theirs 0" and seen[8] == b"ours 4" * 5


def test_fixed_ephemerals_give_byte_identical_messages() -> None:
    """With the same keys on both implementations, every byte on the wire must agree."""
    e_i, e_r = key("initiator ephemeral"), key("responder ephemeral")
    a = ours_initiator(ephemeral_private=e_i)
    b = theirs(
        initiator=True,
        static=INITIATOR_S,
        remote_static=noise.x25519_public(RESPONDER_S),
        ephemeral=e_i,
    )
    msg1 = a.write_message(b"payload one")
    assert msg1 == bytes(b.write_message(b"payload one"))
    responder = ours_responder(ephemeral_private=e_r)
    responder.read_message(msg1)
    msg2 = responder.write_message(b"payload two")
    reference = theirs(initiator=False, static=RESPONDER_S, ephemeral=e_r)
    reference.read_message(msg1)
    assert msg2 == bytes(reference.write_message(b"payload two"))
    assert len(msg1) == 32 + 48 + len(b"payload one") + 16
    assert len(msg2) == 32 + len(b"payload two") + 16


def test_wrong_psk_fails_on_both_sides() -> None:
    ours = ours_initiator(psk=key("other psk"))
    peer = theirs(initiator=False, static=RESPONDER_S)
    # IKpsk2 mixes the PSK only at the end of message 2, so the responder cannot tell yet.
    peer.read_message(ours.write_message())
    with pytest.raises(RemoteProtocolError):
        ours.read_message(bytes(peer.write_message()))
    # And when our responder holds the other PSK, the oracle initiator rejects message 2.
    peer_i = theirs(
        initiator=True, static=INITIATOR_S, remote_static=noise.x25519_public(RESPONDER_S)
    )
    responder = ours_responder(psk=key("other psk"))
    responder.read_message(bytes(peer_i.write_message()))
    with pytest.raises(InvalidTag):
        peer_i.read_message(responder.write_message())


def test_wrong_expected_responder_key_fails_at_the_responder() -> None:
    ours = ours_initiator(remote_static=noise.x25519_public(key("somebody else")))
    with pytest.raises(RemoteProtocolError):
        ours_responder().read_message(ours.write_message())


def test_wrong_initiator_static_is_visible_to_the_responder() -> None:
    """The responder learns (and can then refuse) exactly the key the initiator holds."""
    responder = ours_responder()
    responder.read_message(ours_initiator(static_private=key("intruder")).write_message())
    assert responder.remote_static == noise.x25519_public(key("intruder"))


def test_every_tampered_byte_is_rejected_and_the_genuine_message_still_works() -> None:
    initiator = ours_initiator(ephemeral_private=key("e1"))
    msg1 = initiator.write_message(b"abc")
    for i in range(len(msg1)):
        forged = bytearray(msg1)
        forged[i] ^= 0x01
        with pytest.raises(RemoteProtocolError):
            ours_responder().read_message(bytes(forged))
    responder = ours_responder()
    responder.read_message(msg1)
    msg2 = responder.write_message(b"xyz")
    for i in range(len(msg2)):
        forged = bytearray(msg2)
        forged[i] ^= 0x80
        with pytest.raises(RemoteProtocolError):
            initiator.read_message(bytes(forged))
    # Failed reads left the initiator's state untouched.
    assert initiator.read_message(msg2) == b"xyz"
    assert initiator.handshake_hash == responder.handshake_hash


def test_truncated_and_extended_messages_are_rejected() -> None:
    msg1 = ours_initiator().write_message(b"abc")
    for cut in (0, 1, 31, 32, 79, 80, len(msg1) - 1):
        with pytest.raises(RemoteProtocolError):
            ours_responder().read_message(msg1[:cut])
    with pytest.raises(RemoteProtocolError):
        ours_responder().read_message(msg1 + b"\x00")


def test_low_order_ephemeral_is_rejected() -> None:
    # An all-zero public key (a low-order point) makes every X25519 output zero.
    with pytest.raises(RemoteProtocolError):
        ours_responder().read_message(bytes(32) + bytes(48 + 16))
    with pytest.raises(RemoteProtocolError):
        noise.dh(INITIATOR_S, bytes(32))
    with pytest.raises(RemoteProtocolError):
        noise.dh(INITIATOR_S, b"short")


def test_out_of_turn_calls_are_local_errors() -> None:
    initiator = ours_initiator()
    with pytest.raises(LocalProtocolError):
        initiator.read_message(b"x" * 100)
    with pytest.raises(LocalProtocolError):
        initiator.split()
    initiator.write_message()
    with pytest.raises(LocalProtocolError):
        initiator.write_message()
    responder = ours_responder()
    with pytest.raises(LocalProtocolError):
        responder.write_message()
    with pytest.raises(LocalProtocolError):
        noise.HandshakeState(initiator=True, static_private=INITIATOR_S, psk=PSK)
    with pytest.raises(LocalProtocolError):
        noise.HandshakeState(initiator=False, static_private=RESPONDER_S, psk=b"short")


def test_hkdf_matches_noiseprotocol() -> None:
    reference = NoiseConnection.from_name(NAME).noise_protocol.hkdf
    for n in (2, 3):
        assert noise.hkdf(key("ck"), b"input", n) == tuple(reference(key("ck"), b"input", n))
    assert noise.hkdf(key("ck"), b"", 2) == tuple(reference(key("ck"), b"", 2))
    with pytest.raises(LocalProtocolError):
        noise.hkdf(key("ck"), b"", 4)


def test_aead_round_trip_and_failures() -> None:
    k = key("transport")
    ct = noise.aead_encrypt(k, 7, b"ad", b"secret")
    assert noise.aead_decrypt(k, 7, b"ad", ct) == b"secret"
    assert len(ct) == len(b"secret") + 16
    for bad_args in ((k, 8, b"ad", ct), (k, 7, b"AD", ct), (key("other"), 7, b"ad", ct)):
        with pytest.raises(RemoteProtocolError):
            noise.aead_decrypt(*bad_args)
    with pytest.raises(RemoteProtocolError):
        noise.aead_decrypt(k, 7, b"ad", ct[:15])
    with pytest.raises(RemoteProtocolError):
        noise.aead_decrypt(k, 2**64 - 1, b"ad", ct)
    with pytest.raises(LocalProtocolError):
        noise.aead_encrypt(k, 2**64 - 1, b"", b"")
    with pytest.raises(LocalProtocolError):
        noise.aead_encrypt(b"short", 0, b"", b"")


def test_ed25519_identity_converts_to_a_working_x25519_key() -> None:
    seed_a, seed_b = key("node a"), key("node b")
    priv_a, pub_a = noise.x25519_keypair_from_ed25519_seed(seed_a)
    priv_b, pub_b = noise.x25519_keypair_from_ed25519_seed(seed_b)
    assert pub_a == noise.x25519_public(priv_a)
    ed_pub_a = bytes(nacl.signing.SigningKey(seed_a).verify_key)
    assert noise.x25519_public_from_ed25519_public(ed_pub_a) == pub_a
    assert noise.dh(priv_a, pub_b) == noise.dh(priv_b, pub_a)
    with pytest.raises(RemoteProtocolError):
        noise.x25519_public_from_ed25519_public(b"\x00" * 31)
    # A y coordinate of 2 is not on the curve; libsodium refuses to convert it.
    with pytest.raises(RemoteProtocolError):
        noise.x25519_public_from_ed25519_public((2).to_bytes(32, "little"))


def _valid_messages() -> tuple[bytes, bytes]:
    initiator = ours_initiator(ephemeral_private=key("fuzz e1"))
    msg1 = initiator.write_message(b"payload")
    responder = ours_responder(ephemeral_private=key("fuzz e2"))
    responder.read_message(msg1)
    return msg1, responder.write_message(b"reply")


MSG1, MSG2 = _valid_messages()


def mutated(base: bytes) -> st.SearchStrategy[bytes]:
    """Valid messages with a few bytes changed, cut short or extended."""

    def apply(edits: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
        data = bytearray(base)
        for pos, value in edits:
            data[pos % len(data)] = value
        return bytes(data[: len(data) - cut]) + tail

    return st.builds(
        apply,
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
        st.integers(0, 8),
        st.binary(max_size=4),
    )


@settings(max_examples=150)
@given(st.one_of(st.binary(max_size=200), mutated(MSG1)))
def test_fuzz_responder_read_raises_only_remote_errors(data: bytes) -> None:
    try:
        payload = ours_responder().read_message(data)
    except RemoteProtocolError:
        return
    # Only the genuine message may pass authentication.
    assert data == MSG1 and payload == b"payload"


@settings(max_examples=150)
@given(st.one_of(st.binary(max_size=120), mutated(MSG2)))
def test_fuzz_initiator_read_raises_only_remote_errors(data: bytes) -> None:
    initiator = ours_initiator(ephemeral_private=key("fuzz e1"))
    initiator.write_message(b"payload")
    try:
        payload = initiator.read_message(data)
    except RemoteProtocolError:
        assert not initiator.complete
        return
    assert data == MSG2 and payload == b"reply"


def test_random_keys_interoperate_many_times() -> None:
    rng = random.Random(1234)
    for _ in range(10):
        s_i, s_r, psk = rng.randbytes(32), rng.randbytes(32), rng.randbytes(32)
        ours = noise.HandshakeState(
            initiator=True,
            static_private=s_i,
            psk=psk,
            remote_static=noise.x25519_public(s_r),
            prologue=PROLOGUE,
        )
        peer = theirs(initiator=False, static=s_r, psk=psk)
        peer.read_message(ours.write_message())
        ours.read_message(bytes(peer.write_message()))
        assert ours.handshake_hash == peer.get_handshake_hash()
