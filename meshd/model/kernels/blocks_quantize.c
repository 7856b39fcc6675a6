/* Quantizing fp32 weight rows into ggml's block formats, byte for byte as llama-quantize does.
 *
 * A safetensors checkpoint quantized at load (quantization q8_0, q4_0, q4_k, q5_k, q6_k) is turned
 * into the same blocks a GGUF file of that type would hold, so it runs through the same kernels
 * (blocks.c, blocks_k.c) as a GGUF file run as stored. The rules are ggml's reference quantizers,
 * which llama-quantize runs for every tensor when it is given no importance matrix:
 * quantize_row_q8_0_ref, _q4_0_ref, _q4_1_ref, _q5_0_ref, _q5_1_ref, _q4_K_ref (with its
 * make_qkx2_quants search of scale and minimum), _q5_K_ref and _q6_K_ref (make_qx_quants).
 *
 * Ported from ggml (https://github.com/ggml-org/ggml, as vendored by llama.cpp):
 * src/ggml-quants.c and src/ggml-impl.h (the fp16 conversions). That code is under this licence:
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
 * Rules the callers rely on:
 * - The bytes are the ones ggml's reference functions write: the same float operations in the
 *   same order (the library is compiled with -ffp-contract=off, so no multiply-add is fused that
 *   ggml's generic build does not fuse), fp16 by ggml's exact software conversion on every path.
 * - Rows are independent: rows are split between OpenMP threads, and a row's bytes do not depend
 *   on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ggml_types.h"
#include "half.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* ggml's block layouts (every field 1 or 2 bytes wide: no padding). */
typedef uint16_t half;
typedef struct { half d; int8_t qs[QK]; } block_q8_0;
typedef struct { half d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { half d, m; uint8_t qs[QK / 2]; } block_q4_1;
typedef struct { half d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;
typedef struct { half d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;
typedef struct { half d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct { half d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; half d; } block_q6_K;
_Static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K layout");

/* ---- blocks of 32 ---------------------------------------------------------------------------- */

/* The value of largest magnitude in a block (the first of equals), sign kept: q4_0 and q5_0
 * scale by it so that it lands on the grid's negative end. */
static float widest(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

/* A block's least and greatest values (q4_1 and q5_1 map that range onto their grid). */
static void range_of(const float *x, float *min_out, float *max_out) {
    float min = INFINITY, max = -INFINITY;
    for (int j = 0; j < QK; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    *min_out = min;
    *max_out = max;
}

/* Stores the 5-bit codes of positions j and j + 16 of a q5_0 / q5_1 block: low nibbles in qs,
 * fifth bits in qh. */
static inline void put5(uint8_t *qs, uint32_t *qh, int j, uint8_t xi0, uint8_t xi1) {
    qs[j] = (uint8_t)((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    *qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
    *qh |= ((xi1 & 0x10u) >> 4) << (j + QK / 2);
}

static void q8_0_row(const float *x, block_q8_0 *y, int64_t k) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < nb; i++) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = MAX(amax, fabsf(x[i * QK + j]));
        const float d = amax / ((1 << 7) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_fp16_soft(d);
        for (int j = 0; j < QK; ++j) y[i].qs[j] = (int8_t)roundf(x[i * QK + j] * id);
    }
}

static void q4_0_row(const float *x, block_q4_0 *y, int64_t k) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < nb; i++) {
        const float max = widest(x + i * QK);
        const float d = max / -8;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_fp16_soft(d);
        for (int j = 0; j < QK / 2; ++j) {
            const float x0 = x[i * QK + j] * id;
            const float x1 = x[i * QK + QK / 2 + j] * id;
            const uint8_t xi0 = (uint8_t)MIN(15, (int8_t)(x0 + 8.5f));
            const uint8_t xi1 = (uint8_t)MIN(15, (int8_t)(x1 + 8.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

static void q4_1_row(const float *x, block_q4_1 *y, int64_t k) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < nb; i++) {
        float min, max;
        range_of(x + i * QK, &min, &max);
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_fp16_soft(d);
        y[i].m = to_fp16_soft(min);
        for (int j = 0; j < QK / 2; ++j) {
            const float x0 = (x[i * QK + j] - min) * id;
            const float x1 = (x[i * QK + QK / 2 + j] - min) * id;
            const uint8_t xi0 = (uint8_t)MIN(15, (int8_t)(x0 + 0.5f));
            const uint8_t xi1 = (uint8_t)MIN(15, (int8_t)(x1 + 0.5f));
            y[i].qs[j] = (uint8_t)(xi0 | (xi1 << 4));
        }
    }
}

static void q5_0_row(const float *x, block_q5_0 *y, int64_t k) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < nb; i++) {
        const float max = widest(x + i * QK);
        const float d = max / -16;
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_fp16_soft(d);
        uint32_t qh = 0;
        for (int j = 0; j < QK / 2; ++j) {
            const float x0 = x[i * QK + j] * id;
            const float x1 = x[i * QK + QK / 2 + j] * id;
            const uint8_t xi0 = (uint8_t)MIN(31, (int8_t)(x0 + 16.5f));
            const uint8_t xi1 = (uint8_t)MIN(31, (int8_t)(x1 + 16.5f));
            put5(y[i].qs, &qh, j, xi0, xi1);
        }
        memcpy(&y[i].qh, &qh, sizeof(qh));
    }
}

static void q5_1_row(const float *x, block_q5_1 *y, int64_t k) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < nb; i++) {
        float min, max;
        range_of(x + i * QK, &min, &max);
        const float d = (max - min) / ((1 << 5) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        y[i].d = to_fp16_soft(d);
        y[i].m = to_fp16_soft(min);
        uint32_t qh = 0;
        for (int j = 0; j < QK / 2; ++j) {
            const float x0 = (x[i * QK + j] - min) * id;
            const float x1 = (x[i * QK + QK / 2 + j] - min) * id;
            const uint8_t xi0 = (uint8_t)(x0 + 0.5f);
            const uint8_t xi1 = (uint8_t)(x1 + 0.5f);
            put5(y[i].qs, &qh, j, xi0, xi1);
        }
        memcpy(&y[i].qh, &qh, sizeof(qh));
    }
}

/* ---- K-quants (super-blocks of 256) ---------------------------------------------------------- */

static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* The scale minimising the weighted squared error of x ≈ scale * (L - nmax), searched over 19
 * candidates around -nmax / max (ggml's make_qx_quants; Q6_K calls it with rmse_type 1). */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L, int rmse_type,
                            const float *qw) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    if (rmse_type == 0) {
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            L[i] = (int8_t)(nmax + MAX(-nmax, MIN(nmax - 1, l)));
        }
        return 1 / iscale;
    }
    int return_early = 0;
    if (rmse_type < 0) {
        rmse_type = -rmse_type;
        return_early = 1;
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAX(-nmax, MIN(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = qw ? qw[i] : rmse_type == 1 ? x[i] * x[i] : rmse_type == 2 ? 1 : rmse_type == 3 ? fabsf(x[i]) : sqrtf(fabsf(x[i]));
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    if (return_early) return suml2 > 0 ? 0.5f * (scale + 1 / iscale) : 1 / iscale;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = MAX(-nmax, MIN(nmax - 1, l));
            float w = qw ? qw[i] : rmse_type == 1 ? x[i] * x[i] : rmse_type == 2 ? 1 : rmse_type == 3 ? fabsf(x[i]) : sqrtf(fabsf(x[i]));
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + MAX(-nmax, MIN(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Scale and minimum of x ≈ scale * L - min (L in 0..nmax) minimising the weighted error: the
 * min-max start, then nstep + 1 least-squares fits on grids stretched by rmin + rdelta * is
 * (ggml's make_qkx2_quants, what Q4_K and Q5_K use; n <= 32).
 *
 * ggml tries the candidates one after another, and a candidate that wins moves the minimum the
 * later ones are computed from. Here the candidates from `first` on are computed together (each
 * lane of the inner loops is one candidate, its sums accumulated over i in ggml's order, so every
 * sum has ggml's bits); they are then taken in ggml's order, and after a winner that moved the
 * minimum the rest are computed again from the new one. The result is ggml's, in a fraction of
 * its time (the search is most of a K-quant model's load: about 2x faster than ggml's loop). */
#define NCAND 24 /* candidates computed together: nstep + 1 <= 21 in ggml's callers */

static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)MAX(0, MIN(nmax, l));
        float diff = scale * L[i] + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if (nstep < 1) {
        *the_min = -min;
        return scale;
    }
    const int ns = MIN(nstep + 1, NCAND);
    float isc[NCAND], sl[NCAND], sl2[NCAND], sxl[NCAND], dd[NCAND], ts[NCAND], tm[NCAND];
    float err[NCAND];
    float laux[32][NCAND]; /* the codes as floats (small integers: exact) */
    int first = 0;
    while (first < ns) {
        const float range = max - min;
        const int m = ns - first;
        /* All NCAND lanes are computed (a fixed count the compiler vectorizes without a scalar
         * tail); those past the last candidate are ignored below. */
        for (int c = 0; c < NCAND; ++c) {
            isc[c] = (rmin + rdelta * (first + c) + nmax) / range;
            sl[c] = sl2[c] = sxl[c] = 0;
        }
        for (int i = 0; i < n; ++i) {
            const float xm = x[i] - min, w = weights[i], xi = x[i];
            float *lc = laux[i];
            for (int c = 0; c < NCAND; ++c) {
                /* nearest_int and the clamp, written out so the compiler vectorizes the loop */
                float v = isc[c] * xm + 12582912.f;
                int l;
                memcpy(&l, &v, 4);
                l = (l & 0x007fffff) - 0x00400000;
                l = l < 0 ? 0 : l;
                l = l > nmax ? nmax : l;
                const float lf = (float)l;
                lc[c] = lf;
                sl[c] += w * lf;
                sl2[c] += w * lf * lf;
                sxl[c] += w * lf * xi;
            }
        }
        for (int c = 0; c < NCAND; ++c) {
            dd[c] = sum_w * sl2[c] - sl[c] * sl[c];
            float this_scale = (sum_w * sxl[c] - sum_x * sl[c]) / dd[c];
            float this_min = (sl2[c] * sum_x - sl[c] * sxl[c]) / dd[c];
            ts[c] = this_min > 0 ? sxl[c] / sl2[c] : this_scale;
            tm[c] = this_min > 0 ? 0 : this_min;
            err[c] = 0;
        }
        for (int i = 0; i < n; ++i) {
            const float w = weights[i], xi = x[i];
            const float *lc = laux[i];
            for (int c = 0; c < NCAND; ++c) {
                float diff = ts[c] * lc[c] + tm[c] - xi;
                err[c] += w * (diff * diff);
            }
        }
        int moved = 0;
        for (int c = 0; c < m && !moved; ++c) {
            if (dd[c] > 0 && err[c] < best_error) {
                for (int i = 0; i < n; ++i) L[i] = (uint8_t)laux[i][c];
                best_error = err[c];
                scale = ts[c];
                moved = tm[c] != min;
                min = tm[c];
                if (moved) first += c + 1;
            }
        }
        if (!moved) break;
    }
    *the_min = -min;
    return scale;
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* Q4_K and Q5_K share everything but the code range (nmax 15 or 31), the search grid and the
 * packing of the codes; `L` receives the 256 codes of the super-block. */
static void k_scales(const float *x, int nmax, float rmin, int nstep, half *d_out, half *dmin_out,
                     uint8_t scales_out[12], uint8_t L[QK_K]) {
    float weights[32];
    float mins[QK_K / 32];
    float scales[QK_K / 32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], rmin,
                                     0.1f, nstep);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(scales_out, 0, 12);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = MIN(63, ls);
        lm = MIN(63, lm);
        if (j < 4) {
            scales_out[j] = ls;
            scales_out[j + 4] = lm;
        } else {
            scales_out[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            scales_out[j - 4] |= (uint8_t)((ls >> 4) << 6);
            scales_out[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *d_out = to_fp16_soft(max_scale / 63.f);
    *dmin_out = to_fp16_soft(max_min / 63.f);
    uint8_t sc, m;
    for (int j = 0; j < QK_K / 32; ++j) {
        get_scale_min_k4(j, scales_out, &sc, &m);
        const float d = fp16_soft(*d_out) * sc;
        if (!d) continue;
        const float dm = fp16_soft(*dmin_out) * m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)MAX(0, MIN(nmax, l));
        }
    }
}

static void q4_K_row(const float *x, block_q4_K *y, int64_t k) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        k_scales(x, 15, -1.f, 20, &y[i].d, &y[i].dmin, y[i].scales, L);
        uint8_t *q = y[i].qs;
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            q += 32;
        }
    }
}

static void q5_K_row(const float *x, block_q5_K *y, int64_t k) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        k_scales(x, 31, -0.5f, 15, &y[i].d, &y[i].dmin, y[i].scales, L);
        uint8_t *qh = y[i].qh;
        uint8_t *ql = y[i].qs;
        memset(qh, 0, QK_K / 8);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < QK_K; n += 64) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j];
                if (l1 > 15) {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                int l2 = L[n + j + 32];
                if (l2 > 15) {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
            m1 = (uint8_t)(m1 << 2);
            m2 = (uint8_t)(m2 << 2);
            ql += 32;
        }
    }
}

static void q6_K_row(const float *x, block_q6_K *y, int64_t k) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < QK_K / 16; ++ib) {
            const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib, 1, NULL);
            scales[ib] = scale;
            const float abs_scale = fabsf(scale);
            if (abs_scale > max_abs_scale) {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof(block_q6_K));
            y[i].d = to_fp16_soft(0.f);
            continue;
        }
        float iscale = -128.f / max_scale;
        y[i].d = to_fp16_soft(1 / iscale);
        for (int ib = 0; ib < QK_K / 16; ++ib)
            y[i].scales[ib] = (int8_t)MIN(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < QK_K / 16; ++j) {
            float d = fp16_soft(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                l = MAX(-32, MIN(31, l));
                L[16 * j + ii] = (int8_t)(l + 32);
            }
        }
        uint8_t *ql = y[i].ql;
        uint8_t *qh = y[i].qh;
        for (int j = 0; j < QK_K; j += 128) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l + 0] & 0xF;
                const uint8_t q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF;
                const uint8_t q4 = L[j + l + 96] & 0xF;
                ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
                ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                  ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
            }
            ql += 64;
            qh += 32;
        }
    }
}

