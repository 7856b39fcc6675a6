"""numpy ports of what llama.cpp's CPU backend computes for the 32-element block formats: the
activation quantizer of ggml-cpu's x86 code (quantize_row_q8_0 / quantize_row_q8_1: d = amax /
127, q = round(x * (127 / amax)) with ties to even, Q8_1's s = fp16(d * sum(q))) and the block
dot products (an exact integer sum per block, then d_w * d_x * sum + m_w * s_x in fp32), summed
here in float64 so that the kernels' fp32 accumulation is the only difference left; and the
layouts llama.cpp repacks Q4_K and Q4_0 rows into, to call its own kernels on real weights."""

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


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 `a * b + c` rounded once (VFMADD*PS), from float64: the product of two fp32 values
    is exact there, the sum and its rounding error exact by TwoSum, and the rounding to fp32 is
    off only where the float64 sum is a tie between two fp32 values, which the error's sign
    breaks."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    back = s - p
    err = (p - (s - back)) + (c64 - back)
    r = s.astype(np.float32)
    toward = np.nextafter(r, np.where(s > r, np.float32(np.inf), np.float32(-np.inf)))
    tie = (err != 0) & (r.astype(np.float64) != s)
    tie &= s == (r.astype(np.float64) + toward.astype(np.float64)) / 2
    # At a tie the exact sum lies past the midpoint on err's side.
    past = np.sign(err) == np.sign(toward.astype(np.float64) - r.astype(np.float64))
    return np.where(tie & past, toward, r)


def avx2_product(raw: np.ndarray, qtype: T, x: np.ndarray, n_out: int) -> np.ndarray:
    """`x @ W.T` in fp32 as ggml-cpu's AVX2 vec_dot kernels compute it for a 32-element format
    (ggml/src/ggml-cpu/arch/x86/quants.c, ggml_vec_dot_q4_0_q8_0 and its siblings, which AVX-512
    builds run too): per block, eight int32 lanes (lane L: the signed products of elements
    4L..4L+3), converted, `acc = fma(d_w * d_x, lanes, acc)`; at the end hsum_float_8(acc)
    (`(l_j + l_j+4)`, then `(r0 + r2) + (r1 + r3)`), plus the _1 formats' `m_w * s_x` summed
    in block order. Returns `[t, n]` float32."""
    t, k = x.shape
    nb = k // 32
    codes, dw, mw = weight_blocks(raw, qtype, n_out, k)
    q, dx, sx, _ = quantize_q8(x)
    acc = np.zeros((t, n_out, 8), np.float32)
    summs = np.zeros((t, n_out), np.float32)
    wl = codes.reshape(n_out, nb, 8, 4).astype(np.int64)
    xl = q.reshape(t, nb, 8, 4).astype(np.int64)
    for b in range(nb):
        lanes = np.einsum("nlj,tlj->tnl", wl[:, b], xl[:, b]).astype(np.float32)  # exact
        d = (dw[None, :, b] * dx[:, b, None]).astype(np.float32)
        acc = _fma32(np.broadcast_to(d[:, :, None], acc.shape), lanes, acc)
        if qtype in _ONE:
            summs = summs + (mw[None, :, b] * sx[:, b, None]).astype(np.float32)
    r = acc[:, :, 4:] + acc[:, :, :4]
    return ((r[:, :, 0] + r[:, :, 2]) + (r[:, :, 1] + r[:, :, 3])) + summs


def q4_K_x8(raw: np.ndarray, n_out: int, k: int) -> np.ndarray:
    """`raw` Q4_K rows in llama.cpp's repacked layout (repack.cpp's make_block_q4_Kx8 with
    8-byte interleave): per group of 8 rows and super-block, d[8], dmin[8], the 6-bit scales
    and mins regrouped by sub-block (96 bytes), and the codes 8 bytes per row in turn."""
    nb = k // 256
    blocks = raw.reshape(n_out // 8, 8, nb, 144).transpose(0, 2, 1, 3)  # group, block, row
    out = np.zeros((n_out // 8, nb, 1152), np.uint8)
    out[..., 0:16] = blocks[..., 0:2].reshape(n_out // 8, nb, 16)
    out[..., 16:32] = blocks[..., 2:4].reshape(n_out // 8, nb, 16)
    sc = blocks[..., 4:16].astype(np.int32)  # [group, block, row, 12]
    for i in range(4):
        for half, (s, m) in enumerate(
            [
                (sc[..., i] & 63, sc[..., i + 4] & 63),
                (
                    ((sc[..., i] & 192) >> 2) | (sc[..., i + 8] & 15),
                    ((sc[..., i + 4] & 192) >> 2) | ((sc[..., i + 8] & 240) >> 4),
                ),
            ]
        ):
            at = 32 + 48 * half + 12 * i
            out[..., at : at + 4] = (s[..., 0:4] & 63) + ((s[..., 4:8] & 48) << 2)
            out[..., at + 4 : at + 8] = (m[..., 0:4] & 63) + ((m[..., 4:8] & 48) << 2)
            out[..., at + 8 : at + 12] = (s[..., 4:8] & 15) + ((m[..., 4:8] & 15) << 4)
    qs = blocks[..., 16:144].reshape(n_out // 8, nb, 8, 16, 8).transpose(0, 1, 3, 2, 4)
    out[..., 128:] = qs.reshape(n_out // 8, nb, 1024)
    return out.reshape(-1)


def q4_0_x8(raw: np.ndarray, n_out: int, k: int) -> np.ndarray:
    """`raw` Q4_0 rows in llama.cpp's repacked layout (repack.cpp's make_block_q4_0x8 with
    8-byte interleave): per group of 8 rows and block, d[8], then the codes 8 bytes per row in
    turn, each byte xor 0x88 (the codes made signed nibbles)."""
    nb = k // 32
    blocks = raw.reshape(n_out // 8, 8, nb, 18).transpose(0, 2, 1, 3)  # group, block, row
    out = np.zeros((n_out // 8, nb, 144), np.uint8)
    out[..., :16] = blocks[..., 0:2].reshape(n_out // 8, nb, 16)
    qs = blocks[..., 2:18].reshape(n_out // 8, nb, 8, 2, 8).transpose(0, 1, 3, 2, 4)
    out[..., 16:] = qs.reshape(n_out // 8, nb, 128) ^ 0x88
    return out.reshape(-1)
