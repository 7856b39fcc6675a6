"""numpy ports of what llama.cpp's CPU backend computes for the 32-element block formats: the
activation quantizer of ggml-cpu's x86 code (quantize_row_q8_0 / quantize_row_q8_1: d = amax /
127, q = round(x * (127 / amax)) with ties to even, Q8_1's s = fp16(d * sum(q))) and the block
dot products (an exact integer sum per block, then d_w * d_x * sum + m_w * s_x in fp32), summed
here in float64 so that the kernels' fp32 accumulation is the only difference left."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

# Block bytes of the 32-element formats and where their codes start.
_SIZES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}
_ONE = (T.Q4_1, T.Q5_1)


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 in the last axis (2 bytes) as fp32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows `x` `[t, k]` as llama.cpp's x86 quantize_row_q8_1 makes them: codes `[t, k/32, 32]`
    (int8 values), the fp16 scale d and fp16 sum s (widened, `[t, k/32]`) and d unrounded."""
    t, k = x.shape
    blocks = x.reshape(t, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint((blocks * inv[:, :, None]).astype(np.float32))  # ties to even
    s = (codes.sum(axis=2).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    return codes.astype(np.int8), d.astype(np.float16).astype(np.float32), s, d


def q8_0_bytes(x: np.ndarray) -> np.ndarray:
    """Rows `x` `[t, k]` as the Q8_0 blocks llama.cpp's x86 quantize_row_q8_0 writes, `[t, k/32,
    34]` uint8 (its scale and codes are those of quantize_q8)."""
    codes, _, _, d = quantize_q8(x)
    out = np.empty((*codes.shape[:2], 34), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16)[:, :, None].view(np.uint8)
    out[:, :, 2:] = codes.view(np.uint8)
    return out


def weight_blocks(raw: np.ndarray, qtype: T, n_out: int, k: int) -> tuple[np.ndarray, ...]:
    """Stored rows of a 32-element format: signed codes `[n, k/32, 32]` (Q4_0/Q5_0 offsets
    removed), d and m `[n, k/32]` (m = 0 for the formats without one)."""
    size = _SIZES[qtype]
    b = np.asarray(raw).reshape(n_out, k // 32, size)
    d = _half(b[:, :, 0:2])
    m = _half(b[:, :, 2:4]) if qtype in _ONE else np.zeros_like(d)
    if qtype == T.Q8_0:
        return b[:, :, 2:].copy().view(np.int8).astype(np.int32), d, m
    qs = b[:, :, size - 16 :].astype(np.int32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=2)
    if qtype in (T.Q5_0, T.Q5_1):
        start = 4 if qtype == T.Q5_1 else 2
        qh = b[:, :, start : start + 4].copy().view("<u4").astype(np.int64)
        codes |= (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
    codes -= {T.Q4_0: 8, T.Q5_0: 16}.get(qtype, 0)
    return codes, d, m


def block_product(raw: np.ndarray, qtype: T, x: np.ndarray, n_out: int) -> tuple[np.ndarray, ...]:
    """llama.cpp's `x @ W.T` for a 32-element format, each block's fp32 term as its vec_dot
    forms it, summed in float64: returns the product `[t, n]` and the sum of |terms| (fp32
    accumulation of the terms in any order stays within a small multiple of eps of it)."""
    t, k = x.shape
    codes, dw, mw = weight_blocks(raw, qtype, n_out, k)
    q, dx, sx, _ = quantize_q8(x)
    q, codes = q.astype(np.float64), codes.astype(np.float64)
    y = np.zeros((t, n_out))
    bound = np.zeros((t, n_out))
    for b in range(k // 32):
        sums = q[:, b, :] @ codes[:, b, :].T  # integers below 2^53: exact
        scale = (dx[:, b, None] * dw[None, :, b]).astype(np.float32).astype(np.float64)
        term = scale * sums
        offset = (mw[None, :, b] * sx[:, b, None]).astype(np.float32).astype(np.float64)
        y += term + offset
        bound += np.abs(term) + np.abs(offset)
    return y, bound
