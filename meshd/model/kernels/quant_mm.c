/* meshd's int8 matrix product for x86 CPUs with AVX-512 VNNI (see docs/model-runtime.md).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] for fp32 rows x and int8 weights W with one scale per
 * output channel. Each row of x is quantized on its own onto uint8 over its [min, max]
 * (x ~= lo + s * q), so y = sw[n] * (s * sum_k q[k] * Wq[n, k] + lo * sum_k Wq[n, k]).
 *
 * Rules that the Python side relies on:
 * - A row's result has the same bits whatever other rows share the call: its quantization
 *   reads only that row, integer sums are exact, and the epilogue is the same per-element
 *   sequence of fp32 multiplies and adds (no FMA contraction: built with -ffp-contract=off).
 * - Weights are packed by `meshd_int8_pack` into tiles of 64 output channels: for each group
 *   of 4 input positions, 64 x 4 bytes, so a tile streams from memory as one sequence and one
 *   VPDPBUSD consumes each 64-byte line.
 * - Threads split the tiles (OpenMP: the same libgomp runtime as torch once torch is loaded),
 *   in guided chunks rather than fixed halves: on a shared machine one thread is often late
 *   (its core taken by another tenant), and with fixed halves the other waits for it at every
 *   matrix (int8 decode at 2 threads, one process, alternating: 84 tok/s static, 93 guided).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64 /* output channels per tile: four 16-lane vectors */
#define ROWS 4  /* rows sharing one pass over a tile's weights */

int meshd_int8_abi(void) { return 8; }

/* exp(x) for 16 lanes: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 (in two parts), e^r
 * by its degree-6 Taylor polynomial (|r| <= ln 2 / 2: relative error ~2e-7), 2^n by scalef. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* SwiGLU of row `x` [2k] (gate, then up) into `y` [k]: silu(gate) * up. */
static void swiglu_row(const float *x, int64_t k, float *y) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < k; i += 16) {
        __mmask16 m = i + 16 <= k ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
        __m512 g = _mm512_maskz_loadu_ps(m, x + i), u = _mm512_maskz_loadu_ps(m, x + k + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(silu, u));
    }
}

/* RMS norm of row `x` [k] into `y`: x * (1 / sqrt(mean(x^2) + eps)) * weight, as HF computes
 * it in fp32 (the statistic summed in a fixed order, so the same row gives the same bits). */
static void rms_norm_row(const float *x, int64_t k, const float *weight, float eps, float *y) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    if (i < k) {
        __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << (k - i)) - 1), x + i);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    float r = 1.0f / sqrtf(eps + _mm512_reduce_add_ps(acc) * (1.0f / (float)k));
    __m512 vr = _mm512_set1_ps(r);
    for (i = 0; i < k; i += 16) {
        __mmask16 m = i + 16 <= k ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vr);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weight + i)));
    }
}

/* Pack q [N, K] int8 (row-major) into tiles: out has ceil(N/64) * (Kp/4) * 256 bytes, zeros
 * in the padding. Kp is K rounded up to a multiple of 4. */
void meshd_int8_pack(const int8_t *q, int64_t n, int64_t k, int64_t kp, int8_t *out) {
    int64_t tiles = (n + TILE - 1) / TILE, quads = kp / 4;
    memset(out, 0, (size_t)(tiles * quads * 4 * TILE));
    for (int64_t c = 0; c < n; c++) {
        int64_t t = c / TILE, lane = c % TILE;
        int8_t *tile = out + t * quads * 4 * TILE;
        for (int64_t i = 0; i < k; i++)
            tile[(i / 4) * 4 * TILE + lane * 4 + (i % 4)] = q[c * k + i];
    }
}

