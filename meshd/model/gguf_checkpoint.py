"""A GGUF model file (what llama.cpp, Ollama and LM Studio store) as a `Checkpoint`.

`GGUFCheckpoint.open(path)` takes the checked file (`meshd.model.gguf_model.open_gguf`: config,
tensor table by Hugging Face name, no tensor bytes read) and checks every runtime tensor's
shape against the config. `stored(name)` gives a tensor as stored, a read-only view of the
mapped file (what a `gguf` stage multiplies); `load(names)` reads and dequantizes only the
tensors asked for (stages converting to another quantization), one at a time and in row chunks,
so a stage of layers 8-15 never touches the other layers' bytes and peak memory is one tensor in
float plus one chunk's scratch.

llama.cpp's converter permutes the q/k projection rows of the `llama` architecture
(`LlamaModel.permute`, for ggml's adjacent-pair RoPE); `load` undoes it so the runtime sees
Hugging Face order (and then applies its own interleave, the same permutation).
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from meshd.model.checkpoint import Checkpoint, OnTensor, TensorInfo, expected_shapes
from meshd.model.config import ModelConfig
from meshd.model.errors import CorruptCheckpoint, MissingFile, MissingTensor, ShapeMismatch
from meshd.model.gguf_model import GGUFTensor, hf_to_gguf_name, open_gguf

# Dequantize at most this many output elements at once (16 MiB of fp32): the numpy block
# decoders allocate a few temporaries per element, so whole-tensor calls would multiply peak RSS.
_CHUNK_ELEMENTS = 4 * 1024 * 1024


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (weights `[out, in]` or biases `[out]`)."""
    shape = t.shape
    return t.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass(eq=False)
