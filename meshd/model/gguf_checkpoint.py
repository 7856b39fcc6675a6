"""A GGUF model file (what llama.cpp, Ollama and LM Studio store), opened lazily.

`GGUFCheckpoint.open(path)` parses the header, metadata and tensor table with the `gguf`
package (llama.cpp's own reader; the file is memory-mapped, no tensor bytes are read), maps the
metadata to a `ModelConfig` and GGUF tensor names to the Hugging Face names the runtime uses,
and checks every tensor's type and shape. `load(names)` then reads and dequantizes only the
tensors asked for, one at a time and in row chunks, so a stage of layers 8-15 never touches the
other layers' bytes and peak memory is one tensor in float plus one chunk's scratch.

GGUF stores dimensions in ggml's order (`ne`, innermost first): a Hugging Face `[out, in]`
matrix is `ne = [in, out]`. llama.cpp's converter permutes the q/k projection rows of the
`llama` architecture (`LlamaModel.permute`, for ggml's adjacent-pair RoPE); `load` undoes it so
the runtime sees Hugging Face order (and then applies its own interleave, the same permutation).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import pathlib
import re
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meshd.model.checkpoint import Checkpoint, OnTensor, TensorInfo, expected_shapes
from meshd.model.config import FAMILIES, ModelConfig, RopeConfig
from meshd.model.errors import (
    CorruptCheckpoint,
    InvalidConfig,
    MissingFile,
    MissingTensor,
    ShapeMismatch,
    UnsupportedArchitecture,
)

if TYPE_CHECKING:
    from gguf import GGUFReader
    from gguf.gguf_reader import ReaderField

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF `general.architecture` values we run
# Tensor types `load` dequantizes, and the stage quantization each lands in by default: a
# quantized file must not silently grow into fp32. Q4_1/Q5_0/Q5_1 are llama-quantize's
# fallbacks for rows that are not whole 256-value K-quant blocks, so K-quant files hold them.
TENSOR_TYPES = {
    "F32": "none", "F16": "none", "BF16": "none",
    "Q8_0": "int8", "Q6_K": "int8", "Q5_K": "int8", "Q5_0": "int8", "Q5_1": "int8",
    "Q4_0": "int4", "Q4_K": "int4", "Q4_1": "int4",
}  # fmt: skip
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_CONTROL = 3  # gguf.TokenType.CONTROL
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Dequantize at most this many output elements at once (16 MiB of fp32): the numpy block
# decoders allocate a few temporaries per element, so whole-tensor calls would multiply peak RSS.
_CHUNK_ELEMENTS = 4 * 1024 * 1024
# llama.cpp's text heuristic for end-of-generation tokens (llama-vocab.cpp), for files whose
# metadata names only one eos id.
EOG_TEXTS = frozenset(
    ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
     "<EOT>", "_<EOT>", "<|end_of_text|>")
)  # fmt: skip


def gguf_name_to_hf(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for tensors the runtime ignores."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (weights `[out, in]` or biases `[out]`)."""
    shape = t.shape
    return t.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass(frozen=True)
class _Entry:
    """Where one runtime tensor lives in the GGUF file."""

    gguf_name: str
    ggml_type: int
    type_name: str


