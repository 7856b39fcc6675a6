"""Tiny random checkpoints written by transformers: the oracle of meshd.model's tests and the
inputs of benchmark scripts."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, overrides). Chosen so each family's peculiarity is exercised.
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3_rope": (
        transformers.LlamaConfig,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": (transformers.MistralConfig, {"sliding_window": 6}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32, "attention_bias": True}),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (biases and norm weights too) distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)


def make_checkpoint(
    directory: pathlib.Path,
    family: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Write a random `family` checkpoint to `directory`; return the transformers model."""
    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = cls(**(BASE | extra | overrides))
    auto: Any = transformers.AutoModelForCausalLM
    model: Any = auto.from_config(config, attn_implementation="sdpa")
    randomize(model, seed)
    model.eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    result: transformers.PreTrainedModel = model
    return result


def mtp_tensor_shapes(hidden: int, model: transformers.PreTrainedModel) -> dict[str, torch.Size]:
    """Names and shapes of one MTP depth, the block shaped like a main decoder layer."""
    layer = model.model.layers[0]
    shapes = {f"block.{n}": p.shape for n, p in layer.named_parameters()}
    shapes |= {"enorm.weight": torch.Size([hidden]), "hnorm.weight": torch.Size([hidden])}
    shapes |= {
        "norm.weight": torch.Size([hidden]),
        "eh_proj.weight": torch.Size([hidden, 2 * hidden]),
    }
    return shapes


def add_mtp(
    directory: pathlib.Path, model: transformers.PreTrainedModel, depth: int, seed: int = 1
) -> dict[str, torch.Tensor]:
    """Append random `mtp.{k}.*` weights to a single-file checkpoint; return them."""
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(directory / "model.safetensors")
    added: dict[str, torch.Tensor] = {}
    for k in range(depth):
        for name, shape in mtp_tensor_shapes(model.config.hidden_size, model).items():
            noise = torch.randn(shape, generator=gen)
            added[f"mtp.{k}.{name}"] = (
                1 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise
            )
    save_file(weights | added, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = depth
    (directory / "config.json").write_text(json.dumps(config))
    return added
