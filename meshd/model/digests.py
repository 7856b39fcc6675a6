"""SHA-256 digests of a model file's tensors, for its manifest (the model id), cached.

Hashing every byte costs about 1 s/GB on one core, so the tensors are hashed in a few threads
at once (hashlib releases the GIL), and their digests are cached by file (path, device, inode,
size, mtime_ns): in the process, and on disk under the cache dir (`set_cache_dir`,
`<state dir>/models/hashes/`), so a restart does not hash again and a changed file (any of
those differ) is hashed anew. No torch: `meshd serve` starts hashing while torch imports.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pathlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec

from meshd.model.errors import CorruptCheckpoint

log = logging.getLogger(__name__)


class Ranged(Protocol):
    """A tensor's name and byte range in its file (`TensorInfo`, `GGUFTensor`)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


_HASH_BLOCK = 8 * 1024 * 1024
# Threads hashing a file's tensors at once: hashlib hashes without the GIL, so each takes a core.
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))

_lock = threading.Lock()
_cache_dir: pathlib.Path | None = None
# (path, device, inode, size, mtime_ns) -> {tensor name: sha256}
_file_hashes: dict[tuple[str, int, int, int, int], dict[str, bytes]] = {}
# Held while a file's digests are computed (`file_tensor_digests`), by the same key.
_file_locks: dict[tuple[str, int, int, int, int], threading.Lock] = {}
_tensor_bytes_hashed = 0  # by `sha256_ranges`, in this process


class _HashCache(msgspec.Struct):
    path: str
    size: int
    mtime_ns: int
    hashes: dict[str, bytes]
    device: int = -1
    inode: int = -1


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Where tensor hashes (and fetched models) persist; None: hashes stay in the process."""
    global _cache_dir
    _cache_dir = pathlib.Path(path) if path else None


def cache_dir() -> pathlib.Path | None:
    """The cache dir `set_cache_dir` named."""
    return _cache_dir


def sha256_range(path: pathlib.Path, offset: int, nbytes: int) -> bytes:
    """(blocking) SHA-256 of bytes [offset, offset + nbytes) of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = nbytes
        while left:
            block = f.read(min(_HASH_BLOCK, left))
            if not block:
                raise CorruptCheckpoint(f"{path}: ends before byte {offset + nbytes}")
            digest.update(block)
            left -= len(block)
    return digest.digest()


def sha256_ranges(path: pathlib.Path, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """(blocking) SHA-256 of each byte range `(offset, nbytes)` of a file, in a few threads.

    The file is memory-mapped and each range hashed in one call, which hashlib runs without the
    GIL: the threads hash on as many cores, with no copy of the bytes. Largest ranges first, so
    one big tensor (an embedding) does not finish alone at the end.
    """
    global _tensor_bytes_hashed
    if not ranges:
        return []
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset, nbytes in ranges:
            if offset + nbytes > size:
                raise CorruptCheckpoint(f"{path}: ends before byte {offset + nbytes}")
        if size == 0:
            return [hashlib.sha256().digest() for _ in ranges]
        with (
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as view,
        ):

            def one(index: int) -> bytes:
                offset, nbytes = ranges[index]
                with view[offset : offset + nbytes] as part:
                    return hashlib.sha256(part).digest()

            order = sorted(range(len(ranges)), key=lambda i: -ranges[i][1])
            with ThreadPoolExecutor(min(_HASH_THREADS, len(ranges))) as pool:
                digests = dict(zip(order, pool.map(one, order), strict=True))
    with _lock:
        _tensor_bytes_hashed += sum(nbytes for _, nbytes in ranges)
    return [digests[i] for i in range(len(ranges))]


def tensor_bytes_hashed() -> int:
    """How many tensor bytes this process has hashed for manifests (`sha256_ranges`)."""
    return _tensor_bytes_hashed


def file_tensor_digests(path: pathlib.Path, infos: Sequence[Ranged]) -> dict[str, bytes]:
    """(blocking) SHA-256 of each tensor's bytes `infos` names in file `path`, by name (the
    result may hold more names): from the process's cache, else the cache dir's file for
    `path` if it was written for this very file (path, device, inode, size and mtime_ns all
    equal), else hashed (`sha256_ranges`) and cached in both. One file is hashed by one
    caller at a time: a second waits and takes the first one's digests."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _lock:
        file_lock = _file_locks.setdefault(key, threading.Lock())
    with file_lock:
        return _file_digests(path, key, infos)


def _file_digests(
    path: pathlib.Path, key: tuple[str, int, int, int, int], infos: Sequence[Ranged]
) -> dict[str, bytes]:
    with _lock:
        known = _file_hashes.get(key)
    if known is not None and all(i.name in known for i in infos):
        return known
    disk = _disk_cache_path(key[0])
    if disk is not None and known is None:
        try:
            cached = msgspec.msgpack.decode(disk.read_bytes(), type=_HashCache)
            stored = (cached.path, cached.device, cached.inode, cached.size, cached.mtime_ns)
            if stored == key:
                known = cached.hashes
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            known = None
    hashes = dict(known or {})
    missing = [info for info in infos if info.name not in hashes]
    digests = sha256_ranges(path, [(info.offset, info.nbytes) for info in missing])
    hashes |= {info.name: digest for info, digest in zip(missing, digests, strict=True)}
    with _lock:
        _file_hashes[key] = hashes
    if disk is not None and hashes != known:
        try:
            disk.parent.mkdir(parents=True, exist_ok=True)
            tmp = disk.with_suffix(".tmp")
            entry = _HashCache(key[0], key[3], key[4], hashes, device=key[1], inode=key[2])
            tmp.write_bytes(msgspec.msgpack.encode(entry))
            tmp.replace(disk)
        except OSError as exc:
            log.warning("cannot cache tensor hashes in %s: %s", disk, exc)
    return hashes


def _disk_cache_path(resolved: str) -> pathlib.Path | None:
    if _cache_dir is None:
        return None
    name = hashlib.sha256(resolved.encode()).hexdigest()[:24]
    return _cache_dir / "hashes" / f"{name}.msgpack"
