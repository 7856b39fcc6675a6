"""DeepSeek-V3-style multi-token-prediction (MTP) modules, inference side.

Depth k+1 (weights `mtp.{k}.*`, k = 0..D-1) at position i:

    x      = eh_proj(cat([enorm(embed(t[i+k+1])), hnorm(h_prev[i])], -1))
    h      = block(x, rope position i, causal attention over this depth's own KV cache)
    logits = lm_head(norm(h))            # predicts t[i+k+2]

`h_prev` is the main model's last-layer residual output (before the final norm) for depth 1,
and depth k's `h` for depth k+1. The embedding and `lm_head` are the main model's. The block is
one decoder layer with the main layers' weight names (`mtp.{k}.block.input_layernorm.weight`,
`mtp.{k}.block.self_attn.q_proj.weight`, ...) and always attends causally over full context.
"""

from __future__ import annotations

import torch
from torch import nn

from meshd.model.config import ModelConfig
from meshd.model.llama import AttnSpan, DecoderLayer, LayerCache, RMSNorm, decoder_layer_shapes


class MtpModule(nn.Module):
    """One MTP depth: combine a token embedding with the previous depth's hidden state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        span: AttnSpan,
    ) -> torch.Tensor:
        """This depth's hidden state `h` `[T, hidden]` (before `norm`)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden)), dim=-1))
        h: torch.Tensor = self.block(x, rope, cache, span)
        return h


def mtp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (relative to `mtp.{k}.`) and shapes of one MTP depth's weights."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "norm.weight": (h,),
    }
    shapes |= {f"block.{name}": shape for name, shape in decoder_layer_shapes(config).items()}
    return shapes
