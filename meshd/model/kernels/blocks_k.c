/* meshd's kernels for ggml's K-quant block formats (Q4_K, Q5_K, Q6_K against Q8_K activations).
 *
 * Ported from ggml (https://github.com/ggml-org/ggml, as vendored by llama.cpp):
 * src/ggml-quants.c (quantize_row_q8_K_ref, dequantize_row_q4_K/q5_K/q6_K),
 * src/ggml-cpu/quants.c (the generic dot products) and src/ggml-cpu/arch/x86/quants.c (the AVX2
 * ggml_vec_dot_q4_K_q8_K, ..._q5_K_..., ..._q6_K_...). That code is under this licence:
 *
 *   MIT License
 *
 *   Copyright (c) 2023-2026 The ggml authors
 *
 *   Permission is hereby granted, free of charge, to any person obtaining a copy
 *   of this software and associated documentation files (the "Software"), to deal
 *   in the Software without restriction, including without limitation the rights
 *   to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
 *   copies of the Software, and to permit persons to whom the Software is
 *   furnished to do so, subject to the following conditions:
 *
 *   The above copyright notice and this permission notice shall be included in all
 *   copies or substantial portions of the Software.
 *
 *   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
 *   IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
 *   FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
 *   AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
 *   LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
 *   OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
 *   SOFTWARE.
 *
 * One file, compiled three ways (always with -ffp-contract=off): AVX-512 (F, BW, VL, VNNI),
 * AVX2 + FMA + F16C, and portable C for any little-endian CPU (GGUF blocks are little-endian).
 *
 * Rules the callers rely on:
 * - Every path gives the SAME BITS for the same inputs. A dot product's integer part is exact,
 *   so only its float steps can differ, and all three paths run the same ones: those of the
 *   kernel llama.cpp runs on x86 by default for the format, so the result is llama.cpp's on
 *   every CPU (also on AVX-512 machines: ggml has no wider K-quant kernel).
 *   - Q5_K, Q6_K: ggml's AVX2 vec_dot. Per super-block, eight int32 lanes (lane L holds the
 *     products of positions 4L..4L+3 of every 32-value chunk, each chunk times its sub-block
 *     scale), converted to float and accumulated with one FMA per lane, then ggml's
 *     horizontal sum.
 *   - Q4_K: ggml's repacked gemv (ggml_gemv_q4_K_8x8_q8_K; llama.cpp repacks Q4_K weights into
 *     8 interleaved rows at load). Per super-block, the exact sums of scales x codes and of
 *     mins x block sums, each converted to float and added with one FMA, the mins' total
 *     subtracted at the end. One float per row and super-block (not eight lanes) is what lets
 *     the decode kernel run eight stored rows' float steps in one vector.
 * - Q8_K activations are ggml's quantize_row_q8_K_ref byte for byte on every path.
 * - The result depends only on the inputs: no alignment-dependent peeling, no thread-dependent
 *   split, so a verify window of t tokens gives what t single-token steps give.
 * - Explicit FMAs are written as fmaf / _mm256_fmadd_ps because the file is built with
 *   -ffp-contract=off; every other float expression is evaluated as written. Link with -lm
 *   (the portable build calls fmaf).
 * - Block pointers need no alignment (mapped GGUF rows of Q6_K start at 2-byte offsets).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK_K 256

/* Byte sizes and field offsets of ggml's blocks (ggml-common.h, QK_K = 256). */
#define Q4_K_BYTES 144 /* d, dmin (fp16), scales[12], qs[128] */
#define Q5_K_BYTES 176 /* d, dmin (fp16), scales[12], qh[32], qs[128] */
#define Q6_K_BYTES 210 /* ql[128], qh[64], scales[16] (int8), d (fp16) */
#define Q8_K_BYTES 292 /* d (fp32), qs[256] (int8), bsums[16] (int16) */
#define Q8_K_QS 4
#define Q8_K_BSUMS 260
#define KQ_NT 4 /* most tokens sharing one pass over a weight row (blocks.c's NT) */
_Static_assert(KQ_NT == 4, "rows_q4_K sums four tokens' lanes in one vector");

/* The AVX-512 code also needs BW (byte and word ops) and VNNI (VPDPWSSD); without them the AVX2
 * code runs. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                    \
    defined(__AVX512VNNI__) && defined(__FMA__)
#define KQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KQ_AVX2 1
#else
#define KQ_SCALAR 1
#endif

/* ---- shared helpers ----------------------------------------------------------------------- */

/* fp16 -> fp32 is exact, so F16C and the integer route give the same value. */
static inline float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 is exact in fp32 */
        const float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

static inline float f32_at(const uint8_t *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* ---- Q8_K: activations --------------------------------------------------------------------- */

/* x [k] -> k/256 block_q8_K. Per super-block: d = max / -127 where max is the value of largest
 * magnitude (the first one on a tie), qs = round(x * -127 / max), bsums = sums of 16 qs.
 *
 * Rounding: ties to even. That is what every Q8_K quantizer of llama.cpp's x86 CPU backend runs:
 * quantize_row_q8_K is quantize_row_q8_K_ref there (nearest_int below), and the repacked
 * Q4_K path's ggml_quantize_mat_q8_K_4x8 rounds with _mm256_round_ps(_MM_ROUND_NEAREST). Neither
 * uses roundf (ties away from zero), which ggml's Q8_0/Q8_1 reference quantizers do.
 *
 * One departure: an all-zero super-block gets bsums = 0 (ggml leaves them unwritten; its dot
 * products multiply them by d = 0), so the output bytes depend only on the input. */
#if defined(__AVX2__)

/* The value of largest magnitude in x[0..255], the first on a tie (0 when all are 0): the
 * largest |x| by VMAXPS (NaN lanes lose: VMAXPS returns its second operand when either is NaN,
 * as `ax > amax` is false for NaN), then the first position holding it. */
static inline float q8_K_peak(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QK_K; j += 8) {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    if (amax == 0.f) return 0.f;
    const __m256 target = _mm256_set1_ps(amax);
    for (int j = 0; j < QK_K; j += 8) {
        const __m256 ax = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(ax, target, _CMP_EQ_OQ));
        for (int l = 0; l < 8; ++l) {
            if (hit & (1 << l)) return x[j + l];
        }
    }
    return 0.f; /* not reached: amax is one of the |x| */
}

/* qs = round(iscale * x) (ties to even: VCVTPS2DQ in the default rounding mode, as nearest_int),
 * at most 127, and the sums of 16. A NaN product gives 0, as nearest_int gives for the default
 * NaN. */
static inline void q8_K_scale(const float *x, float iscale, int8_t *qs, int16_t *bsums) {
    const __m256 mul = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int g = 0; g < QK_K / 16; ++g) {
        __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(x + 16 * g), mul);
        __m256 v1 = _mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8), mul);
        v0 = _mm256_andnot_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), v0);
        v1 = _mm256_andnot_ps(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q), v1);
        const __m256i i0 = _mm256_min_epi32(_mm256_cvtps_epi32(v0), top);
        const __m256i i1 = _mm256_min_epi32(_mm256_cvtps_epi32(v1), top);
        /* the 16 values in order as int16, then as int8 */
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
        const __m128i b =
            _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128((__m128i *)(qs + 16 * g), b);
        const __m256i s = _mm256_add_epi32(i0, i1);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        bsums[g] = (int16_t)_mm_cvtsi128_si32(t);
    }
}

#else

/* ggml's nearest_int: adding 1.5 * 2^23 leaves the integer in the low mantissa bits, rounded
 * by the FPU's mode, i.e. to nearest with ties to even (|fval| <= 2^22). */
static inline int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int32_t i;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007FFFFF) - 0x00400000;
}

static inline float q8_K_peak(const float *x) {
    float max = 0.f, amax = 0.f;
    for (int j = 0; j < QK_K; ++j) {
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    return max;
}

static inline void q8_K_scale(const float *x, float iscale, int8_t *qs, int16_t *bsums) {
    for (int j = 0; j < QK_K; ++j) {
        const int v = nearest_int(iscale * x[j]);
        qs[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < QK_K / 16; ++j) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += qs[j * 16 + l];
        bsums[j] = (int16_t)sum;
    }
}

#endif

void meshd_quantize_row_q8_K(const float *x, void *vy, int64_t k) {
    uint8_t *y = (uint8_t *)vy;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q8_K_BYTES) {
        const float max = q8_K_peak(x);
        int8_t qs[QK_K];
        int16_t bsums[QK_K / 16];
        float d = 0.f;
        if (max == 0.f) {
            memset(qs, 0, sizeof qs);
            memset(bsums, 0, sizeof bsums);
        } else {
            const float iscale = -127.f / max;
            q8_K_scale(x, iscale, qs, bsums);
            d = 1 / iscale;
        }
        memcpy(y, &d, sizeof d);
        memcpy(y + Q8_K_QS, qs, sizeof qs);
        memcpy(y + Q8_K_BSUMS, bsums, sizeof bsums);
    }
}

/* ---- dequantization (ggml's dequantize_row_q*_K; fp32 multiply then subtract, as gguf-py) -- */

