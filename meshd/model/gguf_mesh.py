"""A GGUF model over the mesh: its manifest, and the checkpoint a `mesh:ID` node fetches into.

The manifest (`format = "gguf"`) lists as files `gguf.header` (bytes [0, data start) of the
file: header, metadata with the tokenizer, tensor table), for a split model `gguf.header.K` for
shard K = 2..N as well, and `gguf.tensor.NAME` for each tensor that is not a runtime weight
(`rope_freqs.weight`, read while opening); and as tensors each runtime weight by its Hugging Face
name, with its GGUF type as dtype, its HF shape and its bytes as stored (quantized blocks,
unconverted). A node holding the file(s) serves every artifact from its byte range in its shard.

A fetching node holds the files first (`bootstrap_store`). From them it writes a *skeleton*: a
sparse file per shard holding its header and file tensors at their offsets (the holes cost no
disk; shards named `model-0000K-of-0000N.gguf`, as llama-gguf-split names them), which opens as
a `GGUFCheckpoint` (config, tokenizer, tensor table, q/k permutation);
`GGUFStoreCheckpoint` then points each runtime tensor it holds at its own stored file (raw bytes,
`tensors/NAME.bin`), so a stage loads and dequantizes exactly as from the original file.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from meshd.model.checkpoint import OnTensor, TensorInfo, expected_shapes
from meshd.model.digests import file_tensor_digests, sha256_range
from meshd.model.errors import CorruptCheckpoint
from meshd.model.gguf_checkpoint import GGUFCheckpoint, StoredTensor
from meshd.model.gguf_file import parse_gguf, read_gguf
from meshd.model.gguf_model import TENSOR_TYPES
from protocol.artifacts import MANIFEST_VERSION, Artifact, ArtifactKind, Manifest

if TYPE_CHECKING:
    from meshd.model.manifest import ModelStore

FORMAT = "gguf"
HEADER = "gguf.header"
FILE_TENSOR_PREFIX = "gguf.tensor."
SKELETON = "model.gguf"
# Room left after each tensor when sizing the skeleton (GGUF aligns tensor data, 32 bytes by
# default): a sparse file may be larger than the original at no cost.
_ALIGN_SLACK = 4096
# The most shards a fetched split model may have (llama-gguf-split numbers them in 5 digits).
_MAX_SHARDS = 99999


def header_name(shard: int) -> str:
    """The file artifact holding shard `shard`'s header (0-based; shard 0 is a single file's)."""
    return HEADER if shard == 0 else f"{HEADER}.{shard + 1}"


def skeleton_name(shard: int, count: int) -> str:
    """A skeleton shard's file name, as llama-gguf-split names shards (`model.gguf` if one)."""
    return SKELETON if count == 1 else f"model-{shard + 1:05d}-of-{count:05d}.gguf"


def file_locations(checkpoint: GGUFCheckpoint) -> dict[str, tuple[pathlib.Path, int, int]]:
    """(blocking) Where each file artifact of a GGUF holder lies: {name: (path, offset, nbytes)}
    (every shard's header and non-weight tensors for a split model)."""
    runtime = expected_shapes(checkpoint.config)
    gguf_names = {checkpoint.entries[n].gguf_name for n in runtime}
    where: dict[str, tuple[pathlib.Path, int, int]] = {}
    for shard, (path, data_start) in enumerate(checkpoint.headers):
        where[header_name(shard)] = (path, 0, data_start)
        for tensor in read_gguf(path).tensors:
            if tensor.name not in gguf_names:
                where[FILE_TENSOR_PREFIX + tensor.name] = (
                    path,
                    int(tensor.data_offset),
                    int(tensor.n_bytes),
                )
    return where


def gguf_manifest(checkpoint: GGUFCheckpoint) -> tuple[str, bytes, Manifest]:
    """(blocking) The manifest of a GGUF file: (model id, bytes, manifest). Tensor hashes are
    cached like a safetensors checkpoint's (`meshd.model.manifest`)."""
    from protocol.artifacts import encode_manifest, manifest_id

    artifacts: list[Artifact] = []
    for name, (path, offset, nbytes) in sorted(checkpoint.file_locations.items()):
        digest = sha256_range(path, offset, nbytes)
        artifacts.append(Artifact(ArtifactKind.FILE, name, nbytes, digest))
    names = sorted(expected_shapes(checkpoint.config))
    infos = [checkpoint.tensors[n] for n in names]
    hashes: dict[str, bytes] = {}
    for path in sorted({info.path for info in infos}):  # one file, or each shard
        hashes |= file_tensor_digests(path, [i for i in infos if i.path == path])
    for info in infos:
        artifacts.append(
            Artifact(
                ArtifactKind.TENSOR,
                info.name,
                info.nbytes,
                hashes[info.name],
                dtype=info.dtype,
                shape=list(info.shape),
            )
        )
    manifest = Manifest(MANIFEST_VERSION, FORMAT, artifacts)
    data = encode_manifest(manifest)
    return manifest_id(data), data, manifest