/* Row `x` [k] onto uint8 codes [kp] (zeros past k); its offset and step. */
static void quantize_row(const float *x, int64_t k, int64_t kp, uint8_t *q, float *lo_out,
                         float *step_out, float tiny) {
    __m512 vmin = _mm512_set1_ps(x[0]), vmax = vmin;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        vmin = _mm512_min_ps(vmin, v);
        vmax = _mm512_max_ps(vmax, v);
    }
    if (i < k) {
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(x[0]), m, x + i);
        vmin = _mm512_min_ps(vmin, v);
        vmax = _mm512_max_ps(vmax, v);
    }
    float lo = _mm512_reduce_min_ps(vmin), hi = _mm512_reduce_max_ps(vmax);
    float step = (hi - lo) / 255.0f;
    if (!(step >= tiny)) step = tiny; /* a constant row (or NaN): every code is 0 */
    float inv = 1.0f / step;
    __m512 vlo = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv);
    __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(255.0f);
    for (i = 0; i < kp; i += 16) {
        __mmask16 m = i + 16 <= k ? (__mmask16)0xFFFF
                      : i < k     ? (__mmask16)((1u << (k - i)) - 1)
                                  : (__mmask16)0;
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        v = _mm512_mul_ps(_mm512_sub_ps(v, vlo), vinv);
        v = _mm512_min_ps(_mm512_max_ps(v, zero), top);
        __m512i c = _mm512_maskz_mov_epi32(m, _mm512_cvtps_epi32(v)); /* nearest, ties even */
        __m128i b = _mm512_cvtusepi32_epi8(c);
        if (i + 16 <= kp)
            _mm_storeu_si128((__m128i *)(q + i), b);
        else
            _mm_mask_storeu_epi8(q + i, (__mmask16)((1u << (kp - i)) - 1), b);
    }
    *lo_out = lo;
    *step_out = step;
}

/* Rows [r0, r0 + R) of x against one tile; R is a constant where this is inlined. */
static inline __attribute__((always_inline)) void tile_rows(
    const int8_t *w, const uint8_t *q, int64_t kp, const int R, int64_t r0, int64_t n0, int64_t n,
    const float *lo, const float *step, const float *sw, const float *wsum, const float *res,
    float *out) {
    __m512i acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 4; g++) acc[r][g] = _mm512_setzero_si512();
    const int64_t quads = kp / 4;
    for (int64_t j = 0; j < quads; j++) {
        const __m512i *wp = (const __m512i *)(w + j * 4 * TILE);
        __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 1);
        __m512i w2 = _mm512_loadu_si512(wp + 2), w3 = _mm512_loadu_si512(wp + 3);
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, q + (r0 + r) * kp + 4 * j, 4);
            __m512i xb = _mm512_set1_epi32(four);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
            acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 vs = _mm512_set1_ps(step[r0 + r]), vl = _mm512_set1_ps(lo[r0 + r]);
        for (int g = 0; g < 4; g++) {
            int64_t c = n0 + 16 * g;
            if (c >= n) break;
            __mmask16 m = c + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
            __m512 v = _mm512_cvtepi32_ps(acc[r][g]);
            v = _mm512_add_ps(_mm512_mul_ps(vs, v), _mm512_mul_ps(vl, _mm512_loadu_ps(wsum + c)));
            v = _mm512_mul_ps(_mm512_loadu_ps(sw + c), v);
            float *o = out + (r0 + r) * n + c;
            if (res != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res + (r0 + r) * n + c));
            _mm512_mask_storeu_ps(o, m, v);
        }
    }
}

/* Rows of x through the prologue (RMS norm, SwiGLU or nothing: see meshd_int8_mm) onto
 * uint8 codes q [m, kp], with each row's offset and step. `normed` holds k floats. */
static void prepare_rows(const float *x, int64_t m, int64_t k, int64_t kp, const float *norm_weight,
                         float eps, int glu, float tiny, uint8_t *q, float *lo, float *step,
                         float *normed) {
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * (glu ? 2 * k : k);
        if (glu) {
            swiglu_row(row, k, normed);
            row = normed;
        } else if (norm_weight != NULL) {
            rms_norm_row(row, k, norm_weight, eps, normed);
            row = normed;
        }
        quantize_row(row, k, kp, q + r * kp, lo + r, step + r, tiny);
    }
}

/* out [m, n] = f(x) @ W^T (+ res [m, n] when not NULL), where f is the RMS norm with
 * `norm_weight` [k] and `eps` when norm_weight is not NULL, SwiGLU when `glu` (x is then
 * [m, 2k]: gate and up), else nothing (x [m, k]). sw and wsum hold ceil(n/64)*64 floats (the
 * weights' scales and code sums, zeros past n). Returns 0, or -1 when out of memory. */
