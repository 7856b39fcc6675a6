"""A checkpoint's manifest (its model id), and the store a `mesh:ID` node fetches into.

`checkpoint_manifest` lists a safetensors checkpoint directory's small files (`MODEL_FILES`
that exist) and every tensor the runtime reads, each with its SHA-256 (`protocol.artifacts`);
the model id is the hash of that manifest, so every node holding the same files computes the
same id, and a node fetching the model can check each byte against it. Hashing every byte costs
about 1 s/GB on one core, so the tensors are hashed in a few threads at once (hashlib releases
the GIL), and their hashes are cached by file (path, device, inode, size, mtime_ns): in the
process, and on disk under the cache dir (`set_cache_dir`), so a restart does not hash again.

`ModelStore` keeps a fetched model under `<cache dir>/models/<id>/`: the manifest, the small
files under their own names (so the tokenizer opens the directory as usual), and each tensor as
its own one-tensor safetensors file under `tensors/`, written only once its hash matched.
`StoreCheckpoint` is a `Checkpoint` over the tensors held there: stages load from it the same way.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pathlib
import re
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from meshd.model.checkpoint import Checkpoint, OnTensor, TensorInfo, expected_shapes
from meshd.model.config import ModelConfig
from meshd.model.errors import CorruptCheckpoint
from protocol.artifacts import (
    MANIFEST_VERSION,
    Artifact,
    ArtifactKind,
    Manifest,
    encode_manifest,
    manifest_id,
    open_manifest,
)

log = logging.getLogger(__name__)

# The small files a node needs beside the tensors (those present are in the manifest).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
)
MANIFEST_FILE = "manifest.msgpack"
NAME_FILE = "name"
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,200}")
_HASH_BLOCK = 8 * 1024 * 1024
# Threads hashing a file's tensors at once: hashlib hashes without the GIL, so each takes a core.
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))

_lock = threading.Lock()
_cache_dir: pathlib.Path | None = None
# (path, device, inode, size, mtime_ns) -> {tensor name: sha256}
_file_hashes: dict[tuple[str, int, int, int, int], dict[str, bytes]] = {}
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


def _hash_file_tensors(path: pathlib.Path, infos: list[TensorInfo]) -> dict[str, bytes]:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
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


def checkpoint_manifest(checkpoint: Checkpoint) -> tuple[str, bytes, Manifest]:
    """(blocking) The manifest of a safetensors checkpoint directory: (model id, bytes, manifest)."""
    directory = checkpoint.directory
    artifacts: list[Artifact] = []
    for name in MODEL_FILES:
        path = directory / name
        if path.is_file():
            data = path.read_bytes()
            artifacts.append(
                Artifact(ArtifactKind.FILE, name, len(data), hashlib.sha256(data).digest())
            )
    names = sorted(expected_shapes(checkpoint.config))
    by_file: dict[pathlib.Path, list[TensorInfo]] = {}
    for name in names:
        info = checkpoint.tensors[name]
        by_file.setdefault(info.path, []).append(info)
    hashes: dict[str, bytes] = {}
    for path, infos in by_file.items():
        hashes |= _hash_file_tensors(path, infos)
    for name in names:
        info = checkpoint.tensors[name]
        artifacts.append(
            Artifact(
                ArtifactKind.TENSOR,
                name,
                info.nbytes,
                hashes[name],
                dtype=info.dtype,
                shape=list(info.shape),
            )
        )
    manifest = Manifest(MANIFEST_VERSION, "safetensors", artifacts)
    data = encode_manifest(manifest)
    return manifest_id(data), data, manifest


# ---- the store of a fetched model ----------------------------------------------------------


def tensor_file_header(artifact: Artifact) -> bytes:
    """The safetensors header (length prefix included) of a one-tensor file for `artifact`;
    its length is a multiple of 8, so the data that follows is aligned."""
    header = msgspec.json.encode(
        {
            artifact.name: {
                "dtype": artifact.dtype,
                "shape": artifact.shape,
                "data_offsets": [0, artifact.nbytes],
            }
        }
    )
    header += b" " * (-(len(header) + 8) % 8)
    return struct.pack("<Q", len(header)) + header


@dataclass(frozen=True, slots=True)
class _Verified:
    size: int
    mtime_ns: int


class ModelStore:
    """A model fetched (in part) over the mesh: `<root>/models/<model id>/`."""

    def __init__(self, root: pathlib.Path, model_id: str, data: bytes, manifest: Manifest) -> None:
        # Names become file names: a manifest from a peer must not reach outside the store.
        for artifact in manifest.artifacts:
            if manifest.format == "gguf":
                from meshd.model.gguf_mesh import check_artifact

                problem = check_artifact(artifact)
                if problem is not None:
                    raise CorruptCheckpoint(f"manifest of {model_id}: {problem}")
                continue
            if artifact.kind == ArtifactKind.FILE and artifact.name not in MODEL_FILES:
                raise CorruptCheckpoint(
                    f"manifest of {model_id}: unexpected file {artifact.name!r}"
                )
            if artifact.kind == ArtifactKind.TENSOR and not _TENSOR_NAME.fullmatch(artifact.name):
                raise CorruptCheckpoint(
                    f"manifest of {model_id}: tensor name {artifact.name!r} is not a plain name"
                )
            if artifact.kind == ArtifactKind.TENSOR and artifact.dtype not in _TORCH_DTYPES:
                raise CorruptCheckpoint(
                    f"manifest of {model_id}: tensor {artifact.name!r} has dtype {artifact.dtype!r}"
                )
        self.model_id = model_id
        self.manifest_bytes = data
        self.manifest = manifest
        self.directory = root / "models" / model_id
        self.tensor_dir = self.directory / "tensors"
        self.tensor_dir.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        path = self.directory / MANIFEST_FILE
        if not path.is_file() or path.read_bytes() != data:
            _write_atomic(path, data)
        # Artifacts whose stored bytes matched their hash, and the file's stat then: a file
        # changed since (a different size or mtime) is hashed again before it is trusted.
        self._verified: dict[int, _Verified] = {}
        self._lock = threading.Lock()  # artifacts are verified in worker threads
        self._verified_path = self.directory / "verified.msgpack"
        try:
            raw = msgspec.msgpack.decode(
                self._verified_path.read_bytes(), type=dict[int, list[int]]
            )
            self._verified = {i: _Verified(v[0], v[1]) for i, v in raw.items() if len(v) == 2}
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            self._verified = {}

    def _remove_leftovers(self) -> None:
        """(blocking) Delete what a process killed mid-write left: part files of artifacts
        that were arriving and temp files of atomic writes. Nothing says which bytes of a part
        file arrived, so a fetch begins it afresh anyway; one of an artifact the next plan
        does not want would otherwise hold its disk for good."""
        stale = [*self.directory.glob("*.tmp")]
        for path in stale:
            path.unlink(missing_ok=True)
        removed = len(stale) + self.remove_parts()
        if removed:
            log.info("%s: removed %d files a killed process left", self.directory, removed)

    def remove_parts(self) -> int:
        """(blocking) Delete every part file (artifacts that began arriving and were not
        verified); how many. Only while no fetch runs into this store: a fetch that ends
        unfinished (stopped, failed, cancelled by a graceful stop) begins them afresh next
        time anyway, and one retargeted away from an artifact leaves its part behind."""
        parts = [*self.tensor_dir.glob("*.part"), *self.directory.glob("*.part")]
        for path in parts:
            path.unlink(missing_ok=True)
        return len(parts)

    @property
    def name(self) -> str:
        """What the holders' APIs call the model ("" if no holder said): a `mesh:ID` node
        answers to the same name."""
        try:
            return (self.directory / NAME_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    def set_name(self, name: str) -> None:
        """Keep the holders' name for the model (one line; restarts need no peer)."""
        if name and name != self.name:
            _write_atomic(self.directory / NAME_FILE, name.splitlines()[0].encode())

    @classmethod
    def open_cached(cls, root: pathlib.Path, prefix: str) -> ModelStore | None:
        """The store of the one cached model whose id starts with `prefix` (None: none, or
        several match; the manifest is checked against its id)."""
        models = root / "models"
        if not models.is_dir():
            return None
        found = [p for p in models.iterdir() if p.name.startswith(prefix)]
        if len(found) != 1:
            return None
        try:
            data = (found[0] / MANIFEST_FILE).read_bytes()
            model_id, manifest = open_manifest(data, found[0].name)
        except Exception:  # a damaged cache entry is fetched anew
            return None
        return cls(root, model_id, data, manifest)

    def path_of(self, index: int) -> pathlib.Path:
        """Where artifact `index` is stored once verified."""
        artifact = self.manifest.artifacts[index]
        if artifact.kind == ArtifactKind.FILE:
            return self.directory / artifact.name
        if self.manifest.format == "gguf":  # raw GGUF bytes (`meshd.model.gguf_mesh`)
            return self.tensor_dir / f"{artifact.name}.bin"
        return self.tensor_dir / f"{artifact.name}.safetensors"

    def data_offset(self, index: int) -> int:
        """Where artifact `index`'s bytes start in its file."""
        artifact = self.manifest.artifacts[index]
        if artifact.kind == ArtifactKind.FILE or self.manifest.format == "gguf":
            return 0
        return len(tensor_file_header(artifact))

    def part_path(self, index: int) -> pathlib.Path:
        """Where artifact `index` is written while it arrives."""
        path = self.path_of(index)
        return path.with_name(path.name + ".part")

    def begin(self, index: int) -> None:
        """(blocking) Start a fresh part file for artifact `index` (header in place)."""
        artifact = self.manifest.artifacts[index]
        part = self.part_path(index)
        with part.open("wb") as f:
            if self.data_offset(index):
                f.write(tensor_file_header(artifact))
            f.truncate(self.data_offset(index) + artifact.nbytes)

    def write(self, index: int, offset: int, data: bytes) -> None:
        """(blocking) Store received bytes of artifact `index` in its part file."""
        fd = os.open(self.part_path(index), os.O_WRONLY)
        try:
            os.pwrite(fd, data, self.data_offset(index) + offset)
        finally:
            os.close(fd)

    def finish(self, index: int) -> bool:
        """(blocking) Hash the part file: keep it when it matches the manifest (True), or
        delete it (False)."""
        artifact = self.manifest.artifacts[index]
        part = self.part_path(index)
        ok = sha256_range(part, self.data_offset(index), artifact.nbytes) == artifact.sha256
        if not ok:
            part.unlink(missing_ok=True)
            return False
        path = self.path_of(index)
        part.replace(path)
        stat = path.stat()
        with self._lock:
            self._verified[index] = _Verified(stat.st_size, stat.st_mtime_ns)
            self._save_verified()
        return True

    def held(self, indices: Iterable[int]) -> set[int]:
        """(blocking) Which of `indices` are stored and intact. A file whose stat changed since
        it was verified is hashed again; one that no longer matches is deleted."""
        out: set[int] = set()
        changed = False
        for index in indices:
            path = self.path_of(index)
            try:
                stat = path.stat()
            except OSError:
                with self._lock:  # a fetch may verify artifacts in another thread meanwhile
                    if self._verified.pop(index, None) is not None:
                        changed = True
                continue
            known = self._verified.get(index)
            if known == _Verified(stat.st_size, stat.st_mtime_ns):
                out.add(index)
                continue
            artifact = self.manifest.artifacts[index]
            offset = self.data_offset(index)
            intact = stat.st_size == offset + artifact.nbytes and (
                sha256_range(path, offset, artifact.nbytes) == artifact.sha256
            )
            changed = True
            if intact:
                with self._lock:
                    self._verified[index] = _Verified(stat.st_size, stat.st_mtime_ns)
                out.add(index)
            else:
                log.warning("%s: does not match the manifest; fetching it again", path)
                with self._lock:
                    self._verified.pop(index, None)
                path.unlink(missing_ok=True)
        if changed:
            with self._lock:
                self._save_verified()
        return out

    def is_held(self, index: int) -> bool:
        """Whether artifact `index` was verified (by this process or a previous one)."""
        return index in self._verified

    def _save_verified(self) -> None:
        raw = {i: [v.size, v.mtime_ns] for i, v in self._verified.items()}
        _write_atomic(self._verified_path, msgspec.msgpack.encode(raw))

    def tensor_indices(self, names: Iterable[str]) -> list[int]:
        """The manifest indices of tensors by name (KeyError: not in the manifest)."""
        index = {
            a.name: i
            for i, a in enumerate(self.manifest.artifacts)
            if a.kind == ArtifactKind.TENSOR
        }
        return [index[name] for name in names]

    def file_indices(self) -> list[int]:
        """The manifest indices of the small files."""
        return [i for i, a in enumerate(self.manifest.artifacts) if a.kind == ArtifactKind.FILE]

    def tensor_info(self, index: int) -> TensorInfo:
        """Where a held tensor's bytes are, for `Checkpoint.load`."""
        artifact = self.manifest.artifacts[index]
        return TensorInfo(
            artifact.name,
            artifact.dtype,
            tuple(artifact.shape),
            self.path_of(index),
            self.data_offset(index),
            artifact.nbytes,
        )


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def with_verified(store: ModelStore, tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` and every tensor `store` holds verified (a store checkpoint's `refresh`)."""
    held = dict(tensors)
    for i, a in enumerate(store.manifest.artifacts):
        if a.kind == ArtifactKind.TENSOR and store.is_held(i):
            held[a.name] = store.tensor_info(i)
    return held


@dataclass(eq=False)
class StoreCheckpoint(Checkpoint):
    """The tensors a `ModelStore` holds, as a `Checkpoint` (`tensors` grows as they arrive).

    `synthetic` stands in random weights for tensors not held: measuring compute needs only
    shapes, so a node can time a layer before it fetched one.
    """

    store: ModelStore | None = None
    synthetic: bool = False
    _known: dict[str, TensorInfo] = field(default_factory=dict)

    @classmethod
    def over(cls, store: ModelStore, *, synthetic: bool = False) -> StoreCheckpoint:
        """A checkpoint over `store` (config from its `config.json`, already fetched)."""
        config = ModelConfig.from_file(store.directory / "config.json")
        known = {
            a.name: TensorInfo(a.name, a.dtype, tuple(a.shape), pathlib.Path(), 0, a.nbytes)
            for a in store.manifest.artifacts
            if a.kind == ArtifactKind.TENSOR
        }
        checkpoint = cls(store.directory, config, {}, store=store, synthetic=synthetic)
        checkpoint._known = known
        checkpoint.refresh()
        return checkpoint

    def refresh(self) -> None:
        """Take in the tensors the store verified since."""
        assert self.store is not None
        self.tensors = with_verified(self.store, self.tensors)

    @property
    def model_id(self) -> str:
        """The manifest's id (what every holder of the files computes)."""
        assert self.store is not None
        return self.store.model_id

    def missing(self, names: Iterable[str]) -> list[str]:
        """The names not held here."""
        return [n for n in names if n not in self.tensors]

    def load(
        self, names: Iterable[str], on_tensor: OnTensor | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Held tensors from their files; with `synthetic`, random ones for the rest."""
        wanted = list(names)
        if not self.synthetic:
            yield from super().load(wanted, on_tensor)
            return
        generator = torch.Generator().manual_seed(0)
        for name in wanted:
            info = self._known[name]
            dtype = _TORCH_DTYPES[info.dtype]
            yield name, (torch.randn(info.shape, generator=generator) * 0.02).to(dtype)


_TORCH_DTYPES: Mapping[str, Any] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def store_checkpoint(store: ModelStore, *, synthetic: bool = False) -> Checkpoint:
    """(blocking) The checkpoint over a store (its files held): a `StoreCheckpoint`, or for a
    GGUF manifest a `GGUFStoreCheckpoint` (`meshd.model.gguf_mesh`)."""
    if store.manifest.format == "gguf":
        from meshd.model.gguf_mesh import GGUFStoreCheckpoint

        return GGUFStoreCheckpoint.over(store, synthetic=synthetic)
    return StoreCheckpoint.over(store, synthetic=synthetic)


def store_of(checkpoint: Checkpoint) -> ModelStore | None:
    """The store a fetching node's checkpoint reads (None: a checkpoint of local files)."""
    store = getattr(checkpoint, "store", None)
    return store if isinstance(store, ModelStore) else None