void meshd_dequantize_row_q4_K(const void *vw, float *y, int64_t k) {
    const uint8_t *w = (const uint8_t *)vw;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; i++, w += Q4_K_BYTES) {
        const float d = fp16_at(w), min = fp16_at(w + 2);
        const uint8_t *scales = w + 4, *q = w + 16;
        for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
            uint8_t sc, m;
            scale_min_k4(is + 0, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

void meshd_dequantize_row_q5_K(const void *vw, float *y, int64_t k) {
    const uint8_t *w = (const uint8_t *)vw;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; i++, w += Q5_K_BYTES) {
        const float d = fp16_at(w), min = fp16_at(w + 2);
        const uint8_t *scales = w + 4, *qh = w + 16, *ql = w + 48;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32) {
            uint8_t sc, m;
            scale_min_k4(is + 0, scales, &sc, &m);
            const float d1 = d * sc, m1 = min * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = min * m;
            for (int l = 0; l < 32; ++l) {
                *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            }
            for (int l = 0; l < 32; ++l) {
                *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            }
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
    }
}

void meshd_dequantize_row_q6_K(const void *vw, float *y, int64_t k) {
    const uint8_t *w = (const uint8_t *)vw;
    const int64_t nb = k / QK_K;
    for (int64_t i = 0; i < nb; i++, w += Q6_K_BYTES) {
        const float d = fp16_at(w + 208);
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l + 0] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

/* ---- dot products: portable C ------------------------------------------------------------- */

#if defined(KQ_SCALAR)

/* ggml's hsum_float_8: (a0+a4 + a2+a6) + (a1+a5 + a3+a7), in that association. */
static inline float hsum8(const float a[8]) {
    const float r0 = a[0] + a[4], r1 = a[1] + a[5], r2 = a[2] + a[6], r3 = a[3] + a[7];
    return (r0 + r2) + (r1 + r3);
}

/* Sub-block sums of the mins, as the AVX2 kernels pair them: lane p = mins 2p and 2p+1 times
 * the Q8_K sums of their 32 values. */
static inline void mins_by_bsums(const uint8_t mins[8], const int16_t bsums[16], int32_t prod[4]) {
    for (int p = 0; p < 4; ++p) {
        prod[p] = mins[2 * p] * (bsums[4 * p] + bsums[4 * p + 1]) +
                  mins[2 * p + 1] * (bsums[4 * p + 2] + bsums[4 * p + 3]);
    }
}

/* lanes[L] += scale * sum_{t<4} q[4L+t] * q8[4L+t] over one 32-value chunk, where the scale is
 * s_lo for lanes 0-3 (values 0-15) and s_hi for lanes 4-7 (values 16-31). */
static inline void chunk_into_lanes(const uint8_t q[32], const int8_t *q8, int32_t s_lo,
                                    int32_t s_hi, int32_t lanes[8]) {
    for (int L = 0; L < 8; ++L) {
        int32_t s = 0;
        for (int t = 0; t < 4; ++t) s += q[4 * L + t] * q8[4 * L + t];
        lanes[L] += (L < 4 ? s_lo : s_hi) * s;
    }
}

/* Q4_K in the order of ggml's repacked gemv (ggml_gemv_q4_K_8x8_q8_K, what llama.cpp runs for
 * Q4_K by default on x86): per super-block, the exact integer sums of scales x codes and of
 * mins x block sums, each converted to float and added with one FMA at d x yd (dmin x yd), and
 * the mins' total subtracted at the end. */
static float dot_q4_K(int64_t nb, const uint8_t *w, const uint8_t *y) {
    float acc = 0.f, acc_m = 0.f;
    for (int64_t i = 0; i < nb; i++, w += Q4_K_BYTES, y += Q8_K_BYTES) {
        const float yd = f32_at(y);
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; ++j) scale_min_k4(j, w + 4, &sc[j], &mn[j]);
        int16_t bsums[16];
        memcpy(bsums, y + Q8_K_BSUMS, sizeof bsums);
        const uint8_t *qs = w + 16;
        const int8_t *q8 = (const int8_t *)(y + Q8_K_QS);
        int32_t isum = 0, imin = 0;
        for (int j = 0; j < 4; ++j, qs += 32, q8 += 64) {
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 32; ++l) {
                lo += (qs[l] & 0xF) * q8[l];
                hi += (qs[l] >> 4) * q8[l + 32];
            }
            isum += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        for (int j = 0; j < 8; ++j) imin += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
        acc = fmaf((float)isum, yd * fp16_at(w), acc);
        acc_m = fmaf((float)imin, yd * fp16_at(w + 2), acc_m);
    }
    return acc - acc_m;
}

static float dot_q5_K(int64_t nb, const uint8_t *w, const uint8_t *y) {
    float acc[8] = {0}, summs = 0.f;
    for (int64_t i = 0; i < nb; i++, w += Q5_K_BYTES, y += Q8_K_BYTES) {
        const float yd = f32_at(y);
        const float d = yd * fp16_at(w);
        const float dmin = -yd * fp16_at(w + 2);
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; ++j) scale_min_k4(j, w + 4, &sc[j], &mn[j]);
        int16_t bsums[16];
        memcpy(bsums, y + Q8_K_BSUMS, sizeof bsums);
        int32_t prod[4];
        mins_by_bsums(mn, bsums, prod);
        /* ggml writes `summs += dmin * hsum`; llama.cpp is built as gnu11 with FMA enabled, where
         * GCC (and clang) contract that into one FMA, so it is one here. */
        summs = fmaf(dmin, (float)((prod[0] + prod[1]) + (prod[2] + prod[3])), summs);

        const uint8_t *qh = w + 16, *qs = w + 48;
        const int8_t *q8 = (const int8_t *)(y + Q8_K_QS);
        int32_t lanes[8] = {0};
        for (int j = 0; j < 4; ++j, qs += 32, q8 += 64) {
            uint8_t lo[32], hi[32];
            for (int l = 0; l < 32; ++l) {
                lo[l] = (uint8_t)((qs[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4));
                hi[l] = (uint8_t)((qs[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
            }
            chunk_into_lanes(lo, q8, sc[2 * j], sc[2 * j], lanes);
            chunk_into_lanes(hi, q8 + 32, sc[2 * j + 1], sc[2 * j + 1], lanes);
        }
        for (int L = 0; L < 8; ++L) acc[L] = fmaf(d, (float)lanes[L], acc[L]);
    }
    return hsum8(acc) + summs;
}

/* Q6_K values are taken unsigned (0..63) and 32 * sum(scale * bsum) is subtracted after, as
 * ggml's AVX2 kernel does; the 16-value sub-blocks give lanes 0-3 and 4-7 of a chunk their own
 * scales. */
static float dot_q6_K(int64_t nb, const uint8_t *w, const uint8_t *y) {
    float acc[8] = {0};
    for (int64_t i = 0; i < nb; i++, w += Q6_K_BYTES, y += Q8_K_BYTES) {
        const float d = f32_at(y) * fp16_at(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        int16_t bsums[16];
        memcpy(bsums, y + Q8_K_BSUMS, sizeof bsums);
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *q8 = (const int8_t *)(y + Q8_K_QS);
        int32_t lanes[8] = {0};
        for (int j = 0; j < 2; ++j, ql += 64, qh += 32) {
            /* chunks 0-3: low nibbles of ql[0..31], ql[32..63], then high nibbles, each with
             * the next two bits of qh as bits 4-5 */
            uint8_t q[4][32];
            for (int l = 0; l < 32; ++l) {
                q[0][l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                q[1][l] = (uint8_t)((ql[32 + l] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                q[2][l] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[3][l] = (uint8_t)((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
            for (int c = 0; c < 4; ++c, q8 += 32) {
                chunk_into_lanes(q[c], q8, sc[8 * j + 2 * c], sc[8 * j + 2 * c + 1], lanes);
            }
        }
        for (int L = 0; L < 8; ++L) {
            lanes[L] -= 32 * (bsums[2 * L] * sc[2 * L] + bsums[2 * L + 1] * sc[2 * L + 1]);
            acc[L] = fmaf(d, (float)lanes[L], acc[L]);
        }
    }
    return hsum8(acc);
}

#endif /* KQ_SCALAR */

/* ---- dot products: AVX2 and AVX-512 ------------------------------------------------------- */

#if defined(KQ_AVX2) || defined(KQ_AVX512)

static inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

/* The 12 scale bytes of a Q4_K/Q5_K block as 16 bytes: 8 scales, then 8 mins (ggml's
 * get_scale_min_k4 for all eight sub-blocks at once, by byte shuffles). It loads 16 bytes: the
 * 4 after the 12 are the block's first codes, read and unused. */
static inline __m128i scales_mins_k4(const uint8_t *scales) {
    const __m128i s = _mm_loadu_si128((const __m128i *)scales);
    /* low bits: scales 0-3 = s0-3 & 63, scales 4-7 = s8-11 & 15, mins 0-3 = s4-7 & 63,
     * mins 4-7 = s8-11 >> 4 */
    const __m128i a =
        _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i lo = _mm_or_si128(
        _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(a, 4),
                      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    /* bits 4-5 of scales 4-7: s0-3 >> 6; of mins 4-7: s4-7 >> 6 */
    const __m128i h =
        _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
}

/* Four lanes of mins * bsums (see mins_by_bsums) from the 16 widened scales+mins. */
static inline __m128i mins_by_bsums_v(__m256i mins_and_scales, const uint8_t *y) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(y + Q8_K_BSUMS));
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                       _mm256_extracti128_si256(q8sums, 1));
    return _mm_madd_epi16(_mm256_extracti128_si256(mins_and_scales, 1), q8s);
}

/* VPDPWSSD where the CPU has it (AVX-512 VNNI, AVX-VNNI): the same exact int32 sums as
 * VPMADDWD + VPADDD. */
#if defined(KQ_AVX512)
#define KQ_MADD_ADD(acc, p16, sc) _mm256_dpwssd_epi32((acc), (p16), (sc))
#elif defined(__AVXVNNI__)
#define KQ_MADD_ADD(acc, p16, sc) _mm256_dpwssd_avx_epi32((acc), (p16), (sc))
#else
#define KQ_MADD_ADD(acc, p16, sc) _mm256_add_epi32((acc), _mm256_madd_epi16((p16), (sc)))
#endif

/* The 4 bytes at p as one int32 (any alignment). */
static inline int32_t i32_at(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A VPSHUFB control that copies 16-bit word `w` into every word. */
static inline __m256i word_index(int w) { return _mm256_set1_epi16((short)(0x0202 * w + 0x0100)); }

/* The Q4_K kernels run the portable dot_q4_K's float steps (ggml's repacked gemv order): the
 * integer sums of a super-block are exact however they are grouped, so only those steps decide
 * the bits, and one row against one token gives the same bits in a tile of tokens (rows_q4_K)
 * and in a group of eight rows (rows8_q4_K). */

/* One weight row against nt <= KQ_NT tokens (token r's Q8_K blocks at y + r * stride): each
 * 64-value step decodes the row's codes and chunk scales once and runs every token on them, and
 * the float steps run for the tokens in one vector (lane r: token r). */
static inline __attribute__((always_inline)) void rows_q4_K(int64_t nb, const uint8_t *w,
                                                           const uint8_t *y, int64_t stride,
                                                           int nt, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m128 acc = _mm_setzero_ps(), acc_m = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += Q4_K_BYTES, y += Q8_K_BYTES) {
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(scales_mins_k4(w + 4));
        const __m256i scales = _mm256_permute4x64_epi64(mins_and_scales, 0x44);
        const uint8_t *q4 = w + 16;
        __m256i sumi[KQ_NT][2];
        for (int r = 0; r < KQ_NT; ++r) sumi[r][0] = sumi[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; ++j, q4 += 32) {
            const __m256i q4bits = _mm256_loadu_si256((const __m256i *)q4);
            const __m256i q4l = _mm256_and_si256(q4bits, m4);
            const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            const __m256i scale_l = _mm256_shuffle_epi8(scales, word_index(2 * j));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, word_index(2 * j + 1));
            for (int r = 0; r < nt; ++r) {
                const int8_t *q8 = (const int8_t *)(y + r * stride + Q8_K_QS) + 64 * j;
                const __m256i p16l =
                    _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *)q8));
                const __m256i p16h =
                    _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
                sumi[r][0] = KQ_MADD_ADD(sumi[r][0], p16l, scale_l);
                sumi[r][1] = KQ_MADD_ADD(sumi[r][1], p16h, scale_h);
            }
        }
        __m256i isum[KQ_NT];
        __m128i imin[KQ_NT];
        float yd[KQ_NT] = {0};
        for (int r = 0; r < KQ_NT; ++r) {
            isum[r] = _mm256_add_epi32(sumi[r][0], sumi[r][1]);
            imin[r] = _mm_setzero_si128();
        }
        for (int r = 0; r < nt; ++r) {
            imin[r] = mins_by_bsums_v(mins_and_scales, y + r * stride);
            yd[r] = f32_at(y + r * stride);
        }
        /* lane r: token r's sums */
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(isum[0], isum[1]),
                                            _mm256_hadd_epi32(isum[2], isum[3]));
        const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const __m128i mins =
            _mm_hadd_epi32(_mm_hadd_epi32(imin[0], imin[1]), _mm_hadd_epi32(imin[2], imin[3]));
        const __m128 yds = _mm_loadu_ps(yd);
        const __m128 d = _mm_mul_ps(yds, _mm_set1_ps(fp16_at(w)));
        const __m128 dmin = _mm_mul_ps(yds, _mm_set1_ps(fp16_at(w + 2)));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), d, acc);
        acc_m = _mm_fmadd_ps(_mm_cvtepi32_ps(mins), dmin, acc_m);
    }
    float all[4];
    _mm_storeu_ps(all, _mm_sub_ps(acc, acc_m));
    for (int r = 0; r < nt; ++r) out[r] = all[r];
}

/* Lane r: the sum of v[r]'s eight lanes. */
static inline __m256i sum_each_8(const __m256i v[8]) {
    const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                            _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Lane r: the sum of v[r]'s four lanes. */
static inline __m256i sum_each_4(const __m128i v[8]) {
    const __m256i h0 =
        _mm256_hadd_epi32(_mm256_set_m128i(v[4], v[0]), _mm256_set_m128i(v[5], v[1]));
    const __m256i h1 =
        _mm256_hadd_epi32(_mm256_set_m128i(v[6], v[2]), _mm256_set_m128i(v[7], v[3]));
    return _mm256_hadd_epi32(h0, h1);
}

/* The 16-bit halves (low: `high` = 0, else high) of eight 32-bit lanes, in order. */
static inline __m128i halves(__m256i v, int high) {
    const __m256i pick = high ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1,
                                                 -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1,
                                                 -1, -1, -1, -1, -1, -1)
                              : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1,
                                                 -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1,
                                                 -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08));
}