int meshd_int8_mm(const float *x, int64_t m, int64_t k, const int8_t *w, const float *sw,
                  const float *wsum, int64_t n, int64_t kp, float *out, const float *res,
                  const float *norm_weight, float eps, int glu, float tiny, int threads) {
    uint8_t *q = (uint8_t *)aligned_alloc(64, (size_t)((m * kp + 63) / 64 * 64));
    float *lo = (float *)malloc((size_t)(m * 2 + k) * sizeof(float));
    if (q == NULL || lo == NULL) {
        free(q);
        free(lo);
        return -1;
    }
    float *step = lo + m;
    prepare_rows(x, m, k, kp, norm_weight, eps, glu, tiny, q, lo, step, lo + 2 * m);
    const int64_t tiles = (n + TILE - 1) / TILE, tile_bytes = kp * TILE;
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int8_t *wt = w + t * tile_bytes;
        int64_t r0 = 0;
        for (; r0 + ROWS <= m; r0 += ROWS)
            tile_rows(wt, q, kp, ROWS, r0, t * TILE, n, lo, step, sw, wsum, res, out);
        switch (m - r0) {
        case 3: tile_rows(wt, q, kp, 3, r0, t * TILE, n, lo, step, sw, wsum, res, out); break;
        case 2: tile_rows(wt, q, kp, 2, r0, t * TILE, n, lo, step, sw, wsum, res, out); break;
        case 1: tile_rows(wt, q, kp, 1, r0, t * TILE, n, lo, step, sw, wsum, res, out); break;
        default: break;
        }
    }
    free(q);
    free(lo);
    return 0;
}

/* ---- int4: asymmetric 4-bit groups ------------------------------------------------------
 * w[n, i] = (c - 8) * d[n, g] + z[n, g] for the group g = i / G (G = 32 or 64), c in 0..15,
 * d and z bf16 (torch's int4pack convention). With a row x ~= lo + s * q:
 *   y[n] = s * sum_g (d * A_g + (z - 8 d) * X_g) + lo * wsum[n]
 * where A_g = sum_{i in g} c_i q_i (VPDPBUSD), X_g = sum_{i in g} q_i, and wsum the sum of the
 * stored weights. Tiles of 64 channels as for int8; a quad's 64 x 4 codes take 128 bytes: byte
 * (h, lane * 4 + i) of half h holds channel 32h + lane in its low nibble and channel
 * 32h + 16 + lane in its high one, at input 4 * quad + i. d and z are stored per tile and group
 * as 64 bf16 each. */

void meshd_int4_pack(const uint8_t *c, int64_t n, int64_t k, uint8_t *out) {
    int64_t tiles = (n + TILE - 1) / TILE, quads = k / 4;
    memset(out, 0x88, (size_t)(tiles * quads * 128)); /* padding channels: code 8, weight 0 */
    for (int64_t ch = 0; ch < n; ch++) {
        int64_t t = ch / TILE, lane = ch % TILE, h = lane / 32, hi = (lane % 32) / 16, l = lane % 16;
        uint8_t *tile = out + t * quads * 128;
        for (int64_t i = 0; i < k; i++) {
            uint8_t *b = tile + (i / 4) * 128 + h * 64 + l * 4 + (i % 4);
            uint8_t code = c[ch * k + i] & 0x0F;
            *b = hi ? (uint8_t)((*b & 0x0F) | (code << 4)) : (uint8_t)((*b & 0xF0) | code);
        }
    }
}

static inline __m512 bf16x16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

