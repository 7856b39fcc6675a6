"""The single-node decode loop: chunked prefill, stop ids, seeded sampling, session cleanup."""

from __future__ import annotations

import pathlib

import pytest
import torch

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.single_node import Sampler, Sampling, generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.device import device_memory_bytes, pick_device
from meshd.model.stage import StageModel

PROMPT = [1, 9, 8, 7, 100, 101, 102, 5, 5, 5, 60]


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> list[StageModel]:
    directory = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(directory, "qwen3", seed=13)
    checkpoint = Checkpoint.open(directory)
    return [StageModel.load(checkpoint, 0, 3), StageModel.load(checkpoint, 3, 4)]


def test_chunked_prefill_gives_the_same_continuation(stages: list[StageModel]) -> None:
    whole = generate(stages, PROMPT, 12)
    assert generate(stages, PROMPT, 12, prefill_chunk=3).tokens == whole.tokens
    assert whole.finish_reason == "length" and len(whole.tokens) == 12
    assert all(len(s.kv) == 0 for s in stages)  # sessions are closed afterwards


def test_stops_at_a_stop_id(stages: list[StageModel]) -> None:
    tokens = generate(stages, PROMPT, 12).tokens
    stop = tokens[4]
    first = tokens.index(stop)
    result = generate(stages, PROMPT, 12, stop_ids=[stop])
    assert result.finish_reason == "stop"
    assert result.tokens == tokens[: first + 1]  # the stop token is included, as in HF


def test_sampling_is_seeded(stages: list[StageModel]) -> None:
    hot = Sampling(temperature=1.5, seed=7)
    a = generate(stages, PROMPT, 16, sampling=hot).tokens
    assert generate(stages, PROMPT, 16, sampling=hot).tokens == a
    assert generate(stages, PROMPT, 16, sampling=Sampling(temperature=1.5, seed=8)).tokens != a
    greedy = generate(stages, PROMPT, 16).tokens
    assert a != greedy
    # Truncation to the single best token is greedy whatever the temperature.
    for narrow in (Sampling(temperature=2.0, top_k=1), Sampling(temperature=2.0, top_p=1e-6)):
        assert generate(stages, PROMPT, 16, sampling=narrow).tokens == greedy


def test_top_k_and_top_p_only_pick_allowed_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])
    top2 = Sampler(Sampling(temperature=5.0, top_k=2, seed=1), torch.device("cpu"))
    assert {int(top2(logits)) for _ in range(200)} == {1, 2}
    # Probabilities at T=1: ~[0.03, 0.36, 0.33, 0.01, 0.27]; top_p=0.6 keeps tokens 1 and 2.
    nucleus = Sampler(Sampling(temperature=1.0, top_p=0.6, seed=1), torch.device("cpu"))
    assert {int(nucleus(logits)) for _ in range(200)} == {1, 2}


def test_generate_rejects_empty_requests(stages: list[StageModel]) -> None:
    with pytest.raises(ValueError):
        generate(stages, [], 4)
    with pytest.raises(ValueError):
        generate(stages, PROMPT, 0)


def test_device_choice_and_memory() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    mps = torch.backends.mps.is_available()
    expected = "cuda" if torch.cuda.is_available() else ("mps" if mps else "cpu")
    assert pick_device().type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            pick_device("cuda:1")
    # A machine running these tests has at least 256 MiB available, and less than 64 TiB.
    assert 256 << 20 < device_memory_bytes("cpu") < 64 << 40


def test_builtin_dir_is_inside_the_package() -> None:
    path = builtin_model_dir()
    assert path.parts[-3:] == ("meshd", "model", "builtin")
    assert isinstance(path, pathlib.Path)