/* ---- entry point ----------------------------------------------------------------------------- */

static int64_t quant_row_bytes(int type, int64_t k) {
    switch (type) {
    case T_F32: return k * 4;
    case T_F16: case T_BF16: return k * 2;
    case T_Q8_0: return k % QK ? -1 : k / QK * 34;
    case T_Q4_0: return k % QK ? -1 : k / QK * 18;
    case T_Q4_1: return k % QK ? -1 : k / QK * 20;
    case T_Q5_0: return k % QK ? -1 : k / QK * 22;
    case T_Q5_1: return k % QK ? -1 : k / QK * 24;
    case T_Q4_K: return k % QK_K ? -1 : k / QK_K * 144;
    case T_Q5_K: return k % QK_K ? -1 : k / QK_K * 176;
    case T_Q6_K: return k % QK_K ? -1 : k / QK_K * 210;
    default: return -1;
    }
}

static void quantize_row(int type, const float *x, uint8_t *y, int64_t k) {
    switch (type) {
    case T_F32: memcpy(y, x, (size_t)k * 4); break;
    case T_F16:
        for (int64_t i = 0; i < k; i++) {
            half h = to_fp16_soft(x[i]);
            memcpy(y + 2 * i, &h, 2);
        }
        break;
    case T_BF16:
        for (int64_t i = 0; i < k; i++) {
            uint16_t h = to_bf16(x[i]);
            memcpy(y + 2 * i, &h, 2);
        }
        break;
    case T_Q8_0: q8_0_row(x, (block_q8_0 *)y, k); break;
    case T_Q4_0: q4_0_row(x, (block_q4_0 *)y, k); break;
    case T_Q4_1: q4_1_row(x, (block_q4_1 *)y, k); break;
    case T_Q5_0: q5_0_row(x, (block_q5_0 *)y, k); break;
    case T_Q5_1: q5_1_row(x, (block_q5_1 *)y, k); break;
    case T_Q4_K: q4_K_row(x, (block_q4_K *)y, k); break;
    case T_Q5_K: q5_K_row(x, (block_q5_K *)y, k); break;
    case T_Q6_K: q6_K_row(x, (block_q6_K *)y, k); break;
    default: break;
    }
}

/* 1 where meshd_blocks_quantize_rows writes this type. */
int meshd_blocks_quantizable(int type) { return quant_row_bytes(type, QK_K) > 0; }

/* Quantize n rows of k fp32 values (x, row-major) into `type`'s blocks at y (n * row bytes, the
 * layout a GGUF file stores), rows split between `threads` OpenMP threads. Returns 0, or -1 for a
 * type it does not write or a k the blocks do not divide (nothing written). */
int meshd_blocks_quantize_rows(int type, const float *x, int64_t n, int64_t k, uint8_t *y,
                               int threads) {
    const int64_t rb = quant_row_bytes(type, k);
    if (rb <= 0 || n < 0) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
    for (int64_t r = 0; r < n; r++) quantize_row(type, x + r * k, y + r * rb, k);
    return 0;
}