/* Super-blocks whose integer sums rows8_q4_K keeps between its two steps: short spans keep the
 * float steps close to the loads they follow, so the weights' stream from memory keeps moving
 * (docs/benchmarks.md, "Q4_K rows that keep the memory busy"). */
#define KQ_SPAN 4
/* Most tokens an eight-row group takes: against KQ_NT the one-row tiles of rows_q4_K measured
 * faster (the eight rows' sums of four tokens no longer stay in registers and cache). */
#define KQ8_NT (KQ_NT - 1)

/* Eight rows (row r's blocks at w + r * rb) against nt <= KQ8_NT tokens (token t's Q8_K row at
 * y + t * stride, its outputs at out + t * ldo), in two steps per span of super-blocks: each
 * row's exact integer sums for every token, row after row (each 64-value step decoded once for
 * all the tokens), then per token the float steps of the eight rows in one vector (lane r:
 * row r, the steps of rows_q4_K in its order), as ggml runs the rows of its repacked Q4_K, but
 * on the rows as stored. Where ahead_bytes > 0, row r requests the same bytes of the row at
 * ahead + r * rb (into L2 where `stream`, else L1): a row of at most KQ_BURST bytes all at once
 * as it starts, a longer one block by block as it goes, since a burst longer than the core's
 * queue of misses stalls the loads behind it. */
#define KQ_BURST 1024

/* Requests `bytes` at p ahead of their use: into L2 where `stream`, else into L1. */
static inline __attribute__((always_inline)) void request(const uint8_t *p, int64_t bytes,
                                                         int stream) {
    for (int64_t off = 0; off < bytes; off += 64) {
        if (stream)
            __builtin_prefetch(p + off, 0, 1);
        else
            __builtin_prefetch(p + off, 0, 3);
    }
}

/* A Q8_K block's 16 block sums as 8 sums of pairs (the mins' multipliers, as ggml pairs them). */
static inline __m128i bsum_pairs(const uint8_t *yb) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(yb + Q8_K_BSUMS));
    return _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
}

/* One super-block's float steps for eight rows against nt tokens (token t's Q8_K block at
 * yb + t * stride): lane r of tot[t] / mtot[t] holds a row's exact totals of scales x codes and
 * of mins x block sums, row_at that row's byte offset from `blocks` (its d and dmin are the
 * first 4 bytes there); per (row, token) rows_q4_K's steps, in its order. */
static inline __attribute__((always_inline)) void float_steps8(const uint8_t *blocks,
                                                              __m256i row_at, const uint8_t *yb,
                                                              int64_t stride, int nt,
                                                              const __m256i *tot,
                                                              const __m256i *mtot, __m256 *acc,
                                                              __m256 *acc_m) {
    const __m256i dm = _mm256_i32gather_epi32((const int *)blocks, row_at, 1);
    const __m256 wd = _mm256_cvtph_ps(halves(dm, 0)), wmin = _mm256_cvtph_ps(halves(dm, 1));
    for (int t = 0; t < nt; ++t) {
        const __m256 yd = _mm256_set1_ps(f32_at(yb + t * stride));
        const __m256 d = _mm256_mul_ps(yd, wd), dmin = _mm256_mul_ps(yd, wmin);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[t]), d, acc[t]);
        acc_m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mtot[t]), dmin, acc_m[t]);
    }
}

static inline __attribute__((always_inline)) void rows8_q4_K(int64_t nb, const uint8_t *w,
                                                            int64_t rb, const uint8_t *y,
                                                            int64_t stride, int nt, float *out,
                                                            int64_t ldo, const uint8_t *ahead,
                                                            int64_t ahead_bytes, int stream,
                                                            int smooth) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const int32_t b = (int32_t)rb;
    const __m256i row_at = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
    __m256 acc[KQ8_NT], acc_m[KQ8_NT];
    for (int t = 0; t < nt; ++t) acc[t] = acc_m[t] = _mm256_setzero_ps();
    __m256i isum[KQ8_NT][KQ_SPAN][8];
    __m128i imin[KQ8_NT][KQ_SPAN][8], bsums[KQ8_NT][KQ_SPAN];
    for (int64_t i0 = 0; i0 < nb; i0 += KQ_SPAN) {
        const int span = nb - i0 < KQ_SPAN ? (int)(nb - i0) : KQ_SPAN;
        const uint8_t *ys = y + i0 * Q8_K_BYTES;
        for (int t = 0; t < nt; ++t)
            for (int i = 0; i < span; ++i) bsums[t][i] = bsum_pairs(ys + t * stride + i * Q8_K_BYTES);
        for (int r = 0; r < 8; ++r) {
            if (!smooth && i0 == 0) request(ahead + r * rb, ahead_bytes, stream);
            const uint8_t *blk = w + r * rb + i0 * Q4_K_BYTES;
            const uint8_t *later = ahead + r * rb + i0 * Q4_K_BYTES;
            for (int i = 0; i < span; ++i, blk += Q4_K_BYTES, later += Q4_K_BYTES) {
                if (smooth && ahead_bytes > 0) request(later, Q4_K_BYTES, stream);
                const __m256i mins_and_scales = _mm256_cvtepu8_epi16(scales_mins_k4(blk + 4));
                const __m256i scales = _mm256_permute4x64_epi64(mins_and_scales, 0x44);
                const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
                __m256i s0[KQ8_NT], s1[KQ8_NT];
                for (int t = 0; t < nt; ++t) {
                    imin[t][i][r] = _mm_madd_epi16(mins, bsums[t][i]);
                    s0[t] = s1[t] = _mm256_setzero_si256();
                }
                for (int j = 0; j < QK_K / 64; ++j) {
                    const __m256i q4bits = _mm256_loadu_si256((const __m256i *)(blk + 16) + j);
                    const __m256i q4l = _mm256_and_si256(q4bits, m4);
                    const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                    const __m256i scale_l = _mm256_shuffle_epi8(scales, word_index(2 * j));
                    const __m256i scale_h = _mm256_shuffle_epi8(scales, word_index(2 * j + 1));
                    for (int t = 0; t < nt; ++t) {
                        const int8_t *q8 =
                            (const int8_t *)(ys + t * stride + i * Q8_K_BYTES + Q8_K_QS) + 64 * j;
                        const __m256i q8l = _mm256_loadu_si256((const __m256i *)q8);
                        const __m256i q8h = _mm256_loadu_si256((const __m256i *)(q8 + 32));
                        s0[t] = KQ_MADD_ADD(s0[t], _mm256_maddubs_epi16(q4l, q8l), scale_l);
                        s1[t] = KQ_MADD_ADD(s1[t], _mm256_maddubs_epi16(q4h, q8h), scale_h);
                    }
                }
                for (int t = 0; t < nt; ++t) isum[t][i][r] = _mm256_add_epi32(s0[t], s1[t]);
            }
        }
        for (int i = 0; i < span; ++i) {
            __m256i tot[KQ8_NT], mtot[KQ8_NT];
            for (int t = 0; t < nt; ++t) {
                tot[t] = sum_each_8(isum[t][i]);
                mtot[t] = sum_each_4(imin[t][i]);
            }
            float_steps8(w + (i0 + i) * Q4_K_BYTES, row_at, ys + i * Q8_K_BYTES, stride, nt, tot,
                         mtot, acc, acc_m);
        }
    }
    for (int t = 0; t < nt; ++t) _mm256_storeu_ps(out + t * ldo, _mm256_sub_ps(acc[t], acc_m[t]));
}

#endif

#if defined(KQ_AVX512)
/* Q4_K against several tokens (a prefill, a wide verify window): sixteen rows at once, one
 * 512-bit lane per row, as ggml's AVX-512 repacked gemm runs its interleaved rows, but on the
 * rows as stored. Each 32-byte step of codes of the sixteen rows is transposed once (dword k of
 * every row side by side) and serves every token: VPDPBUSD of the codes with the token's dword
 * k broadcast adds four products per row, eight such give every row's sum over a 32-value
 * sub-block, one VPMULLD applies the rows' sub-block scales. Nothing is added in int16 or
 * rounded: the integer totals are exact, and the float steps per (row, token, super-block) are
 * rows_q4_K's, so each output has the bits of the single-row dot.
 *
 * Lane p = 4L + i (128-bit lane L, dword i) holds row 4i + L: in-lane byte shuffles of four
 * rows' heads per register produce the scales in that order. */
#define KQ16_NT 8 /* tokens per group: their integer totals stay in registers */
#define KQ16_TOKENS 64 /* most tokens per call (blocks.c's TOKEN_BLOCK) */
#define ROW16(p) (4 * ((p) % 4) + (p) / 4)

