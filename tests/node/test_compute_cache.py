"""A node measures its compute per layer and token at its first start and reads it from its
state dir on a restart; another file, thread count or kernel library is measured anew."""

from __future__ import annotations

import os
import pathlib
import shutil

import msgspec
import pytest
import torch
import trio

from meshd.bench.gguf_writer import write_gguf
from meshd.config import NodeConfig, load_config
from meshd.model import digests
from meshd.model.builtin import builtin_model_dir
from meshd.model.compute_cache import ComputeKey, _Entry
from meshd.model.gguf_file import forget_parsed
from meshd.node.basis import NodeBasis
from meshd.node.compute import measure_or_cached
from tests.node.daemons import SECRET

# A figure no measurement of the tiny built-in model gives (about 1e4-1e6 ns here): seen in
# the result only when it was read from the cache.
PLANTED_NS = 987_654_321


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("gguf") / "builtin.gguf"
    return write_gguf(builtin_model_dir(), path, "Q8_0")


def _config(state: pathlib.Path) -> NodeConfig:
    return load_config(
        {"mesh_secret": SECRET, "listen_host": "127.0.0.1", "mdns.enabled": False},
        {"MESHD_STATE_DIR": str(state)},
        None,
    )


def _start(config: NodeConfig, model: pathlib.Path) -> int:
    """What a (re)started daemon's node does: open the model, take its compute figure."""
    digests._file_hashes.clear()  # a new process: nothing cached in memory
    forget_parsed()
    basis = NodeBasis.load(config, str(model))
    return trio.run(measure_or_cached, basis, basis.models[0], config)


def _plant(state: pathlib.Path) -> ComputeKey:
    """Overwrite the one cached figure with PLANTED_NS; its key."""
    (entry_path,) = (state / "compute").iterdir()
    entry = msgspec.json.decode(entry_path.read_bytes(), type=_Entry)
    entry.compute_ns = PLANTED_NS
    entry_path.write_bytes(msgspec.json.encode(entry))
    return entry.key


def test_a_restart_reads_the_measured_compute_and_a_changed_file_is_measured_again(
    q8_file: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = tmp_path / "m.gguf"
    shutil.copy(q8_file, model)
    state = tmp_path / "state"
    config = _config(state)
    first = _start(config, model)
    assert 0 < first < PLANTED_NS
    key = _plant(state)
    assert key.quantization == "gguf" and key.kernels.startswith("blocks-")
    assert key.threads == torch.get_num_threads()

    # A restart on the same state dir plans with the stored figure: nothing measured.
    assert _start(config, model) == PLANTED_NS
    # Touched (new mtime, same bytes): the tensors are hashed again, the model is the same
    # one, so is its compute.
    os.utime(model, ns=(1, 1))
    assert _start(config, model) == PLANTED_NS

    # Another file in its place (one weight byte changed, same size and mtime): another model,
    # measured anew and stored beside the first.
    stat = model.stat()
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    other = tmp_path / "other.gguf"
    other.write_bytes(data)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, model)
    assert _start(config, model) not in (PLANTED_NS, 0)
    assert len(list((state / "compute").iterdir())) == 2


def test_other_threads_are_measured_anew_and_a_damaged_entry_is_measured_over(
    q8_file: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    state = tmp_path / "state"
    config = _config(state)
    _start(config, q8_file)
    _plant(state)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(previous + 1)
        assert _start(config, q8_file) != PLANTED_NS
    finally:
        torch.set_num_threads(previous)
    assert _start(config, q8_file) == PLANTED_NS
    for entry in (state / "compute").iterdir():
        entry.write_bytes(b"{not json")
    assert _start(config, q8_file) != PLANTED_NS
