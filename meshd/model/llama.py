"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in one readable file.

Shapes carry no batch dimension: one session runs one window of T positions at a time, so
activations are `[T, hidden]` and attention runs over `[heads, T, head_dim]`. Keys and values
live in an explicit positional cache owned by the caller (see `kvcache.py`): a layer writes the
window's keys at absolute positions and attends over `[span.start, span.end)` of that cache.

As in gpt-fast, q/k/v and gate/up projections are fused into one matmul each at load time; the
checkpoint keeps the usual Hugging Face names (`decoder_layer_shapes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshd.model.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled in the activation dtype (as in HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, dim: int, max_positions: int, seq_len: int) -> torch.Tensor:
    """Inverse RoPE frequencies `[dim/2]` (fp32) for `rope`, as transformers computes them.

    `seq_len` matters only for `dynamic` (NTK) scaling, which stretches the base once the
    sequence outgrows `max_positions`.
    """
    base = rope.theta
    if rope.rope_type == "dynamic" and seq_len > max_positions:
        scale = (rope.factor * seq_len / max_positions) - (rope.factor - 1)
        base = base * scale ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_context = rope.original_max_position_embeddings
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """cos/sin tables by absolute position, grown on demand, shaped `[T, 1, head_dim]`."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self._rope = config.rope
        self._dim = config.head_dim
        self._max_positions = config.max_position_embeddings
        self._device = device
        self._dtype = dtype
        self._inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, 0).to(device)
        self._cos = torch.empty(0, 1, self._dim, device=device, dtype=dtype)
        self._sin = self._cos

    def _table(self, inv_freq: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, ...]:
        positions = torch.arange(start, end, device=self._device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self._dtype), emb.sin().to(self._dtype)

    def cos_sin(self, base_pos: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions `base_pos .. base_pos+length-1`."""
        end = base_pos + length
        if self._rope.rope_type == "dynamic" and end > self._max_positions:
            # The NTK base depends on the window's end, so no table can be shared.
            inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, end)
            cos, sin = self._table(inv_freq.to(self._device), base_pos, end)
            return cos, sin
        if end > self._cos.shape[0]:
            size = max(end, 2 * self._cos.shape[0], 256)
            self._cos, self._sin = self._table(self._inv_freq, 0, size)
        return self._cos[base_pos:end], self._sin[base_pos:end]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by position (the "rotate half" convention of HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class AttnSpan:
    """Which cached positions a window attends to: keys `[start, end)`, and a mask if needed."""

    start: int
    end: int
    mask: torch.Tensor | None

    @staticmethod
    def build(base_pos: int, length: int, window: int | None, device: torch.device) -> AttnSpan:
        """Causal (optionally sliding-window) span for queries at `base_pos .. +length-1`."""
        end = base_pos + length
        start = 0 if window is None else max(0, base_pos + 1 - window)
        if length == 1:
            return AttnSpan(start, end, None)
        q_pos = torch.arange(base_pos, end, device=device)[:, None]
        k_pos = torch.arange(start, end, device=device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        return AttnSpan(start, end, allowed)


@dataclass(frozen=True)
class LayerCache:
    """One layer's slice of a session's positional cache: `[kv_heads, max_positions, head_dim]`."""

    k: torch.Tensor
    v: torch.Tensor


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE over a positional KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.num_heads
        self.n_kv = config.num_kv_heads
        self.head_dim = config.head_dim
        width = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self.wqkv = nn.Linear(config.hidden_size, width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(
            self.n_heads * self.head_dim, config.hidden_size, bias=config.o_bias
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        span: AttnSpan,
    ) -> torch.Tensor:
        length = x.shape[0]
        qkv = self.wqkv(x).view(length, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = qkv[:, : self.n_heads + self.n_kv], qkv[:, self.n_heads + self.n_kv :]
        if self.q_norm is not None and self.k_norm is not None:
            q_part, k_part = self.q_norm(qk[:, : self.n_heads]), self.k_norm(qk[:, self.n_heads :])
            qk = torch.cat((q_part, k_part), dim=1)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        base_pos = span.end - length
        cache.k[:, base_pos : span.end] = k.transpose(0, 1)
        cache.v[:, base_pos : span.end] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            cache.k[None, :, span.start : span.end],
            cache.v[None, :, span.start : span.end],
            attn_mask=span.mask,
            enable_gqa=self.n_kv != self.n_heads,
        )
        merged = out[0].transpose(0, 1).reshape(length, self.n_heads * self.head_dim)
        projected: torch.Tensor = self.o_proj(merged)
        return projected


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache,
        span: AttnSpan,
    ) -> torch.Tensor:
        h: torch.Tensor = x + self.self_attn(self.input_layernorm(x), rope, cache, span)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


def decoder_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint (HF) names and shapes of one decoder layer's weights, relative to its prefix."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "mlp.gate_proj.weight": (config.intermediate_size, h),
        "mlp.up_proj.weight": (config.intermediate_size, h),
        "mlp.down_proj.weight": (h, config.intermediate_size),
    }
    if config.qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,)}
        shapes |= {"self_attn.v_proj.bias": (kv_out,)}
    if config.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if config.mlp_bias:
        shapes |= {"mlp.gate_proj.bias": (config.intermediate_size,), "mlp.down_proj.bias": (h,)}
        shapes["mlp.up_proj.bias"] = (config.intermediate_size,)
    return shapes


def fuse_layer_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map one layer's HF-named weights to this module's (fused) parameter names."""
    fused: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        qkv = [weights.get(f"self_attn.{p}_proj.{suffix}") for p in "qkv"]
        if all(t is not None for t in qkv):
            fused[f"self_attn.wqkv.{suffix}"] = torch.cat([t for t in qkv if t is not None])
        gate_up = [weights.get(f"mlp.{p}_proj.{suffix}") for p in ("gate", "up")]
        if all(t is not None for t in gate_up):
            fused[f"mlp.w_gate_up.{suffix}"] = torch.cat([t for t in gate_up if t is not None])
    for name, tensor in weights.items():
        if not any(f"{p}_proj" in name for p in ("q", "k", "v", "gate", "up")):
            fused[name] = tensor
    return fused


def assign_parameters(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Replace every parameter of a (meta-device) module by the given tensors, exactly once each."""
    names = {name for name, _ in module.named_parameters()}
    if names != set(weights):
        missing, extra = sorted(names - set(weights)), sorted(set(weights) - names)
        raise RuntimeError(f"parameter names differ: missing {missing}, unexpected {extra}")
    module.load_state_dict(dict(weights), strict=True, assign=True)
    for param in module.parameters():
        param.requires_grad_(False)