/* The first 16 bytes (d, dmin, 12 scale bytes) of rows 4q .. 4q + 3's block, lane L: row 4q + L. */
static inline __m512i heads4(const uint8_t *b, int64_t rb) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + rb)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 2 * rb)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 3 * rb)), 3);
}

/* scales_mins_k4 in each 128-bit lane of heads4's register (the scale bytes at 4 .. 15). */
static inline __m512i scales_mins_k4_x4(__m512i s) {
    const __m512i a = _mm512_shuffle_epi8(
        s, _mm512_broadcast_i32x4(
               _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
    const __m512i lo = _mm512_or_si512(
        _mm512_and_si512(a, _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63,
                                                                 63, 63, 63, 0, 0, 0, 0))),
        _mm512_and_si512(_mm512_srli_epi16(a, 4),
                         _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                              15, 15, 15, 15))));
    const __m512i h = _mm512_shuffle_epi8(
        s, _mm512_broadcast_i32x4(
               _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
    return _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi16(h, 2), _mm512_set1_epi8(0x30)));
}

/* Byte c of each dword's 4-byte group g (bytes 4g .. 4g + 3 of a lane) into dword c, zero
 * extended; with `pair`, group g's byte c into word 2c and group g + 1's into word 2c + 1. */
static inline __m512i spread4(__m512i v, int g, int pair) {
    const char b = (char)(4 * g);
    const __m128i ctl =
        pair ? _mm_setr_epi8(b, -1, b + 4, -1, b + 1, -1, b + 5, -1, b + 2, -1, b + 6, -1, b + 3, -1,
                             b + 7, -1)
             : _mm_setr_epi8(b, -1, -1, -1, b + 1, -1, -1, -1, b + 2, -1, -1, -1, b + 3, -1, -1, -1);
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(ctl));
}

/* The rows of transpose16: dword k of register m's low half comes from row lo[m], of its high
 * half from row hi[m], so that the transpose leaves row ROW16(p) in lane p. */
static inline void rows16_halves(const uint8_t *w, int64_t rb, const uint8_t *lo[8],
                                 const uint8_t *hi[8]) {
    for (int m = 0; m < 4; ++m) {
        lo[m] = w + 4 * m * rb, hi[m] = w + (4 * m + 2) * rb;
        lo[m + 4] = w + (4 * m + 1) * rb, hi[m + 4] = w + (4 * m + 3) * rb;
    }
}

/* d[k]: dword k of the 32 bytes at byte `off` of each of the sixteen rows, lane p: row ROW16(p). */
static inline __attribute__((always_inline)) void transpose16(const uint8_t *const lo[8],
                                                             const uint8_t *const hi[8],
                                                             int64_t off, __m512i d[8]) {
    __m512i z[8], u[8];
    for (int m = 0; m < 8; ++m)
        z[m] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(lo[m] + off))),
            _mm256_loadu_si256((const __m256i *)(hi[m] + off)), 1);
    for (int g = 0; g < 8; g += 4) {
        const __m512i t0 = _mm512_unpacklo_epi32(z[g], z[g + 1]);
        const __m512i t1 = _mm512_unpackhi_epi32(z[g], z[g + 1]);
        const __m512i t2 = _mm512_unpacklo_epi32(z[g + 2], z[g + 3]);
        const __m512i t3 = _mm512_unpackhi_epi32(z[g + 2], z[g + 3]);
        u[g] = _mm512_unpacklo_epi64(t0, t2), u[g + 1] = _mm512_unpackhi_epi64(t0, t2);
        u[g + 2] = _mm512_unpacklo_epi64(t1, t3), u[g + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int k = 0; k < 4; ++k) {
        d[k] = _mm512_permutex2var_epi64(u[k], first, u[k + 4]);
        d[k + 4] = _mm512_permutex2var_epi64(u[k], second, u[k + 4]);
    }
}

/* One super-block of the sixteen rows against g <= KQ16_NT tokens (token t's Q8_K block at
 * yb + t * stride): the integer totals from the transposed codes (codes[s][k]: dword k of
 * sub-block s, lane p: row ROW16(p)) and the sub-block scales and min pairs in lane order, then
 * rows_q4_K's float steps into acc[t] / acc_m[t] (from zero where `first`). */
static inline __attribute__((always_inline)) void rows16_q4_K_group(
    const __m512i codes[QK_K / 32][8], const __m512i scale[QK_K / 32], const __m512i minp[4],
    __m512 wd, __m512 wmin, const uint8_t *yb, int64_t stride, const int g, __m512 *acc,
    __m512 *acc_m, int first) {
    __m512i tot[KQ16_NT];
    for (int t = 0; t < g; ++t) tot[t] = _mm512_setzero_si512();
    for (int s = 0; s < QK_K / 32; ++s) {
        __m512i c[8];
        for (int k = 0; k < 8; ++k) c[k] = codes[s][k];
        /* (every token unrolled, so that tot[] stays in registers; two chains of sums per
         * token, so that the adds do not wait on each other) */
#pragma GCC unroll 8
        for (int t = 0; t < g; ++t) {
            const uint8_t *q8 = yb + t * stride + Q8_K_QS + 32 * s;
            __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int k = 0; k < 8; ++k)
                sum[k % 2] =
                    _mm512_dpbusd_epi32(sum[k % 2], c[k], _mm512_set1_epi32(i32_at(q8 + 4 * k)));
            const __m512i all = _mm512_add_epi32(sum[0], sum[1]);
            tot[t] = _mm512_add_epi32(tot[t], _mm512_mullo_epi32(all, scale[s]));
        }
    }
    for (int t = 0; t < g; ++t) {
        const uint8_t *yt = yb + t * stride;
        int32_t pairs[4];
        _mm_storeu_si128((__m128i *)pairs, bsum_pairs(yt));
        __m512i mtot = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p)
            mtot = _mm512_dpwssd_epi32(mtot, minp[p], _mm512_set1_epi32(pairs[p]));
        const __m512 yd = _mm512_set1_ps(f32_at(yt));
        const __m512 a = first ? _mm512_setzero_ps() : acc[t];
        const __m512 am = first ? _mm512_setzero_ps() : acc_m[t];
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[t]), _mm512_mul_ps(yd, wd), a);
        acc_m[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mtot), _mm512_mul_ps(yd, wmin), am);
    }
}

typedef void (*rows16_group_fn)(const __m512i (*)[8], const __m512i *, const __m512i *, __m512,
                                __m512, const uint8_t *, int64_t, __m512 *, __m512 *, int);
#define KQ_GROUP16(G)                                                                              \
    static void rows16_q4_K_g##G(const __m512i codes[QK_K / 32][8], const __m512i *scale,         \
                                 const __m512i *minp, __m512 wd, __m512 wmin, const uint8_t *yb,  \
                                 int64_t stride, __m512 *acc, __m512 *acc_m, int first) {         \
        rows16_q4_K_group(codes, scale, minp, wd, wmin, yb, stride, G, acc, acc_m, first);        \
    }
KQ_GROUP16(1)
KQ_GROUP16(2)
KQ_GROUP16(3)
KQ_GROUP16(4)
KQ_GROUP16(5)
KQ_GROUP16(6)
KQ_GROUP16(7)
KQ_GROUP16(8)
_Static_assert(KQ16_NT == 8, "one rows16_q4_K_group copy per token count");
static const rows16_group_fn rows16_q4_K_groups[KQ16_NT + 1] = {
    NULL,
    rows16_q4_K_g1,
    rows16_q4_K_g2,
    rows16_q4_K_g3,
    rows16_q4_K_g4,
    rows16_q4_K_g5,
    rows16_q4_K_g6,
    rows16_q4_K_g7,
    rows16_q4_K_g8,
};

/* Sixteen rows against nt <= KQ16_TOKENS tokens: each super-block's codes are transposed and
 * its scales put in lane order once, for all the tokens, eight at a time. */
static void rows16_q4_K(int64_t nb, const uint8_t *w, int64_t rb, const uint8_t *y,
                        int64_t stride, int nt, float *out, int64_t ldo) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t *lo[8], *hi[8];
    rows16_halves(w, rb, lo, hi);
    __m512 acc[KQ16_TOKENS], acc_m[KQ16_TOKENS];
    __m512i codes[QK_K / 32][8];
    for (int64_t i = 0; i < nb; ++i) {
        const int64_t at = i * Q4_K_BYTES;
        /* the same super-block of the next tile's rows, into L2 (a prefetch never faults, past
         * the matrix's end included) */
        for (int r = 16; r < 32; ++r) request(w + r * rb + at, Q4_K_BYTES, 1);
        __m512i head[4], sm[4];
        for (int q = 0; q < 4; ++q) {
            head[q] = heads4(w + 4 * q * rb + at, rb);
            sm[q] = scales_mins_k4_x4(head[q]);
        }
        /* dword s of lane L: the scale (low bytes) or min (high bytes) of sub-block s, s < 4,
         * of rows L, 4 + L, 8 + L, 12 + L; s >= 4 in the second register */
        const __m512i sa = _mm512_unpacklo_epi8(sm[0], sm[1]);
        const __m512i sb = _mm512_unpacklo_epi8(sm[2], sm[3]);
        const __m512i ma = _mm512_unpackhi_epi8(sm[0], sm[1]);
        const __m512i mb = _mm512_unpackhi_epi8(sm[2], sm[3]);
        const __m512i sc[2] = {_mm512_unpacklo_epi16(sa, sb), _mm512_unpackhi_epi16(sa, sb)};
        const __m512i mn[2] = {_mm512_unpacklo_epi16(ma, mb), _mm512_unpackhi_epi16(ma, mb)};
        __m512i scale[QK_K / 32], minp[4];
        for (int s = 0; s < QK_K / 32; ++s) scale[s] = spread4(sc[s / 4], s % 4, 0);
        for (int p = 0; p < 4; ++p) minp[p] = spread4(mn[p / 2], 2 * (p % 2), 1);
        /* dword i of lane L of head[0..3]: (d, dmin) of row 4i + L */
        const __m512i dm = _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(head[0], head[1]),
                                                 _mm512_unpacklo_epi32(head[2], head[3]));
        const __m512 wd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        const __m512 wmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        for (int j = 0; j < QK_K / 64; ++j) {
            __m512i d[8];
            transpose16(lo, hi, at + 16 + 32 * j, d);
            for (int k = 0; k < 8; ++k) {
                codes[2 * j][k] = _mm512_and_si512(d[k], m4);
                codes[2 * j + 1][k] = _mm512_and_si512(_mm512_srli_epi16(d[k], 4), m4);
            }
        }
        const uint8_t *yb = y + i * Q8_K_BYTES;
        for (int t0 = 0; t0 < nt; t0 += KQ16_NT) {
            const int g = nt - t0 < KQ16_NT ? nt - t0 : KQ16_NT;
            rows16_q4_K_groups[g]((const __m512i(*)[8])codes, scale, minp, wd, wmin,
                                  yb + t0 * stride, stride, acc + t0, acc_m + t0, i == 0);
        }
    }
    /* back to row order: row r sits in lane ROW16(r) (the map is its own inverse) */
    const __m512i rows = _mm512_setr_epi32(ROW16(0), ROW16(1), ROW16(2), ROW16(3), ROW16(4),
                                           ROW16(5), ROW16(6), ROW16(7), ROW16(8), ROW16(9),
                                           ROW16(10), ROW16(11), ROW16(12), ROW16(13), ROW16(14),
                                           ROW16(15));
    for (int t = 0; t < nt; ++t)
        _mm512_storeu_ps(out + t * ldo,
                         _mm512_permutexvar_ps(rows, _mm512_sub_ps(acc[t], acc_m[t])));
}
#endif

