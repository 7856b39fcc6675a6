"""The stage tests' checkpoint: a 3-layer llama (a module may define its own `model_dir`)."""

from __future__ import annotations

import pathlib

import pytest

from meshd.bench.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("stage_ckpt")
    make_checkpoint(directory, "llama", seed=3, num_hidden_layers=3)
    return directory