class GGUFCheckpoint(Checkpoint):
    """An opened GGUF file: `Checkpoint`'s interface over HF names, dequantizing on `load`.

    `directory` is the file's path; `tensors[name].dtype` is the GGUF type name (`Q8_0`, ...)
    and `.nbytes` its size in the file.
    """

    entries: Mapping[str, GGUFTensor] = field(default_factory=dict)
    # Per file (one, or every shard of a split model): header + metadata + tensor table bytes,
    # hashed whole into the id.
    headers: tuple[tuple[pathlib.Path, int], ...] = ()
    # q/k rows to un-permute (GGUF architecture `llama`): HF name -> heads.
    permuted: Mapping[str, int] = field(default_factory=dict)
    architecture: str = ""
    # Read-only maps of the file(s), opened by the first `stored` call and kept while the
    # checkpoint lives: the tensors a stage holds as stored are views of them.
    _maps: dict[pathlib.Path, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> GGUFCheckpoint:
        """Open and validate a GGUF file (header, metadata and tensor table only)."""
        path = pathlib.Path(directory)
        if not path.is_file():
            raise MissingFile(f"{path}: GGUF file not found")
        model = open_gguf(path)
        config = model.config
        infos = {
            name: TensorInfo(name, t.type_name, t.shape, t.path, t.offset, t.nbytes)
            for name, t in model.tensors.items()
        }
        _check_shapes(model.path, config, model.tensors)
        permuted: dict[str, int] = {}
        if model.architecture == "llama":
            for i in range(config.num_layers):
                for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                    for kind in ("weight", "bias"):
                        name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                        if name in infos:
                            permuted[name] = heads
        return cls(
            model.path,
            config,
            infos,
            default_quantization=_default_quantization(infos),
            entries=model.tensors,
            headers=tuple((p, r.data_offset) for p, r in model.readers),
            permuted=permuted,
            architecture=model.architecture,
        )

    @functools.cached_property
    def manifest(self) -> Any:
        """(model id, bytes, manifest) of the GGUF file, or of every shard of a split model
        (`meshd.model.gguf_mesh`: every tensor hashed)."""
        from meshd.model.gguf_mesh import gguf_manifest

        return gguf_manifest(self)

    @functools.cached_property
    def file_locations(self) -> dict[str, tuple[pathlib.Path, int, int]]:
        """(blocking: parses every shard's header, seconds for a large vocabulary) Where each
        file artifact of the manifest lies (`meshd.model.gguf_mesh.file_locations`); parsed
        once, for the manifest and for serving."""
        from meshd.model.gguf_mesh import file_locations

        return file_locations(self)

    @functools.cached_property
    def model_id(self) -> str:
        """Stable id of the file (hex, 32 chars): equal on every node holding the same file(s).

        Its manifest's id (config, headers, every tensor's SHA-256), so a `mesh:ID` node can
        fetch it over the mesh.
        """
        return str(self.manifest[0])

    def load(
        self, names: Iterable[str], on_tensor: OnTensor | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` per name: F32/F16/BF16 as stored, quantized types as fp32.

        Only these tensors' bytes are read (the file is memory-mapped); q/k rows of the
        `llama` architecture come back in Hugging Face order.
        """
        wanted = list(names)
        for name in wanted:
            if name not in self.tensors:
                raise MissingTensor(f"{self.directory}: tensor {name!r} is not in the checkpoint")
        maps: dict[pathlib.Path, np.ndarray] = {}
        try:
            for name in wanted:
                info, entry = self.tensors[name], self.entries[name]
                if info.path not in maps:
                    try:
                        maps[info.path] = np.memmap(info.path, mode="r")
                    except (OSError, ValueError) as exc:
                        raise CorruptCheckpoint(f"{info.path}: cannot map ({exc})") from None
                raw = maps[info.path][info.offset : info.offset + info.nbytes]
                tensor = dequantize(raw, entry.ggml_type, info.shape)
                if name in self.permuted:
                    tensor = unpermute_rows(tensor, self.permuted[name])
                self.loaded_names.add(name)
                if on_tensor is not None:
                    on_tensor(name, info.nbytes)
                yield name, tensor
        finally:
            maps.clear()

    @property
    def file_tensors(self) -> Mapping[str, TensorInfo]:
        """Every runtime tensor of the file(s), held here or not (a fetching node holds some)."""
        return self.tensors

    def stored(self, name: str) -> StoredTensor:
        """Tensor `name` as the file stores it: a read-only view of its bytes, no copy.

        The view's pages are the file's (shared with the page cache): they are read when first
        multiplied, and counted once however many processes map the file.
        """
        if name not in self.tensors:
            raise MissingTensor(f"{self.directory}: tensor {name!r} is not in the checkpoint")
        info, entry = self.tensors[name], self.entries[name]
        if info.path not in self._maps:
            try:
                self._maps[info.path] = np.memmap(info.path, mode="r")
            except (OSError, ValueError) as exc:
                raise CorruptCheckpoint(f"{info.path}: cannot map ({exc})") from None
        raw = self._maps[info.path][info.offset : info.offset + info.nbytes]
        if raw.nbytes != info.nbytes:
            raise CorruptCheckpoint(
                f"{info.path}: truncated: tensor {entry.gguf_name} needs bytes "
                f"[{info.offset}, {info.offset + info.nbytes}), file has {len(self._maps[info.path])}"
            )
        self.loaded_names.add(name)
        return StoredTensor(entry.gguf_name, raw, entry.ggml_type, entry.type_name, info.shape)


@dataclass(frozen=True)
class StoredTensor:
    """One GGUF tensor as stored: its bytes (a view of the mapped file) and ggml type."""

    gguf_name: str
    raw: np.ndarray  # uint8, read-only
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]  # Hugging Face order: `[out, in]` for a matrix


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor's bytes (uint8) as a torch tensor of `shape` (HF order), row chunk by chunk.

    F32/F16/BF16 keep their dtype (copied out of the map); block-quantized types become fp32.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as dequantize_blocks

    qtype = GGMLQuantizationType(ggml_type)
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(shape).copy())
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(shape).copy())
    if qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    blocks = raw.reshape(rows, cols // block * type_size)
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        out[start : start + step] = dequantize_blocks(blocks[start : start + step], qtype)
    return torch.from_numpy(out).reshape(shape)


def _check_shapes(
    path: pathlib.Path, config: ModelConfig, tensors: Mapping[str, GGUFTensor]
) -> None:
    """Every tensor the runtime reads for `config` is in the file, of the shape it implies."""
    for name, shape in expected_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            gguf = hf_to_gguf_name(name)
            raise MissingTensor(f"{path}: tensor {gguf!r} ({name}) is missing from the GGUF file")
        if tensor.shape != shape:
            raise ShapeMismatch(
                f"{path}: tensor {tensor.gguf_name!r} has shape {list(tensor.shape)} "
                f"(HF order), but the metadata implies {list(shape)}"
            )


def _default_quantization(infos: Mapping[str, TensorInfo]) -> str:
    """`gguf`: the file's tensors as stored, the same model llama.cpp runs; `none` for a file
    of F32 matrices only, which fp32 stages hold as they are, with their fused-layer kernel."""
    matrices = {info.dtype for info in infos.values() if len(info.shape) == 2}
    return "none" if matrices <= {"F32"} else "gguf"
