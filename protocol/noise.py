"""Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s, written from the Noise specification (revision 34).

Only what meshd needs: one pattern (IKpsk2, as WireGuard uses), X25519 from libsodium via
PyNaCl, ChaCha20-Poly1305 (IETF) and BLAKE2s from hashlib. Hand-written because no maintained
Python Noise library offers IKpsk2 on PyNaCl; the `noiseprotocol` package is the test oracle.

Errors follow the package contract: anything caused by received bytes raises
`RemoteProtocolError`; calling out of turn raises `LocalProtocolError`. A `read_message` that
fails leaves the handshake state untouched, so a forged message cannot break a handshake that
is still waiting for the genuine one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from nacl import bindings as sodium
from nacl import exceptions as sodium_errors

from protocol.errors import LocalProtocolError, RemoteProtocolError, UndecryptableError

PROTOCOL_NAME = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s"

DHLEN = 32
HASHLEN = 32
KEYLEN = 32
TAGLEN = 16
PSKLEN = 32

# Noise reserves nonce 2^64-1 (it is used by Rekey), so the last usable counter is one below it.
MAX_COUNTER = 2**64 - 2
_ZERO_DH = bytes(DHLEN)

# Message tokens of IKpsk2 after the pre-message `<- s`.
_PATTERN: tuple[tuple[str, ...], ...] = (("e", "es", "s", "ss"), ("e", "ee", "se", "psk"))


# --- primitives -------------------------------------------------------------------------


def blake2s(data: bytes) -> bytes:
    """HASH(data): unkeyed 32-byte BLAKE2s."""
    return hashlib.blake2s(data).digest()


def hmac_blake2s(key: bytes, data: bytes) -> bytes:
    """HMAC-BLAKE2s (RFC 2104 with a 64-byte block), as Noise's HKDF uses it."""
    return hmac.new(key, data, hashlib.blake2s).digest()


def hkdf(chaining_key: bytes, ikm: bytes, n: int) -> tuple[bytes, ...]:
    """Noise's HKDF (spec section 4.3): `n` (2 or 3) outputs of HASHLEN bytes each."""
    if n not in (2, 3):
        raise LocalProtocolError("Noise HKDF yields 2 or 3 outputs")
    temp_key = hmac_blake2s(chaining_key, ikm)
    outputs: list[bytes] = []
    previous = b""
    for i in range(1, n + 1):
        previous = hmac_blake2s(temp_key, previous + bytes([i]))
        outputs.append(previous)
    return tuple(outputs)


def x25519_public(private: bytes) -> bytes:
    """The X25519 public key of a 32-byte private scalar."""
    if len(private) != DHLEN:
        raise LocalProtocolError("an X25519 private key is 32 bytes")
    return bytes(sodium.crypto_scalarmult_base(private))


def x25519_generate() -> tuple[bytes, bytes]:
    """A fresh random X25519 keypair (private, public)."""
    private = os.urandom(DHLEN)
    return private, x25519_public(private)


def dh(private: bytes, public: bytes) -> bytes:
    """X25519(private, public); a low-order public key (all-zero result) is the peer's fault."""
    if len(public) != DHLEN:
        raise RemoteProtocolError("an X25519 public key is 32 bytes")
    try:
        shared = bytes(sodium.crypto_scalarmult(private, public))
    except (sodium_errors.RuntimeError, sodium_errors.CryptoError) as exc:
        # libsodium refuses an all-zero output, which only a low-order point produces.
        raise RemoteProtocolError("X25519 with a low-order public key") from exc
    if hmac.compare_digest(shared, _ZERO_DH):
        raise RemoteProtocolError("X25519 with a low-order public key")
    return shared


def _nonce(counter: int) -> bytes:
    return bytes(4) + counter.to_bytes(8, "little")


def aead_encrypt(key: bytes, counter: int, ad: bytes, plaintext: bytes) -> bytes:
    """ChaCha20-Poly1305 (IETF) with Noise's nonce: 4 zero bytes then the LE 64-bit counter."""
    if len(key) != KEYLEN:
        raise LocalProtocolError("an AEAD key is 32 bytes")
    if not 0 <= counter <= MAX_COUNTER:
        raise LocalProtocolError("AEAD counter out of range; the key must be replaced")
    return bytes(
        sodium.crypto_aead_chacha20poly1305_ietf_encrypt(plaintext, ad, _nonce(counter), key)
    )