@dataclass(eq=False)
class GGUFCheckpoint(Checkpoint):
    """An opened GGUF file: `Checkpoint`'s interface over HF names, dequantizing on `load`.

    `directory` is the file's path; `tensors[name].dtype` is the GGUF type name (`Q8_0`, ...)
    and `.nbytes` its size in the file.
    """

    entries: Mapping[str, _Entry] = field(default_factory=dict)
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
        readers = read_shards(path)
        path, first = readers[0]
        meta = GGUFMetadata(first, str(path))
        arch = meta.architecture()
        infos, entries = _tensor_table(readers)
        config = config_from_gguf(meta, arch, infos, _rope_factors(readers))
        _check_tensors(path, config, infos, entries)
        permuted: dict[str, int] = {}
        if arch == "llama":
            for i in range(config.num_layers):
                for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                    for kind in ("weight", "bias"):
                        name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                        if name in infos:
                            permuted[name] = heads
        return cls(
            path,
            config,
            infos,
            default_quantization=_default_quantization(infos),
            entries=entries,
            headers=tuple((p, r.data_offset) for p, r in readers),
            permuted=permuted,
            architecture=arch,
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


_ITEM_SIZES: dict[Any, int] = {}  # numpy scalar type -> bytes, for `read_gguf`'s reader
# Parsed files, most recently used last: (resolved path, device, inode, size, mtime_ns) -> reader.
# A start opens one file several times (the start-up check, the checkpoint, its model id, the
# tokenizer); each gets the one parse. `forget_parsed` empties it once the daemon has started,
# and it holds at most `_PARSED_MAX` files, so no parse outlives the start-up for long.
_PARSED_MAX = 4
_parsed: OrderedDict[tuple[str, int, int, int, int], GGUFReader] = OrderedDict()
_parsed_lock = threading.Lock()
_parse_count = 0  # files parsed by this process (the tests count parses with it)


class _Damage(Exception):
    """What is wrong with a GGUF file, found while its header is parsed (the message)."""


def read_gguf(path: pathlib.Path) -> GGUFReader:
    """`parse_gguf(path)`, parsed once while the file is unchanged (same inode, size and
    mtime) until `forget_parsed()`: callers only read the reader, never change it."""
    try:
        stat = path.stat()
    except OSError:
        return parse_gguf(path)  # says what is wrong in its own words
    key = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _parsed_lock:
        reader = _parsed.get(key)
        if reader is not None:
            _parsed.move_to_end(key)
            return reader
    reader = parse_gguf(path)
    with _parsed_lock:
        _parsed[key] = reader
        while len(_parsed) > _PARSED_MAX:
            _parsed.popitem(last=False)
    return reader


def forget_parsed() -> None:
    """Drop every cached parse (`read_gguf`): a started daemon needs none of them again."""
    with _parsed_lock:
        _parsed.clear()


def parse_count() -> int:
    """How many GGUF files this process has parsed (each `parse_gguf` call)."""
    return _parse_count


def parse_gguf(path: pathlib.Path) -> GGUFReader:
    """Parse a GGUF file's header with llama.cpp's reader; damage is a one-line error.

    The file's magic and version are checked first, and its size against the tensor table
    before the reader maps any tensor: a file cut short (an interrupted download or copy) says
    "truncated: expected N bytes, file has M", not what numpy says about a short view.
    Metadata arrays of strings or numbers (a vocabulary, its merges, token types and scores)
    are read in bulk (`_BulkArray`): their `contents()` equal the plain reader's.
    """
    global _parse_count
    reader_class, _ = _reader_classes()
    _check_magic_and_version(path)
    _parse_count += 1
    try:
        return reader_class(path, "r")
    except _Damage as exc:
        raise CorruptCheckpoint(f"{path}: {exc}") from None
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise CorruptCheckpoint(f"{path}: not a readable GGUF file ({exc})") from None


@functools.cache
def _reader_classes() -> tuple[type[GGUFReader], type[ReaderField]]:
    """`parse_gguf`'s reader and bulk array field, subclasses of the `gguf` package's (imported
    on first use: `meshd.model` loads without it until a GGUF file is opened)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class _BulkArray(ReaderField):
        """A metadata array of strings or numbers held whole: `parts` ends with the array's bytes
        (strings: their length prefixes included), `data` indexes that part, and `contents()`
        decodes it, equal to the plain reader's per-element parts (the tests compare them)."""

        # Strings: where each one's length prefix lies in the payload, then the payload's end.
        _bounds: np.ndarray | None
        _strings: list[str] | None

        def __new__(
            cls,
            offset: int,
            name: str,
            parts: list[np.ndarray],
            data: list[int],
            types: list[Any],
            bounds: np.ndarray | None,
        ) -> _BulkArray:
            self = super().__new__(cls, offset, name, parts, data, types)
            self._bounds = bounds
            self._strings = None
            return self

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            payload = self.parts[-1]
            if self._bounds is None:
                if isinstance(index_or_slice, slice):
                    return payload[index_or_slice].tolist()
                return payload[index_or_slice : index_or_slice + 1 or None].tolist()[0]
            if not isinstance(index_or_slice, slice):
                start = int(self._bounds[:-1][index_or_slice]) + 8
                end = int(self._bounds[1:][index_or_slice])
                return str(payload[start:end].tobytes(), encoding="utf-8")
            # Decoded once per parse: a start reads the vocabulary three times (the config's
            # stop ids, the tokenizer's), and a parse lives only through the start.
            if self._strings is None:
                self._strings = _decode_strings(payload, self._bounds)
            return self._strings[index_or_slice]

    class PlainViewReader(GGUFReader):
        # Give the reader a plain ndarray view of the map, not a `np.memmap`: it slices its map
        # once per metadata value, and each `np.memmap` slice runs Python-level finalizers,
        # several times the parse time (figures: docs/model-runtime.md). Still memory-mapped:
        # the view reads nothing until touched.
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)

        def _get(
            self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
        ) -> np.ndarray:
            # The reader's own `_get` slices past the end silently (the short result fails
            # later, in numpy's words): every header field it reads must lie inside the file.
            # It also builds an array per call to learn the item size; the sizes are cached.
            count = int(count)
            size = _ITEM_SIZES.get(dtype)
            if size is None:
                size = _ITEM_SIZES.setdefault(dtype, np.dtype(dtype).itemsize)
            end = int(offset) + size * count
            if end > len(self._plain):
                raise _Damage(_past_end(end, len(self._plain)))
            arr: np.ndarray = self._plain[offset:end].view(dtype=dtype)
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:
            # The reader's own, but an array of strings or numbers becomes one `_BulkArray`:
            # the reader makes a field part (numpy views) per element, 760 000 of them for a
            # 151k-token vocabulary with its merges and token types, seconds of parse time and
            # 200 MB of Python objects (figures: docs/model-runtime.md).
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                name = str(bytes(kv_kdata), encoding="utf-8")
                head: list[np.ndarray] = [kv_klen, kv_kdata, raw_kv_type]
                bulk = self._bulk_array(orig_offs, name, head, offs, int(raw_kv_type[0]))
                if bulk is not None:
                    self._push_field(bulk, skip_sum=True)
                    offs += sum(int(part.nbytes) for part in bulk.parts[len(head) :])
                    continue
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                self._push_field(
                    ReaderField(
                        orig_offs, name, head + parts, [i + len(head) for i in idxs], types
                    ),
                    skip_sum=True,
                )
                offs += size
            return offs

        def _bulk_array(
            self, orig_offs: int, name: str, head: list[np.ndarray], offs: int, raw_type: int
        ) -> _BulkArray | None:
            """The array at `offs` read whole, or None for any other value (the reader's own
            code reads those: scalars, strings, empty or nested arrays, unknown types)."""
            if raw_type != GGUFValueType.ARRAY:
                return None
            item_type = self._get(offs, np.uint32)
            length = self._get(offs + 4, np.uint64)
            count, item, start = int(length[0]), int(item_type[0]), offs + 12
            if count == 0:
                return None
            if item == GGUFValueType.STRING:
                bounds = self._string_bounds(start, count)
                payload = self._get(start, np.uint8, int(bounds[-1]))
                kind = GGUFValueType.STRING
            else:
                try:
                    kind = GGUFValueType(item)
                except ValueError:
                    return None
                nptype = self.gguf_scalar_to_np.get(kind)
                if nptype is None:
                    return None
                bounds = None
                payload = self._get(start, nptype, count)
            parts = [*head, item_type, length, payload]
            return _BulkArray(
                orig_offs, name, parts, [len(parts) - 1], [GGUFValueType.ARRAY, kind], bounds
            )

        def _string_bounds(self, start: int, count: int) -> np.ndarray:
            """Where each of `count` strings from `start` begins (its 8-byte length), relative
            to `start`, and where the last ends: the lengths chain, so this is one pass."""
            order = "=" if self.byte_order == "I" else ("<" if sys.byteorder == "big" else ">")
            unpack = struct.Struct(order + "Q").unpack_from
            buf, size = self._plain.data, len(self._plain)
            bounds = [0] * (count + 1)
            pos = start
            for i in range(count):
                if pos + 8 > size:
                    raise _Damage(_past_end(pos + 8, size))
                bounds[i] = pos - start
                pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                raise _Damage(_past_end(pos, size))
            bounds[count] = pos - start
            return np.array(bounds, dtype=np.int64)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            # Tensors lie at data start + their offset; the file must hold the last byte of
            # every one before the reader shapes views of them.
            expected = start_offs
            for entry in fields:
                _, name, _, dims, raw_type, offset = entry.parts
                try:
                    qtype = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise _Damage(
                        f"tensor {bytes(name).decode(errors='replace')!r} has unknown type "
                        f"{int(raw_type[0])} (corrupt, or a type newer than this meshd's gguf "
                        f"package)"
                    ) from None
                block, type_size = GGML_QUANT_SIZES[qtype]
                nbytes = math.prod(int(d) for d in dims) * type_size // block
                expected = max(expected, start_offs + int(offset[0]) + nbytes)
            if expected > len(self._plain):
                raise _Damage(
                    f"truncated: expected {expected} bytes, file has {len(self._plain)} "
                    f"(copy or download it again)"
                )
            super()._build_tensors(start_offs, fields)

    return PlainViewReader, _BulkArray


