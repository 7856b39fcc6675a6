"""meshd's decoder against transformers on tiny random checkpoints of every supported family."""

from __future__ import annotations

import pathlib

import pytest
import torch

from meshd.bench.checkpoints import FAMILIES, make_checkpoint
from meshd.bench.single_node import generate
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel

PROMPT = [1, 17, 200, 42, 42, 9, 130, 77, 5, 250, 3, 64]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path: pathlib.Path, family: str) -> None:
    model = make_checkpoint(tmp_path, family, seed=3)
    stage = StageModel.load(Checkpoint.open(tmp_path), 0, 4, device="cpu")
    ids = torch.tensor(PROMPT * 2)  # 24 positions: beyond Mistral's window and llama3's 16
    stage.open_session("s", len(ids))
    ours = stage.forward("s", 0, ids).logits
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    assert ours is not None and ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4

    ref = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False
    )[0, len(PROMPT) :].tolist()
    assert generate([stage], PROMPT, 20).tokens == ref


def test_sharded_checkpoint_loads_like_single_file(tmp_path: pathlib.Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model = make_checkpoint(single, "qwen2", seed=5)
    make_checkpoint(sharded, "qwen2", seed=5, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    a, b = Checkpoint.open(single), Checkpoint.open(sharded)
    assert a.model_id == b.model_id

    stage = StageModel.load(b, 0, 4)
    stage.open_session("s", len(PROMPT))
    ours = stage.forward("s", 0, torch.tensor(PROMPT)).logits
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0]
    assert ours is not None and (ours - theirs).abs().max().item() <= 1e-4
    ref = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False
    )[0, len(PROMPT) :].tolist()
    assert generate([stage], PROMPT, 20).tokens == ref


def test_dynamic_rope_beyond_trained_length_matches_transformers(tmp_path: pathlib.Path) -> None:
    # One full window past max_position_embeddings: the NTK base stretches in both.
    model = make_checkpoint(
        tmp_path,
        "llama",
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        max_position_embeddings=16,
    )
    stage = StageModel.load(Checkpoint.open(tmp_path), 0, 4)
    ids = torch.tensor(PROMPT * 2)
    stage.open_session("s", len(ids))
    ours = stage.forward("s", 0, ids).logits
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    assert ours is not None and (ours - theirs).abs().max().item() <= 1e-4


def test_linear_rope_and_tied_embeddings_match_transformers(tmp_path: pathlib.Path) -> None:
    model = make_checkpoint(
        tmp_path,
        "llama",
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        tie_word_embeddings=True,
    )
    checkpoint = Checkpoint.open(tmp_path)
    assert "lm_head.weight" not in checkpoint.tensors
    stage = StageModel.load(checkpoint, 0, 4)
    stage.open_session("s", len(PROMPT))
    ours = stage.forward("s", 0, torch.tensor(PROMPT)).logits
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0]
    assert ours is not None and (ours - theirs).abs().max().item() <= 1e-4


def test_bf16_is_as_accurate_as_transformers_bf16(tmp_path: pathlib.Path) -> None:
    # bf16 rounding differs with matmul blocking, so compare both bf16 runs to the fp32 truth.
    model = make_checkpoint(tmp_path, "llama", seed=2)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        truth = model(prompt).logits[0]
        theirs = model.to(torch.bfloat16)(prompt).logits[0].float()
    stage = StageModel.load(Checkpoint.open(tmp_path), 0, 4, dtype=torch.bfloat16)
    stage.open_session("s", len(PROMPT))
    ours = stage.forward("s", 0, prompt[0]).logits
    assert ours is not None and ours.dtype == torch.float32
    our_err, their_err = (ours - truth).abs(), (theirs - truth).abs()
    assert our_err.mean() <= 1.25 * their_err.mean()
    assert our_err.max() <= 1.5 * their_err.max()
