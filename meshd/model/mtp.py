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

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from meshd.model.config import ModelConfig
from meshd.model.gguf_matrix import Matrix
from meshd.model.llama import (
    AttnSpan,
    Dims,
    LayerCache,
    LayerWeights,
    MatrixPrep,
    StepScratch,
    decoder_layer,
    decoder_layer_shapes,
    linear_weight,
    rms_norm,
)
from meshd.model.quant import matmul


@dataclass(frozen=True, slots=True)
class MtpWeights:
    """One MTP depth: its norms, the embedding/hidden projection and its decoder block."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Matrix  # [2 * hidden, hidden] (`linear_weight`)
    block: LayerWeights
    norm: torch.Tensor

    @classmethod
    def from_checkpoint(
        cls, w: Mapping[str, torch.Tensor], d: Dims, matrix: MatrixPrep = linear_weight
    ) -> MtpWeights:
        """Build from one depth's tensors, names relative to `mtp.{k}.`."""
        block = {n.removeprefix("block."): t for n, t in w.items() if n.startswith("block.")}
        return cls(
            enorm=w["enorm.weight"],
            hnorm=w["hnorm.weight"],
            eh_proj=matrix(w["eh_proj.weight"]),
            block=LayerWeights.from_checkpoint(block, d, matrix),
            norm=w["norm.weight"],
        )

    def nbytes(self) -> int:
        """Bytes held by this depth's weights."""
        own = self.enorm.nbytes + self.hnorm.nbytes + self.norm.nbytes
        return own + self.eh_proj.nbytes + self.block.nbytes()


def mtp_hidden(
    embeds: torch.Tensor,
    prev_hidden: torch.Tensor,
    w: MtpWeights,
    d: Dims,
    rope: torch.Tensor,
    cache: LayerCache,
    span: AttnSpan,
    scratch: StepScratch | None = None,
) -> torch.Tensor:
    """This depth's hidden state `h` `[T, hidden]` (before `norm`; the next depth's h_prev)."""
    joined = torch.cat((rms_norm(embeds, w.enorm, d), rms_norm(prev_hidden, w.hnorm, d)), -1)
    return decoder_layer(matmul(joined, w.eh_proj), w.block, d, rope, cache, span, scratch)


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