def check_artifact(artifact: Artifact) -> str | None:
    """Why a GGUF manifest's artifact cannot be stored (None: it can)."""
    if artifact.kind == ArtifactKind.FILE:
        rest = artifact.name.removeprefix(FILE_TENSOR_PREFIX)
        plain = rest.replace(".", "").replace("_", "").isalnum() and not rest.startswith(".")
        shard = artifact.name.removeprefix(HEADER + ".")
        if shard.isascii() and shard.isdigit() and 2 <= int(shard) <= _MAX_SHARDS:
            return None
        if artifact.name != HEADER and not (artifact.name != rest and plain):
            return f"unexpected file {artifact.name!r}"
    elif artifact.dtype not in TENSOR_TYPES:
        return f"tensor {artifact.name!r} has GGUF type {artifact.dtype!r}"
    return None


def write_skeleton(store: ModelStore) -> pathlib.Path:
    """(blocking) The sparse GGUF file(s) of a store's headers and file tensors (written once);
    the path of the first shard."""
    manifest = store.manifest
    files = [a for a in manifest.artifacts if a.kind == ArtifactKind.FILE]
    count = sum(1 for a in files if _is_header(a.name))
    first = store.directory / skeleton_name(0, count)
    if first.is_file():  # renamed into place last: every other shard is there
        return first
    size = sum(a.nbytes + _ALIGN_SLACK for a in manifest.artifacts)
    placed: set[str] = set()
    written: list[tuple[pathlib.Path, pathlib.Path]] = []
    for shard in range(count):
        header = store.path_of(_index(manifest, header_name(shard)))
        path = store.directory / skeleton_name(shard, count)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as out:
            out.write(header.read_bytes())
            out.truncate(header.stat().st_size + size)
        # Uncached: the file changes next (tensors written in, renamed), so no later open
        # could use this parse.
        offsets = {t.name: int(t.data_offset) for t in parse_gguf(tmp).tensors}
        with tmp.open("r+b") as out:
            for i, artifact in enumerate(manifest.artifacts):
                name = artifact.name.removeprefix(FILE_TENSOR_PREFIX)
                if artifact.kind == ArtifactKind.FILE and name in offsets:
                    out.seek(offsets[name])
                    out.write(store.path_of(i).read_bytes())
                    placed.add(artifact.name)
        written.append((tmp, path))
    for artifact in files:
        if not _is_header(artifact.name) and artifact.name not in placed:
            raise CorruptCheckpoint(f"{store.directory}: {artifact.name!r} is in no header")
    for tmp, path in reversed(written):
        os.replace(tmp, path)
    return first


def _is_header(name: str) -> bool:
    return name == HEADER or name.startswith(HEADER + ".")


def _index(manifest: Manifest, name: str) -> int:
    index = manifest.index_of(name, ArtifactKind.FILE)
    if index is None:
        raise CorruptCheckpoint(f"GGUF manifest without {name!r}")
    return index


@dataclass(eq=False)
class GGUFStoreCheckpoint(GGUFCheckpoint):
    """The runtime tensors a `ModelStore` of a GGUF manifest holds, as a `GGUFCheckpoint`
    (`tensors` grows as they arrive; `synthetic`: random weights stand in for those not held,
    to time compute before any arrived)."""

    store: ModelStore | None = None
    synthetic: bool = False
    _known: dict[str, TensorInfo] = field(default_factory=dict)

    @classmethod
    def over(cls, store: ModelStore, *, synthetic: bool = False) -> GGUFStoreCheckpoint:
        """(blocking) A checkpoint over `store`, whose files are held."""
        base = GGUFCheckpoint.open(write_skeleton(store))
        values = {f.name: getattr(base, f.name) for f in fields(GGUFCheckpoint)}
        checkpoint = cls(**values, store=store, synthetic=synthetic)
        checkpoint._known = dict(base.tensors)
        checkpoint.tensors = {}
        checkpoint.refresh()
        return checkpoint

    @property
    def file_tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor of the manifest's file(s), held or not."""
        return self._known

    def refresh(self) -> None:
        """Take in the tensors the store verified since."""
        from meshd.model.manifest import with_verified  # manifest imports this module

        assert self.store is not None
        self.tensors = with_verified(self.store, self.tensors)

    @property
    def manifest(self) -> tuple[str, bytes, Manifest]:
        """The store's manifest (the holders' files hash to it)."""
        assert self.store is not None
        return self.store.model_id, self.store.manifest_bytes, self.store.manifest

    @functools.cached_property
    def model_id(self) -> str:
        """The manifest's id."""
        assert self.store is not None
        return self.store.model_id

    def load(
        self, names: Iterable[str], on_tensor: OnTensor | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Held tensors from their files; with `synthetic`, random fp32 ones for every name."""
        wanted = list(names)
        if not self.synthetic:
            yield from super().load(wanted, on_tensor)
            return
        generator = torch.Generator().manual_seed(0)
        for name in wanted:
            yield name, torch.randn(self._known[name].shape, generator=generator) * 0.02

    def stored(self, name: str) -> StoredTensor:
        """A held tensor as stored; with `synthetic`, zero blocks of its type and size (a block
        kernel does the same work whatever the values, which is all a timing needs)."""
        if not self.synthetic:
            return super().stored(name)
        info, entry = self._known[name], self.entries[name]
        raw = np.zeros(info.nbytes, dtype=np.uint8)
        raw.flags.writeable = False
        return StoredTensor(entry.gguf_name, raw, entry.ggml_type, entry.type_name, info.shape)