#if defined(KQ_AVX2)
/* rows8_q4_K on AVX2, its integer step two rows at a time: a vector holds 16 values of row A in
 * its low half and the same 16 of row B in its high half, against those 16 activation bytes in
 * both halves. The two halves of a 32-value chunk (one scale) are summed in int16 before the
 * one VPMADDWD with the scales (|sum| <= 2 * 2 * 15 * 128 = 7680: exact), so a pair of rows
 * takes 4 VPMADDUBSW and 2 VPMADDWD per 64 values where a row at a time took 4 and 4: the
 * multiply ports are what this step runs out of. (AVX-512's VPDPWSSD fuses the VPMADDWD with
 * its add; there pairing measured no faster.) The sums are exact integers, so the float steps,
 * and every result bit, are rows8_q4_K's. */
#define KQ_PAIRED 1

/* v[p] holds row 2p's sums in lanes 0-3 and row 2p + 1's in lanes 4-7; lane i of the result is
 * the total of row 2 * (i % 4) + i / 4 (rows 0, 2, 4, 6, 1, 3, 5, 7). */
static inline __m256i sum_pairs(const __m256i v[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

/* 16 bytes at p in both halves. */
static inline __m256i both(const __m128i *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(p));
}

/* The Q4_K blocks of rows A and B: [A's 8 scales | B's], [A's 8 mins | B's], as int16. */
static inline void pair_scales(const uint8_t *a, const uint8_t *b, __m256i *scales,
                               __m256i *mins) {
    const __m256i ms_a = _mm256_cvtepu8_epi16(scales_mins_k4(a + 4));
    const __m256i ms_b = _mm256_cvtepu8_epi16(scales_mins_k4(b + 4));
    *scales = _mm256_permute2x128_si256(ms_a, ms_b, 0x20);
    *mins = _mm256_permute2x128_si256(ms_a, ms_b, 0x31);
}

/* 64-value step j of the blocks at a and b: c[0] and c[1] hold values 0-15 and 16-31 of its
 * first 32-value chunk (both rows), c[2] and c[3] those of its second. */
static inline __attribute__((always_inline)) void pair_codes(const uint8_t *a, const uint8_t *b,
                                                            int j, __m256i c[4]) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const uint8_t *qa = a + 16 + 32 * j, *qb = b + 16 + 32 * j;
    const __m256i v0 = _mm256_loadu2_m128i((const __m128i *)qb, (const __m128i *)qa);
    const __m256i v1 = _mm256_loadu2_m128i((const __m128i *)(qb + 16), (const __m128i *)(qa + 16));
    c[0] = _mm256_and_si256(v0, m4);
    c[1] = _mm256_and_si256(v1, m4);
    c[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
    c[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
}

/* Step j's int16 sums against one token's Q8_K block yb: *pl the first chunk's, *ph the
 * second's (each one scale). */
static inline __attribute__((always_inline)) void pair_products(const __m256i c[4],
                                                               const uint8_t *yb, int j,
                                                               __m256i *pl, __m256i *ph) {
    const __m128i *q8 = (const __m128i *)(yb + Q8_K_QS + 64 * j);
    *pl = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], both(q8)),
                           _mm256_maddubs_epi16(c[1], both(q8 + 1)));
    *ph = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], both(q8 + 2)),
                           _mm256_maddubs_epi16(c[3], both(q8 + 3)));
}

static inline __attribute__((always_inline)) void rows8_q4_K_pairs(
    int64_t nb, const uint8_t *w, int64_t rb, const uint8_t *y, int64_t stride, int nt,
    float *out, int64_t ldo, const uint8_t *ahead, int64_t ahead_bytes, int stream, int smooth) {
    const int32_t b = (int32_t)rb;
    /* d and dmin gathered in sum_pairs' row order, the outputs put back in order at the end */
    const __m256i row_at = _mm256_setr_epi32(0, 2 * b, 4 * b, 6 * b, b, 3 * b, 5 * b, 7 * b);
    __m256 acc[KQ8_NT], acc_m[KQ8_NT];
    for (int t = 0; t < nt; ++t) acc[t] = acc_m[t] = _mm256_setzero_ps();
    __m256i isum[KQ8_NT][KQ_SPAN][4], imin[KQ8_NT][KQ_SPAN][4], bsums[KQ8_NT][KQ_SPAN];
    for (int64_t i0 = 0; i0 < nb; i0 += KQ_SPAN) {
        const int span = nb - i0 < KQ_SPAN ? (int)(nb - i0) : KQ_SPAN;
        const uint8_t *ys = y + i0 * Q8_K_BYTES;
        for (int t = 0; t < nt; ++t)
            for (int i = 0; i < span; ++i) {
                const __m128i s = bsum_pairs(ys + t * stride + i * Q8_K_BYTES);
                bsums[t][i] = _mm256_set_m128i(s, s);
            }
        for (int p = 0; p < 4; ++p) {
            /* row A's and row B's lines in turn, as rows8_q4_K requests one row's */
            if (!smooth && i0 == 0)
                for (int64_t off = 0; off < ahead_bytes; off += 64) {
                    request(ahead + 2 * p * rb + off, 1, stream);
                    request(ahead + (2 * p + 1) * rb + off, 1, stream);
                }
            const uint8_t *blk = w + 2 * p * rb + i0 * Q4_K_BYTES;
            const uint8_t *later = ahead + 2 * p * rb + i0 * Q4_K_BYTES;
            for (int i = 0; i < span; ++i, blk += Q4_K_BYTES, later += Q4_K_BYTES) {
                if (smooth && ahead_bytes > 0) {
                    request(later, Q4_K_BYTES, stream);
                    request(later + rb, Q4_K_BYTES, stream);
                }
                __m256i scales, mins;
                pair_scales(blk, blk + rb, &scales, &mins);
                __m256i s0[KQ8_NT], s1[KQ8_NT];
                for (int t = 0; t < nt; ++t) {
                    imin[t][i][p] = _mm256_madd_epi16(mins, bsums[t][i]);
                    s0[t] = s1[t] = _mm256_setzero_si256();
                }
                for (int j = 0; j < QK_K / 64; ++j) {
                    __m256i c[4];
                    pair_codes(blk, blk + rb, j, c);
                    const __m256i scale_l = _mm256_shuffle_epi8(scales, word_index(2 * j));
                    const __m256i scale_h = _mm256_shuffle_epi8(scales, word_index(2 * j + 1));
                    for (int t = 0; t < nt; ++t) {
                        __m256i pl, ph;
                        pair_products(c, ys + t * stride + i * Q8_K_BYTES, j, &pl, &ph);
                        s0[t] = KQ_MADD_ADD(s0[t], pl, scale_l);
                        s1[t] = KQ_MADD_ADD(s1[t], ph, scale_h);
                    }
                }
                for (int t = 0; t < nt; ++t) isum[t][i][p] = _mm256_add_epi32(s0[t], s1[t]);
            }
        }
        for (int i = 0; i < span; ++i) {
            __m256i tot[KQ8_NT], mtot[KQ8_NT];
            for (int t = 0; t < nt; ++t) {
                tot[t] = sum_pairs(isum[t][i]);
                mtot[t] = sum_pairs(imin[t][i]);
            }
            float_steps8(w + (i0 + i) * Q4_K_BYTES, row_at, ys + i * Q8_K_BYTES, stride, nt, tot,
                         mtot, acc, acc_m);
        }
    }
    const __m256i rows = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int t = 0; t < nt; ++t)
        _mm256_storeu_ps(out + t * ldo,
                         _mm256_permutevar8x32_ps(_mm256_sub_ps(acc[t], acc_m[t]), rows));
}

/* Two rows (row B at w + rb) against KQ_NT tokens, a prefill's tile: the integer step of
 * rows8_q4_K_pairs, the float steps of rows_q4_K (lane r: token r) for both rows in one vector
 * (lanes 0-3: row A's tokens, 4-7: row B's), so each (row, token) gets rows_q4_K's bits. Row A's
 * token r lands in out[r * ldo], row B's in out[r * ldo + 1]. */
static void rows2_q4_K(int64_t nb, const uint8_t *w, int64_t rb, const uint8_t *y, int64_t stride,
                       float *out, int64_t ldo) {
    __m256 acc = _mm256_setzero_ps(), acc_m = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += Q4_K_BYTES, y += Q8_K_BYTES) {
        const uint8_t *wb = w + rb;
        __m256i scales, mins;
        pair_scales(w, wb, &scales, &mins);
        __m256i sumi[KQ_NT], imin[KQ_NT];
        for (int t = 0; t < KQ_NT; ++t) sumi[t] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; ++j) {
            __m256i c[4];
            pair_codes(w, wb, j, c);
            const __m256i scale_l = _mm256_shuffle_epi8(scales, word_index(2 * j));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, word_index(2 * j + 1));
            for (int t = 0; t < KQ_NT; ++t) {
                __m256i pl, ph;
                pair_products(c, y + t * stride, j, &pl, &ph);
                sumi[t] = KQ_MADD_ADD(KQ_MADD_ADD(sumi[t], pl, scale_l), ph, scale_h);
            }
        }
        float yd[KQ_NT];
        for (int t = 0; t < KQ_NT; ++t) {
            const __m128i bs = bsum_pairs(y + t * stride);
            imin[t] = _mm256_madd_epi16(mins, _mm256_set_m128i(bs, bs));
            yd[t] = f32_at(y + t * stride);
        }
        /* lanes 0-3: row A's totals for tokens 0-3, lanes 4-7: row B's */
        const __m256i sums = sum_pairs(sumi), msum = sum_pairs(imin);
        const __m128 y4 = _mm_loadu_ps(yd);
        const __m256 yds = _mm256_set_m128(y4, y4);
        const __m256 wd = _mm256_set_m128(_mm_set1_ps(fp16_at(wb)), _mm_set1_ps(fp16_at(w)));
        const __m256 wmin =
            _mm256_set_m128(_mm_set1_ps(fp16_at(wb + 2)), _mm_set1_ps(fp16_at(w + 2)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(yds, wd), acc);
        acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(yds, wmin), acc_m);
    }
    float all[8];
    _mm256_storeu_ps(all, _mm256_sub_ps(acc, acc_m));
    for (int t = 0; t < KQ_NT; ++t) {
        out[t * ldo] = all[t];
        out[t * ldo + 1] = all[4 + t];
    }
}

