"""This node's long-term identity: an Ed25519 signing key kept in the state directory.

The key is created on first run as `<state_dir>/identity.key` (mode 0600, directory 0700 when
we create it) and loaded on every later run, so a node keeps its name across restarts. The
same seed yields the X25519 static key the lanes use for Noise, so one file is the node's
whole identity. A key file that others could read is refused, as ssh refuses such keys.

`node_id` is a short fingerprint for people and logs (the first 16 hex digits of the BLAKE2s
hash of the public key); `fingerprint()` is the full hash, for comparing keys out of band.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import nacl.exceptions
import nacl.signing

from protocol.noise import x25519_keypair_from_ed25519_seed, x25519_public_from_ed25519_public

KEY_FILE_NAME = "identity.key"
NODE_ID_HEX_CHARS = 16
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
_FILE_KIND = "meshd-identity"
_FILE_VERSION = 1
# A genuine key file is about 200 bytes; anything much larger is not one.
_MAX_FILE_BYTES = 4096


class IdentityError(Exception):
    """The identity key file cannot be used; the message names the path and the fix."""

    def __init__(self, message: str, *, path: Path) -> None:
        super().__init__(message)
        self.path = path


class _KeyFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    version: int
    ed25519_seed: str
    ed25519_public: str


def fingerprint_of(public_key: bytes) -> str:
    """The full fingerprint of an Ed25519 public key: 64 hex digits of its BLAKE2s hash."""
    return hashlib.blake2s(bytes(public_key)).hexdigest()


def node_id_of(public_key: bytes) -> str:
    """The short node id of an Ed25519 public key (the first 16 hex digits of its fingerprint)."""
    return fingerprint_of(public_key)[:NODE_ID_HEX_CHARS]


class NodeIdentity:
    """An Ed25519 signing key and everything derived from it (never prints the secret)."""

    def __init__(self, seed: bytes, *, path: Path | None = None) -> None:
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        self._signing_key = nacl.signing.SigningKey(bytes(seed))
        self._x25519_private, self._x25519_public = x25519_keypair_from_ed25519_seed(bytes(seed))
        self.path = path

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh random identity held only in memory (tests, simulations)."""
        return cls(bytes(nacl.signing.SigningKey.generate()))

    @classmethod
    def load_or_create(cls, state_dir: str | os.PathLike[str]) -> NodeIdentity:
        """Load `<state_dir>/identity.key`, creating the directory and the key on first run.

        Raises IdentityError when the file is readable by group or others, or corrupt.
        """
        directory = Path(state_dir)
        path = directory / KEY_FILE_NAME
        if not path.exists():
            _make_private_dir(directory)
            try:
                created = _write_new_key(path, bytes(nacl.signing.SigningKey.generate()))
            except OSError as exc:
                raise IdentityError(
                    f"cannot write identity key {path}: {_os_reason(exc, directory)}", path=path
                ) from None
            if created is not None:
                return cls(created, path=path)
            # Another process created the key between our check and our write: use theirs.
        return cls.load(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NodeIdentity:
        """Load an existing key file, refusing one that is group/world accessible or corrupt."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise IdentityError(f"identity key {path} does not exist", path=path) from None
        except OSError as exc:
            raise IdentityError(
                f"cannot open identity key {path}: {_os_reason(exc, path.parent)}", path=path
            ) from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise IdentityError(f"identity key {path} is not a regular file", path=path)
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                raise IdentityError(
                    f"identity key {path} has mode {mode:04o}: it holds this node's private key "
                    f"and must be accessible only by its owner. Fix: chmod 600 '{path}'",
                    path=path,
                )
            raw = f.read(_MAX_FILE_BYTES + 1)
        return cls(_parse_key_file(raw, path), path=path)

    @property
    def public_key(self) -> bytes:
        """The Ed25519 public key (32 bytes)."""
        return bytes(self._signing_key.verify_key)

    @property
    def x25519_private(self) -> bytes:
        """The X25519 private key for the lanes' Noise static key (32 bytes)."""
        return self._x25519_private

    @property
    def x25519_public(self) -> bytes:
        """The X25519 public key peers must expect when opening a lane to us (32 bytes)."""
        return self._x25519_public

    @property
    def node_id(self) -> str:
        """A short, stable, human-friendly name of this node (16 hex digits)."""
        return node_id_of(self.public_key)

    def fingerprint(self) -> str:
        """The full fingerprint of the public key (64 hex digits), for out-of-band checks."""
        return fingerprint_of(self.public_key)

    def sign(self, data: bytes) -> bytes:
        """A detached Ed25519 signature of `data` (64 bytes)."""
        return bytes(self._signing_key.sign(bytes(data)).signature)

    @staticmethod
    def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
        """True when `signature` is `public_key`'s signature of `data`; never raises."""
        if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            nacl.signing.VerifyKey(bytes(public_key)).verify(bytes(data), bytes(signature))
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, ValueError):
            return False
        return True

    def __repr__(self) -> str:
        return f"NodeIdentity(node_id={self.node_id!r}, path={self.path!r})"


