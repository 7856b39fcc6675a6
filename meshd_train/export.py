"""The exported directory: a Hugging Face Llama (config.json, model.safetensors, tokenizer
files) plus `mtp.*` tensors and training_info.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import LlamaConfig

from meshd_train.corpus import CHAT_TEMPLATE, END, EOT, ROLE_TOKENS
from meshd_train.model import BuiltinModel


def export_state_dict(model: BuiltinModel) -> dict[str, torch.Tensor]:
    """HF names for the main model (lm_head omitted: tied) plus mtp.{k}.*, in bf16."""
    tensors = {k: v for k, v in model.lm.state_dict().items() if k != "lm_head.weight"}
    tensors |= {f"mtp.{k}": v for k, v in model.mtp.state_dict().items()}
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}


def save_directory(
    model: BuiltinModel, tok: Tokenizer, config: LlamaConfig, out: Path, info: dict[str, object]
) -> None:
    """Write the HF directory: weights, config, tokenizer, generation config, training info."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(export_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = config.to_dict()
    cfg_dict["architectures"] = ["LlamaForCausalLM"]
    cfg_dict["torch_dtype"] = "bfloat16"
    cfg_dict["dtype"] = "bfloat16"
    cfg_dict["num_nextn_predict_layers"] = len(model.mtp)
    # Readers older than transformers 5 look for rope_theta at the top level.
    cfg_dict["rope_theta"] = config.rope_parameters["rope_theta"]
    for key in ("attn_implementation", "id2label", "label2id"):
        cfg_dict.pop(key, None)
    cfg_dict.pop("_attn_implementation_autoset", None)
    write_json(out / "config.json", cfg_dict)
    tok.save(str(out / "tokenizer.json"))
    # Written by hand so that both transformers 4.x and 5.x and meshd's runtime read it.
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOT,
            "pad_token": EOT,
            "additional_special_tokens": [*ROLE_TOKENS, END],
            "model_max_length": config.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )
    eos = [tok.token_to_id(EOT), tok.token_to_id(END)]
    write_json(
        out / "generation_config.json",
        {"eos_token_id": eos, "pad_token_id": eos[0], "bos_token_id": eos[0]},
    )
    write_json(out / "training_info.json", info)


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