/* Q4_K against several tokens on AVX2: eight rows per call, lane r of every vector row r, as
 * rows16_q4_K on AVX-512 but without VNNI: each 32-byte step of codes of the eight rows is
 * transposed once (dword k of every row side by side) for all the tokens; per token and
 * sub-block, eight VPMADDUBSW of the codes' dword k with the token's broadcast dword k summed in
 * int16 (|sum| <= 8 * 2 * 15 * 127 = 30480: exact), then one VPMADDWD with the rows' scale in
 * both words of each lane. 9 multiplies per 256 products where the row pairs take 12. The float
 * steps are rows_q4_K's, so every bit is the single-row dot's. */
#define KQ8T_NT 8 /* tokens per group: their integer totals stay in registers */
#define KQ8T_TOKENS 64 /* most tokens per call (blocks.c's TOKEN_BLOCK) */

/* d[k]: dword k of the 32 bytes at w + r * rb + off, lane r: row r. */
static inline __attribute__((always_inline)) void transpose8(const uint8_t *w, int64_t rb,
                                                            int64_t off, __m256i d[8]) {
    __m256i z[8], u[8];
    for (int r = 0; r < 8; ++r) z[r] = _mm256_loadu_si256((const __m256i *)(w + r * rb + off));
    for (int g = 0; g < 8; g += 4) {
        const __m256i t0 = _mm256_unpacklo_epi32(z[g], z[g + 1]);
        const __m256i t1 = _mm256_unpackhi_epi32(z[g], z[g + 1]);
        const __m256i t2 = _mm256_unpacklo_epi32(z[g + 2], z[g + 3]);
        const __m256i t3 = _mm256_unpackhi_epi32(z[g + 2], z[g + 3]);
        u[g] = _mm256_unpacklo_epi64(t0, t2), u[g + 1] = _mm256_unpackhi_epi64(t0, t2);
        u[g + 2] = _mm256_unpacklo_epi64(t1, t3), u[g + 3] = _mm256_unpackhi_epi64(t1, t3);
    }
    /* u[k] (k < 4): dword k of rows g .. g + 3 in its low half, dword k + 4 in its high half */
    for (int k = 0; k < 4; ++k) {
        d[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
        d[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
    }
}

static inline __attribute__((always_inline)) void rows8t_q4_K_group(
    const __m256i codes[QK_K / 32][8], const __m256i scale[QK_K / 32], const __m256i minp[4],
    __m256 wd, __m256 wmin, const uint8_t *yb, int64_t stride, const int g, __m256 *acc,
    __m256 *acc_m, int first) {
    __m256i tot[KQ8T_NT];
    for (int t = 0; t < g; ++t) tot[t] = _mm256_setzero_si256();
    for (int s = 0; s < QK_K / 32; ++s) {
#pragma GCC unroll 8
        for (int t = 0; t < g; ++t) {
            const uint8_t *q8 = yb + t * stride + Q8_K_QS + 32 * s;
            __m256i sum[2];
            for (int k = 0; k < 8; ++k) {
                const __m256i x = _mm256_set1_epi32(i32_at(q8 + 4 * k));
                const __m256i p = _mm256_maddubs_epi16(codes[s][k], x);
                sum[k % 2] = k < 2 ? p : _mm256_add_epi16(sum[k % 2], p);
            }
            tot[t] = KQ_MADD_ADD(tot[t], _mm256_add_epi16(sum[0], sum[1]), scale[s]);
        }
    }
    for (int t = 0; t < g; ++t) {
        const uint8_t *yt = yb + t * stride;
        int32_t pairs[4];
        _mm_storeu_si128((__m128i *)pairs, bsum_pairs(yt));
        __m256i mtot = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) mtot = KQ_MADD_ADD(mtot, minp[p], _mm256_set1_epi32(pairs[p]));
        const __m256 yd = _mm256_set1_ps(f32_at(yt));
        const __m256 a = first ? _mm256_setzero_ps() : acc[t];
        const __m256 am = first ? _mm256_setzero_ps() : acc_m[t];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[t]), _mm256_mul_ps(yd, wd), a);
        acc_m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mtot), _mm256_mul_ps(yd, wmin), am);
    }
}

typedef void (*rows8t_group_fn)(const __m256i (*)[8], const __m256i *, const __m256i *, __m256,
                                __m256, const uint8_t *, int64_t, __m256 *, __m256 *, int);
#define KQ_GROUP8T(G)                                                                              \
    static void rows8t_q4_K_g##G(const __m256i codes[QK_K / 32][8], const __m256i *scale,         \
                                 const __m256i *minp, __m256 wd, __m256 wmin, const uint8_t *yb,  \
                                 int64_t stride, __m256 *acc, __m256 *acc_m, int first) {         \
        rows8t_q4_K_group(codes, scale, minp, wd, wmin, yb, stride, G, acc, acc_m, first);        \
    }
KQ_GROUP8T(1)
KQ_GROUP8T(2)
KQ_GROUP8T(3)
KQ_GROUP8T(4)
KQ_GROUP8T(5)
KQ_GROUP8T(6)
KQ_GROUP8T(7)
KQ_GROUP8T(8)
_Static_assert(KQ8T_NT == 8, "one rows8t_q4_K_group copy per token count");
static const rows8t_group_fn rows8t_q4_K_groups[KQ8T_NT + 1] = {
    NULL,
    rows8t_q4_K_g1,
    rows8t_q4_K_g2,
    rows8t_q4_K_g3,
    rows8t_q4_K_g4,
    rows8t_q4_K_g5,
    rows8t_q4_K_g6,
    rows8t_q4_K_g7,
    rows8t_q4_K_g8,
};

/* Eight rows against nt <= KQ8T_TOKENS tokens, each super-block unpacked once for all of them. */
static void rows8t_q4_K(int64_t nb, const uint8_t *w, int64_t rb, const uint8_t *y,
                        int64_t stride, int nt, float *out, int64_t ldo) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int32_t b = (int32_t)rb;
    const __m256i row_at = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
    __m256 acc[KQ8T_TOKENS], acc_m[KQ8T_TOKENS];
    __m256i codes[QK_K / 32][8];
    for (int64_t i = 0; i < nb; ++i) {
        const int64_t at = i * Q4_K_BYTES;
        /* the same super-block of the next tile's rows, into L2 (as rows16_q4_K) */
        for (int r = 8; r < 16; ++r) request(w + r * rb + at, Q4_K_BYTES, 1);
        /* the rows' scales (bytes 0-7) and mins (8-15), transposed: qword s of sm[s / 2] holds
         * sub-block s's scale of rows 0-7, of mn[s / 2] its min */
        __m128i x[8], a[4], c[4];
        for (int r = 0; r < 8; ++r) x[r] = scales_mins_k4(w + r * rb + at + 4);
        for (int q = 0; q < 4; ++q) a[q] = _mm_unpacklo_epi8(x[2 * q], x[2 * q + 1]);
        for (int q = 0; q < 4; ++q) c[q] = _mm_unpackhi_epi8(x[2 * q], x[2 * q + 1]);
        const __m128i s03 = _mm_unpacklo_epi16(a[0], a[1]), s47 = _mm_unpackhi_epi16(a[0], a[1]);
        const __m128i t03 = _mm_unpacklo_epi16(a[2], a[3]), t47 = _mm_unpackhi_epi16(a[2], a[3]);
        const __m128i m03 = _mm_unpacklo_epi16(c[0], c[1]), m47 = _mm_unpackhi_epi16(c[0], c[1]);
        const __m128i n03 = _mm_unpacklo_epi16(c[2], c[3]), n47 = _mm_unpackhi_epi16(c[2], c[3]);
        const __m128i sm[4] = {_mm_unpacklo_epi32(s03, t03), _mm_unpackhi_epi32(s03, t03),
                               _mm_unpacklo_epi32(s47, t47), _mm_unpackhi_epi32(s47, t47)};
        const __m128i mn[4] = {_mm_unpacklo_epi32(m03, n03), _mm_unpackhi_epi32(m03, n03),
                               _mm_unpacklo_epi32(m47, n47), _mm_unpackhi_epi32(m47, n47)};
        __m256i scale[QK_K / 32], minp[4];
        for (int s = 0; s < QK_K / 32; ++s) {
            const __m256i v = _mm256_cvtepu8_epi32(s % 2 ? _mm_srli_si128(sm[s / 2], 8) : sm[s / 2]);
            scale[s] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
        }
        /* lane r of minp[p]: row r's mins of sub-blocks 2p and 2p + 1, as int16 */
        for (int p = 0; p < 4; ++p)
            minp[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn[p], _mm_srli_si128(mn[p], 8)));
        const __m256i dm = _mm256_i32gather_epi32((const int *)(w + at), row_at, 1);
        const __m256 wd = _mm256_cvtph_ps(halves(dm, 0)), wmin = _mm256_cvtph_ps(halves(dm, 1));
        for (int j = 0; j < QK_K / 64; ++j) {
            __m256i d[8];
            transpose8(w, rb, at + 16 + 32 * j, d);
            for (int k = 0; k < 8; ++k) {
                codes[2 * j][k] = _mm256_and_si256(d[k], m4);
                codes[2 * j + 1][k] = _mm256_and_si256(_mm256_srli_epi16(d[k], 4), m4);
            }
        }
        const uint8_t *yb = y + i * Q8_K_BYTES;
        for (int t0 = 0; t0 < nt; t0 += KQ8T_NT) {
            const int g = nt - t0 < KQ8T_NT ? nt - t0 : KQ8T_NT;
            rows8t_q4_K_groups[g]((const __m256i(*)[8])codes, scale, minp, wd, wmin,
                                  yb + t0 * stride, stride, acc + t0, acc_m + t0, i == 0);
        }
    }
    for (int t = 0; t < nt; ++t) _mm256_storeu_ps(out + t * ldo, _mm256_sub_ps(acc[t], acc_m[t]));
}
#endif /* KQ_AVX2 */

#if defined(KQ_AVX2)

static inline __m256i get_scale_shuffle_k4(int i) {
    static const uint8_t k_shuffle[256] = {
        0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  0,  1,
        0,  1,  0,  1,  0,  1,  0,  1,  0,  1,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,
        2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  2,  3,  4,  5,
        4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,  4,  5,
        4,  5,  4,  5,  4,  5,  4,  5,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,
        6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  6,  7,  8,  9,  8,  9,
        8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,
        8,  9,  8,  9,  8,  9,  10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11,
        10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 12, 13, 12, 13, 12, 13,
        12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
        12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15,
        14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15};
    return _mm256_loadu_si256((const __m256i *)k_shuffle + i);
}

