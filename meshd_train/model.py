"""The model trained: a transformers Llama plus DeepSeek-V3-style MTP depths (`mtp.*`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from meshd_train.config import TrainConfig
from meshd_train.corpus import END, EOT


class MTPLayer(nn.Module):
    """One DeepSeek-V3 MTP depth; attribute names are the checkpoint contract (mtp.{k}.*)."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = LlamaDecoderLayer(config, layer_idx)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self, tok_embeds: torch.Tensor, h_prev: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """Return this depth's pre-norm hidden state (the next depth's h_prev)."""
        x = self.eh_proj(torch.cat([self.enorm(tok_embeds), self.hnorm(h_prev)], dim=-1))
        # attention_mask=None makes transformers' sdpa path causal over the depth's sequence.
        return self.block(x, attention_mask=None, position_embeddings=rope)


class BuiltinModel(nn.Module):
    """LlamaForCausalLM plus `mtp` draft depths sharing its embedding and lm_head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)
        depths = config.num_nextn_predict_layers
        layers = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(config, layers + k) for k in range(depths))

    def trunk(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Main model's last-layer residual output (before the final norm) and the RoPE."""
        m = self.lm.model
        h = m.embed_tokens(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        rope = m.rotary_emb(h, position_ids=pos)
        for layer in m.layers:
            h = layer(h, attention_mask=None, position_embeddings=rope)
        return h, rope

    def logits(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return self.lm.lm_head(norm(h))

    def forward(self, seq: torch.Tensor) -> list[torch.Tensor]:
        """Logits for the main head and each MTP depth over T = len(seq) - 1 - D positions.

        Main position i predicts seq[i+1]; depth k+1 at position i sees seq[i+k+1] and
        predicts seq[i+k+2].
        """
        depths = len(self.mtp)
        t = seq.shape[1] - 1 - depths
        h, rope = self.trunk(seq[:, :t])
        out = [self.logits(h, self.lm.model.norm)]
        embed = self.lm.model.embed_tokens
        for k, layer in enumerate(self.mtp):
            h = layer(embed(seq[:, k + 1 : k + 1 + t]), h, rope)
            out.append(self.logits(h, layer.norm))
        return out


def llama_config(cfg: TrainConfig, tok: Tokenizer) -> LlamaConfig:
    eot = tok.token_to_id(EOT)
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max(
            cfg.context_tokens, cfg.edit_context_tokens if cfg.edit_steps else 0
        ),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=[eot, tok.token_to_id(END)],
        pad_token_id=eot,
        num_nextn_predict_layers=cfg.mtp_depths,
        attn_implementation="sdpa",
    )


def round_to_bf16(model: nn.Module) -> None:
    """Round every weight to bf16 and back: the model as the shipped file holds it."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def load_exported(model: BuiltinModel, directory: Path) -> None:
    """Weights of an exported directory (export_state_dict's names) into `model`."""
    weights = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    main = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(main, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(
            f"{directory}: weights do not match (missing {missing}, extra {unexpected})"
        )
    model.lm.tie_weights()
    model.mtp.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("mtp.")})
