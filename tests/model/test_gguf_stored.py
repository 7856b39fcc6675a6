"""GGUF files run as stored (quantization `gguf`): the file's blocks are the weights.

The stage maps each tensor's bytes and multiplies them with its block format's kernel, which
quantizes activations per block as llama.cpp does; so a `gguf` stage computes what the
dequantized file computes (`none`), to activation rounding, while holding the file's bytes.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.gguf_writer import write_gguf
from meshd.bench.single_node import generate
from meshd.coord.generation import REPLAY_WINDOW_TOKENS
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint
from meshd.model.gguf_checkpoint import GGUFCheckpoint
from meshd.model.gguf_matrix import GgufMatrix
from meshd.model.kernels import cpu_kernels
from meshd.model.stage import StageModel
from meshd.node.planning import model_shape

PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211, 17, 3]
FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3"]
# A Q4_K_M-like mix: K-quant matrices, v and down in Q6_K, rows narrower than 256 in Q5_0.
MIXED = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q5_0"}


def load(checkpoint: GGUFCheckpoint, quantization: str, start: int = 0, end: int = 0):  # type: ignore[no-untyped-def]
    end = end or checkpoint.config.num_layers
    return StageModel.load(checkpoint, start, end, device="cpu", quantization=quantization)


def logits(stage: StageModel, ids: list[int]) -> torch.Tensor:
    stage.open_session("t", len(ids) + 1)
    try:
        out = stage.forward("t", 0, torch.tensor(ids))
    finally:
        stage.close_session("t")
    assert out.logits is not None
    return out.logits


def types_for(checkpoint_dir: pathlib.Path, mix: dict[str, str], layers: int) -> dict[str, str]:
    del checkpoint_dir
    return {f"blk.{i}.{name}": t for i in range(layers) for name, t in mix.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_gguf_stage_computes_what_the_dequantized_file_computes(
    tmp_path: pathlib.Path, family: str, kind: str
) -> None:
    make_checkpoint(tmp_path / "hf", family, seed=3)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", kind, sliding_window=True)
    checkpoint = open_checkpoint(path)
    assert isinstance(checkpoint, GGUFCheckpoint)
    assert checkpoint.default_quantization == "gguf"
    stored, dequantized = load(checkpoint, "gguf"), load(checkpoint, "none")
    ours, theirs = logits(stored, PROMPT), logits(dequantized, PROMPT)
    # Activations are quantized to 8 bits per block of 32: a rounding, not another model.
    # (Random weights give near-flat logits, so their argmax is left to the trained model's
    # test below; the lowest cosine measured over these files was 0.9989, Q4_0 qwen2.)
    assert float(F.cosine_similarity(ours, theirs, dim=-1).min()) > 0.995


def test_the_builtin_model_as_a_k_quant_file_answers_like_its_dequantized_self(
    tmp_path: pathlib.Path,
) -> None:
    types = types_for(builtin_model_dir(), MIXED, 6)
    checkpoint = open_checkpoint(
        write_gguf(builtin_model_dir(), tmp_path / "q.gguf", "Q4_K", types=types)
    )
    assert checkpoint.tensors["model.layers.0.self_attn.v_proj.weight"].dtype == "Q6_K"
    stored, dequantized = load(checkpoint, "gguf"), load(checkpoint, "none")
    ours, theirs = logits(stored, PROMPT), logits(dequantized, PROMPT)
    assert float(F.cosine_similarity(ours, theirs, dim=-1).min()) > 0.999
    same = generate([stored], PROMPT, 16).tokens == generate([dequantized], PROMPT, 16).tokens
    assert same or (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_the_weights_are_the_files_bytes_not_a_copy(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "qwen2", seed=4)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0")
    checkpoint = open_checkpoint(path)
    stage = load(checkpoint, "gguf")
    matrices = [m for m in stage.weight_matrices() if isinstance(m, GgufMatrix)]
    assert len(matrices) == len(stage.weight_matrices())
    data = np.memmap(path, mode="r")
    start = data.ctypes.data
    for matrix in matrices:
        for part in matrix.parts:
            raw = part.data
            address = raw.ctypes.data
            # The tensor's bytes lie inside the file's mapping and are read-only.
            assert not raw.flags.writeable
            assert 0 <= address - start < len(data) or raw.base is not None
    # The stage holds the file's tensors: matrices, embedding (tied head shares it), vectors.
    held = sum(info.nbytes for info in checkpoint.tensors.values())
    assert stage.weight_bytes == held


@pytest.mark.parametrize("fused", [True, False])
def test_a_verify_window_gives_the_bits_of_the_steps_it_replaces(
    tmp_path: pathlib.Path, fused: bool
) -> None:
    make_checkpoint(tmp_path / "hf", "qwen2", seed=6)  # biases, reordered q/k products
    types = {"blk.1.attn_v.weight": "Q5_0"}  # a fused q/k/v of two types
    checkpoint = open_checkpoint(
        write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0", types=types)
    )
    stage = load(checkpoint, "gguf")
    # Windows run every layer in one call of meshd's C kernel where this CPU has it, else
    # op by op; both give a row the same bits alone or in a window.
    assert stage.layer_kernel == ("meshd layers" if cpu_kernels() is not None else None)
    if not fused:
        stage._kernel_layers = None
    window = logits(stage, PROMPT[:8])
    stage.open_session("s", 16)
    try:
        steps = [stage.forward("s", i, torch.tensor([t])).logits for i, t in enumerate(PROMPT[:8])]
    finally:
        stage.close_session("s")
    assert torch.equal(window, torch.cat([s for s in steps if s is not None]))


@pytest.mark.parametrize("split", [(0, 1), (1, 2), (2, 3), (0, 3)])
def test_the_planner_counts_the_bytes_each_stage_holds(
    tmp_path: pathlib.Path, split: tuple[int, int]
) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=7)
    types = {"blk.0.ffn_down.weight": "Q8_0"}  # one layer larger than the others
    checkpoint = open_checkpoint(
        write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q4_0", types=types)
    )
    assert isinstance(checkpoint, GGUFCheckpoint)
    shape = model_shape(checkpoint, torch.float32, "gguf")
    start, end = split
    stage = load(checkpoint, "gguf", start, end)
    n = checkpoint.config.num_layers
    planned = (end - start) * shape.bytes_per_layer
    planned += shape.embedding_bytes if start == 0 else 0
    planned += shape.head_bytes if end == n else 0
    planned -= shape.shared_bytes if (start, end) == (0, n) else 0
    # Never less than held (a layer counts as the file's largest), never more than one layer's
    # difference per layer.
    assert stage.weight_bytes <= planned
    assert planned - stage.weight_bytes <= (end - start) * (
        shape.bytes_per_layer - min(layer.nbytes() for layer in stage.layers)
    )


def test_two_gguf_stages_decode_the_tokens_of_one(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "qwen3", seed=8)
    checkpoint = open_checkpoint(write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0"))
    assert isinstance(checkpoint, GGUFCheckpoint)
    one = load(checkpoint, "gguf")
    first, second = load(checkpoint, "gguf", 0, 1), load(checkpoint, "gguf", 1, 0)
    assert generate([first, second], PROMPT, 12).tokens == generate([one], PROMPT, 12).tokens


def test_a_safetensors_directory_is_refused_at_gguf(tmp_path: pathlib.Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", seed=9)
    checkpoint = open_checkpoint(tmp_path / "hf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        StageModel.load(checkpoint, 0, 1, device="cpu", quantization="gguf")


def test_a_recovery_replay_in_short_windows_rebuilds_the_bits_decoding_gave(
    tmp_path: pathlib.Path,
) -> None:
    # A recovery re-prefills prompt + generated tokens on a new route: the prompt in the window
    # it first went in, the generated tokens in windows of REPLAY_WINDOW_TOKENS, which give each
    # row the bits its decode step gave it, so the next greedy token is the undisturbed one.
    checkpoint = open_checkpoint(write_gguf(builtin_model_dir(), tmp_path / "q.gguf", "Q8_0"))
    stage = load(checkpoint, "gguf")
    prompt = list(range(40, 60))
    generated = [
        int(t) for t in torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(3))
    ]
    n = len(prompt) + len(generated)

    def run(windows: list[list[int]]) -> torch.Tensor:
        stage.open_session("s", n + 1)
        try:
            out, pos = [], 0
            for window in windows:
                out.append(stage.forward("s", pos, torch.tensor(window)).logits)
                pos += len(window)
            return torch.cat([o for o in out if o is not None])
        finally:
            stage.close_session("s")

    decoded = run([prompt] + [[t] for t in generated])
    step = REPLAY_WINDOW_TOKENS
    replayed = run([prompt] + [generated[i : i + step] for i in range(0, len(generated), step)])
    assert torch.equal(replayed, decoded)