static inline __m128i get_scale_shuffle(int i) {
    static const uint8_t k_shuffle[128] = {
        0,  0,  0,  0,  0,  0,  0,  0,  1,  1,  1,  1,  1,  1,  1,  1,  2,  2,  2,  2,  2,  2,
        2,  2,  3,  3,  3,  3,  3,  3,  3,  3,  4,  4,  4,  4,  4,  4,  4,  4,  5,  5,  5,  5,
        5,  5,  5,  5,  6,  6,  6,  6,  6,  6,  6,  6,  7,  7,  7,  7,  7,  7,  7,  7,  8,  8,
        8,  8,  8,  8,  8,  8,  9,  9,  9,  9,  9,  9,  9,  9,  10, 10, 10, 10, 10, 10, 10, 10,
        11, 11, 11, 11, 11, 11, 11, 11, 12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13,
        13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15};
    return _mm_loadu_si128((const __m128i *)k_shuffle + i);
}

/* The AVX2 tiles: one weight row against nt <= KQ_NT tokens (token r's Q8_K blocks at
 * y + r * stride). Each 64-value step decodes the row's codes and chunk scales once and runs
 * every token on them; per token the integer lanes and the float steps are ggml's AVX2 kernel's
 * in its order, so any nt gives each token the bits of nt = 1 (the single-token dot). */

/* ggml's AVX2 ggml_vec_dot_q5_K_q8_K, tokens innermost; `summs` as in the portable code. */
static inline __attribute__((always_inline)) void rows_q5_K(int64_t nb, const uint8_t *w,
                                                           const uint8_t *y, int64_t stride,
                                                           int nt, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i mone = _mm256_set1_epi8(1);
    __m256 acc[KQ_NT];
    float summs[KQ_NT];
    for (int r = 0; r < nt; ++r) {
        acc[r] = _mm256_setzero_ps();
        summs[r] = 0.f;
    }
    for (int64_t i = 0; i < nb; i++, w += Q5_K_BYTES, y += Q8_K_BYTES) {
        const float wd = fp16_at(w), wmin = fp16_at(w + 2);
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(scales_mins_k4(w + 4));
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        __m256i hmask = mone;
        const uint8_t *q5 = w + 48;
        __m256i sumi[KQ_NT];
        for (int r = 0; r < nt; ++r) sumi[r] = _mm256_setzero_si256();
        int bit = 0;
        for (int j = 0; j < QK_K / 64; ++j, q5 += 32) {
            const __m256i scale_0 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 0));
            const __m256i scale_1 = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2 * j + 1));
            const __m256i q5bits = _mm256_loadu_si256((const __m256i *)q5);
            const __m256i q5l_0 = _mm256_and_si256(q5bits, m4);
            const __m256i q5h_0 = _mm256_slli_epi16(
                _mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            const __m256i q5_0 = _mm256_add_epi8(q5l_0, q5h_0);
            hmask = _mm256_slli_epi16(hmask, 1);
            const __m256i q5l_1 = _mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4);
            const __m256i q5h_1 = _mm256_slli_epi16(
                _mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
            const __m256i q5_1 = _mm256_add_epi8(q5l_1, q5h_1);
            hmask = _mm256_slli_epi16(hmask, 1);
            for (int r = 0; r < nt; ++r) {
                const int8_t *q8 = (const int8_t *)(y + r * stride + Q8_K_QS) + 64 * j;
                const __m256i q8_0 = _mm256_loadu_si256((const __m256i *)q8);
                const __m256i q8_1 = _mm256_loadu_si256((const __m256i *)(q8 + 32));
                sumi[r] = KQ_MADD_ADD(sumi[r], _mm256_maddubs_epi16(q5_0, q8_0), scale_0);
                sumi[r] = KQ_MADD_ADD(sumi[r], _mm256_maddubs_epi16(q5_1, q8_1), scale_1);
            }
        }
        for (int r = 0; r < nt; ++r) {
            const uint8_t *yr = y + r * stride;
            const float yd = f32_at(yr);
            const float d = yd * wd, dmin = -yd * wmin;
            const __m128i prod = mins_by_bsums_v(mins_and_scales, yr);
            const __m128i mzero = _mm_setzero_si128();
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
            summs[r] = fmaf(dmin, (float)_mm_extract_epi32(hsum, 0), summs[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) out[r] = hsum_float_8(acc[r]) + summs[r];
}

/* ggml's AVX2 ggml_vec_dot_q6_K_q8_K, tokens innermost. */
static inline __attribute__((always_inline)) void rows_q6_K(int64_t nb, const uint8_t *w,
                                                           const uint8_t *y, int64_t stride,
                                                           int nt, float *out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[KQ_NT];
    for (int r = 0; r < nt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += Q6_K_BYTES, y += Q8_K_BYTES) {
        const float wd = fp16_at(w + 208);
        const uint8_t *q4 = w, *qh = w + 128;
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i sumi[KQ_NT];
        for (int r = 0; r < nt; ++r) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 128; ++j, q4 += 64, qh += 32) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)q4);
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(q4 + 32));
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 =
                _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 =
                _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
            __m256i q[4], sc[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            q[1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
            for (int c = 0; c < 4; ++c)
                sc[c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(4 * j + c)));
            for (int r = 0; r < nt; ++r) {
                const int8_t *q8 = (const int8_t *)(y + r * stride + Q8_K_QS) + 128 * j;
                for (int c = 0; c < 4; ++c) {
                    const __m256i q8c = _mm256_loadu_si256((const __m256i *)(q8 + 32 * c));
                    sumi[r] = KQ_MADD_ADD(sumi[r], _mm256_maddubs_epi16(q[c], q8c), sc[c]);
                }
            }
        }
        for (int r = 0; r < nt; ++r) {
            const uint8_t *yr = y + r * stride;
            const float d = f32_at(yr) * wd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(yr + Q8_K_BSUMS));
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const __m256i lanes = _mm256_sub_epi32(sumi[r], q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) out[r] = hsum_float_8(acc[r]);
}

#endif /* KQ_AVX2 */

#if defined(KQ_AVX512)

/* The AVX-512 build computes the same eight int32 lanes per super-block as ggml's AVX2 kernels,
 * with VNNI's VPDPWSSD (int16 pair products times the chunk scales, added into the lanes) in
 * place of VPMADDWD + VPADDD. Q5_K stays at 256 bits (as the shared Q4_K code): at 512 its
 * shifts, VPMADDUBSW and VPDPWSSD all issue on port 0, and they measured slower than at 256
 * (figures in the commit that chose this). Q6_K has more to unpack per value and gains from 512 bits: two 32-value
 * chunks per instruction (one in each 256-bit half), folded before the float steps. VPMADDUBSW
 * does not saturate here: 0 <= q <= 63 and |q8| <= 127. Integer sums are exact, so how they are
 * grouped cannot change a bit of the result. */

/* Q6_K's 16 int16 scales spread over 32 words: word i gets scale first + i / 8. */
static inline __m512i spread_scales(__m512i sc16, int first) {
    const __m512i step = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                         13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        3);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16((short)first), step), sc16);
}

static inline __m256i fold_lanes(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}


/* qh bit 2j (2j+1) of each byte is shifted to bit 4 and merged with the low (high) nibbles by
 * one ternary-logic op. */
static inline __attribute__((always_inline)) void rows_q5_K(int64_t nb, const uint8_t *w,
                                                           const uint8_t *y, int64_t stride,
                                                           int nt, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m16 = _mm256_set1_epi8(0x10);
    __m256 acc[KQ_NT];
    float summs[KQ_NT];
    for (int r = 0; r < nt; ++r) {
        acc[r] = _mm256_setzero_ps();
        summs[r] = 0.f;
    }
    for (int64_t i = 0; i < nb; i++, w += Q5_K_BYTES, y += Q8_K_BYTES) {
        const float wd = fp16_at(w), wmin = fp16_at(w + 2);
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(scales_mins_k4(w + 4));
        const __m128i sc128 = _mm256_castsi256_si128(mins_and_scales);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        __m256i hbits = _mm256_loadu_si256((const __m256i *)(w + 16));
        const uint8_t *q5 = w + 48;
        __m256i sumi[KQ_NT][2];
        for (int r = 0; r < nt; ++r) sumi[r][0] = sumi[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; ++j, q5 += 32) {
            const __m256i q5bits = _mm256_loadu_si256((const __m256i *)q5);
            /* bit 0 (1) of each qh byte to bit 4; bits leaking in from the byte below are
             * masked off by the 0x10 of A | (B & C) */
            const __m256i h0 = _mm256_slli_epi16(hbits, 4);
            const __m256i h1 = _mm256_slli_epi16(hbits, 3);
            hbits = _mm256_srli_epi16(hbits, 2);
            const __m256i lo = _mm256_and_si256(q5bits, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4);
            const __m256i q5_0 = _mm256_ternarylogic_epi64(lo, h0, m16, 0xF8);
            const __m256i q5_1 = _mm256_ternarylogic_epi64(hi, h1, m16, 0xF8);
            const __m256i s0 = _mm256_shuffle_epi8(scales, word_index(2 * j));
            const __m256i s1 = _mm256_shuffle_epi8(scales, word_index(2 * j + 1));
            for (int r = 0; r < nt; ++r) {
                const int8_t *q8 = (const int8_t *)(y + r * stride + Q8_K_QS) + 64 * j;
                const __m256i p0 =
                    _mm256_maddubs_epi16(q5_0, _mm256_loadu_si256((const __m256i *)q8));
                const __m256i p1 =
                    _mm256_maddubs_epi16(q5_1, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
                sumi[r][0] = _mm256_dpwssd_epi32(sumi[r][0], p0, s0);
                sumi[r][1] = _mm256_dpwssd_epi32(sumi[r][1], p1, s1);
            }
        }
        for (int r = 0; r < nt; ++r) {
            const uint8_t *yr = y + r * stride;
            const float yd = f32_at(yr);
            const float d = yd * wd, dmin = -yd * wmin;
            const __m128i prod = mins_by_bsums_v(mins_and_scales, yr);
            const __m128i mzero = _mm_setzero_si128();
            const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, mzero), mzero);
            summs[r] = fmaf(dmin, (float)_mm_extract_epi32(hsum, 0), summs[r]);
            const __m256i lanes = _mm256_add_epi32(sumi[r][0], sumi[r][1]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) out[r] = hsum_float_8(acc[r]) + summs[r];
}

static inline __attribute__((always_inline)) void rows_q6_K(int64_t nb, const uint8_t *w,
                                                           const uint8_t *y, int64_t stride,
                                                           int nt, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i m48 = _mm512_set1_epi8(0x30);
    __m256 acc[KQ_NT];
    for (int r = 0; r < nt; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += Q6_K_BYTES, y += Q8_K_BYTES) {
        const float wd = fp16_at(w + 208);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        const __m512i sc16 = _mm512_castsi256_si512(scales_16);
        const uint8_t *ql = w, *qh = w + 128;
        __m512i sumi[KQ_NT][2];
        for (int r = 0; r < nt; ++r) sumi[r][0] = sumi[r][1] = _mm512_setzero_si512();
        for (int j = 0; j < QK_K / 128; ++j, ql += 64, qh += 32) {
            /* chunks 0 and 1: low nibbles of ql[0..63], qh bits 0-1 and 2-3 rotated to bits 4-5;
             * chunks 2 and 3: high nibbles, qh bits 4-5 and 6-7. */
            const __m512i l = _mm512_loadu_si512(ql);
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
            const __m512i h01 =
                _mm512_rorv_epi64(h, _mm512_set_epi64(62, 62, 62, 62, 60, 60, 60, 60));
            const __m512i h23 = _mm512_rorv_epi64(h, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0));
            const __m512i q01 = _mm512_ternarylogic_epi64(_mm512_and_si512(l, m4), h01, m48, 0xF8);
            const __m512i q23 = _mm512_ternarylogic_epi64(
                _mm512_and_si512(_mm512_srli_epi16(l, 4), m4), h23, m48, 0xF8);
            const __m512i s01 = spread_scales(sc16, 8 * j);
            const __m512i s23 = spread_scales(sc16, 8 * j + 4);
            for (int r = 0; r < nt; ++r) {
                const int8_t *q8 = (const int8_t *)(y + r * stride + Q8_K_QS) + 128 * j;
                const __m512i p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(q8));
                const __m512i p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(q8 + 64));
                sumi[r][0] = _mm512_dpwssd_epi32(sumi[r][0], p01, s01);
                sumi[r][1] = _mm512_dpwssd_epi32(sumi[r][1], p23, s23);
            }
        }
        for (int r = 0; r < nt; ++r) {
            const uint8_t *yr = y + r * stride;
            const float d = f32_at(yr) * wd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)(yr + Q8_K_BSUMS));
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const __m256i all = fold_lanes(_mm512_add_epi32(sumi[r][0], sumi[r][1]));
            const __m256i lanes = _mm256_sub_epi32(all, q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) out[r] = hsum_float_8(acc[r]);
}