def aead_decrypt(key: bytes, counter: int, ad: bytes, ciphertext: bytes) -> bytes:
    """Open a ciphertext from `aead_encrypt`; any failure raises RemoteProtocolError."""
    if len(key) != KEYLEN:
        raise LocalProtocolError("an AEAD key is 32 bytes")
    # The counter is normally read off the wire, so a bad one is the peer's fault.
    if not 0 <= counter <= MAX_COUNTER:
        raise RemoteProtocolError("AEAD counter out of range")
    if len(ciphertext) < TAGLEN:
        raise RemoteProtocolError("ciphertext shorter than its tag")
    try:
        return bytes(
            sodium.crypto_aead_chacha20poly1305_ietf_decrypt(ciphertext, ad, _nonce(counter), key)
        )
    except sodium_errors.CryptoError as exc:
        raise UndecryptableError("AEAD authentication failed") from exc


def x25519_keypair_from_ed25519_seed(seed32: bytes) -> tuple[bytes, bytes]:
    """The X25519 (private, public) pair birationally equivalent to an Ed25519 identity seed."""
    if len(seed32) != 32:
        raise LocalProtocolError("an Ed25519 seed is 32 bytes")
    ed_public, ed_secret = sodium.crypto_sign_seed_keypair(seed32)
    private = bytes(sodium.crypto_sign_ed25519_sk_to_curve25519(ed_secret))
    public = bytes(sodium.crypto_sign_ed25519_pk_to_curve25519(ed_public))
    return private, public


def x25519_public_from_ed25519_public(pub32: bytes) -> bytes:
    """The X25519 public key of a peer's Ed25519 public key (which usually came off the wire).

    Raises RemoteProtocolError when the bytes are not a valid Ed25519 point.
    """
    if len(pub32) != 32:
        raise RemoteProtocolError("an Ed25519 public key is 32 bytes")
    try:
        return bytes(sodium.crypto_sign_ed25519_pk_to_curve25519(pub32))
    except (sodium_errors.RuntimeError, sodium_errors.CryptoError) as exc:
        raise RemoteProtocolError("not a valid Ed25519 public key") from exc


# --- Noise objects ----------------------------------------------------------------------


@dataclass
class CipherState:
    """Noise CipherState: a key (or none yet) and its nonce counter."""

    k: bytes | None = None
    n: int = 0

    def has_key(self) -> bool:
        """Whether a key is set (before that, encryption is the identity)."""
        return self.k is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        """EncryptWithAd: encrypt under (k, n) and advance n; identity without a key."""
        if self.k is None:
            return plaintext
        ciphertext = aead_encrypt(self.k, self.n, ad, plaintext)
        self.n += 1
        return ciphertext

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        """DecryptWithAd: n advances only when authentication succeeds."""
        if self.k is None:
            return ciphertext
        plaintext = aead_decrypt(self.k, self.n, ad, ciphertext)
        self.n += 1
        return plaintext


