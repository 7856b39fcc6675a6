"""A Hugging Face checkpoint directory, opened lazily.

`Checkpoint.open(dir)` reads `config.json` and the safetensors headers (single file or sharded
via `model.safetensors.index.json`), validates them byte by byte, and checks that every weight
the config implies is present with the right shape. Tensor bytes are read only when a stage asks
for them by name, so a node holding layers 8-15 never reads the other layers.

The model id is the hash of the checkpoint's manifest (`meshd.model.manifest`: its small files'
and every tensor's SHA-256, with names, dtypes and shapes): every node holding the same files
computes the same id, two fine-tunes get different ids, and a node fetching the model over the
mesh checks every byte against it.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open

from meshd.model.config import ModelConfig
from meshd.model.errors import (
    CorruptCheckpoint,
    MissingFile,
    MissingTensor,
    ShapeMismatch,
    UnsupportedArchitecture,
)
from meshd.model.llama import decoder_layer_shapes
from meshd.model.mtp import mtp_shapes

if TYPE_CHECKING:
    from protocol.artifacts import Manifest

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> bytes per element. Only float types can be weights.
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_WEIGHT_DTYPES = ("F32", "F16", "BF16")
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# Told after each tensor `Checkpoint.load` reads: (its name, its size in the file in bytes).
OnTensor = Callable[[str, int], None]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: file, absolute byte range, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: pathlib.Path
    offset: int
    nbytes: int


def read_safetensors_header(path: pathlib.Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header without reading tensor bytes.

    Raises `CorruptCheckpoint` (naming the file and tensor) for a truncated file, a header
    length beyond the file, bad JSON, unknown dtypes, offsets outside the data section,
    overlapping tensors, or a byte length that disagrees with dtype x shape.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpoint(f"{path}: truncated ({size} bytes, no header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len < 2 or header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CorruptCheckpoint(
                    f"{path}: header length {header_len} does not fit a {size}-byte file"
                )
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = msgspec.json.decode(header_bytes)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpoint(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    tensors = {
        name: _tensor_info(path, name, entry, data_start, size - data_start)
        for name, entry in header.items()
        if name != "__metadata__"
    }
    _check_no_overlap(path, tensors.values())
    return tensors


def _tensor_info(
    path: pathlib.Path, name: str, entry: Any, data_start: int, data_len: int
) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CorruptCheckpoint(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise CorruptCheckpoint(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise CorruptCheckpoint(f"{where}: bad shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise CorruptCheckpoint(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if begin > end or end > data_len:
        raise CorruptCheckpoint(
            f"{where}: data_offsets [{begin}, {end}] lie beyond the file's {data_len} data bytes"
        )
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if end - begin != expected:
        raise CorruptCheckpoint(
            f"{where}: {end - begin} bytes stored but {dtype} {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_no_overlap(path: pathlib.Path, tensors: Iterable[TensorInfo]) -> None:
    previous: TensorInfo | None = None
    for info in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if previous is not None and info.offset < previous.offset + previous.nbytes:
            raise CorruptCheckpoint(
                f"{path}: tensors {previous.name!r} and {info.name!r} overlap in the file"
            )
        previous = info


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the runtime reads for `config`, by checkpoint name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    layer = decoder_layer_shapes(config)
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    for k in range(config.num_mtp_layers):
        shapes |= {f"mtp.{k}.{name}": shape for name, shape in mtp_shapes(config).items()}
    return shapes


@dataclass(eq=False)
class Checkpoint:
    """An opened checkpoint directory: validated config and tensor manifest, bytes on demand."""

    directory: pathlib.Path
    config: ModelConfig
    tensors: Mapping[str, TensorInfo]
    # Names whose bytes were read by `load`.
    loaded_names: set[str] = field(default_factory=set)
    # The stage quantization (`none`, `gguf`, `q8_0`, ...) this checkpoint's own precision
    # calls for when the config says `auto`: full-precision safetensors need none.
    default_quantization: str = "none"

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Checkpoint:
        """Open and validate a checkpoint directory (reads headers only)."""
        path = pathlib.Path(directory)
        if not path.is_dir():
            raise MissingFile(f"{path}: checkpoint directory not found")
        config = ModelConfig.from_file(path / "config.json")
        tensors = _read_manifest(path)
        _check_against_config(config, tensors)
        return cls(path, config, tensors)

    @functools.cached_property
    def manifest(self) -> tuple[str, bytes, Manifest]:
        """(model id, canonical bytes, manifest): every tensor hashed (`meshd.model.manifest`)."""
        from meshd.model.manifest import checkpoint_manifest

        return checkpoint_manifest(self)

    @property
    def model_id(self) -> str:
        """The hash of the manifest (hex, 32 chars); equal on every node holding the files."""
        return self.manifest[0]

    def refresh(self) -> None:
        """Take in tensors that arrived since (a fetching node's checkpoint; files: nothing)."""

    def load(
        self, names: Iterable[str], on_tensor: OnTensor | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for each name (CPU, stored dtype), opening each file once.

        `on_tensor(name, nbytes)` is called after each read (for progress displays).
        """
        by_file: dict[pathlib.Path, list[str]] = {}
        for name in names:
            if name not in self.tensors:
                raise MissingTensor(f"{self.directory}: tensor {name!r} is not in the checkpoint")
            by_file.setdefault(self.tensors[name].path, []).append(name)
        for path, file_names in by_file.items():
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in file_names:
                        tensor = f.get_tensor(name)
                        self.loaded_names.add(name)
                        if on_tensor is not None:
                            on_tensor(name, self.tensors[name].nbytes)
                        yield name, tensor
            except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
                raise CorruptCheckpoint(f"{path}: cannot read tensors ({exc})") from None


def _read_manifest(path: pathlib.Path) -> dict[str, TensorInfo]:
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.is_file():
        return read_safetensors_header(single)
    if not index.is_file():
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins[0]}: PyTorch .bin weights are not supported)" if bins else ""
        raise MissingFile(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    try:
        raw = msgspec.json.decode(index.read_bytes())
    except msgspec.DecodeError as exc:
        raise CorruptCheckpoint(f"{index}: not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpoint(f"{index}: missing or malformed 'weight_map'")
    shard_names = sorted(set(weight_map.values()))
    for shard_name in shard_names:
        if pathlib.PurePath(shard_name).name != shard_name:
            raise CorruptCheckpoint(f"{index}: shard name {shard_name!r} is not a plain file name")
        if not (path / shard_name).is_file():
            raise MissingFile(
                f"{path / shard_name}: weights shard listed in {INDEX_FILE} not found"
            )
    tensors: dict[str, TensorInfo] = {}
    for shard_name in shard_names:
        header = read_safetensors_header(path / shard_name)
        for name, file_name in weight_map.items():
            if file_name == shard_name:
                if name not in header:
                    raise CorruptCheckpoint(f"{index}: tensor {name!r} is not in {shard_name}")
                tensors[name] = header[name]
    return tensors


def _check_against_config(config: ModelConfig, tensors: Mapping[str, TensorInfo]) -> None:
    for name, shape in expected_shapes(config).items():
        info = tensors.get(name)
        if info is None:
            raise MissingTensor(f"tensor {name!r} is missing from the checkpoint's weights")
        if info.dtype not in _WEIGHT_DTYPES:
            raise UnsupportedArchitecture(
                f"{info.path}: tensor {name!r} is stored as {info.dtype}; only F32/F16/BF16 "
                "weights are supported (quantized checkpoints are not)"
            )
        if info.shape != shape:
            raise ShapeMismatch(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)}, but config.json "
                f"implies {list(shape)}"
            )
