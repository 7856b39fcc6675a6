/* meshd's decoder layers for x86 CPUs with AVX-512 (see docs/model-runtime.md): every layer of a
 * stage in one call (`meshd_layers`), its products by the fp32 product below or, for matrices
 * in ggml's block formats, by the block library (blocks.c), and attention one query row at a
 * time.
 *
 * Rules that the Python side relies on:
 * - A row's result has the same bits whatever other rows share the call: each product sums a
 *   row's terms in one fixed order, the block library quantizes each row on its own, and no
 *   multiply-add is contracted by the compiler (built with -ffp-contract=off).
 * - Threads split the output columns (OpenMP: the same libgomp runtime as torch once torch is
 *   loaded), in guided chunks where the work is uneven: on a shared machine one thread is often
 *   late (its core taken by another tenant), and with fixed halves the other waits for it at
 *   every matrix.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 64 /* output channels per tile: four 16-lane vectors */
#define ROWS 4  /* rows sharing one pass over a tile's weights */

int meshd_layers_abi(void) { return 2; }

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

/* Rows from which a prologue (and a layer's RoPE) splits over the threads: a decode step's row
 * and short verify windows stay on the calling thread, with no hand-off; a prefill's rows split
 * (16: not tuned; docs/benchmarks.md, "AVX2 prefill against llama.cpp built without AVX-512"). */
#define PROLOGUE_SPLIT_ROWS 16

/* A product's prologue for rows x [m, k] (SwiGLU when `glu`: x is [m, 2k], gate then up; else
 * the RMS norm with `norm_weight`) into y [m, k]. */
static void prologue_rows(const float *x, int64_t m, int64_t k, const float *norm_weight,
                          float eps, int glu, float *y, int threads) {
    /* Each row is computed alike on any thread: the split changes no bit. */
    const int at = m >= PROLOGUE_SPLIT_ROWS ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(at) if (at > 1)
    for (int64_t r = 0; r < m; r++) {
        if (glu)
            swiglu_row(x + r * 2 * k, k, y + r * k);
        else
            rms_norm_row(x + r * k, k, norm_weight, eps, y + r * k);
    }
}

/* ---- fp32 products ----------------------------------------------------------------------------
 * out [m, n] = f(x) @ W^T (+ res [m, n] when not NULL), where f is the RMS norm with
 * `norm_weight` [k] and `eps` when norm_weight is not NULL, SwiGLU when `glu` (x is then
 * [m, 2k]: gate and up), else nothing (x [m, k]), for fp32 weights left where the stage
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
        prologue_rows(x, m, k, norm_weight, eps, glu, xs, threads);
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
    /* 32: fp32 [k][layout] (codes W^T), 33: fp32 [n][layout] (codes W), 64: ggml blocks (a
     * GGUF file's tensors as stored, or a checkpoint quantized at load; codes: `layout`
     * meshd_block_part, side by side; scales: the block library's meshd_blocks_parts_mm) */
    int64_t kind;
    int64_t in, out, layout;
    const void *codes, *scales;
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

/* out [m, n] = f(x) @ W^T (+ res), f as for meshd_f32_mm, for a kind-64 operand: its parts'
 * products by the block library, their columns placed at their offsets (permuted where a part
 * says). */
static int blocks_mm(const meshd_matrix *w, const float *x, int64_t m, float *out,
                     const float *res, const float *norm, float eps, int glu, int threads) {
    const int64_t k = w->in;
    float *rows = (norm != NULL || glu) ? (float *)malloc((size_t)(m * k) * sizeof(float)) : NULL;
    if ((norm != NULL || glu) && rows == NULL) return -1;
    const float *xin = x;
    if (rows != NULL) {
        prologue_rows(x, m, k, norm, eps, glu, rows, threads);
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
    float eps, scale;
} meshd_dims;

static int matrix_mm(const meshd_matrix *w, const float *x, int64_t m, float *out,
                     const float *res, const float *norm, float eps, int glu, int threads) {
    if (w->kind == 64) return blocks_mm(w, x, m, out, res, norm, eps, glu, threads);
    return meshd_f32_mm(x, m, w->in, (const float *)w->codes, w->layout, w->out, w->kind == 32,
                        out, res, norm, eps, glu, threads);
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
        failed |= matrix_mm(&w->qkv, x, t, qkv, NULL, w->input_norm, d->eps, 0, threads);
        if (failed) break;
        add_bias(qkv, t, width, w->bqkv);
        const int rt = t >= PROLOGUE_SPLIT_ROWS ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(rt) if (rt > 1)
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
        failed |= matrix_mm(&w->o, att, t, h, x, NULL, 0.0f, 0, threads);
        if (failed) break;
        add_bias(h, t, hidden, w->bo);
        failed |= matrix_mm(&w->gate_up, h, t, gu, NULL, w->post_norm, d->eps, 0, threads);
        if (failed) break;
        add_bias(gu, t, 2 * d->inter, w->b_gate_up);
        failed |= matrix_mm(&w->down, gu, t, x, h, NULL, 0.0f, 1, threads);
        add_bias(x, t, hidden, w->b_down);
    }
    free(qkv);
    free(att);
    free(h);
    free(gu);
    free(scores);
    return failed ? -1 : 0;
}