#endif /* KQ_AVX512 */

/* ---- exported dot products ---------------------------------------------------------------- */

#if defined(KQ_SCALAR)
/* The portable build has no tiles: each token is the single-token dot. */
#define KQ_ROWS(type)                                                                              \
    static void rows_##type##_n(int64_t nb, const uint8_t *w, const uint8_t *y, int64_t stride,   \
                                int nt, float *out) {                                              \
        for (int r = 0; r < nt; ++r) out[r] = dot_##type(nb, w, y + r * stride);                   \
    }
#else
/* One copy per token count, so each keeps its accumulators in registers; the single-token dot
 * is the nt = 1 copy, hence a batch's tokens get a decode step's bits. */
#define KQ_ROWS(type)                                                                              \
    static float dot_##type(int64_t nb, const uint8_t *w, const uint8_t *y) {                      \
        float out;                                                                                 \
        rows_##type(nb, w, y, 0, 1, &out);                                                         \
        return out;                                                                                \
    }                                                                                              \
    static void rows_##type##_n(int64_t nb, const uint8_t *w, const uint8_t *y, int64_t stride,   \
                                int nt, float *out) {                                              \
        switch (nt) {                                                                              \
        case 1: out[0] = dot_##type(nb, w, y); break;                                              \
        case 2: rows_##type(nb, w, y, stride, 2, out); break;                                      \
        case 3: rows_##type(nb, w, y, stride, 3, out); break;                                      \
        default: rows_##type(nb, w, y, stride, KQ_NT, out); break;                                 \
        }                                                                                          \
    }
#endif
KQ_ROWS(q4_K)
KQ_ROWS(q5_K)
KQ_ROWS(q6_K)

float meshd_vec_dot_q4_K_q8_K(int64_t n, const void *w, const void *x) {
    return dot_q4_K(n / QK_K, (const uint8_t *)w, (const uint8_t *)x);
}

float meshd_vec_dot_q5_K_q8_K(int64_t n, const void *w, const void *x) {
    return dot_q5_K(n / QK_K, (const uint8_t *)w, (const uint8_t *)x);
}

float meshd_vec_dot_q6_K_q8_K(int64_t n, const void *w, const void *x) {
    return dot_q6_K(n / QK_K, (const uint8_t *)w, (const uint8_t *)x);
}

/* One weight row of n values against nt (1..KQ_NT) tokens, token r's Q8_K row at
 * x + r * stride bytes: out[r] is what meshd_vec_dot_*_q8_K gives for that token, bit for bit. */
void meshd_rows_q4_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out) {
    rows_q4_K_n(n / QK_K, (const uint8_t *)w, (const uint8_t *)x, stride, nt, out);
}

void meshd_rows_q5_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out) {
    rows_q5_K_n(n / QK_K, (const uint8_t *)w, (const uint8_t *)x, stride, nt, out);
}

void meshd_rows_q6_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out) {
    rows_q6_K_n(n / QK_K, (const uint8_t *)w, (const uint8_t *)x, stride, nt, out);
}

/* Rows 0..7 (row r of n values at w + r * rb bytes) against nt (1..KQ8_NT) tokens, token t's
 * Q8_K row at x + t * stride bytes and its eight outputs at out + t * ldo: each what
 * meshd_vec_dot_q4_K_q8_K gives, bit for bit, requesting the rows at ahead as rows8_q4_K says.
 * One copy per token count (and per way of requesting), so each keeps its accumulators in
 * registers. */
#if !defined(KQ_SCALAR)
#if defined(KQ_PAIRED)
#define ROWS8 rows8_q4_K_pairs
#else
#define ROWS8 rows8_q4_K
#endif
#define KQ_ROWS8(NTC)                                                                              \
    static void rows8_q4_K_##NTC(int64_t nb, const uint8_t *w, int64_t rb, const uint8_t *y,      \
                                 int64_t stride, float *out, int64_t ldo, const uint8_t *ahead,  \
                                 int64_t ahead_bytes, int stream) {                               \
        if (rb > KQ_BURST)                                                                         \
            ROWS8(nb, w, rb, y, stride, NTC, out, ldo, ahead, ahead_bytes, stream, 1);            \
        else                                                                                       \
            ROWS8(nb, w, rb, y, stride, NTC, out, ldo, ahead, ahead_bytes, stream, 0);            \
    }
KQ_ROWS8(1)
KQ_ROWS8(2)
KQ_ROWS8(3)
_Static_assert(KQ8_NT == 3, "one rows8_q4_K copy per token count");
#endif

void meshd_rows8_q4_K_q8_K_nt(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                              int nt, float *out, int64_t ldo, const void *ahead,
                              int64_t ahead_bytes, int stream) {
    const int64_t nb = n / QK_K;
    const uint8_t *wb = (const uint8_t *)w, *y = (const uint8_t *)x, *a = (const uint8_t *)ahead;
#if defined(KQ_SCALAR)
    (void)a, (void)ahead_bytes, (void)stream;
    for (int t = 0; t < nt; ++t)
        for (int r = 0; r < 8; ++r) out[t * ldo + r] = dot_q4_K(nb, wb + r * rb, y + t * stride);
#else
    switch (nt) {
    case 1: rows8_q4_K_1(nb, wb, rb, y, stride, out, ldo, a, ahead_bytes, stream); break;
    case 2: rows8_q4_K_2(nb, wb, rb, y, stride, out, ldo, a, ahead_bytes, stream); break;
    default: rows8_q4_K_3(nb, wb, rb, y, stride, out, ldo, a, ahead_bytes, stream); break;
    }
#endif
}

/* Rows 0 and 1 (row 1 at w + rb bytes) against KQ_NT tokens (token t's Q8_K row at
 * x + t * stride): row r's token t in out[t * ldo + r], what meshd_rows_q4_K_q8_K gives, bit for
 * bit. The AVX2 build computes the two rows together (rows2_q4_K); blocks.c calls this there. */
void meshd_rows2_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           float *out, int64_t ldo) {
    const uint8_t *wb = (const uint8_t *)w, *y = (const uint8_t *)x;
#if defined(KQ_PAIRED)
    rows2_q4_K(n / QK_K, wb, rb, y, stride, out, ldo);
#else
    float o[KQ_NT];
    for (int r = 0; r < 2; ++r) {
        rows_q4_K_n(n / QK_K, wb + r * rb, y, stride, KQ_NT, o);
        for (int t = 0; t < KQ_NT; ++t) out[t * ldo + r] = o[t];
    }
#endif
}

/* Rows 0..15 (row r at w + r * rb bytes) against nt (1..64) tokens (token t's Q8_K row at
 * x + t * stride, its sixteen outputs at out + t * ldo): each what meshd_vec_dot_q4_K_q8_K gives,
 * bit for bit. AVX-512 only (rows16_q4_K); blocks.c calls it there. Returns -1 elsewhere. */
int meshd_rows16_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           int nt, float *out, int64_t ldo) {
#if defined(KQ_AVX512)
    const int64_t nb = n / QK_K;
    const uint8_t *wb = (const uint8_t *)w, *y = (const uint8_t *)x;
    rows16_q4_K(nb, wb, rb, y, stride, nt, out, ldo);
    return 0;
#else
    (void)n, (void)w, (void)rb, (void)x, (void)stride, (void)nt, (void)out, (void)ldo;
    return -1;
#endif
}

/* Rows 0..7 (row r at w + r * rb bytes) against nt (1..64) tokens (token t's Q8_K row at
 * x + t * stride, its eight outputs at out + t * ldo): each what meshd_vec_dot_q4_K_q8_K gives,
 * bit for bit. AVX2 only (rows8t_q4_K); blocks.c calls it there. Returns -1 elsewhere. */
int meshd_rows8t_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           int nt, float *out, int64_t ldo) {
#if defined(KQ_AVX2)
    rows8t_q4_K(n / QK_K, (const uint8_t *)w, rb, (const uint8_t *)x, stride, nt, out, ldo);
    return 0;
#else
    (void)n, (void)w, (void)rb, (void)x, (void)stride, (void)nt, (void)out, (void)ldo;
    return -1;
#endif
}

/* The same against one token's Q8_K row x (a decode step). */
void meshd_rows8_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, float *out,
                           const void *ahead, int64_t ahead_bytes, int stream) {
    meshd_rows8_q4_K_q8_K_nt(n, w, rb, x, 0, 1, out, 8, ahead, ahead_bytes, stream);
}
