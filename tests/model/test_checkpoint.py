"""Checkpoint loading: typed errors that name the culprit, header validation, model id."""

from __future__ import annotations

import json
import pathlib
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshd.bench.checkpoints import make_checkpoint
from meshd.model.checkpoint import Checkpoint, read_safetensors_header
from meshd.model.config import parse_config
from meshd.model.errors import (
    CorruptCheckpoint,
    InvalidConfig,
    MissingFile,
    MissingTensor,
    ShapeMismatch,
    UnsupportedArchitecture,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("pristine")
    make_checkpoint(directory, "llama", seed=21, num_hidden_layers=2)
    return directory


@pytest.fixture
def ckpt(pristine: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def edit_config(directory: pathlib.Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_unsupported_architecture_names_it(ckpt: pathlib.Path) -> None:
    edit_config(ckpt, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture, match=r"gpt2.*supported: llama, mistral"):
        Checkpoint.open(ckpt)
    edit_config(ckpt, model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="gelu")
    with pytest.raises(UnsupportedArchitecture, match="hidden_act 'gelu'"):
        Checkpoint.open(ckpt)
    edit_config(ckpt, hidden_act="silu", rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(UnsupportedArchitecture, match="rope type 'yarn'"):
        Checkpoint.open(ckpt)


def test_missing_files_are_named(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with pytest.raises(MissingFile, match="checkpoint directory not found"):
        Checkpoint.open(tmp_path / "nowhere")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(MissingFile, match=r"no model\.safetensors"):
        Checkpoint.open(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(MissingFile, match=r"config\.json not found"):
        Checkpoint.open(ckpt)


def test_missing_shard_and_tensor_are_named(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path, "llama", num_hidden_layers=2, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    weights = load_file(shards[0])
    dropped = sorted(weights)[0]
    del weights[dropped]
    save_file(weights, shards[0], metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpoint, match=f"{dropped}.*is not in {shards[0].name}"):
        Checkpoint.open(tmp_path)
    shards[-1].unlink()
    with pytest.raises(MissingFile, match=shards[-1].name):
        Checkpoint.open(tmp_path)


def test_tensor_missing_from_single_file(ckpt: pathlib.Path) -> None:
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Checkpoint.open(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt: pathlib.Path) -> None:
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(
        ShapeMismatch, match=r"gate_proj\.weight' has shape \[128, 64\].*\[96, 64\]"
    ):
        Checkpoint.open(ckpt)


def _rewrite_header(path: pathlib.Path, edit: object) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)  # type: ignore[operator]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:5]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "beyond the file"),
        (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + p.read_bytes()[8:]), "header length"),
        (lambda p: p.write_bytes(p.read_bytes()[:8] + b"{not json" + p.read_bytes()[17:]), "JSON"),
        (
            lambda p: _rewrite_header(
                p, lambda h: h["model.norm.weight"].__setitem__("dtype", "F33")
            ),
            "unknown dtype 'F33'",
        ),
        (
            lambda p: _rewrite_header(
                p, lambda h: h["model.norm.weight"].__setitem__("shape", [65])
            ),
            r"model\.norm\.weight.*needs 260",
        ),
        (
            lambda p: _rewrite_header(
                p, lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, 256])
            ),
            "overlap",
        ),
    ],
    ids=["truncated", "short-data", "header-length", "bad-json", "dtype", "shape", "overlap"],
)
def test_corrupt_header_is_typed(ckpt: pathlib.Path, damage: object, message: str) -> None:
    path = ckpt / "model.safetensors"
    damage(path)  # type: ignore[operator]
    with pytest.raises(CorruptCheckpoint, match=message):
        Checkpoint.open(ckpt)


def test_header_reader_accepts_what_safetensors_writes(tmp_path: pathlib.Path) -> None:
    tensors = {
        "a": torch.zeros(3, 5),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "e": torch.zeros(0),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert {n: (i.dtype, i.shape, i.nbytes) for n, i in header.items()} == {
        "a": ("F32", (3, 5), 60),
        "b": ("BF16", (2,), 4),
        "e": ("F32", (0,), 0),
    }


def test_model_id_is_stable_and_sees_fine_tunes(ckpt: pathlib.Path, pristine: pathlib.Path) -> None:
    first = Checkpoint.open(ckpt).model_id
    assert first == Checkpoint.open(pristine).model_id and len(first) == 32
    # A "fine-tune": same names, dtypes and shapes, one layer's weights nudged.
    weights = load_file(ckpt / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] += 0.01
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert Checkpoint.open(ckpt).model_id != first


def test_config_layouts_v4_and_v5_agree() -> None:
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 64
    v4 = parse_config(base | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    v5 = parse_config(
        base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert v4 == v5 and v4.rope.rope_type == "llama3" and v4.num_kv_heads == 4
    with pytest.raises(InvalidConfig, match="'vocab_size' is missing"):
        parse_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(InvalidConfig, match="num_key_value_heads"):
        parse_config(base | {"num_key_value_heads": 3})
    with pytest.raises(InvalidConfig, match="hidden_size must be an integer"):
        parse_config(base | {"hidden_size": "64"})


def test_qwen_sliding_layers_and_defaults() -> None:
    qwen = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    cfg = parse_config(qwen)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
    assert [cfg.window_for_layer(i) for i in range(4)] == [None, None, 8, 8]
    q3 = parse_config(qwen | {"model_type": "qwen3", "use_sliding_window": False})
    assert q3.qk_norm and q3.head_dim == 128 and q3.sliding_window is None