static inline __attribute__((always_inline)) void tile_rows4(
    const uint8_t *w, const uint16_t *dz, const uint8_t *q, const int32_t *xs, int64_t k,
    int64_t group, const int R, int64_t r0, int64_t n0, int64_t n, const float *lo,
    const float *step, const float *wsum, const float *res, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512 eight = _mm512_set1_ps(8.0f);
    const int64_t groups = k / group, qpg = group / 4;
    __m512 f[2][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) f[r][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* Two sets of sums, for even and odd quads: twice the independent VPDPBUSD chains
         * (integer sums, so the bits are the same), which the one set's latency bounded. */
        __m512i acc[2][4], odd[2][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) acc[r][v] = odd[r][v] = _mm512_setzero_si512();
        for (int64_t j = g * qpg; j < (g + 1) * qpg; j += 2) {
            const __m512i *wp = (const __m512i *)(w + j * 128);
            __m512i a = _mm512_loadu_si512(wp), b = _mm512_loadu_si512(wp + 1);
            __m512i c = _mm512_loadu_si512(wp + 2), e = _mm512_loadu_si512(wp + 3);
            __m512i w0 = _mm512_and_si512(a, low), w1 = _mm512_and_si512(_mm512_srli_epi16(a, 4), low);
            __m512i w2 = _mm512_and_si512(b, low), w3 = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            __m512i u0 = _mm512_and_si512(c, low), u1 = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
            __m512i u2 = _mm512_and_si512(e, low), u3 = _mm512_and_si512(_mm512_srli_epi16(e, 4), low);
            for (int r = 0; r < R; r++) {
                int32_t four[2];
                memcpy(four, q + (r0 + r) * k + 4 * j, 8);
                __m512i xb = _mm512_set1_epi32(four[0]), yb = _mm512_set1_epi32(four[1]);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
                acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
                acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
                odd[r][0] = _mm512_dpbusd_epi32(odd[r][0], yb, u0);
                odd[r][1] = _mm512_dpbusd_epi32(odd[r][1], yb, u1);
                odd[r][2] = _mm512_dpbusd_epi32(odd[r][2], yb, u2);
                odd[r][3] = _mm512_dpbusd_epi32(odd[r][3], yb, u3);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_add_epi32(acc[r][v], odd[r][v]);
        const uint16_t *d = dz + g * 2 * TILE, *z = d + TILE;
        for (int v = 0; v < 4; v++) {
            __m512 dv = bf16x16(d + 16 * v), zv = bf16x16(z + 16 * v);
            __m512 mv = _mm512_sub_ps(zv, _mm512_mul_ps(eight, dv));
            for (int r = 0; r < R; r++) {
                __m512 xg = _mm512_set1_ps((float)xs[(r0 + r) * groups + g]);
                __m512 t = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(acc[r][v]));
                f[r][v] = _mm512_add_ps(f[r][v], _mm512_add_ps(t, _mm512_mul_ps(mv, xg)));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 vs = _mm512_set1_ps(step[r0 + r]), vl = _mm512_set1_ps(lo[r0 + r]);
        for (int v = 0; v < 4; v++) {
            int64_t c = n0 + 16 * v;
            if (c >= n) break;
            __mmask16 m = c + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
            __m512 y = _mm512_add_ps(_mm512_mul_ps(vs, f[r][v]), _mm512_mul_ps(vl, _mm512_loadu_ps(wsum + c)));
            if (res != NULL) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, res + (r0 + r) * n + c));
            _mm512_mask_storeu_ps(out + (r0 + r) * n + c, m, y);
        }
    }
}

/* As meshd_int8_mm for int4 weights packed by meshd_int4_pack (k a multiple of `group`, which
 * is a multiple of 4); dz holds each tile's groups' d and z (bf16), wsum ceil(n/64)*64 sums. */
int meshd_int4_mm(const float *x, int64_t m, int64_t k, const uint8_t *w, const uint16_t *dz,
                  const float *wsum, int64_t n, int64_t group, float *out, const float *res,
                  const float *norm_weight, float eps, int glu, float tiny, int threads) {
    const int64_t groups = k / group;
    uint8_t *q = (uint8_t *)aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *lo = (float *)malloc((size_t)(m * 2 + k) * sizeof(float));
    int32_t *xs = (int32_t *)malloc((size_t)(m * groups) * sizeof(int32_t));
    if (q == NULL || lo == NULL || xs == NULL) {
        free(q);
        free(lo);
        free(xs);
        return -1;
    }
    float *step = lo + m;
    prepare_rows(x, m, k, k, norm_weight, eps, glu, tiny, q, lo, step, lo + 2 * m);
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int64_t i = g * group; i < (g + 1) * group; i++) sum += q[r * k + i];
            xs[r * groups + g] = sum;
        }
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = w + t * (k / 4) * 128;
        const uint16_t *dzt = dz + t * groups * 2 * TILE;
        int64_t r0 = 0;
        for (; r0 + 2 <= m; r0 += 2)
            tile_rows4(wt, dzt, q, xs, k, group, 2, r0, t * TILE, n, lo, step, wsum, res, out);
        if (r0 < m) tile_rows4(wt, dzt, q, xs, k, group, 1, r0, t * TILE, n, lo, step, wsum, res, out);
    }
    free(q);
    free(lo);
    free(xs);
    return 0;
}

/* ---- fp32: the same products for full-precision weights -----------------------------------
 * out [m, n] = f(x) @ W^T (+ res) as meshd_int8_mm, for fp32 weights left where the stage
 * keeps them for torch (`llama.linear_weight`): `transposed` 1 reads W^T as [k][ld] (the
 * contiguous [in, out] copy of q/k/v and gate/up), 0 reads W as [n][ld] (the checkpoint's
 * [out, in] rows of o and down). Every output sums its k products in one order whatever m,
 * the thread count or the split are (one FMA chain per 16 lanes), so a row's result is the
 * same alone or in a window; it differs from MKL's sum in the last bits. */

