"""What a start costs on a GGUF file: its header parsed once (checkpoint, model id and tokenizer
share the parse, which is dropped afterwards), metadata arrays read in bulk with the values
llama.cpp's reader gives, and tensor hashes taken from the cache on a restart."""

from __future__ import annotations

import gc
import hashlib
import os
import pathlib
import shutil
import time
import weakref

import gguf
import pytest

from meshd.bench.gguf_writer import write_gguf
from meshd.model import digests
from meshd.model.builtin import builtin_model_dir
from meshd.model.digests import set_cache_dir, sha256_ranges, tensor_bytes_hashed
from meshd.model.errors import CorruptCheckpoint, InvalidConfig
from meshd.model.files import open_checkpoint, open_tokenizer, prepare
from meshd.model.gguf_file import (
    GGUFMetadata,
    forget_parsed,
    parse_count,
    parse_gguf,
    read_gguf,
)

# Arrays of every kind the bulk reader takes, with the awkward strings: empty ones, multi-byte
# characters, a character made of a whole 4-byte sequence, spaces (merges are "a b").
V = gguf.GGUFValueType
ARRAYS: dict[str, tuple[list[object], gguf.GGUFValueType]] = {
    "test.strings": (["", "a", "héllo", "", "日本語", "🦙", "Ġthe Ġcat", "x" * 300, ""], V.STRING),
    "test.ascii": (["a", "bc", "", "def"], V.STRING),
    "test.int32": ([3, -1, 2**31 - 1, -(2**31)], V.INT32),
    "test.uint8": ([0, 255, 7], V.UINT8),
    "test.int16": ([-300, 300], V.INT16),
    "test.float32": ([0.5, -1.25, 3.0e38, 1e-7], V.FLOAT32),
    "test.float64": ([0.1, -2.5], V.FLOAT64),
    "test.uint64": ([2**64 - 1, 0], V.UINT64),
    "test.int64": ([-(2**63), 5], V.INT64),
    "test.bool": ([True, False, True], V.BOOL),
    "test.one": (["only"], V.STRING),
}
REAL_FILES = (
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    forget_parsed()
    digests._file_hashes.clear()
    set_cache_dir(None)


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The built-in model as a Q8_0 GGUF file with extra metadata arrays of every kind."""
    path = tmp_path_factory.mktemp("gguf") / "builtin.gguf"
    metadata = {key: (values, V.ARRAY, kind) for key, (values, kind) in ARRAYS.items()}
    return write_gguf(builtin_model_dir(), path, "Q8_0", metadata=metadata)


def _assert_same_fields(ours: gguf.GGUFReader, plain: gguf.GGUFReader) -> None:
    assert list(ours.fields) == list(plain.fields)
    for key, theirs in plain.fields.items():
        field = ours.fields[key]
        assert (field.name, field.offset, field.types) == (theirs.name, theirs.offset, theirs.types)
        value = theirs.contents()
        assert field.contents() == value, key
        if isinstance(value, list):
            assert [type(v) for v in field.contents()] == [type(v) for v in value], key
            for index in (0, len(value) // 2, -1) if value else ():
                assert field.contents(index) == theirs.contents(index), (key, index)
            assert field.contents(slice(1, 3)) == theirs.contents(slice(1, 3)), key
    assert ours.data_offset == plain.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in plain.tensors
    ]


def test_metadata_read_in_bulk_equals_llama_cpps_reader(model_gguf: pathlib.Path) -> None:
    ours = parse_gguf(model_gguf)
    _assert_same_fields(ours, gguf.GGUFReader(model_gguf))
    assert ours.fields["test.strings"].contents() == ARRAYS["test.strings"][0]
    # The vocabulary is held whole (one array part), not one part per token.
    assert len(ours.fields["tokenizer.ggml.tokens"].parts) < 10


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_FILES)
def test_bulk_metadata_of_real_files_equals_llama_cpps_reader(name: str) -> None:
    cache = pathlib.Path(os.environ.get("MESHD_MODEL_CACHE", "~/.cache/meshd/models"))
    path = cache.expanduser() / name
    if not path.is_file():
        pytest.skip(f"{name} is not cached (scripts/fetch_models)")
    _assert_same_fields(parse_gguf(path), gguf.GGUFReader(path))


@pytest.mark.parametrize(
    "strings",
    [
        [b"ok", b"\xff"],  # not UTF-8
        [b"ok", b"\xc3", b"\xa9"],  # one character cut across two strings
        [b"\xe6\x97", b"\xa5x"],
    ],
)
def test_a_string_array_that_is_not_utf8_is_refused_as_the_reader_refuses_it(
    tmp_path: pathlib.Path, strings: list[bytes]
) -> None:
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.bad", strings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain = gguf.GGUFReader(path).fields["test.bad"]
    with pytest.raises(UnicodeDecodeError):
        plain.contents()
    field = parse_gguf(path).fields["test.bad"]
    with pytest.raises(UnicodeDecodeError):
        field.contents()
    with pytest.raises(InvalidConfig, match=r"test\.bad"):
        GGUFMetadata(parse_gguf(path), str(path)).value("test.bad")


def test_a_file_cut_inside_the_vocabulary_is_a_one_line_error(
    model_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    field = parse_gguf(model_gguf).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_gguf.read_bytes()[: field.offset + 1000])
    with pytest.raises(CorruptCheckpoint, match="runs past the end of the file") as exc:
        parse_gguf(cut)
    assert "\n" not in str(exc.value) and str(cut) in str(exc.value)


def test_a_start_parses_the_file_once_and_keeps_no_parse(model_gguf: pathlib.Path) -> None:
    before = parse_count()
    checkpoint = open_checkpoint(model_gguf)  # `meshd serve`'s check, then the daemon's
    checkpoint = open_checkpoint(model_gguf)
    tokenizer = open_tokenizer(model_gguf)
    assert checkpoint.model_id
    assert parse_count() == before + 1
    assert tokenizer.encode("Once upon a time") and checkpoint.config.num_layers
    parsed = weakref.ref(read_gguf(model_gguf))
    forget_parsed()
    gc.collect()
    assert parsed() is None  # neither the checkpoint nor the tokenizer holds the parse
    open_tokenizer(model_gguf)
    assert parse_count() == before + 2


def test_a_changed_file_is_parsed_again(model_gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(model_gguf, path)
    first = read_gguf(path)
    assert read_gguf(path) is first
    os.utime(path, ns=(1, 1))
    assert read_gguf(path) is not first


def test_a_restart_takes_every_tensor_hash_from_the_cache(
    model_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(model_gguf, path)
    set_cache_dir(tmp_path / "state")
    hashed = tensor_bytes_hashed()
    first = open_checkpoint(path).model_id
    assert tensor_bytes_hashed() > hashed
    # A restart: a new process (empty in-process caches), the same state dir.
    _restart()
    hashed = tensor_bytes_hashed()
    assert open_checkpoint(path).model_id == first
    assert tensor_bytes_hashed() == hashed
    # Another file put in its place with the same size and mtime (a new inode) is hashed anew.
    stat = path.stat()
    other = tmp_path / "other.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    other.write_bytes(data)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, path)
    _restart()
    assert open_checkpoint(path).model_id != first
    assert tensor_bytes_hashed() > hashed


def _restart() -> None:
    """What a new process starts without: the in-process file hashes and parsed headers."""
    digests._file_hashes.clear()
    forget_parsed()


def _opened_once(model_gguf: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, str, int]:
    """A copy of the model file opened once, then a restart: (its path, its model id, the
    tensor bytes that first open hashed)."""
    path = tmp_path / "m.gguf"
    shutil.copy(model_gguf, path)
    hashed = tensor_bytes_hashed()
    expected_id = open_checkpoint(path).model_id
    once = tensor_bytes_hashed() - hashed
    _restart()
    return path, expected_id, once


def test_a_prepared_file_is_hashed_ahead_and_its_model_id_hashes_nothing_again(
    model_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path, expected_id, once = _opened_once(model_gguf, tmp_path)
    set_cache_dir(tmp_path / "state")
    hashed = tensor_bytes_hashed()
    prepare(path)  # as `meshd serve` does before it imports torch
    deadline = time.monotonic() + 30
    while not list((tmp_path / "state").glob("hashes/*.msgpack")):  # hashed with no open
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert open_checkpoint(path).model_id == expected_id
    assert tensor_bytes_hashed() - hashed == once  # each tensor hashed once, not again


def test_a_model_id_asked_while_its_file_is_hashed_waits_for_that_hashing(
    model_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    path, expected_id, once = _opened_once(model_gguf, tmp_path)
    hashed = tensor_bytes_hashed()
    prepare(path)
    assert open_checkpoint(path).model_id == expected_id  # at once, the hashing under way
    deadline = time.monotonic() + 30
    while tensor_bytes_hashed() - hashed < once:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert tensor_bytes_hashed() - hashed == once


def test_threaded_range_hashes_equal_hashlibs(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "blob"
    data = os.urandom(3 * 1024 * 1024 + 17)
    path.write_bytes(data)
    ranges = [(0, 0), (5, 3 * 1024 * 1024), (100, 1), (len(data) - 7, 7), (0, len(data))]
    assert sha256_ranges(path, ranges) == [
        hashlib.sha256(data[offset : offset + nbytes]).digest() for offset, nbytes in ranges
    ]
    with pytest.raises(CorruptCheckpoint, match="ends before byte"):
        sha256_ranges(path, [(len(data) - 3, 4)])
