"""`StageModel.load(progress=...)`: byte progress over exactly the tensors a stage reads."""

from __future__ import annotations

import pytest
import torch

from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel


@pytest.mark.parametrize("layers", [(0, 2), (2, 5), (5, 6), (0, 6)])
def test_progress_counts_every_byte_the_stage_reads_once(layers: tuple[int, int]) -> None:
    checkpoint = Checkpoint.open(builtin_model_dir())
    calls: list[tuple[int, int]] = []
    stage = StageModel.load(
        checkpoint, *layers, device="cpu", progress=lambda d, t: calls.append((d, t))
    )

    read = sum(checkpoint.tensors[name].nbytes for name in checkpoint.loaded_names)
    done = [d for d, _ in calls]
    assert calls[0] == (0, read) and calls[-1] == (read, read)
    assert done == sorted(done) and len(set(done)) == len(done)  # every call moves forward
    assert {t for _, t in calls} == {read}
    assert len(calls) == len(checkpoint.loaded_names) + 1  # one call per tensor read

    # The callback changes nothing about what is loaded.
    plain = StageModel.load(Checkpoint.open(builtin_model_dir()), *layers, device="cpu")
    for a, b in zip(stage.weight_matrices(), plain.weight_matrices(), strict=True):
        assert torch.equal(a, b)
