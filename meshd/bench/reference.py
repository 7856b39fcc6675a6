"""The transformers model of a checkpoint directory or GGUF file (benchmarks' reference).

A directory loads with `from_pretrained`. transformers' own GGUF loader needs `accelerate`
(not a meshd dependency), so a GGUF file becomes a transformers model built from its
`ModelConfig` and filled with the tensors `GGUFCheckpoint.load` returns (dequantized, q/k in
Hugging Face order): the reference then computes with exactly the weights meshd holds.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from meshd.model.config import ModelConfig
from meshd.model.files import is_gguf, open_checkpoint


def transformers_model(path: str | os.PathLike[str], dtype: torch.dtype) -> Any:
    """A transformers causal LM of the model at `path`, in eval mode, on the CPU."""
    import transformers as module

    transformers: Any = module
    if not is_gguf(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa"
        )
        model.eval()
        return model
    checkpoint = open_checkpoint(path)
    hf_config = transformers.AutoConfig.for_model(**hf_config_dict(checkpoint.config))
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, dtype=dtype, attn_implementation="sdpa"
    )
    state = dict(checkpoint.load(sorted(checkpoint.tensors)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head has no tensor of its own; everything else must have come from the file.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if checkpoint.config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    return model


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face `config.json` mapping for `config` (the inverse of `parse_config`)."""
    rope: dict[str, Any] = {"rope_type": config.rope.rope_type, "rope_theta": config.rope.theta}
    if config.rope.rope_type != "default":
        rope["factor"] = config.rope.factor
    if config.rope.rope_type == "llama3":
        rope |= {
            "low_freq_factor": config.rope.low_freq_factor,
            "high_freq_factor": config.rope.high_freq_factor,
            "original_max_position_embeddings": config.rope.original_max_position_embeddings,
        }
    raw: dict[str, Any] = {
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) or None,
    }
    if config.family in ("llama", "mistral"):
        raw["mlp_bias"] = config.mlp_bias
    if config.family != "qwen2":
        raw["attention_bias"] = config.o_bias or config.qkv_bias
    if config.family == "mistral":
        raw["sliding_window"] = config.sliding_window
    elif config.sliding_window is not None:
        raise ValueError(f"no transformers config for a {config.family} sliding window")
    return raw