def _decode_strings(payload: np.ndarray, bounds: np.ndarray) -> list[str]:
    """The strings of a GGUF string array (`payload`: each one's 8-byte length, then its UTF-8
    bytes; `bounds`: where each length lies, then the end), as `str(bytes, encoding="utf-8")`
    of each gives them, with its errors.

    The bytes of all strings are decoded in one call and the text cut at each string's first
    character: the same strings whenever the whole decodes and no string starts with a UTF-8
    continuation byte (then no character spans two strings). Otherwise each string is decoded
    alone, which raises the error a damaged string gives.
    """
    starts, ends = bounds[:-1] + 8, bounds[1:]
    keep = np.ones(len(payload), dtype=bool)
    keep[(bounds[:-1, None] + np.arange(8)).ravel()] = False
    data = payload[keep]
    lengths = ends - starts
    byte_offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=byte_offsets[1:])
    continuation = (data & 0xC0) == 0x80
    text: str | None = None
    if not continuation[byte_offsets[:-1][lengths > 0]].any():
        try:
            text = data.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is None:
        raw = payload.tobytes()
        return [
            str(raw[s:e], encoding="utf-8")
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
    if len(text) == len(data):  # ASCII: characters are bytes
        offsets = byte_offsets.tolist()
    else:
        chars = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum(~continuation, out=chars[1:])
        offsets = chars[byte_offsets].tolist()
    return [text[a:b] for a, b in itertools.pairwise(offsets)]


def _past_end(end: int, size: int) -> str:
    return (
        f"truncated or corrupt: its GGUF header runs past the end of the file "
        f"(needs at least {end} bytes, file has {size})"
    )


def _check_magic_and_version(path: pathlib.Path) -> None:
    """Raise CorruptCheckpoint unless the file starts with GGUF's magic and a version the
    reader knows (either byte order: a big-endian file is refused once read)."""
    from gguf import READER_SUPPORTED_VERSIONS

    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not head:
        raise CorruptCheckpoint(f"{path}: the file is empty, not a GGUF model")
    if head[:4] != b"GGUF":
        raise CorruptCheckpoint(
            f"{path}: not a GGUF file: it starts with {head[:4]!r}, not the magic b'GGUF'"
        )
    if len(head) < 8:
        raise CorruptCheckpoint(
            f"{path}: truncated: the file has {len(head)} bytes, not even a GGUF header"
        )
    version = int.from_bytes(head[4:], "little")
    if not version & 0xFFFF:
        version = int.from_bytes(head[4:], "big")
    if version not in READER_SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        raise CorruptCheckpoint(
            f"{path}: GGUF version {version} is not supported (supported: {supported}): "
            f"corrupt, or written by a newer llama.cpp"
        )


_SHARD_RE = re.compile(r"(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def read_shards(path: pathlib.Path) -> list[tuple[pathlib.Path, GGUFReader]]:
    """The file's reader, or for a split model (`split.count` > 1) every shard's, first first.

    Shards are named as llama.cpp's `llama-gguf-split` names them, `PREFIX-00001-of-00003.gguf`;
    any one of them may be given. The first holds the metadata, each its own tensors.
    """
    reader = read_gguf(path)
    if reader.byte_order != "I":
        raise UnsupportedArchitecture(f"{path}: a big-endian GGUF file is not supported")
    field = reader.fields.get("split.count")
    count = int(field.contents()) if field is not None else 1
    if count <= 1:
        return [(path, reader)]
    match = _SHARD_RE.fullmatch(path.name)
    if match is None or int(match["count"]) != count:
        raise MissingFile(
            f"{path}: one of {count} split GGUF files, but not named PREFIX-0000N-of-"
            f"{count:05d}.gguf, so the others cannot be found"
        )
    shards = [
        path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf")
        for i in range(1, count + 1)
    ]
    readers: list[tuple[pathlib.Path, GGUFReader]] = []
    for i, shard in enumerate(shards):
        if not shard.is_file():
            raise MissingFile(f"{shard}: shard {i + 1} of {count} of a split GGUF model not found")
        readers.append((shard, reader if shard == path else read_gguf(shard)))
    return readers


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


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata; errors name the key."""

    def __init__(self, reader: GGUFReader, source: str) -> None:
        self._fields = reader.fields
        self.source = source

    def has(self, key: str) -> bool:
        return key in self._fields

    def value(self, key: str, default: Any = None) -> Any:
        """The key's value (str, number, bool or list), `default` when absent."""
        found = self._fields.get(key)
        if found is None:
            return default
        try:
            return found.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise InvalidConfig(f"{self.source}: metadata {key!r} is unreadable ({exc})") from None

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.value(key, default)
        if value is not None and not isinstance(value, str):
            raise InvalidConfig(f"{self.source}: metadata {key!r} must be a string, got {value!r}")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.value(key, default)
        if value is None:
            raise InvalidConfig(f"{self.source}: required metadata {key!r} is missing")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidConfig(
                f"{self.source}: metadata {key} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def number(self, key: str, default: float) -> float:
        value = self.value(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise InvalidConfig(
                f"{self.source}: metadata {key} must be a positive number, got {value!r}"
            )
        # GGUF stores f32: print it back as the shortest decimal that rounds to the same f32.
        return float(str(np.float32(value)))

    def optional_id(self, key: str) -> int | None:
        value = self.value(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidConfig(f"{self.source}: metadata {key} must be a token id, got {value!r}")
        return value

    def architecture(self) -> str:
        arch = self.string("general.architecture")
        if arch is None:
            raise InvalidConfig(f"{self.source}: metadata 'general.architecture' is missing")
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{self.source}: GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        return arch


def _tensor_table(
    readers: list[tuple[pathlib.Path, GGUFReader]],
) -> tuple[dict[str, TensorInfo], dict[str, _Entry]]:
    """The runtime's tensors (HF names, HF shapes) and where each lies in the file(s)."""

    infos: dict[str, TensorInfo] = {}
    entries: dict[str, _Entry] = {}
    for path, reader in readers:
        size = path.stat().st_size
        for tensor in reader.tensors:
            hf_name = gguf_name_to_hf(tensor.name)
            if hf_name is None:
                continue
            if hf_name in infos:
                raise CorruptCheckpoint(f"{path}: tensor {tensor.name!r} is stored twice")
            info = _tensor_info(path, size, tensor, hf_name)
            infos[hf_name] = info
            entries[hf_name] = _Entry(tensor.name, int(tensor.tensor_type), info.dtype)
    return infos, entries


def _tensor_info(path: pathlib.Path, size: int, tensor: Any, hf_name: str) -> TensorInfo:
    """One tensor's type, HF-order shape and byte range, checked against the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(tensor.tensor_type)
    ne = [int(d) for d in tensor.shape]
    block, type_size = GGML_QUANT_SIZES[qtype]
    if ne and ne[0] % block:
        raise CorruptCheckpoint(
            f"{path}: tensor {tensor.name!r} has rows of {ne[0]} values, not whole "
            f"{qtype.name} blocks of {block}"
        )
    nbytes = math.prod(ne) // block * type_size
    if tensor.data_offset + nbytes > size:
        raise CorruptCheckpoint(
            f"{path}: tensor {tensor.name!r} lies beyond the end of the file ({size} bytes)"
        )
    shape = tuple(reversed(ne))
    return TensorInfo(hf_name, qtype.name, shape, path, tensor.data_offset, nbytes)


def _rope_factors(readers: list[tuple[pathlib.Path, GGUFReader]]) -> np.ndarray | None:
    """llama.cpp's per-frequency RoPE divisors (`rope_freqs.weight`, Llama 3 scaling), if any."""
    for path, reader in readers:
        for tensor in reader.tensors:
            if tensor.name == "rope_freqs.weight":
                if tensor.tensor_type != 0:  # F32
                    raise UnsupportedArchitecture(f"{path}: rope_freqs.weight is not F32")
                return np.array(tensor.data, dtype=np.float32).reshape(-1)
    return None


def config_from_gguf(
    meta: GGUFMetadata,
    arch: str,
    infos: Mapping[str, TensorInfo],
    rope_factors: np.ndarray | None,
) -> ModelConfig:
    """Map GGUF metadata (`{arch}.block_count`, ...) to the runtime's `ModelConfig`."""
    source = meta.source
    experts = meta.value(f"{arch}.expert_count", 0)
    if experts:
        raise UnsupportedArchitecture(
            f"{source}: mixture-of-experts GGUF ({arch}.expert_count = {experts}) is not supported"
        )
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    kv_heads = meta.integer(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads)
    value_dim = meta.integer(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedArchitecture(
            f"{source}: attention.value_length ({value_dim}) != key_length ({head_dim})"
        )
    rope_dim = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedArchitecture(
            f"{source}: partial RoPE ({arch}.rope.dimension_count {rope_dim} of {head_dim})"
        )
    if heads % kv_heads:
        raise InvalidConfig(
            f"{source}: head_count ({heads}) is not a multiple of head_count_kv ({kv_heads})"
        )
    if head_dim % 2:
        raise InvalidConfig(f"{source}: head dim ({head_dim}) must be even for RoPE")
    layers = meta.integer(f"{arch}.block_count")
    embed = infos.get("model.embed_tokens.weight")
    vocab = embed.shape[0] if embed is not None else meta.integer(f"{arch}.vocab_size")
    family = arch
    window: int | None = None
    sliding: tuple[bool, ...] = (False,) * layers
    swa = meta.value(f"{arch}.attention.sliding_window")
    if swa is not None and arch == "llama":
        # Mistral 7B's window. llama.cpp's converter writes Mistral as plain `llama` without
        # it (and runs full attention); a file that names a window gets it on every layer.
        family, window = "mistral", meta.integer(f"{arch}.attention.sliding_window")
        sliding = (True,) * layers
    assert family in FAMILIES
    layer0 = "model.layers.0."
    bos = meta.optional_id("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        max_position_embeddings=meta.integer(f"{arch}.context_length", 2048),
        rope=_rope(meta, arch, head_dim, rope_factors),
        tie_word_embeddings="lm_head.weight" not in infos,
        qkv_bias=layer0 + "self_attn.q_proj.bias" in infos,
        o_bias=layer0 + "self_attn.o_proj.bias" in infos,
        mlp_bias=layer0 + "mlp.up_proj.bias" in infos,
        qk_norm=layer0 + "self_attn.q_norm.weight" in infos,
        sliding_window=window,
        sliding_layers=sliding,
        bos_token_id=bos,
        eos_token_ids=stop_ids(meta),
    )


def stop_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    """End-of-generation ids: eos/eot/eom, plus control tokens llama.cpp treats as such."""
    ids = [
        i
        for key in ("eos", "eot", "eom")
        if (i := meta.optional_id(f"tokenizer.ggml.{key}_token_id")) is not None
    ]
    tokens = meta.value("tokenizer.ggml.tokens") or []
    types = meta.value("tokenizer.ggml.token_type") or []
    n = min(len(tokens), len(types))
    control = np.flatnonzero(np.asarray(types[:n]) == _CONTROL).tolist() if n else []
    ids += [i for i in control if tokens[i] in EOG_TEXTS]
    return tuple(dict.fromkeys(ids))


def _rope(meta: GGUFMetadata, arch: str, head_dim: int, factors: np.ndarray | None) -> RopeConfig:
    theta = meta.number(f"{arch}.rope.freq_base", 10000.0)
    scaling = meta.string(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = meta.number(f"{arch}.rope.scaling.factor", 1.0)
        if factors is not None:
            raise UnsupportedArchitecture(f"{meta.source}: rope_freqs with linear RoPE scaling")
        return RopeConfig(rope_type="linear", theta=theta, factor=factor)
    if scaling != "none":
        raise UnsupportedArchitecture(
            f"{meta.source}: RoPE scaling {scaling!r} is not supported (supported: none, "
            "linear, llama3 via rope_freqs)"
        )
    if factors is None:
        return RopeConfig(theta=theta)
    return llama3_rope_from_factors(factors, theta, head_dim, meta.source)


def llama3_rope_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, source: str
) -> RopeConfig:
    """Recover Llama 3 RoPE scaling from llama.cpp's per-frequency divisors (`rope_freqs`).

    The converter writes `r_i = 1 / ((1 - s_i) / factor + s_i)` with
    `s_i = (L / wavelen_i - low) / (high - low)` between the two wavelength bounds, 1 above
    and `factor` below them. Every Llama 3.x release uses low = 1, high = 4; `factor` is the
    largest divisor and `L` (the original context) follows from any smoothed frequency. The
    result must reproduce every stored divisor, or the file is refused.
    """
    n = head_dim // 2
    if factors.shape != (n,):
        raise UnsupportedArchitecture(
            f"{source}: rope_freqs has {factors.size} values, expected {n} (head_dim / 2)"
        )
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    low, high = 1.0, 4.0
    original = 8192
    medium = [(w, float(r)) for w, r in zip(wavelen, factors, strict=True) if 1 < r < factor]
    if medium and factor > 1:
        w, r = medium[0]
        smooth = (1 / r - 1 / factor) / (1 - 1 / factor)
        original = round(w * (smooth * (high - low) + low))
    elif factor > 1:
        # No smoothed frequency: any context between the last unscaled and first scaled
        # wavelength gives the same divisors; take the smallest power of two that does.
        scaled = wavelen[factors >= factor]
        original = 2 ** math.ceil(math.log2(float(scaled.min()) * low)) if scaled.size else 8192
    rope = RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=max(1, original),
    )
    if not np.allclose(_llama3_divisors(rope, wavelen), factors, rtol=1e-4, atol=0):
        raise UnsupportedArchitecture(
            f"{source}: rope_freqs is not Llama 3 RoPE scaling with low/high frequency "
            "factors 1/4 (other per-frequency scalings are not supported)"
        )
    return rope


def _llama3_divisors(rope: RopeConfig, wavelen: np.ndarray) -> np.ndarray:
    """The converter's `rope_factors` for `rope` (generate_extra_tensors in llama.py)."""
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    mid = 1 / ((1 - smooth) / rope.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, rope.factor, mid))


def _check_tensors(
    path: pathlib.Path,
    config: ModelConfig,
    infos: Mapping[str, TensorInfo],
    entries: Mapping[str, _Entry],
) -> None:
    for name, shape in expected_shapes(config).items():
        info = infos.get(name)
        if info is None:
            gguf = _hf_to_gguf_name(name)
            raise MissingTensor(f"{path}: tensor {gguf!r} ({name}) is missing from the GGUF file")
        if info.dtype not in TENSOR_TYPES:
            raise UnsupportedArchitecture(
                f"{path}: tensor {entries[name].gguf_name!r} is stored as {info.dtype}; "
                f"supported GGUF types: {', '.join(TENSOR_TYPES)}"
            )
        if info.shape != shape:
            raise ShapeMismatch(
                f"{path}: tensor {entries[name].gguf_name!r} has shape {list(info.shape)} "
                f"(HF order), but the metadata implies {list(shape)}"
            )


def _hf_to_gguf_name(name: str) -> str:
    for gguf, hf in _GLOBAL_NAMES.items():
        if hf == name:
            return gguf
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match:
        for gguf, hf in _BLOCK_NAMES.items():
            if hf == match.group(2):
                return f"blk.{match.group(1)}.{gguf}"
    return name


def _default_quantization(infos: Mapping[str, TensorInfo]) -> str:
    """`gguf`: the file's tensors as stored, the same model llama.cpp runs; `none` for a file
    of F32 matrices only, which fp32 stages hold as they are, with their fused-layer kernel."""
    matrices = {info.dtype for info in infos.values() if len(info.shape) == 2}
    return "none" if matrices <= {"F32"} else "gguf"


def converted_quantization(infos: Mapping[str, TensorInfo]) -> str:
    """The scheme the file's dominant decoder matrix type (by elements) converts to, where its
    blocks are not run as stored."""
    elements: dict[str, int] = {}
    for name, info in infos.items():
        if name.startswith("model.layers.") and any(f".{m}." in name for m in _MATRICES):
            elements[info.dtype] = elements.get(info.dtype, 0) + math.prod(info.shape)
    if not elements:
        return "none"
    dominant = max(elements, key=lambda t: elements[t])
    return TENSOR_TYPES.get(dominant, "none")