/* Input rows per pass over a thread's columns of [k][ld]: each row's slice of the pass is one
 * long forward stream for the prefetcher. Each thread takes one contiguous column range: with
 * shorter chunks (8 tiles) the streams were 2 KB long and the product reached 15-17 GB/s from
 * memory where MKL reaches 20-25 (1024 x 5632, one core; docs/model-runtime.md). */
#define F32_KBLOCK 16

/* Rows [r0, r0 + R) through input rows [k0, k1) of a [k][ld] matrix for the outputs of tile
 * n0: acc starts from `out` unless k0 is 0. */
static inline __attribute__((always_inline)) void f32_in_tile(
    const float *x, int64_t k, const float *w, int64_t ld, int64_t n, const int R, int64_t r0,
    int64_t n0, int64_t k0, int64_t k1, float *out) {
    __m512 acc[ROWS][4];
    __mmask16 mk[4];
    for (int g = 0; g < 4; g++) {
        int64_t c = n0 + 16 * g;
        mk[g] = c >= n ? 0 : c + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 4; g++)
            acc[r][g] = k0 == 0 ? _mm512_setzero_ps()
                                : _mm512_maskz_loadu_ps(mk[g], out + (r0 + r) * n + n0 + 16 * g);
    for (int64_t j = k0; j < k1; j++) {
        const float *wr = w + j * ld + n0;
        __m512 w0 = _mm512_maskz_loadu_ps(mk[0], wr), w1 = _mm512_maskz_loadu_ps(mk[1], wr + 16);
        __m512 w2 = _mm512_maskz_loadu_ps(mk[2], wr + 32), w3 = _mm512_maskz_loadu_ps(mk[3], wr + 48);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(x[(r0 + r) * k + j]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 4; g++)
            _mm512_mask_storeu_ps(out + (r0 + r) * n + n0 + 16 * g, mk[g], acc[r][g]);
}

/* Rows [r0, r0 + R) against outputs [c0, c0 + 4) of an [n][ld] matrix (c0 + 4 <= n, or the
 * last outputs one by one with C = 1). */
static inline __attribute__((always_inline)) void f32_out_rows(
    const float *x, int64_t k, const float *w, int64_t ld, int64_t n, const int R, const int C,
    int64_t r0, int64_t c0, float *out) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __mmask16 m = j + 16 <= k ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1);
        __m512 wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm512_maskz_loadu_ps(m, w + (c0 + c) * ld + j);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (r0 + r) * k + j);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[(r0 + r) * n + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

int meshd_f32_mm(const float *x, int64_t m, int64_t k, const float *w, int64_t ld, int64_t n,
                 int transposed, float *out, const float *res, const float *norm_weight, float eps,
                 int glu, int threads) {
    float *xs = NULL;
    if (glu || norm_weight != NULL) {
        xs = (float *)malloc((size_t)(m * k) * sizeof(float));
        if (xs == NULL) return -1;
        for (int64_t r = 0; r < m; r++) {
            if (glu)
                swiglu_row(x + r * 2 * k, k, xs + r * k);
            else
                rms_norm_row(x + r * k, k, norm_weight, eps, xs + r * k);
        }
        x = xs;
    }
    if (transposed) {
        const int64_t tiles = (n + TILE - 1) / TILE, per = (tiles + threads - 1) / threads;
        const int64_t chunks = (tiles + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t t1 = (ch + 1) * per < tiles ? (ch + 1) * per : tiles;
            for (int64_t k0 = 0; k0 < k; k0 += F32_KBLOCK) {
                const int64_t k1 = k0 + F32_KBLOCK < k ? k0 + F32_KBLOCK : k;
                for (int64_t t = ch * per; t < t1; t++) {
                    int64_t r0 = 0;
                    for (; r0 + ROWS <= m; r0 += ROWS)
                        f32_in_tile(x, k, w, ld, n, ROWS, r0, t * TILE, k0, k1, out);
                    switch (m - r0) {
                    case 3: f32_in_tile(x, k, w, ld, n, 3, r0, t * TILE, k0, k1, out); break;
                    case 2: f32_in_tile(x, k, w, ld, n, 2, r0, t * TILE, k0, k1, out); break;
                    case 1: f32_in_tile(x, k, w, ld, n, 1, r0, t * TILE, k0, k1, out); break;
                    default: break;
                    }
                }
            }
        }
    } else {
        const int64_t quads = n / 4;
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1)
        for (int64_t q = 0; q < quads; q++) {
            int64_t r0 = 0;
            for (; r0 + ROWS <= m; r0 += ROWS) f32_out_rows(x, k, w, ld, n, ROWS, 4, r0, 4 * q, out);
            switch (m - r0) {
            case 3: f32_out_rows(x, k, w, ld, n, 3, 4, r0, 4 * q, out); break;
            case 2: f32_out_rows(x, k, w, ld, n, 2, 4, r0, 4 * q, out); break;
            case 1: f32_out_rows(x, k, w, ld, n, 1, 4, r0, 4 * q, out); break;
            default: break;
            }
        }
        for (int64_t c = 4 * quads; c < n; c++)
            for (int64_t r = 0; r < m; r++) f32_out_rows(x, k, w, ld, n, 1, 1, r, c, out);
    }
    if (res != NULL)
        for (int64_t i = 0; i < m * n; i++) out[i] = res[i] + out[i];
    free(xs);
    return 0;
}

