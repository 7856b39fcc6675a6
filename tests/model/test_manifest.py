"""The model id is the hash of the manifest: equal for equal files, different for one flipped
byte, cached by (path, size, mtime) so a restart does not hash again; a store keeps only
bytes that match, and a process killed mid-fetch leaves nothing the next one keeps."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from meshd.model import digests
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.manifest import ModelStore, StoreCheckpoint, set_cache_dir
from protocol.artifacts import ArtifactKind, manifest_id


def _copy(tmp: pathlib.Path, name: str) -> pathlib.Path:
    target = tmp / name
    shutil.copytree(builtin_model_dir(), target)
    return target


def _flip_last_byte(path: pathlib.Path, *, keep_mtime: bool = False) -> None:
    stat = path.stat()
    with path.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    digests._file_hashes.clear()
    set_cache_dir(None)


def test_equal_files_give_one_id_and_a_flipped_byte_another(tmp_path: pathlib.Path) -> None:
    a, b = _copy(tmp_path, "a"), _copy(tmp_path, "b")
    ca, cb = Checkpoint.open(a), Checkpoint.open(b)
    assert ca.model_id == cb.model_id == manifest_id(ca.manifest[1])
    _flip_last_byte(b / "model.safetensors")  # the last tensor's last byte
    assert Checkpoint.open(b).model_id != ca.model_id
    (a / "tokenizer.json").write_text((a / "tokenizer.json").read_text() + " ")
    assert Checkpoint.open(a).model_id != ca.model_id  # the tokenizer is part of the model


def test_hashes_are_cached_on_disk_by_size_and_mtime(tmp_path: pathlib.Path) -> None:
    model = _copy(tmp_path, "m")
    set_cache_dir(tmp_path / "cache")
    first = Checkpoint.open(model).model_id
    assert list((tmp_path / "cache" / "hashes").iterdir())
    # A restart (empty process cache) with the file untouched takes the cached hashes: the
    # proof is a byte changed behind the cache's back (mtime restored) going unnoticed.
    digests._file_hashes.clear()
    _flip_last_byte(model / "model.safetensors", keep_mtime=True)
    assert Checkpoint.open(model).model_id == first
    # A file written since (new mtime) is hashed again.
    digests._file_hashes.clear()
    os.utime(model / "model.safetensors")
    assert Checkpoint.open(model).model_id != first


def test_a_store_keeps_matching_bytes_and_drops_a_changed_file(tmp_path: pathlib.Path) -> None:
    source = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = source.manifest
    store = ModelStore(tmp_path, model_id, data, manifest)
    name = "model.layers.0.self_attn.q_proj.weight"
    (index,) = store.tensor_indices([name])
    info = source.tensors[name]
    payload = info.path.read_bytes()[info.offset : info.offset + info.nbytes]
    store.begin(index)
    store.write(index, 0, payload[:100])
    store.write(index, 100, payload[100:])
    assert store.finish(index)
    files = store.file_indices()
    for i in files:
        artifact = manifest.artifacts[i]
        store.begin(i)
        store.write(i, 0, (builtin_model_dir() / artifact.name).read_bytes())
        assert store.finish(i)
    checkpoint = StoreCheckpoint.over(store)
    assert checkpoint.model_id == model_id and set(checkpoint.tensors) == {name}
    ((_, tensor),) = list(checkpoint.load([name]))
    ((_, expected),) = list(source.load([name]))
    assert tensor.equal(expected)
    # Wrong bytes are never kept.
    store.begin(index)
    store.write(index, 0, bytes(len(payload)))
    assert not store.finish(index) and not store.part_path(index).exists()
    # A stored file changed later is hashed again when next asked for, and dropped.
    _flip_last_byte(store.path_of(index))
    reopened = ModelStore.open_cached(tmp_path, model_id[:8])
    assert reopened is not None and reopened.held([index]) == set()
    assert not store.path_of(index).exists()
    assert manifest.artifacts[index].kind == ArtifactKind.TENSOR


def test_a_store_reopened_after_a_kill_mid_fetch_drops_the_part_files(
    tmp_path: pathlib.Path,
) -> None:
    # A SIGKILL lands between `begin`/`write` and `finish`: the part files stay on disk, and
    # the next start may be planned for other layers, which would never finish them.
    source = Checkpoint.open(builtin_model_dir())
    model_id, data, manifest = source.manifest
    store = ModelStore(tmp_path, model_id, data, manifest)
    done, cut = store.tensor_indices(
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    )
    info = source.tensors[manifest.artifacts[done].name]
    store.begin(done)
    store.write(done, 0, info.path.read_bytes()[info.offset : info.offset + info.nbytes])
    assert store.finish(done)
    store.begin(cut)
    store.write(cut, 0, b"\x01" * 100)
    (store.directory / "verified.msgpack.tmp").write_bytes(b"cut short")
    files = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert store.part_path(cut).relative_to(tmp_path) in files

    reopened = ModelStore.open_cached(tmp_path, model_id[:8])
    assert reopened is not None
    left = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert left == files - {
        store.part_path(cut).relative_to(tmp_path),
        (store.directory / "verified.msgpack.tmp").relative_to(tmp_path),
    }
    assert reopened.held([done, cut]) == {done}  # what was verified stays verified


def test_a_manifest_naming_paths_outside_the_store_is_refused(tmp_path: pathlib.Path) -> None:
    from meshd.model.errors import CorruptCheckpoint
    from protocol.artifacts import Artifact, Manifest, encode_manifest

    for artifact in (
        Artifact(ArtifactKind.FILE, "../escape.json", 1, b"\0" * 32),
        Artifact(ArtifactKind.TENSOR, "../../x", 4, b"\0" * 32, "F32", [1]),
        Artifact(ArtifactKind.TENSOR, "model.norm/weight", 4, b"\0" * 32, "F32", [1]),
    ):
        manifest = Manifest(1, "safetensors", [artifact])
        data = encode_manifest(manifest)
        with pytest.raises(CorruptCheckpoint):
            ModelStore(tmp_path, manifest_id(data), data, manifest)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