def _parse_key_file(raw: bytes, path: Path) -> bytes:
    fix = (
        f"restore it from a backup, or move it away to create a new identity "
        f"(peers that admitted the old key must admit the new one): mv '{path}' '{path}.bad'"
    )
    if len(raw) > _MAX_FILE_BYTES:
        raise IdentityError(f"identity key {path} is corrupt (too large). Fix: {fix}", path=path)
    try:
        record = msgspec.json.decode(raw, type=_KeyFile)
        if record.kind != _FILE_KIND or record.version != _FILE_VERSION:
            raise ValueError(f"unknown kind/version {record.kind!r}/{record.version}")
        seed = bytes.fromhex(record.ed25519_seed)
        public = bytes.fromhex(record.ed25519_public)
        if len(seed) != 32:
            raise ValueError("the seed is not 32 bytes")
    except (msgspec.DecodeError, ValueError) as exc:
        raise IdentityError(
            f"identity key {path} is corrupt ({exc}). Fix: {fix}", path=path
        ) from None
    # The stored public key doubles as a checksum of the seed.
    if bytes(nacl.signing.SigningKey(seed).verify_key) != public:
        raise IdentityError(
            f"identity key {path} is corrupt (seed and public key disagree). Fix: {fix}", path=path
        )
    return seed


def _make_private_dir(directory: Path) -> None:
    """Create the state directory (and parents) with mode 0700; leave an existing one alone."""
    if directory.is_dir():
        return
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        if directory.is_dir():  # another process made it meanwhile
            return
        raise IdentityError(
            f"state directory {directory} exists but is not a directory", path=directory
        ) from None
    except OSError as exc:
        raise IdentityError(
            f"cannot create state directory {directory}: {_os_reason(exc, directory)}",
            path=directory,
        ) from None
    # mkdir's mode is filtered by the umask; we want exactly 0700.
    os.chmod(directory, 0o700)


def _write_new_key(path: Path, seed: bytes) -> bytes | None:
    """Write a key file atomically (temp file, fsync, link into place) without clobbering.

    Returns the seed written, or None when a key appeared at `path` meanwhile.
    """
    public = bytes(nacl.signing.SigningKey(seed).verify_key)
    record = _KeyFile(_FILE_KIND, _FILE_VERSION, seed.hex(), public.hex())
    # mkstemp creates the file with mode 0600 whatever the umask.
    fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(record) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() fails if the name exists, so two daemons starting at once agree on one key.
            os.link(tmp, path)
        except FileExistsError:
            return None
        except OSError:
            # Filesystems without hard links: fall back to rename (atomic, may clobber a racer).
            os.replace(tmp, path)
        _fsync_dir(path.parent)
        return seed
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _os_reason(exc: OSError, directory: Path) -> str:
    """Why a file in the state directory cannot be made or read, and what to do, in words."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{reason}: free space on the file system of {directory}"
    if exc.errno == errno.EROFS:
        return f"{reason}: set state_dir to a directory on a writable file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{reason}: the daemon's user must own {directory} (or set state_dir)"
    if exc.errno == errno.ENOTDIR:
        return f"{reason}: a part of the path {directory} is a file, not a directory"
    return reason


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def admission_policy(
    admitted_keys: Iterable[bytes], revoked_keys: Iterable[bytes]
) -> Callable[[bytes], bool]:
    """An `admit(x25519_static) -> bool` for the lane endpoint, from Ed25519 key lists.

    The handshake sees a peer's X25519 static key, while operators list Ed25519 keys; each
    listed key is mapped once. Revoked keys are never admitted; when `admitted_keys` is empty
    every holder of the mesh secret is admitted, otherwise only the listed keys.
    """
    admitted = frozenset(x25519_public_from_ed25519_public(k) for k in admitted_keys)
    revoked = frozenset(x25519_public_from_ed25519_public(k) for k in revoked_keys)

    def admit(x25519_static: bytes) -> bool:
        key = bytes(x25519_static)
        if key in revoked:
            return False
        return not admitted or key in admitted

    return admit