/* ---- attention of single query rows against an fp32 KV cache ----------------------------
 * Row r (of t) attends keys [lo[r], end[r]) of `kv` ([position][2 * n_kv][hd]: keys, then
 * values), head h reading kv head h / (n_heads / n_kv): out[r, h] = softmax(q.k * scale) v.
 * Every (row, head) is computed by the same code whatever t is, so a verify window's row has
 * the bits of the same position decoded alone. Returns 0, or -1 when out of memory. */
static void attend_head(const float *q, const float *keys, const float *values, int64_t stride,
                        int64_t hd, int64_t lo, int64_t end, float scale, float *scores,
                        float *out) {
    const int64_t n = end - lo;
    float best = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *k = keys + (lo + j) * stride;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 16) {
            __mmask16 m = d + 16 <= hd ? (__mmask16)0xFFFF : (__mmask16)((1u << (hd - d)) - 1);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, q + d),
                                                   _mm512_maskz_loadu_ps(m, k + d)));
        }
        float s = _mm512_reduce_add_ps(acc) * scale;
        scores[j] = s;
        if (s > best) best = s;
    }
    __m512 vbest = _mm512_set1_ps(best), vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = j + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), vbest));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(scores + j, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (int64_t d = 0; d < hd; d += 16) {
        __mmask16 m = d + 16 <= hd ? (__mmask16)0xFFFF : (__mmask16)((1u << (hd - d)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *v = values + (lo + j) * stride + d;
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(scores[j]), _mm512_maskz_loadu_ps(m, v)));
        }
        _mm512_mask_storeu_ps(out + d, m, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
    }
}

int meshd_attend(const float *q, int64_t q_stride, int64_t t, const float *kv, int64_t n_heads,
                 int64_t n_kv, int64_t hd, const int64_t *lo, const int64_t *end, float scale,
                 float *out, int threads) {
    int64_t longest = 1;
    for (int64_t r = 0; r < t; r++)
        if (end[r] - lo[r] > longest) longest = end[r] - lo[r];
    const int64_t jobs = t * n_heads, group = n_heads / n_kv, stride = 2 * n_kv * hd;
    float *scores = (float *)malloc((size_t)(jobs * ((longest + 15) / 16 * 16)) * sizeof(float));
    if (scores == NULL) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t r = job / n_heads, h = job % n_heads, g = h / group;
        attend_head(q + r * q_stride + h * hd, kv + g * hd, kv + (n_kv + g) * hd, stride, hd, lo[r], end[r], scale,
                    scores + job * ((longest + 15) / 16 * 16), out + (r * n_heads + h) * hd);
    }
    free(scores);
    return 0;
}

/* ---- whole decoder layers: rows of one or several sessions through every layer of a stage --
 * One call runs what `llama.decoder_layer` does for each layer (RMS norm, q/k/v product,
 * biases, RoPE, the cache write, attention one row at a time, the output product and residual,
 * then norm, gate/up, SwiGLU and down with its residual), with the products above. It exists
 * because between the products a decode step otherwise runs ~15 small torch operations and
 * Python calls per layer, ~1 ms a token on the 16-layer checkpoint we measure, which a second
 * core cannot shorten. Row r is at position pos[r] of session sess[r] and attends that
 * session's keys [max(0, pos[r] + 1 - window), pos[r] + 1): each row computes exactly the bits
 * it would alone, so verify windows and batches stay row-exact. */

