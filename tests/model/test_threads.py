"""`configure_threads`: the cores a stage computes with, and the OpenMP wait policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from meshd.bench.decode import RANDOM_CONFIGS
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.config import ModelConfig, parse_config
from meshd.model.threads import available_cores, configure_threads, useful_threads


def _large() -> ModelConfig:
    return parse_config(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "max_position_embeddings": 4096} | RANDOM_CONFIGS["large"]
    )  # fmt: skip


def test_a_stage_uses_the_cores_it_is_given_where_they_pay() -> None:
    large = _large()
    assert useful_threads(2, large) == 2
    assert useful_threads(0, large) == available_cores()
    assert useful_threads(2, large, quantization="q4_k") == 2  # 1.6 MB per q4_k matrix
    # The built-in model's matrices (0.7 MB in fp32) are shared; at q8_0 (0.19 MB) they are
    # too small to share between cores.
    builtin = Checkpoint.open(builtin_model_dir()).config
    assert useful_threads(2, builtin) == 2
    assert useful_threads(2, builtin, quantization="q8_0") == 1
    assert useful_threads(3) == 3
    previous = torch.get_num_threads()
    try:
        assert configure_threads(1, large) == 1 and torch.get_num_threads() == 1
        assert configure_threads(2, builtin, quantization="q8_0") == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match=">= 0"):
        configure_threads(-1)


def test_openmp_workers_spin_briefly_then_sleep_unless_told_otherwise() -> None:
    # libgomp reads the policy when torch loads it: importing meshd first must set it.
    code = (
        "import os, meshd, torch; "
        "print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["PASSIVE", "300000"]
    # An environment that says either keeps its own.
    out = subprocess.run(
        [sys.executable, "-c", code], env=env | {"OMP_WAIT_POLICY": "ACTIVE"},
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.stdout.split() == ["ACTIVE", "None"]
    code = "import os, meshd, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env | {"GOMP_SPINCOUNT": "0"},
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.stdout.strip() == "None"
