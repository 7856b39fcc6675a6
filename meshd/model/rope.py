"""Rotary position embedding (RoPE): inverse frequencies by scaling type, the per-position
rotation tables, and rotating q/k heads in place.

The runtime rotates adjacent pairs of dims (`interleave_rope_dims` says why), so in fp32 RoPE
is one complex multiply.
"""

from __future__ import annotations

import math

import torch

from meshd.model.config import ModelConfig, RopeConfig


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


def interleave_rope_dims(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's dims (rows of `t`) from HF's halves to adjacent pairs.

    transformers rotates dim i with dim i + d/2 ("rotate half"); Meta's original Llama, and
    this runtime, rotate adjacent pairs (2i, 2i+1), which makes RoPE one complex multiply.
    Permuting the q and k projections' output rows (and their biases and q/k norms) this way
    changes no attention score: q·k sums the same products in another order, and keys live
    only in this runtime's own cache.
    """
    shape = t.shape
    return t.reshape(-1, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape)


class Rotary:
    """RoPE tables by absolute position, grown on demand (`table(base_pos, T)`).

    q/k dims are interleaved pairs (`interleave_rope_dims`). In fp32 a table is complex
    `[T, 1, head_dim/2]` holding cos + i·sin, and rotating is `view_as_complex(x) * table`.
    Otherwise (`complex_rope`) the table is real `[2, T, 1, head_dim]`, each pair's cos and
    signed sin, used as `x * cos + swap_pairs(x) * sin` (`rotate_`).
    """

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self._rope = config.rope
        self._dim = config.head_dim
        self._max_positions = config.max_position_embeddings
        self._device = device
        self._dtype = dtype
        self._inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, 0).to(device)
        self._cached = self._table(self._inv_freq, 0, 0)

    def _table(self, inv_freq: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, device=self._device).float()
        # The same fp32 angles, cos and sin as transformers computes, only arranged by pair.
        freqs = positions[:, None, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if complex_rope(self._dtype, self._device):
            return torch.complex(cos, sin)
        signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.stack((cos.repeat_interleave(2, -1), signed_sin)).to(self._dtype)

    def table(self, base_pos: int, length: int) -> torch.Tensor:
        """The rotation of positions `base_pos .. base_pos+length-1`."""
        end = base_pos + length
        if self._rope.rope_type == "dynamic" and end > self._max_positions:
            # The NTK base depends on the window's end, so no table can be shared.
            inv_freq = rope_inv_freq(self._rope, self._dim, self._max_positions, end)
            return self._table(inv_freq.to(self._device), base_pos, end)
        table = self._cached  # one read: another thread may swap in a longer table meanwhile
        if end > table.shape[-3]:
            size = max(end, 2 * table.shape[-3], 256)
            table = self._cached = self._table(self._inv_freq, 0, size)
        return table[base_pos:end] if table.is_complex() else table[:, base_pos:end]


def complex_rope(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether RoPE runs as a complex multiply: fp32 (bf16 has no complex view), not on MPS."""
    return dtype == torch.float32 and device.type != "mps"


def rotation_view(qk: torch.Tensor) -> torch.Tensor:
    """`qk` `[..., head_dim]` as `rotate_` multiplies it: a complex view in fp32, else itself."""
    if complex_rope(qk.dtype, qk.device):
        return torch.view_as_complex(qk.view(*qk.shape[:-1], -1, 2))
    return qk


def rotate_(rot: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate q/k heads in place by position: `rot` from `rotation_view`, `table` from `Rotary`."""
    if rot.is_complex():
        rot.mul_(table)
        return
    pairs = rot.view(*rot.shape[:-1], -1, 2)
    rot.copy_(rot * table[0] + pairs.flip(-1).flatten(-2) * table[1])
