"""Node identity: created once with safe permissions, reused, refused when exposed or corrupt."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import nacl.bindings
import pytest

from meshd.mesh import identity as identity_module
from meshd.mesh.identity import (
    KEY_FILE_NAME,
    IdentityError,
    NodeIdentity,
    admission_policy,
    fingerprint_of,
    node_id_of,
)
from protocol.noise import x25519_keypair_from_ed25519_seed, x25519_public_from_ed25519_public

SEED_A = bytes(range(32))
SEED_B = bytes(range(100, 132))


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave new files world-readable unless the code sets modes itself."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_once_with_private_modes_and_reused(tmp_path: Path, loose_umask: None) -> None:
    state = tmp_path / "deep" / "state"
    first = NodeIdentity.load_or_create(state)
    key_file = state / KEY_FILE_NAME
    assert _mode(key_file) == 0o600
    assert _mode(state) == 0o700
    content = key_file.read_bytes()

    second = NodeIdentity.load_or_create(state)
    assert second.public_key == first.public_key
    assert second.node_id == first.node_id
    assert key_file.read_bytes() == content
    # Only the key file: no temp files left behind.
    assert sorted(p.name for p in state.iterdir()) == [KEY_FILE_NAME]


def test_existing_state_dir_permissions_are_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    NodeIdentity.load_or_create(tmp_path)
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / KEY_FILE_NAME) == 0o600


def test_two_nodes_get_different_identities(tmp_path: Path) -> None:
    a = NodeIdentity.load_or_create(tmp_path / "a")
    b = NodeIdentity.load_or_create(tmp_path / "b")
    assert a.public_key != b.public_key and a.node_id != b.node_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_key_accessible_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    NodeIdentity.load_or_create(tmp_path)
    key_file = tmp_path / KEY_FILE_NAME
    key_file.chmod(mode)
    with pytest.raises(IdentityError) as err:
        NodeIdentity.load_or_create(tmp_path)
    message = str(err.value)
    assert str(key_file) in message
    assert f"{mode:04o}" in message
    assert f"chmod 600 '{key_file}'" in message
    # The fix in the message works.
    key_file.chmod(0o600)
    NodeIdentity.load_or_create(tmp_path)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: b"",  # empty
        lambda raw: b"\x00" * 64,  # garbage
        lambda raw: b"x" * 10_000,  # far too large
        lambda raw: raw.replace(b'"ed25519_seed":"0', b'"ed25519_seed":"1'),  # flipped seed
        lambda raw: raw.replace(b'"version":1', b'"version":9'),  # unknown version
    ],
    ids=["truncated", "empty", "garbage", "huge", "flipped-seed", "version"],
)
def test_corrupt_key_gives_a_clear_error(tmp_path: Path, corrupt: object) -> None:
    # A genuine file from a known (all-zero) seed, then damaged.
    key_file = tmp_path / KEY_FILE_NAME
    identity_module._write_new_key(key_file, bytes(32))
    raw = key_file.read_bytes()
    assert b'"ed25519_seed":"0' in raw and b'"version":1' in raw
    damaged = corrupt(raw)  # type: ignore[operator]
    assert damaged != raw
    key_file.write_bytes(damaged)
    with pytest.raises(IdentityError, match="corrupt") as err:
        NodeIdentity.load_or_create(tmp_path)
    assert str(key_file) in str(err.value)
    # Never silently replaced: the damaged file is still there for the operator.
    assert key_file.read_bytes() == damaged


def test_a_second_writer_never_clobbers_an_existing_key(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    key_file = tmp_path / KEY_FILE_NAME
    content = key_file.read_bytes()
    assert identity_module._write_new_key(key_file, SEED_B) is None
    assert key_file.read_bytes() == content
    assert NodeIdentity.load(key_file).public_key == first.public_key
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY_FILE_NAME]


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="does not exist"):
        NodeIdentity.load(tmp_path / KEY_FILE_NAME)


def test_sign_and_verify() -> None:
    a, b = NodeIdentity(SEED_A), NodeIdentity(SEED_B)
    signature = a.sign(b"capacity record v7")
    assert len(signature) == 64
    assert NodeIdentity.verify(a.public_key, b"capacity record v7", signature)
    assert not NodeIdentity.verify(a.public_key, b"capacity record v8", signature)
    assert not NodeIdentity.verify(b.public_key, b"capacity record v7", signature)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not NodeIdentity.verify(a.public_key, b"capacity record v7", forged)
    # Malformed inputs are a plain "no", never an exception.
    assert not NodeIdentity.verify(a.public_key[:31], b"x", signature)
    assert not NodeIdentity.verify(a.public_key, b"x", signature[:63])
    assert not NodeIdentity.verify(b"\xff" * 32, b"x", signature)


def test_signatures_survive_a_reload(tmp_path: Path) -> None:
    created = NodeIdentity.load_or_create(tmp_path)
    signature = created.sign(b"hello")
    loaded = NodeIdentity.load(tmp_path / KEY_FILE_NAME)
    assert NodeIdentity.verify(loaded.public_key, b"hello", signature)
    assert loaded.sign(b"hello") == signature  # Ed25519 is deterministic


def test_x25519_keys_agree_with_protocol_noise() -> None:
    a, b = NodeIdentity(SEED_A), NodeIdentity(SEED_B)
    assert (a.x25519_private, a.x25519_public) == x25519_keypair_from_ed25519_seed(SEED_A)
    # A peer that only knows our Ed25519 key derives the Noise static key we use.
    assert x25519_public_from_ed25519_public(a.public_key) == a.x25519_public
    # And the keys work for Diffie-Hellman both ways.
    ab = nacl.bindings.crypto_scalarmult(a.x25519_private, b.x25519_public)
    ba = nacl.bindings.crypto_scalarmult(b.x25519_private, a.x25519_public)
    assert ab == ba


def test_node_id_and_fingerprint_are_stable_and_short() -> None:
    a = NodeIdentity(SEED_A)
    assert a.node_id == NodeIdentity(SEED_A).node_id == node_id_of(a.public_key)
    assert len(a.node_id) == 16 and int(a.node_id, 16) >= 0
    assert a.fingerprint() == fingerprint_of(a.public_key)
    assert len(a.fingerprint()) == 64 and a.fingerprint().startswith(a.node_id)
    assert a.node_id != NodeIdentity(SEED_B).node_id


def test_repr_does_not_leak_the_seed() -> None:
    a = NodeIdentity(SEED_A)
    assert SEED_A.hex() not in repr(a) and a.node_id in repr(a)


def test_admission_policy_over_lane_static_keys() -> None:
    a, b, c = NodeIdentity(SEED_A), NodeIdentity(SEED_B), NodeIdentity(bytes(range(1, 33)))
    open_mesh = admission_policy([], [b.public_key])
    assert open_mesh(a.x25519_public) and open_mesh(c.x25519_public)
    assert not open_mesh(b.x25519_public)  # revoked
    allow_list = admission_policy([a.public_key, b.public_key], [b.public_key])
    assert allow_list(a.x25519_public)
    assert not allow_list(b.x25519_public)  # revoked wins over admitted
    assert not allow_list(c.x25519_public)  # not on the list
