"""The GGUF file format: the header, the key/value metadata and the tensor table.

`read_gguf(path)` parses a file with the `gguf` package's reader (llama.cpp's own; the file is
memory-mapped and no tensor bytes are read), checking the magic, the version and that every
tensor lies inside the file, so damage is a one-line `CorruptCheckpoint`. Arrays of strings and
numbers (a vocabulary, its merges) are read in bulk. A parse is cached while the file is
unchanged, so the start-up check, the checkpoint, its model id and the tokenizer share one.
`read_shards` finds the other files of a split model; `GGUFMetadata` reads typed metadata.

What the file *means* to the runtime (its `ModelConfig`, Hugging Face tensor names) is
`meshd.model.gguf_model`'s; the tensors as a checkpoint are `meshd.model.gguf_checkpoint`'s.
Neither this module nor `gguf_model` imports torch: `meshd serve` checks a file with them
before the heavy imports.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import re
import struct
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from meshd.model.errors import (
    CorruptCheckpoint,
    InvalidConfig,
    MissingFile,
    UnsupportedArchitecture,
)

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
    _check_magic_and_version(path)
    _parse_count += 1
    try:
        return _PlainViewReader(path, "r")
    except _Damage as exc:
        raise CorruptCheckpoint(f"{path}: {exc}") from None
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise CorruptCheckpoint(f"{path}: not a readable GGUF file ({exc})") from None


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


class _PlainViewReader(GGUFReader):
    """`parse_gguf`'s reader: the `gguf` package's, reading the map as a plain array, bounds
    checked, arrays read in bulk."""

    # Give the reader a plain ndarray view of the map, not a `np.memmap`: it slices its map
    # once per metadata value, and each `np.memmap` slice runs Python-level finalizers
    # (figures: docs/model-runtime.md). Still memory-mapped: the view reads nothing until touched.
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
        # The reader's own, but an array of strings or numbers becomes one `_BulkArray`, not
        # a field part (numpy views) per element (figures: docs/model-runtime.md).
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
                ReaderField(orig_offs, name, head + parts, [i + len(head) for i in idxs], types),
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


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata; errors name the key."""

    def __init__(self, reader: GGUFReader, source: str) -> None:
        self._fields = reader.fields
        self.source = source

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
