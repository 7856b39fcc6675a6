"""A GGUF file over the mesh: its manifest, and the checkpoint a `mesh:ID` node fetches into.

The manifest (`format = "gguf"`, one file; a split model cannot be fetched) lists as files
`gguf.header` (bytes [0, data start): header, metadata with the tokenizer, tensor table) and
`gguf.tensor.NAME` for each tensor of the file that is not a runtime weight (`rope_freqs.weight`,
read while opening); and as tensors each runtime weight by its Hugging Face name, with its GGUF
type as dtype, its HF shape and its bytes as stored (quantized blocks, unconverted). A node
holding the file serves every artifact from its byte range in the file.

A fetching node holds the files first (`bootstrap_store`). From them it writes a *skeleton*: a
sparse file holding the header and the file tensors at their offsets (the holes cost no disk),
which opens as a `GGUFCheckpoint` (config, tokenizer, tensor table, q/k permutation);
`GGUFStoreCheckpoint` then points each runtime tensor it holds at its own stored file (raw bytes,
`tensors/NAME.bin`), so a stage loads and dequantizes exactly as from the original file.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from meshd.model.checkpoint import OnTensor, TensorInfo, expected_shapes
from meshd.model.errors import CorruptCheckpoint, UnsupportedArchitecture
from meshd.model.gguf_checkpoint import TENSOR_TYPES, GGUFCheckpoint, read_gguf
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


def file_locations(checkpoint: GGUFCheckpoint) -> dict[str, tuple[pathlib.Path, int, int]]:
    """(blocking) Where each file artifact of a GGUF holder lies: {name: (path, offset, nbytes)}.
    UnsupportedArchitecture for a split model (several files)."""
    if len(checkpoint.headers) != 1:
        raise UnsupportedArchitecture(
            f"{checkpoint.directory}: a split GGUF model cannot be fetched over the mesh "
            "(merge it into one file with llama-gguf-split --merge)"
        )
    path, data_start = checkpoint.headers[0]
    runtime = expected_shapes(checkpoint.config)
    gguf_names = {checkpoint.entries[n].gguf_name for n in runtime}
    where = {HEADER: (path, 0, data_start)}
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
    from meshd.model.manifest import _hash_file_tensors, sha256_range
    from protocol.artifacts import encode_manifest, manifest_id

    artifacts: list[Artifact] = []
    for name, (path, offset, nbytes) in sorted(file_locations(checkpoint).items()):
        digest = sha256_range(path, offset, nbytes)
        artifacts.append(Artifact(ArtifactKind.FILE, name, nbytes, digest))
    names = sorted(expected_shapes(checkpoint.config))
    infos = [checkpoint.tensors[n] for n in names]
    hashes = _hash_file_tensors(infos[0].path, infos) if infos else {}
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
        if artifact.name != HEADER and not (artifact.name != rest and plain):
            return f"unexpected file {artifact.name!r}"
    elif artifact.dtype not in TENSOR_TYPES:
        return f"tensor {artifact.name!r} has GGUF type {artifact.dtype!r}"
    return None


def write_skeleton(store: ModelStore) -> pathlib.Path:
    """(blocking) The sparse GGUF file of a store's header and file tensors (written once)."""
    path = store.directory / SKELETON
    if path.is_file():
        return path
    manifest = store.manifest
    header = store.path_of(_index(manifest, HEADER))
    size = header.stat().st_size + sum(a.nbytes + _ALIGN_SLACK for a in manifest.artifacts)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        out.write(header.read_bytes())
        out.truncate(size)
    offsets = {t.name: int(t.data_offset) for t in read_gguf(tmp).tensors}
    with tmp.open("r+b") as out:
        for i, artifact in enumerate(manifest.artifacts):
            if artifact.kind == ArtifactKind.FILE and artifact.name != HEADER:
                name = artifact.name.removeprefix(FILE_TENSOR_PREFIX)
                if name not in offsets:
                    raise CorruptCheckpoint(f"{store.directory}: {name!r} is not in the header")
                out.seek(offsets[name])
                out.write(store.path_of(i).read_bytes())
    os.replace(tmp, path)
    return path


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