@dataclass
class SymmetricState:
    """Noise SymmetricState: chaining key, handshake hash and the current CipherState."""

    ck: bytes
    h: bytes
    cipher: CipherState

    @classmethod
    def initialize(cls, protocol_name: bytes) -> SymmetricState:
        """InitializeSymmetric: h = name padded to HASHLEN, or HASH(name) when longer."""
        if len(protocol_name) <= HASHLEN:
            h = protocol_name.ljust(HASHLEN, b"\x00")
        else:
            h = blake2s(protocol_name)
        return cls(ck=h, h=h, cipher=CipherState())

    def copy(self) -> SymmetricState:
        """An independent snapshot, for rolling back a failed read."""
        return SymmetricState(self.ck, self.h, CipherState(self.cipher.k, self.cipher.n))

    def mix_key(self, ikm: bytes) -> None:
        """MixKey: ratchet the chaining key and start a new cipher key."""
        self.ck, temp_k = hkdf(self.ck, ikm, 2)
        self.cipher = CipherState(temp_k)

    def mix_hash(self, data: bytes) -> None:
        """MixHash: h = HASH(h || data)."""
        self.h = blake2s(self.h + data)

    def mix_key_and_hash(self, ikm: bytes) -> None:
        """MixKeyAndHash: used for the PSK token."""
        self.ck, temp_h, temp_k = hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.cipher = CipherState(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        """EncryptAndHash: encrypt with h as associated data, then hash the ciphertext."""
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        """DecryptAndHash: the inverse of encrypt_and_hash."""
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[bytes, bytes]:
        """Split: the two transport keys (initiator->responder, responder->initiator)."""
        k1, k2 = hkdf(self.ck, b"", 2)
        return k1, k2


class HandshakeState:
    """A Noise IKpsk2 handshake: `<- s ... -> e, es, s, ss  <- e, ee, se, psk`.

    The initiator calls write_message then read_message; the responder the reverse. After
    both messages, `complete` is true and `split()` gives the transport keys.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        static_private: bytes,
        psk: bytes,
        remote_static: bytes | None = None,
        prologue: bytes = b"",
        ephemeral_private: bytes | None = None,
    ) -> None:
        if len(psk) != PSKLEN:
            raise LocalProtocolError("the PSK is 32 bytes")
        if initiator and remote_static is None:
            raise LocalProtocolError("an IK initiator must know the responder's static key")
        if not initiator and remote_static is not None:
            raise LocalProtocolError("an IK responder learns the initiator's key from message 1")
        if remote_static is not None and len(remote_static) != DHLEN:
            raise LocalProtocolError("an X25519 public key is 32 bytes")
        self._initiator = initiator
        self._s = static_private
        self._s_pub = x25519_public(static_private)
        self._psk = psk
        self._rs = remote_static
        if ephemeral_private is None:
            self._e, self._e_pub = x25519_generate()
        else:
            self._e, self._e_pub = ephemeral_private, x25519_public(ephemeral_private)
        self._re: bytes | None = None
        self._message_index = 0
        self._ss = SymmetricState.initialize(PROTOCOL_NAME)
        self._ss.mix_hash(prologue)
        # Pre-message `<- s`: both sides hash the responder's static key.
        self._ss.mix_hash(remote_static if remote_static is not None else self._s_pub)

    @property
    def complete(self) -> bool:
        """Whether both handshake messages have been processed."""
        return self._message_index >= len(_PATTERN)

    @property
    def remote_static(self) -> bytes | None:
        """The peer's static X25519 key (the responder learns it from message 1)."""
        return self._rs

    @property
    def handshake_hash(self) -> bytes:
        """The transcript hash h: both sides agree on it once the handshake is complete."""
        return self._ss.h

    def _my_turn_to_write(self) -> bool:
        # Message 0 is the initiator's, message 1 the responder's.
        return (self._message_index % 2 == 0) == self._initiator

    def write_message(self, payload: bytes = b"") -> bytes:
        """Produce the next handshake message carrying an encrypted `payload`."""
        if self.complete:
            raise LocalProtocolError("the handshake is already complete")
        if not self._my_turn_to_write():
            raise LocalProtocolError("it is the peer's turn to send a handshake message")
        out = bytearray()
        for token in _PATTERN[self._message_index]:
            if token == "e":
                out += self._e_pub
                self._ss.mix_hash(self._e_pub)
                self._ss.mix_key(self._e_pub)  # psk handshakes also mix e into the key
            elif token == "s":
                out += self._ss.encrypt_and_hash(self._s_pub)
            else:
                self._mix_token(token)
        out += self._ss.encrypt_and_hash(payload)
        self._message_index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Consume the peer's next handshake message and return its decrypted payload.

        On RemoteProtocolError nothing changes, so the genuine message can still be read.
        """
        if self.complete:
            raise LocalProtocolError("the handshake is already complete")
        if self._my_turn_to_write():
            raise LocalProtocolError("it is our turn to send a handshake message")
        saved = (self._ss.copy(), self._re, self._rs)
        try:
            payload = self._read_tokens(message)
        except RemoteProtocolError:
            self._ss, self._re, self._rs = saved
            raise
        self._message_index += 1
        return payload

    def _read_tokens(self, message: bytes) -> bytes:
        view = memoryview(message)
        for token in _PATTERN[self._message_index]:
            if token == "e":
                if len(view) < DHLEN:
                    raise RemoteProtocolError("handshake message too short for an ephemeral key")
                self._re = bytes(view[:DHLEN])
                view = view[DHLEN:]
                self._ss.mix_hash(self._re)
                self._ss.mix_key(self._re)
            elif token == "s":
                size = DHLEN + (TAGLEN if self._ss.cipher.has_key() else 0)
                if len(view) < size:
                    raise RemoteProtocolError("handshake message too short for a static key")
                self._rs = self._ss.decrypt_and_hash(bytes(view[:size]))
                view = view[size:]
            else:
                self._mix_token(token)
        if self._ss.cipher.has_key() and len(view) < TAGLEN:
            raise RemoteProtocolError("handshake message too short for its payload tag")
        return self._ss.decrypt_and_hash(bytes(view))

    def _mix_token(self, token: str) -> None:
        """The DH and PSK tokens; "es" means initiator's ephemeral with responder's static."""
        if token == "psk":
            self._ss.mix_key_and_hash(self._psk)
            return
        ours_is_ephemeral = {
            "ee": True,
            "ss": False,
            "es": self._initiator,
            "se": not self._initiator,
        }[token]
        theirs_is_ephemeral = {
            "ee": True,
            "ss": False,
            "es": not self._initiator,
            "se": self._initiator,
        }[token]
        private = self._e if ours_is_ephemeral else self._s
        public = self._re if theirs_is_ephemeral else self._rs
        if public is None:
            raise LocalProtocolError(f"token {token} before the peer's key is known")
        self._ss.mix_key(dh(private, public))

    def split(self) -> tuple[bytes, bytes]:
        """(initiator->responder key, responder->initiator key); only after completion."""
        if not self.complete:
            raise LocalProtocolError("split before the handshake is complete")
        return self._ss.split()