typedef struct {
    /* 8: int8 (layout = padded input), 4: int4 (layout = group), 32: fp32 [k][layout] (codes
     * W^T), 33: fp32 [n][layout] (codes W), 64: GGUF tensors as stored (codes: `layout`
     * meshd_block_part, side by side; scales: the block library's meshd_blocks_parts_mm) */
    int64_t kind;
    int64_t in, out, layout;
    const void *codes, *scales;
    const float *sums;
} meshd_matrix;

/* One GGUF tensor [out][in] of a kind-64 operand: its ggml type and bytes as stored, and where
 * each of its output columns comes from (perm[c]: the tensor's row; NULL: in order). */
typedef struct {
    int64_t type, out;
    const void *data;
    const int64_t *perm;
} meshd_block_part;

/* blocks.c's meshd_blocks_parts_mm: out [t][ldo] = every part's product side by side (+ res),
 * each input row converted once per vec_dot type, all parts in one parallel region. */
typedef int (*meshd_blocks_parts_fn)(const meshd_block_part *parts, int64_t n_parts, int64_t k,
                                     const float *x, int64_t t, float *out, int64_t ldo,
                                     const float *res, int threads);

/* out [m, n] = f(x) @ W^T (+ res), f as for meshd_int8_mm, for a kind-64 operand: its parts'
 * products by the block library, their columns placed at their offsets (permuted where a part
 * says). */
static int blocks_mm(const meshd_matrix *w, const float *x, int64_t m, float *out,
                     const float *res, const float *norm, float eps, int glu, int threads) {
    const int64_t k = w->in;
    float *rows = (norm != NULL || glu) ? (float *)malloc((size_t)(m * k) * sizeof(float)) : NULL;
    if ((norm != NULL || glu) && rows == NULL) return -1;
    const float *xin = x;
    if (rows != NULL) {
        for (int64_t r = 0; r < m; r++) {
            if (glu)
                swiglu_row(x + r * 2 * k, k, rows + r * k);
            else
                rms_norm_row(x + r * k, k, norm, eps, rows + r * k);
        }
        xin = rows;
    }
    const meshd_blocks_parts_fn mm = (meshd_blocks_parts_fn)w->scales;
    const int failed = mm((const meshd_block_part *)w->codes, w->layout, k, xin, m, out, w->out,
                          res, threads);
    free(rows);
    return failed ? -1 : 0;
}

typedef struct {
    meshd_matrix qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    const float *bqkv, *bo, *b_gate_up, *b_down; /* biases may be NULL */
    int64_t window;                              /* sliding window, 0: none */
} meshd_layer;

typedef struct {
    int64_t n_heads, n_kv, hd, hidden, inter;
    float eps, tiny, scale;
} meshd_dims;

static int matrix_mm(const meshd_matrix *w, const float *x, int64_t m, float *out,
                     const float *res, const float *norm, float eps, int glu, float tiny,
                     int threads) {
    if (w->kind == 64) return blocks_mm(w, x, m, out, res, norm, eps, glu, threads);
    if (w->kind == 32 || w->kind == 33)
        return meshd_f32_mm(x, m, w->in, (const float *)w->codes, w->layout, w->out,
                            w->kind == 32, out, res, norm, eps, glu, threads);
    if (w->kind == 8)
        return meshd_int8_mm(x, m, w->in, (const int8_t *)w->codes, (const float *)w->scales,
                             w->sums, w->out, w->layout, out, res, norm, eps, glu, tiny, threads);
    return meshd_int4_mm(x, m, w->in, (const uint8_t *)w->codes, (const uint16_t *)w->scales,
                         w->sums, w->out, w->layout, out, res, norm, eps, glu, tiny, threads);
}

static void add_bias(float *y, int64_t m, int64_t n, const float *b) {
    if (b == NULL) return;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) y[r * n + c] += b[c];
}

/* Rotate adjacent pairs (2i, 2i+1) of each of `heads` heads of `x` by the position's
 * cos + i sin pairs `cs` [hd / 2][2]: (a + ib)(c + is) = (ac - bs) + i(bc + as), each product
 * rounded before the sum, as torch's complex multiply does. Written with intrinsics because
 * GCC's vectorizer turns the plain C of it into fused multiply-adds (vfmaddsub) even under
 * -ffp-contract=off, which changes the last bit. */
