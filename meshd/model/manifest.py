"""A checkpoint's manifest (its model id), and the store a `mesh:ID` node fetches into.

`checkpoint_manifest` lists a safetensors checkpoint directory's small files (`MODEL_FILES`
that exist) and every tensor the runtime reads, each with its SHA-256 (`protocol.artifacts`);
the model id is the hash of that manifest, so every node holding the same files computes the
same id, and a node fetching the model can check each byte against it. The tensors' digests
come from `meshd.model.digests` (hashed in threads, cached in the process and under the cache
dir while the file is unchanged, so a restart does not hash again).

`ModelStore` keeps a fetched model under `<cache dir>/models/<id>/`: the manifest, the small
files under their own names (so the tokenizer opens the directory as usual), and each tensor as
its own one-tensor safetensors file under `tensors/`, written only once its hash matched.
`StoreCheckpoint` is a `Checkpoint` over the tensors held there: stages load from it the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import re
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from meshd.model.checkpoint import Checkpoint, OnTensor, TensorInfo, expected_shapes
from meshd.model.config import ModelConfig
from meshd.model.digests import file_tensor_digests, sha256_range
from meshd.model.digests import set_cache_dir as set_cache_dir
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
        hashes |= file_tensor_digests(path, infos)
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
