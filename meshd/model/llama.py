"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in one readable file.

Shapes carry no batch dimension: one session runs one window of T positions at a time, so
activations are `[T, hidden]` and attention runs over `[heads, T, head_dim]`. A batched pass
stacks several sessions' windows as rows (`decoder_layer_batch`): the matmuls run once over all
rows, attention runs per window against that session's cache. Keys and values
live in an explicit positional cache owned by the caller (see `kvcache.py`): a layer writes the
window's keys at absolute positions and attends over `[span.start, span.end)` of that cache.

The forward pass is plain functions over frozen weight records (no nn.Module dispatch on the
per-token path). As in gpt-fast, q/k/v and gate/up projections are fused into one matmul each
at load time; the checkpoint keeps the usual Hugging Face names (`decoder_layer_shapes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshd.model.config import ModelConfig, RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm: fp32 statistics, scaled in the activation dtype (as in HF)."""
    if x.dtype == torch.float32:
        # The fused kernel gives the same fp32 result in one op instead of six.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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
    """cos and signed-sin tables by absolute position, grown on demand, shaped `[T, head_dim]`.

    The sin table has its first half negated, so that `x * cos + roll(x, half) * sin` equals
    transformers' `x * cos + rotate_half(x) * sin` exactly, in fewer ops.
    """

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self._rope = config.rope
        self._dim = config.head_dim
        self._max_positions = config.max_position_embeddings
        self._device = device
        self._dtype = dtype
        self._inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, 0).to(device)
        empty = torch.empty(0, self._dim, device=device, dtype=dtype)
        # One tuple, swapped whole, so a reader on another thread never pairs mismatched tables.
        self._tables: tuple[torch.Tensor, torch.Tensor] = (empty, empty)

    def _table(
        self, inv_freq: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end, device=self._device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : self._dim // 2].neg_()
        return emb.cos().to(self._dtype), sin.to(self._dtype)

    def cos_sin(self, base_pos: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions `base_pos .. base_pos+length-1`."""
        end = base_pos + length
        if self._rope.rope_type == "dynamic" and end > self._max_positions:
            # The NTK base depends on the window's end, so no table can be shared.
            inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, end)
            cos, sin = self._table(inv_freq.to(self._device), base_pos, end)
            return cos, sin
        cos, sin = self._tables
        if end > cos.shape[0]:
            size = max(end, 2 * cos.shape[0], 256)
            cos, sin = self._tables = self._table(self._inv_freq, 0, size)
        return cos[base_pos:end], sin[base_pos:end]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., T, head_dim]` by position (HF's "rotate half" pairing of dims)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


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
    """One layer's view of a session's cache: `[1, kv_heads, max_positions, head_dim]` each."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights, q/k/v and gate/up fused; biases and q/k norms optional."""

    input_norm: torch.Tensor
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None

    @classmethod
    def from_checkpoint(cls, w: Mapping[str, torch.Tensor]) -> LayerWeights:
        """Build from one layer's HF-named tensors (names relative to the layer prefix)."""

        def fused(names: list[str]) -> torch.Tensor | None:
            parts = [w.get(n) for n in names]
            present = [t for t in parts if t is not None]
            return torch.cat(present) if len(present) == len(parts) else None

        qkv = [f"self_attn.{p}_proj" for p in "qkv"]
        gate_up = ["mlp.gate_proj", "mlp.up_proj"]
        wqkv, w_gate_up = (
            fused([f"{n}.weight" for n in qkv]),
            fused([f"{n}.weight" for n in gate_up]),
        )
        assert wqkv is not None and w_gate_up is not None
        return cls(
            input_norm=w["input_layernorm.weight"],
            wqkv=wqkv,
            bqkv=fused([f"{n}.bias" for n in qkv]),
            wo=w["self_attn.o_proj.weight"],
            bo=w.get("self_attn.o_proj.bias"),
            q_norm=w.get("self_attn.q_norm.weight"),
            k_norm=w.get("self_attn.k_norm.weight"),
            post_norm=w["post_attention_layernorm.weight"],
            w_gate_up=w_gate_up,
            b_gate_up=fused([f"{n}.bias" for n in gate_up]),
            w_down=w["mlp.down_proj.weight"],
            b_down=w.get("mlp.down_proj.bias"),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for size accounting)."""
        values = (getattr(self, f) for f in self.__slots__)
        return [t for t in values if isinstance(t, torch.Tensor)]


@dataclass(frozen=True, slots=True)
class Dims:
    """The few numbers the forward pass needs, hoisted out of the config."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, config: ModelConfig) -> Dims:
        """Dims of `config`."""
        return cls(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps)


def attention(
    x: torch.Tensor,
    w: LayerWeights,
    d: Dims,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LayerCache,
    span: AttnSpan,
) -> torch.Tensor:
    """Grouped-query self-attention with RoPE over the positional cache; `[T, hidden]`."""
    qkv = F.linear(x, w.wqkv, w.bqkv)
    return F.linear(_attend(qkv, w, d, rope, cache, span), w.wo, w.bo)


def _attend(
    qkv: torch.Tensor,
    w: LayerWeights,
    d: Dims,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LayerCache,
    span: AttnSpan,
) -> torch.Tensor:
    """One window's attention from its fused q/k/v rows `[T, ...]`; `[T, heads * head_dim]`."""
    length, n_qk = qkv.shape[0], d.n_heads + d.n_kv
    # [1, q heads + k heads + v heads, T, head_dim], the layout attention wants.
    qkv = qkv.view(1, length, -1, d.head_dim).transpose(1, 2)
    qk = qkv[:, :n_qk]
    if w.q_norm is not None and w.k_norm is not None:
        q_part = rms_norm(qk[:, : d.n_heads], w.q_norm, d.eps)
        qk = torch.cat((q_part, rms_norm(qk[:, d.n_heads :], w.k_norm, d.eps)), dim=1)
    qk = apply_rope(qk, *rope)
    base_pos = span.end - length
    cache.k[:, :, base_pos : span.end] = qk[:, d.n_heads :]
    cache.v[:, :, base_pos : span.end] = qkv[:, n_qk:]
    out = F.scaled_dot_product_attention(
        qk[:, : d.n_heads],
        cache.k[:, :, span.start : span.end],
        cache.v[:, :, span.start : span.end],
        attn_mask=span.mask,
        enable_gqa=d.n_kv != d.n_heads,
    )
    return out[0].transpose(0, 1).reshape(length, -1)


@dataclass(frozen=True, slots=True)
class BatchPart:
    """One session's window inside a batched pass: its rows, positions and cache for a layer."""

    length: int
    rope: tuple[torch.Tensor, torch.Tensor]
    cache: LayerCache
    span: AttnSpan


def attention_batch(
    x: torch.Tensor, w: LayerWeights, d: Dims, parts: Sequence[BatchPart]
) -> torch.Tensor:
    """Attention for several sessions' windows stacked as rows of `x` (in `parts` order).

    The projections run once over all rows, so each weight matrix streams from memory once per
    pass; attention itself runs per window, against that session's own cache.
    """
    qkv = F.linear(x, w.wqkv, w.bqkv)
    rows = torch.split(qkv, [p.length for p in parts])
    outs = [_attend(r, w, d, p.rope, p.cache, p.span) for r, p in zip(rows, parts, strict=True)]
    return F.linear(torch.cat(outs) if len(outs) > 1 else outs[0], w.wo, w.bo)


def mlp(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
    gate, up = F.linear(x, w.w_gate_up, w.b_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.w_down, w.b_down)


def decoder_layer(
    x: torch.Tensor,
    w: LayerWeights,
    d: Dims,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: LayerCache,
    span: AttnSpan,
) -> torch.Tensor:
    """Pre-norm residual block: attention then MLP, `[T, hidden]` in and out."""
    h = x + attention(rms_norm(x, w.input_norm, d.eps), w, d, rope, cache, span)
    return h + mlp(rms_norm(h, w.post_norm, d.eps), w)


def decoder_layer_batch(
    x: torch.Tensor, w: LayerWeights, d: Dims, parts: Sequence[BatchPart]
) -> torch.Tensor:
    """`decoder_layer` over several sessions' windows stacked as rows of `x`."""
    h = x + attention_batch(rms_norm(x, w.input_norm, d.eps), w, d, parts)
    return h + mlp(rms_norm(h, w.post_norm, d.eps), w)


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