static void rope_heads(float *x, int64_t heads, int64_t hd, const float *cs) {
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * hd;
        for (int64_t i = 0; i < hd; i += 16) {
            __mmask16 m = i + 16 <= hd ? (__mmask16)0xFFFF : (__mmask16)((1u << (hd - i)) - 1);
            __m512 ab = _mm512_maskz_loadu_ps(m, v + i), t = _mm512_maskz_loadu_ps(m, cs + i);
            __m512 c = _mm512_moveldup_ps(t), s = _mm512_movehdup_ps(t);
            __m512 ac_bc = _mm512_mul_ps(ab, c);
            __m512 bs_as = _mm512_mul_ps(_mm512_permute_ps(ab, 0xB1), s);
            __m512 r = _mm512_mask_sub_ps(_mm512_add_ps(ac_bc, bs_as), (__mmask16)0x5555, ac_bc, bs_as);
            _mm512_mask_storeu_ps(v + i, m, r);
        }
    }
}

#define ATTEND_SPLIT 2048

int meshd_layers(const meshd_layer *layers, int64_t n_layers, const meshd_dims *d, float *x,
                 int64_t t, const int64_t *pos, const int64_t *sess, float *const *kv,
                 const float *const *rope, int threads, int attn_threads) {
    const int64_t hd = d->hd, nh = d->n_heads, nkv = d->n_kv, hidden = d->hidden;
    const int64_t width = (nh + 2 * nkv) * hd, kv_width = 2 * nkv * hd;
    int64_t longest = 1;
    for (int64_t r = 0; r < t; r++)
        if (pos[r] + 1 > longest) longest = pos[r] + 1;
    const int64_t padded = (longest + 15) / 16 * 16;
    float *qkv = (float *)malloc((size_t)(t * width) * sizeof(float));
    float *att = (float *)malloc((size_t)(t * nh * hd) * sizeof(float));
    float *h = (float *)malloc((size_t)(t * hidden) * sizeof(float));
    float *gu = (float *)malloc((size_t)(t * 2 * d->inter) * sizeof(float));
    float *scores = (float *)malloc((size_t)(t * nh * padded) * sizeof(float));
    int failed = qkv == NULL || att == NULL || h == NULL || gu == NULL || scores == NULL;
    for (int64_t l = 0; l < n_layers && !failed; l++) {
        const meshd_layer *w = layers + l;
        failed |= matrix_mm(&w->qkv, x, t, qkv, NULL, w->input_norm, d->eps, 0, d->tiny, threads);
        if (failed) break;
        add_bias(qkv, t, width, w->bqkv);
        for (int64_t r = 0; r < t; r++) {
            float *row = qkv + r * width;
            rope_heads(row, nh + nkv, hd, rope[r]);
            memcpy(kv[sess[r] * n_layers + l] + pos[r] * kv_width, row + nh * hd,
                   (size_t)kv_width * sizeof(float));
        }
        /* Every row's keys are in the cache before any row attends (a window's later rows
         * see its earlier ones). */
        const int64_t jobs = t * nh, group = nh / nkv;
        /* Short spans attend on the calling thread: below ATTEND_SPLIT scores the threads' hand-off
         * costs about what the split saves (each (row, head) is computed alike either way). */
        const int at = jobs * padded >= ATTEND_SPLIT ? attn_threads : 1;
#pragma omp parallel for schedule(static) num_threads(at) if (at > 1)
        for (int64_t job = 0; job < jobs; job++) {
            const int64_t r = job / nh, head = job % nh, g = head / group;
            const float *cache = kv[sess[r] * n_layers + l];
            const int64_t lo = w->window > 0 && pos[r] + 1 > w->window ? pos[r] + 1 - w->window : 0;
            attend_head(qkv + r * width + head * hd, cache + g * hd, cache + (nkv + g) * hd,
                        kv_width, hd, lo, pos[r] + 1, d->scale, scores + job * padded,
                        att + (r * nh + head) * hd);
        }
        failed |= matrix_mm(&w->o, att, t, h, x, NULL, 0.0f, 0, d->tiny, threads);
        if (failed) break;
        add_bias(h, t, hidden, w->bo);
        failed |= matrix_mm(&w->gate_up, h, t, gu, NULL, w->post_norm, d->eps, 0, d->tiny, threads);
        if (failed) break;
        add_bias(gu, t, 2 * d->inter, w->b_gate_up);
        failed |= matrix_mm(&w->down, gu, t, x, h, NULL, 0.0f, 1, d->tiny, threads);
        add_bias(x, t, hidden, w->b_down);
    }
    free(qkv);
    free(att);
    free(h);
    free(gu);
    free(scores);
    return failed ? -1 : 0;
}
