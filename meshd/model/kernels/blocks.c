/* GGUF tensors multiplied as stored: ggml's block formats and dot products (docs/model-runtime.md,
 * "GGUF block kernels").
 *
 * y[t][n] = sum_k x[t][k] * W[n][k], where W is n_out rows of k elements laid out exactly as the
 * GGUF file stores them (ggml's blocks) and x is fp32. As in ggml, each row of x is first
 * converted to the weight type's "vec_dot type": Q8_0 blocks of 32 for Q8_0/Q4_0/Q5_0, Q8_1 for
 * Q4_1/Q5_1 (whose dot needs the activation block's sum), Q8_K blocks of 256 for the K-quants,
 * fp16 for F16, bf16 for BF16, nothing for F32. Activations are quantized as ggml's CPU backend
 * quantizes them on x86 (quantize_row_q8_0 / quantize_row_q8_1 of ggml-cpu's AVX/AVX2 code, also
 * in AVX-512 builds): d = amax / 127, q = round(x * (127 / amax)) with ties to even (the default
 * rounding mode), Q8_1's s = d * sum(q), d and s stored in fp16. So the integer codes and scales
 * are the ones llama.cpp multiplies on the same input. (ggml's reference quantizer, which the
 * `gguf` Python package follows, differs: q = roundf(x * (1 / d)), ties away from zero; one code
 * in a few hundred differs, enough to move a small model's perplexity by as much as fp32 noise
 * does, docs/benchmarks.md.)
 *
 * Rules the Python side relies on:
 * - Every output element is computed by the same sequence of floating-point operations whatever
 *   t, the thread count or the row's place in the batch: integer block sums are exact, each
 *   token has its own accumulators, and the multi-token kernels run the single-token sequence
 *   once per token (compiled with -ffp-contract=off; the FMAs written as intrinsics are in every
 *   variant alike). A verify window's rows are therefore bit-identical to single steps.
 * - The same source builds three ways (`avx512`, `avx2`, `portable`); the intrinsics sit inside
 *   __AVX2__ / __AVX512F__ guards and the scalar code is the reference for any CPU. The avx2
 *   build adds AVX-VNNI (VPDPBUSD on 256 bits) where the CPU has it: the same exact int32 sums.
 * - K-quant dot products come from blocks_k.c when it is compiled in (MESHD_HAVE_K_QUANTS); without
 *   it those types are not supported here (their rows still dequantize, for embeddings).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_types.h"
#include "half.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32   /* elements per block of the non-K formats */
#define QKK 256 /* elements per K-quant super-block */
#define Q8K_BYTES 292
#define NT 4    /* tokens sharing one pass over a weight row */
#define NT_WIDE 8 /* the same for the AVX-512 Q5_0 prefill tiles (a multiple of NT) */
#define CHUNK 16 /* output rows per unit of work between threads */
#define TOKEN_BLOCK 64 /* tokens per unit of work (a multiple of NT) */
/* Weight bytes x tokens a second thread must have to itself before a product is split: below
 * it the hand-off (waking the partner, the join) costs about what the split saves, and on a
 * busy machine a partner that is not running makes the whole product wait for it. */
#define BYTES_PER_THREAD (128 * 1024)
/* Tokens at or below which the activations are converted before the threads start: one
 * barrier less per product, for a conversion of a few microseconds. */
#define SERIAL_CONVERT_TOKENS 4

/* Weight rows requested from memory ahead of the rows being computed: a decode step streams
 * every matrix once, and with the hardware prefetcher alone the dot products wait on loads
 * (docs/model-runtime.md, "GGUF block kernels"). */
#define PREFETCH_ROWS(p, bytes)                                                                    \
    for (int64_t off_ = 0; off_ < (bytes); off_ += 64)                                             \
        __builtin_prefetch((const char *)(p) + off_, 0, 3)
/* The same request into L2 (prefetcht2), for weights streamed from memory (below). */
#define PREFETCH_ROWS_L2(p, bytes)                                                                 \
    for (int64_t off_ = 0; off_ < (bytes); off_ += 64)                                             \
        __builtin_prefetch((const char *)(p) + off_, 0, 1)
/* How a tile requests its successors' rows (the tiles of one thread's range are adjacent rows;
 * the first tiles of a range are requested in one burst before it starts). Two ways, chosen
 * for the process by meshd_blocks_set_streaming (the Python side compares the weights a step
 * reads with the last-level cache):
 * - cached (the weights fit the last-level cache): 2 tiles ahead, into L1;
 * - streaming (they do not: every step reads them from memory): 4 tiles ahead, into L2
 *   (prefetcht2). A request into L1 holds one of the core's few line-fill buffers until its
 *   line arrives, one into L2 does not, so more lines of the stream are in flight; the tile's
 *   own loads then find the row in L2. On weights the cache holds, the L1 requests are faster.
 * Neither changes a result bit. */
static int stream_prefetch = 0;
void meshd_blocks_set_streaming(int on) { stream_prefetch = on != 0; }
/* Each tile is compiled both ways (`stream` a constant in each copy: no branch per request). */
#define PREFETCH_TILES(stream) ((stream) ? 4 : 2)
#define PREFETCH_AHEAD(stream, p)                                                                  \
    do {                                                                                           \
        if (stream)                                                                                \
            __builtin_prefetch((p), 0, 1);                                                         \
        else                                                                                       \
            __builtin_prefetch((p), 0, 3);                                                         \
    } while (0)

#ifdef MESHD_HAVE_K_QUANTS
void meshd_quantize_row_q8_K(const float *x, void *y, int64_t k);
float meshd_vec_dot_q4_K_q8_K(int64_t n, const void *w, const void *x);
float meshd_vec_dot_q5_K_q8_K(int64_t n, const void *w, const void *x);
float meshd_vec_dot_q6_K_q8_K(int64_t n, const void *w, const void *x);
void meshd_rows_q4_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out);
void meshd_rows_q5_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out);
void meshd_rows_q6_K_q8_K(int64_t n, const void *w, const void *x, int64_t stride, int nt,
                          float *out);
void meshd_rows8_q4_K_q8_K_nt(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                              int nt, float *out, int64_t ldo, const void *ahead,
                              int64_t ahead_bytes, int stream);
void meshd_rows2_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           float *out, int64_t ldo);
int meshd_rows16_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           int nt, float *out, int64_t ldo);
int meshd_rows8t_q4_K_q8_K(int64_t n, const void *w, int64_t rb, const void *x, int64_t stride,
                           int nt, float *out, int64_t ldo);
/* Q4_K against many tokens: blocks_k.c's AVX-512 build (KQ_AVX512 there) multiplies its rows
 * sixteen at a time (meshd_rows16_q4_K_q8_K), its AVX2 build eight at a time
 * (meshd_rows8t_q4_K_q8_K), against up to Q4_K_TILE_NT tokens per call. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                    \
    defined(__AVX512VNNI__) && defined(__FMA__)
/* Q4_K_TILE_MIN: the fewest tokens a tile takes; against fewer, the eight-row decode kernel
 * is faster (docs/benchmarks.md, "Q4_K prefill in tiles of rows"). */
#define Q4_K_TILE 16
#define Q4_K_TILE_FN meshd_rows16_q4_K_q8_K
#define Q4_K_TILE_MIN 4
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define Q4_K_TILE 8
#define Q4_K_TILE_FN meshd_rows8t_q4_K_q8_K
#define Q4_K_TILE_MIN 4
#endif
#define Q4_K_TILE_NT 64 /* = blocks_k.c's KQ16_TOKENS and KQ8T_TOKENS */
/* blocks_k.c's AVX2 build (KQ_AVX2 there) multiplies Q4_K rows two at a time against a full
 * group of tokens too (meshd_rows2_q4_K_q8_K). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define Q4_K_ROW_PAIRS 1
#endif
#endif

int meshd_blocks_abi(void) { return 1; }

/* The ISA this copy was compiled for (the Python side checks it loaded the one it asked for). */
const char *meshd_blocks_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "portable";
#endif
}

int meshd_blocks_has_k_quants(void) {
#ifdef MESHD_HAVE_K_QUANTS
    return 1;
#else
    return 0;
#endif
}

/* ---- fp16 / bf16 (exact conversions, round to nearest even, as ggml's: half.h) -------------- */

static inline float fp16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return fp16_soft(h);
#endif
}

static inline uint16_t to_fp16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return to_fp16_soft(f);
#endif
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---- sizes ----------------------------------------------------------------------------------- */

static int64_t block_elems(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return QK;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return QKK;
    default: return 0;
    }
}

static int64_t block_bytes(int type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes of one stored row of k elements; -1 for an unknown type or a k the blocks do not divide. */
int64_t meshd_blocks_row_bytes(int type, int64_t k) {
    const int64_t e = block_elems(type);
    if (e == 0 || k <= 0 || k % e) return -1;
    return k / e * block_bytes(type);
}

/* 1 where meshd_blocks_mm multiplies this type. */
int meshd_blocks_supported(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16:
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0:
        return 1;
#ifdef MESHD_HAVE_K_QUANTS
    case T_Q4_K: case T_Q5_K: case T_Q6_K:
        return 1;
#endif
    default:
        return 0;
    }
}

/* 1 where meshd_blocks_dequantize_rows reads this type. */
int meshd_blocks_dequantizable(int type) { return block_elems(type) != 0; }

/* ---- activations ------------------------------------------------------------------------------
 * One token's converted row ("act") in scratch, 64-byte aligned:
 *   Q8 types: int8 q[k]; float d[nb] (the block scale as stored in fp16, widened: exact);
 *             float s[nb] (Q8_1's fp16 s = d * sum(q), widened); then, 64-byte aligned,
 *             int32 off[nb][2][8] (-8 and -16 times the sum of codes 4L..4L+3 of block b in
 *             lane L: Q4_0's and Q5_0's code offsets, taken out of each of ggml's eight int32
 *             lanes by the AVX2 tiles; loaded, not computed per tile); on AVX-512, then, per
 *             four blocks (a quad; blocks past the last: zeros), the Q4_0/Q5_0/Q8_0 tiles'
 *             operands in their lane order (lane 4q + i: block q of the quad, for each of 4
 *             rows i, tile512_quads): int32 tot4[16] (-8 times the block's sum of codes; the
 *             tiles scale it to their offset) and float d4[16] (the block's d).
 *   F16/BF16/F32: float v[k] (x rounded to fp16 / bf16 and widened: exact; F32: x itself).
 *   K-quants: k / 256 block_q8_K as blocks_k.c writes them.
 * The widened copies hold exactly the values ggml's blocks hold, in a layout that loads aligned. */

enum { ACT_Q8 = 1, ACT_FLOAT = 2, ACT_Q8K = 3 };

static int act_kind(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return ACT_Q8;
    case T_F32: case T_F16: case T_BF16: return ACT_FLOAT;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return ACT_Q8K;
    default: return 0;
    }
}

static inline int64_t align64(int64_t v) { return (v + 63) & ~(int64_t)63; }
/* A Q8 act's off lanes (see above): block b's Q4_0 offsets at + 16 * b, Q5_0's at + 16 * b + 8;
 * the quads' tot4 and d4 (AVX-512 builds). */
#define ACT_OFF(a, k) ((int32_t *)((a) + align64(k) + align64(8 * ((k) / QK))))
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ACT_QUADS(k) (((k) / QK + 3) / 4)
#define ACT_QUAD_BYTES(k) (128 * ACT_QUADS(k))
#define ACT_TOT4(a, k) (ACT_OFF(a, k) + 16 * ((k) / QK))
#define ACT_D4(a, k) ((float *)(ACT_TOT4(a, k) + 16 * ACT_QUADS(k)))
#else
/* Then (AVX2 and portable builds) int32 tot[nb]: -8 times each block's sum of codes (the AVX2
 * Q4_0 tile's code offset). */
#define ACT_QUAD_BYTES(k) align64(4 * ((k) / QK))
#define ACT_TOT(a, k) (ACT_OFF(a, k) + 16 * ((k) / QK))
#endif

#if defined(__AVX2__)
/* off of one block from its 32 codes in element order: -8 and -16 times the sum of each 4
 * codes, exact. */
static inline void store_offsets(__m256i codes, int32_t *off) {
    const __m256i neg8 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), codes),
                                           _mm256_set1_epi16(-1));
    _mm256_storeu_si256((__m256i *)off, neg8);
    _mm256_storeu_si256((__m256i *)(off + 8), _mm256_add_epi32(neg8, neg8));
}
#endif

static int64_t act_stride(int type, int64_t k) {
    switch (act_kind(type)) {
    case ACT_Q8:
        return align64(k) + align64(8 * (k / QK)) + 64 * (k / QK) + ACT_QUAD_BYTES(k);
    case ACT_FLOAT: return align64(4 * k);
    case ACT_Q8K: return align64(k / QKK * Q8K_BYTES);
    default: return 0;
    }
}

/* Bytes of scratch meshd_blocks_mm needs for t rows of k (plus room to align it to 64). */
int64_t meshd_blocks_scratch_bytes(int type, int64_t k, int64_t t) {
    if (!meshd_blocks_supported(type) || meshd_blocks_row_bytes(type, k) < 0) return -1;
    return act_stride(type, k) * t + 64;
}

/* v rounded to the nearest integer, ties to even, for |v| <= 2^22 (the codes' |v| <= 127): adding
 * 1.5 * 2^23 leaves the integer in the low mantissa bits, rounded in the default mode, as
 * VCVTPS2DQ rounds in ggml's x86 quantize_row_q8_0/q8_1 (and its nearest_int). Inlines and
 * vectorizes, unlike a libm call. */
static inline int round_even(float v) {
    const float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, sizeof i);
    return (i & 0x007FFFFF) - 0x00400000;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The AVX-512 tiles read two blocks per 64-byte vector in the order a nibble pair unpacks to:
 * block b's codes 0-15, block b+1's 0-15, b's 16-31, b+1's 16-31 (an odd last block: zeros for
 * b+1; the row's area is rounded up to 64 bytes). */
#define PAIRED 1
static inline int64_t code_at(int64_t b, int j) {
    return (b >> 1) * 64 + (b & 1) * 16 + (j >> 4) * 32 + (j & 15);
}
#else
static inline int64_t code_at(int64_t b, int j) { return b * QK + j; }
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Block b of quantize_q8 below, 16 lanes at a time, to the same bits: the max of finite |x| is
 * the same whatever the order, x * id is one rounding either way, and the conversion rounds to
 * nearest, ties to even, as round_even. Returns 0 without writing where the block holds a NaN
 * or an infinity (the scalar loop then runs: what comes out there depends on its order). */
static inline int quantize_block16x2(const float *xb, int64_t b, int8_t *q, float *d, float *s,
                                     int32_t *off) {
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    if ((__mmask16)(_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) &
                    _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) != (__mmask16)0xFFFF)
        return 0;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float db = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    __m512i c[2];
    for (int h = 0; h < 2; ++h)
        c[h] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(h ? x1 : x0, vid),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i q0 = _mm512_cvtepi32_epi8(c[0]), q1 = _mm512_cvtepi32_epi8(c[1]);
    _mm_storeu_si128((__m128i *)(q + code_at(b, 0)), q0);
    _mm_storeu_si128((__m128i *)(q + code_at(b, 16)), q1);
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(c[0], c[1]));
    d[b] = fp16(to_fp16(db));
    s[b] = fp16(to_fp16((float)total * db));
    store_offsets(_mm256_set_m128i(q1, q0), off + 16 * b);
    return 1;
}
#define QUANTIZE_BLOCK quantize_block16x2
#elif defined(__AVX2__)
/* The same in 8 lanes (the AVX2 layout keeps a block's codes in order). */
static inline int quantize_block8x4(const float *xb, int64_t b, int8_t *q, float *d, float *s,
                                    int32_t *off) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 x[4], m = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int h = 0; h < 4; ++h) {
        x[h] = _mm256_loadu_ps(xb + 8 * h);
        const __m256 a = _mm256_andnot_ps(sign, x[h]);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));
        m = _mm256_max_ps(m, a);
    }
    if (finite != 0xFF) return 0;
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    const float amax = _mm256_cvtss_f32(m);
    const float db = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i c[4], total = _mm256_setzero_si256();
    for (int h = 0; h < 4; ++h) {
        /* ggml's _mm256_round_ps(v, _MM_ROUND_NEAREST), whatever MXCSR says; then exact. */
        c[h] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[h], vid),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, c[h]);
    }
    /* |codes| <= 127: the saturating packs are exact; the permute undoes their lane order. */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
    const __m256i codes =
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(q + code_at(b, 0)), codes);
    store_offsets(codes, off + 16 * b);
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    const int32_t sum_b = _mm_cvtsi128_si32(t4);
    d[b] = fp16(to_fp16(db));
    s[b] = fp16(to_fp16((float)sum_b * db));
    return 1;
}
#define QUANTIZE_BLOCK quantize_block8x4
#endif

static void quantize_q8(const float *x, int64_t k, uint8_t *act) {
    const int64_t nb = k / QK;
    int8_t *q = (int8_t *)act;
    if (nb & 1) memset(q + (nb - 1) * QK, 0, (size_t)(align64(k) - (nb - 1) * QK));
    float *d = (float *)(act + align64(k));
    float *s = d + nb;
    int32_t *off = ACT_OFF(act, k);
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
#ifdef QUANTIZE_BLOCK
        if (QUANTIZE_BLOCK(xb, b, q, d, s, off)) continue;
#endif
        float amax = 0.0f;
        /* ggml's MAX(amax, |x|) (a NaN never replaces amax, as there). */
        for (int j = 0; j < QK; ++j) amax = amax > fabsf(xb[j]) ? amax : fabsf(xb[j]);
        const float db = amax / 127.0f;
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < QK; ++j) {
            const int v = round_even(xb[j] * id);
            q[code_at(b, j)] = (int8_t)v;
            total += v;
            if (j % 4 == 0) off[16 * b + j / 4] = off[16 * b + 8 + j / 4] = 0;
            off[16 * b + j / 4] -= 8 * v;
            off[16 * b + 8 + j / 4] -= 16 * v;
        }
        d[b] = fp16(to_fp16(db));
        /* quantize_row_q8_1 (x86 and reference alike): s = fp16(sum * d), d unrounded. */
        s[b] = fp16(to_fp16((float)total * db));
    }
#if defined(ACT_TOT)
    for (int64_t b = 0; b < nb; ++b) {
        int32_t t = 0;
        for (int l = 0; l < 8; ++l) t += off[16 * b + l];
        ACT_TOT(act, k)[b] = t;
    }
#else
    int32_t *tot4 = ACT_TOT4(act, k);
    float *d4 = ACT_D4(act, k);
    for (int64_t b = 0; b < 4 * ACT_QUADS(k); ++b) {
        int32_t t = 0;
        for (int l = 0; b < nb && l < 8; ++l) t += off[16 * b + l];
        for (int i = 0; i < 4; ++i) {
            tot4[16 * (b / 4) + 4 * (b % 4) + i] = t;
            d4[16 * (b / 4) + 4 * (b % 4) + i] = b < nb ? d[b] : 0.0f;
        }
    }
#endif
}

static void convert_act(int type, const float *x, int64_t k, uint8_t *act) {
    switch (act_kind(type)) {
    case ACT_Q8:
        quantize_q8(x, k, act);
        break;
    case ACT_FLOAT: {
        float *v = (float *)act;
        if (type == T_F16)
            for (int64_t i = 0; i < k; ++i) v[i] = fp16(to_fp16(x[i]));
        else if (type == T_BF16)
            for (int64_t i = 0; i < k; ++i) v[i] = bf16(to_bf16(x[i]));
        else
            memcpy(v, x, (size_t)k * 4);
        break;
    }
#ifdef MESHD_HAVE_K_QUANTS
    case ACT_Q8K:
        meshd_quantize_row_q8_K(x, act, k);
        break;
#endif
    default:
        break;
    }
}

/* ---- shared SIMD helpers ---------------------------------------------------------------------- */

#if defined(__AVX2__)
/* The 32 nibbles of a 16-byte block as bytes 0..15: low nibbles are elements 0..15, high 16..31. */
static inline __m256i nibbles32(const uint8_t *p) {
    /* A broadcast load (load port only) and a per-half shift: no shuffle-port insert. */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)),
                            _mm256_set1_epi8(0x0F));
}

/* 0x10 in byte j where bit j of the 32-bit word is set (Q5's fifth bits). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32)h, 0x10);
#else
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                            _mm256_set1_epi8(0x10));
#endif
}

/* acc + the products of unsigned bytes u (0..128) and signed bytes s, summed in fours: exact. */
static inline __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    /* maddubs pairs stay below 2 * 128 * 127 < 32768: no saturation for these formats. */
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* u0 * s0 + u1 * s1 summed in int32 lanes (unsigned u <= 15, as the nibble codes): exact.
 * Without VNNI the two VPMADDUBSW results add in int16 (at most 2 * 2 * 15 * 128 = 7680)
 * before one VPMADDWD. The lanes group the products differently with and without VNNI; their
 * sum over a 128-bit half is the same. */
static inline __m256i dot2_us(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return dot_us(dot_us(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* The same for signed bytes w (Q8_0's codes; u = |w|) against x: |w| times x carrying w's sign
 * (ggml's trick; |w| <= 128, |x| <= 127), each VPMADDUBSW's int16 pairs (up to 32512) widened by a
 * VPMADDWD before they add. */
static inline __m256i dot2_ss(__m256i w0, __m256i u0, __m256i x0, __m256i w1, __m256i u1,
                              __m256i x1) {
    const __m256i s0 = _mm256_sign_epi8(x0, w0), s1 = _mm256_sign_epi8(x1, w1);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return dot_us(dot_us(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    const __m256i one = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u0, s0), one),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u1, s1), one));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---- quantized dot products, portable C -----------------------------------------------------
 * The AVX2 and AVX-512 builds run the tiles below instead. */

#define ACT_Q(a) ((const int8_t *)(a))
#define ACT_D(a, k) ((const float *)((a) + align64(k)))

/* Block `p` of a Q type as 32 signed codes (Q4_0/Q5_0 with their offset of 8/16 removed), its
 * scale d and its offset m (the _1 formats; 0 otherwise). Written as plain loops over bytes so
 * that compilers vectorize them. */
static inline __attribute__((always_inline)) const int8_t *codes_of(int type, const uint8_t *p,
                                                                    int8_t *c, float *d,
                                                                    float *m) {
    *d = fp16(rd16(p));
    *m = type == T_Q4_1 || type == T_Q5_1 ? fp16(rd16(p + 2)) : 0.0f;
    if (type == T_Q8_0) return (const int8_t *)(p + 2); /* Q8_0's codes as stored */
    const int off = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    const int bias = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
    uint32_t h = 0;
    if (type == T_Q5_0 || type == T_Q5_1) memcpy(&h, p + off - 4, 4);
    for (int j = 0; j < QK / 2; ++j) {
        const int lo = (p[off + j] & 0x0F) | (int)(((h >> j) & 1) << 4);
        const int hi = (p[off + j] >> 4) | (int)(((h >> (j + 16)) & 1) << 4);
        c[j] = (int8_t)(lo - bias);
        c[j + QK / 2] = (int8_t)(hi - bias);
    }
    return c;
}

/* Row w of a Q type · nt tokens' Q8 activations, as ggml's generic vec_dot computes it: an exact
 * int32 sum per block, then sumf += sumi * (d_w * d_x) (+ m_w * s_x for the _1 formats). */
static inline __attribute__((always_inline)) void dot_q(int type, const uint8_t *w, int64_t k,
                                                       const uint8_t *act, int64_t stride,
                                                       int nt, float *out) {
    const int64_t nb = k / QK, bb = type == T_Q4_0   ? 18
                                    : type == T_Q4_1 ? 20
                                    : type == T_Q5_0 ? 22
                                    : type == T_Q5_1 ? 24
                                                     : 34;
    float sumf[NT];
    for (int r = 0; r < nt; ++r) sumf[r] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int8_t buf[QK];
        float dw, mw;
        const int8_t *c = codes_of(type, w + b * bb, buf, &dw, &mw);
        for (int r = 0; r < nt; ++r) {
            const int8_t *q = ACT_Q(act + r * stride) + b * QK;
            const float *d = ACT_D(act + r * stride, k);
            int32_t sumi = 0;
            for (int j = 0; j < QK; ++j) sumi += c[j] * q[j];
            sumf[r] += (float)sumi * (dw * d[b]);
            if (type == T_Q4_1 || type == T_Q5_1) sumf[r] += mw * d[nb + b];
        }
    }
    for (int r = 0; r < nt; ++r) out[r] = sumf[r];
}

/* ---- AVX2: tiles of rows x tokens, one block per step ------------------------------------------
 * The same tiling as the AVX-512 code with one 32-byte block per vector: a tile decodes each
 * weight block once for all its tokens and reads each activation block once for all its rows;
 * every (row, token) runs the same sequence whatever the tile shape. */
#if defined(__AVX2__) && !defined(PAIRED)
#define TILED 1
#define NR_MAX 4

static inline int64_t blk_bytes_q(int type) {
    return type == T_Q4_0   ? 18
           : type == T_Q4_1 ? 20
           : type == T_Q5_0 ? 22
           : type == T_Q5_1 ? 24
                            : 34;
}

/* One block's 32 codes: unsigned for the nibble formats, Q8_0's signed bytes. */
static inline __m256i blk_codes(int type, const uint8_t *p) {
    switch (type) {
    case T_Q4_0: return nibbles32(p + 2);
    case T_Q4_1: return nibbles32(p + 4);
    case T_Q5_0: return _mm256_or_si256(nibbles32(p + 6), fifth_bits(p + 2));
    case T_Q5_1: return _mm256_or_si256(nibbles32(p + 8), fifth_bits(p + 4));
    default: return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
}

/* Q4_0 on AVX2 as llama.cpp's repacked gemv (ggml_gemv_q4_0_8x8_q8_0, what its AVX2 builds run
 * for Q4_0 by default) computes it: each block of a row summed to one integer, then, per row
 * and block, acc = fma(cvt(sum), d_w * d_x, acc), the row's output acc itself. Two rows share a
 * vector (row 2j's 16 nibble bytes in the low half, row 2j+1's in the high half), so values
 * 0-15 and 16-31 take one VPMADDUBSW each against the activation's halves broadcast, their
 * int16 sums add exactly (at most 2 * 2 * 15 * 128 = 7680) before one VPMADDWD, and two
 * horizontal adds leave the 4 rows' block sums in lanes [r0, r2, r0, r2 | r1, r3, r1, r3] (the
 * code offset, -8 times the block's sum of x, added from the act's tot). One conversion, one
 * multiply and one FMA then cover 4 rows. Every (row, token) runs that one sequence whatever
 * the tile shape (absent rows: zero codes and scales), so batches match single steps, and the
 * products are the bits of llama.cpp's gemv. Q8_0 (eight = 1) runs the same steps on its
 * signed codes: |w| against x carrying w's sign, whose int16 pairs (up to 32512) take a
 * VPMADDWD each before they add. */
static inline __attribute__((always_inline)) void tile256_sums(int eight, const uint8_t *const *wr,
                                                              int nr, int64_t k,
                                                              const uint8_t *act, int64_t stride,
                                                              int nt, float *out, int64_t ldo,
                                                              const int stream) {
    const int64_t nb = k / QK, bb = eight ? 34 : 18;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3);
    __m256 acc[(NT + 1) / 2]; /* one per two tokens */
    for (int r = 0; r < nt; r += 2) acc[r / 2] = _mm256_setzero_ps();
    const int64_t ahead = nr > 1 ? (int64_t)(wr[1] - wr[0]) * nr * PREFETCH_TILES(stream) : 0;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i lo[2], hi[2], ulo[2], uhi[2];
        uint64_t d4 = 0; /* fp16 d of rows 0, 2, 1, 3 */
        for (int j = 0; j < 2; ++j) {
            lo[j] = hi[j] = ulo[j] = uhi[j] = _mm256_setzero_si256();
            if (2 * j >= nr) continue;
            const uint8_t *pa = wr[2 * j] + b * bb;
            const uint8_t *pb = 2 * j + 1 < nr ? wr[2 * j + 1] + b * bb : 0;
            if (ahead) {
                PREFETCH_AHEAD(stream, pa + ahead);
                if (pb) PREFETCH_AHEAD(stream, pb + ahead);
            }
            if (eight) {
                const __m128i z = _mm_setzero_si128();
                lo[j] = _mm256_set_m128i(pb ? _mm_loadu_si128((const __m128i *)(pb + 2)) : z,
                                         _mm_loadu_si128((const __m128i *)(pa + 2)));
                hi[j] = _mm256_set_m128i(pb ? _mm_loadu_si128((const __m128i *)(pb + 18)) : z,
                                         _mm_loadu_si128((const __m128i *)(pa + 18)));
                ulo[j] = _mm256_sign_epi8(lo[j], lo[j]);
                uhi[j] = _mm256_sign_epi8(hi[j], hi[j]);
            } else {
                const __m128i na = _mm_loadu_si128((const __m128i *)(pa + 2));
                const __m128i nb16 =
                    pb ? _mm_loadu_si128((const __m128i *)(pb + 2)) : _mm_setzero_si128();
                const __m256i v = _mm256_set_m128i(nb16, na);
                lo[j] = _mm256_and_si256(v, low);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            d4 |= (uint64_t)rd16(pa) << (16 * j);
            if (pb) d4 |= (uint64_t)rd16(pb) << (16 * (2 + j));
        }
        const __m256 dw = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)d4))), spread);
        /* Tokens two at a time: the last horizontal add takes both, so its lanes hold
         * [r0 t, r2 t, r0 u, r2 u | r1 t, r3 t, r1 u, r3 u] (u = t without a second token). */
        for (int r = 0; r < nt; r += 2) {
            const int u = r + 1 < nt ? r + 1 : r;
            const uint8_t *at = act + r * stride, *au = act + u * stride;
            __m256i h[2];
            for (int v = 0; v < 2; ++v) {
                const int8_t *xq = ACT_Q(v ? au : at) + b * QK;
                const __m256i x0 = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)xq));
                const __m256i x1 =
                    _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(xq + 16)));
                const __m256i p0 = eight ? dot2_ss(lo[0], ulo[0], x0, hi[0], uhi[0], x1)
                                         : dot2_us(lo[0], x0, hi[0], x1);
                const __m256i p1 = nr <= 2  ? _mm256_setzero_si256()
                                   : eight ? dot2_ss(lo[1], ulo[1], x0, hi[1], uhi[1], x1)
                                           : dot2_us(lo[1], x0, hi[1], x1);
                h[v] = _mm256_hadd_epi32(p0, p1);
                if (u == r) {
                    h[1] = h[0];
                    break;
                }
            }
            const int32_t tt = eight ? 0 : ACT_TOT(at, k)[b], tu = eight ? 0 : ACT_TOT(au, k)[b];
            const float dt = ACT_D(at, k)[b], du = ACT_D(au, k)[b];
            const __m256i s = _mm256_add_epi32(_mm256_hadd_epi32(h[0], h[1]),
                                               _mm256_setr_epi32(tt, tt, tu, tu, tt, tt, tu, tu));
            const __m256 scale = _mm256_mul_ps(dw, _mm256_setr_ps(dt, dt, du, du, dt, dt, du, du));
            acc[r / 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r / 2]);
        }
    }
    for (int r = 0; r < nt; ++r) {
        float o[8];
        _mm256_storeu_ps(o, acc[r / 2]);
        const int lane[4] = {0, 4, 1, 5};
        for (int i = 0; i < nr; ++i) out[r * ldo + i] = o[lane[i] + 2 * (r & 1)];
    }
}

static inline __attribute__((always_inline)) void tile256(int type, const uint8_t *const *wr,
                                                         int nr, int64_t k, const uint8_t *act,
                                                         int64_t stride, int nt, float *out,
                                                         int64_t ldo, const int stream) {
    if (type == T_Q4_0 || type == T_Q8_0) {
        tile256_sums(type == T_Q8_0, wr, nr, k, act, stride, nt, out, ldo, stream);
        return;
    }
    const int64_t nb = k / QK, bb = blk_bytes_q(type);
    const int one = type == T_Q4_1 || type == T_Q5_1;
    /* Q5_0: where the act's lane offsets of this type start in a block's 16 (8); -1: none. */
    const int off_at = type == T_Q5_0 ? 8 : -1;
    __m256 acc[NR_MAX][NT];
    float summs[NR_MAX][NT];
    for (int i = 0; i < nr; ++i)
        for (int r = 0; r < nt; ++r) {
            acc[i][r] = _mm256_setzero_ps();
            summs[i][r] = 0.0f;
        }
    /* As in the AVX-512 tiles: the same bytes PREFETCH_TILES tiles on (adjacent rows). */
    const int64_t ahead = nr > 1 ? (int64_t)(wr[1] - wr[0]) * nr * PREFETCH_TILES(stream) : 0;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i wv[NR_MAX], sg[NR_MAX];
        float dw[NR_MAX], mw[NR_MAX];
        if (ahead)
            for (int i = 0; i < nr; ++i) PREFETCH_AHEAD(stream, wr[i] + ahead + b * bb);
        for (int i = 0; i < nr; ++i) {
            const uint8_t *p = wr[i] + b * bb;
            wv[i] = blk_codes(type, p);
            if (type == T_Q8_0) {
                /* |w| as unsigned (128 for -128: still exact) times x carrying w's sign. */
                sg[i] = wv[i];
                wv[i] = _mm256_sign_epi8(wv[i], wv[i]);
            }
            dw[i] = fp16(rd16(p));
            mw[i] = one ? fp16(rd16(p + 2)) : 0.0f;
        }
        for (int r = 0; r < nt; ++r) {
            const uint8_t *a = act + r * stride;
            const float *d = ACT_D(a, k);
            const __m256i x = _mm256_load_si256((const __m256i *)(ACT_Q(a) + b * QK));
            /* Q5_0: lane L is ggml's signed sum over codes 4L..4L+3, sum (u - c) * x
             * for the code offset c = 16, as the act's -c * sum x + sum u * x, exact. (With
             * the offset taken out of one lane only, the other lanes held larger sums that
             * cancelled in fp32: docs/benchmarks.md.) */
            const __m256i init =
                off_at >= 0 ? _mm256_load_si256((const __m256i *)(ACT_OFF(a, k) + 16 * b + off_at))
                            : _mm256_setzero_si256();
            for (int i = 0; i < nr; ++i) {
                const __m256i xs = type == T_Q8_0 ? _mm256_sign_epi8(x, sg[i]) : x;
                const __m256i p = dot_us(init, wv[i], xs);
                acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * d[b]), _mm256_cvtepi32_ps(p),
                                            acc[i][r]);
                if (one) summs[i][r] += mw[i] * d[nb + b];
            }
        }
    }
    for (int i = 0; i < nr; ++i)
        for (int r = 0; r < nt; ++r) out[r * ldo + i] = hsum8(acc[i][r]) + summs[i][r];
}
#define TILE_KERNEL tile256
#endif

/* ---- AVX-512: tiles of rows x tokens ----------------------------------------------------------
 * Q4_0, Q5_0 and Q8_0 take four blocks of 4 rows per step (tile512_quads). Q4_1 and Q5_1: one
 * 512-bit VPDPBUSD covers blocks b and b+1 of a row (128-bit quarters 0 and 2: block b, 1 and
 * 3: block b+1); per token, 4 rows' quarter sums then share one conversion, one scale multiply
 * and one FMA.
 * A tile of NR rows x nt tokens decodes each weight pair once and reads each activation pair once.
 * The per-(row, token) sequence is the same for every tile shape; an odd last block runs the same
 * pair code with a zero second block, which adds exact zeros. */
#if defined(PAIRED)
#define TILED 1
#define NR_MAX 4

static inline int64_t blk_bytes_q(int type) {
    return type == T_Q4_0   ? 18
           : type == T_Q4_1 ? 20
           : type == T_Q5_0 ? 22
           : type == T_Q5_1 ? 24
                            : 34;
}

/* Element 0 of v in the lanes that sum block b's codes (0-3, 8-11), element 1 in block b+1's. */
static inline __m512 pair_ps(__m128 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(v));
}

/* 16 bytes of nibbles -> 32 code bytes in ggml's element order (low nibbles, then high). */
static inline __m256i nib_codes(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Blocks b and b+1 (b+1 absent: zeros) of a row as 64 unsigned code bytes in the PAIRED order
 * (Q4_1/Q5_1; Q4_0/Q5_0/Q8_0 run tile512_quads). */
static inline __m512i pair_codes(int type, const uint8_t *p, int64_t bb, int two) {
    const int off = type == T_Q4_1 ? 4 : 8;
    /* [n0, n1, n0, n1] from two broadcast loads (load ports only), the upper half shifted to
     * the high nibbles: no shuffle-port work, which the scales already crowd. */
    const __m512i n0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + off)));
    const __m512i v =
        two ? _mm512_mask_broadcast_i32x4(n0, 0xF0F0,
                                          _mm_loadu_si128((const __m128i *)(p + bb + off)))
            : _mm512_maskz_mov_epi32(0x0F0F, n0);
    __m512i c = _mm512_and_si512(_mm512_mask_srli_epi16(v, (__mmask32)0xFFFF0000u, v, 4),
                                 _mm512_set1_epi8(0x0F));
    if (type == T_Q5_1) {
        uint32_t h0, h1 = 0;
        memcpy(&h0, p + off - 4, 4);
        if (two) memcpy(&h1, p + bb + off - 4, 4);
        const uint64_t m = (uint64_t)(h0 & 0xFFFF) | (uint64_t)(h1 & 0xFFFF) << 16 |
                           (uint64_t)(h0 >> 16) << 32 | (uint64_t)(h1 >> 16) << 48;
        c = _mm512_or_si512(c, _mm512_maskz_set1_epi8(m, 0x10));
    }
    return c;
}

/* Lane L of each 128-bit quarter of `v[i]` summed over its 4 int32 lanes, rows i = 0-3 side by
 * side: quarter q of the result holds [sum of v0's quarter q, v1's, v2's, v3's]. Exact. */
static inline __m512i quad_sums(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* Rows 0..nr-1 of one token from the quarter accumulators: row i is (q0 + q2) + (q1 + q3), then
 * + (m * s of the even blocks + of the odd blocks) for the _1 formats. */
static inline void quad_store(__m512 acc, __m512 macc, int one, int nr, float *out) {
    const __m512 h = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4E));
    __m128 v = _mm_add_ps(_mm512_castps512_ps128(h), _mm512_extractf32x4_ps(h, 1));
    if (one) {
        const __m512 ms = _mm512_permutexvar_ps(
            _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1), macc);
        v = _mm_add_ps(v, _mm_add_ps(_mm512_castps512_ps128(ms), _mm512_extractf32x4_ps(ms, 1)));
    }
    float o[4];
    _mm_storeu_ps(o, v);
    for (int i = 0; i < nr; ++i) out[i] = o[i];
}

/* 16 bytes of each of blocks b..b+nq-1 of a row, block q's in quarter q (quarters past nq:
 * zeros): one broadcast load each, load ports only. `at`: the bytes' offset in a block. */
static inline __m512i quarter_loads(const uint8_t *p, int64_t bb, int64_t at, int64_t nq) {
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + at)));
    if (nq < 4) v = _mm512_maskz_mov_epi32(0x000F, v);
    for (int q = 1; q < nq; ++q)
        v = _mm512_mask_broadcast_i32x4(v, (__mmask16)(0xFu << (4 * q)),
                                        _mm_loadu_si128((const __m128i *)(p + bb * q + at)));
    return v;
}

/* Q4_0 (five = 0) and Q5_0 on AVX-512, four blocks of up to 4 rows per step, each block summed
 * to one integer before any float work, as llama.cpp's repacked gemv (ggml_gemv_q4_0_8x8_q8_0)
 * does: one conversion and one FMA of (d_w * d_x) per 16 (row, block) sums, where ggml's
 * vec_dot takes eight lanes of each. A row's 4 blocks come in as broadcast loads that leave
 * block q's 16 nibble bytes in quarter q (Q5_0's fifth bits added under byte masks), one VPDPBUSD
 * each for values 0-15 and 16-31 against the activation's codes in the same order, and
 * quad_sums puts the 4 rows' block sums side by side (lane 4q + i: block q, row i), where the
 * act's tot4 (the code offset 8, or 16, taken out, exact) and d4 line up with them. Row i thus
 * keeps four fp32 sums, of the blocks 4j + q for q = 0..3, added as (q0 + q2) + (q1 + q3) at
 * the end. The same sequence for every tile shape (absent rows: zero codes and scales; blocks
 * past the row's end: masked loads, zeros), so batches match single steps. */
static inline __attribute__((always_inline)) void tile512_quads(int type, const uint8_t *const *wr,
                                                               int nr, int64_t k,
                                                               const uint8_t *act, int64_t stride,
                                                               int nt, float *out, int64_t ldo,
                                                               const int stream) {
    const int five = type == T_Q5_0, eight = type == T_Q8_0;
    const int64_t nb = k / QK, bb = blk_bytes_q(type);
    /* Word 4q + i: row i's d of block q, at word 9q of Q4_0's head (the row's first 64 bytes)
     * or word 8q of Q5_0's and Q8_0's (each block's first 16 bytes in its quarter); rows 0/1
     * from one permute, 2/3 from another, merged under the mask of words 2-3 of each four. */
    const short s1 = five || eight ? 8 : 9, s2 = 2 * s1, s3 = 3 * s1;
    const __m512i d01 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         32 + s3, s3, 0, 0, 32 + s2, s2, 0, 0, 32 + s1, s1, 0, 0,
                                         32, 0);
    const __m512i d23 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32 + s3,
                                         s3, 0, 0, 32 + s2, s2, 0, 0, 32 + s1, s1, 0, 0, 32, 0, 0,
                                         0);
    /* Q5_0, per quarter: byte j takes qh byte j / 8 (values 0-15: the block's bytes 2-3; 16-31:
     * bytes 4-5) and is tested against bit j % 8. */
    const __m512i h_lo = _mm512_broadcast_i32x4(_mm_set_epi8(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2));
    const __m512i h_hi = _mm512_add_epi8(h_lo, _mm512_set1_epi8(2));
    const __m512i bit = _mm512_broadcast_i32x4(
        _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1));
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[NT_WIDE];
    for (int r = 0; r < nt; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t ahead = nr > 1 ? (int64_t)(wr[1] - wr[0]) * nr * PREFETCH_TILES(stream) : 0;
    for (int64_t b = 0; b < nb; b += 4) {
        const int64_t nq = nb - b < 4 ? nb - b : 4;
        __m512i head[4], w0[4], w1[4];
        for (int i = 0; i < 4; ++i) {
            if (i >= nr) {
                head[i] = w0[i] = w1[i] = zero;
                continue;
            }
            const uint8_t *p = wr[i] + b * bb;
            if (ahead)
                for (int64_t at = 0; at < 4 * bb; at += 64) PREFETCH_AHEAD(stream, p + ahead + at);
            if (eight) {
                /* Q8_0: values 0-15 and 16-31 of block q in quarter q, made unsigned (w + 128;
                 * the act's offset then takes 128 * sum x out); absent blocks stay zero. */
                const __mmask16 valid = nq == 4 ? 0xFFFF : (__mmask16)((1u << (4 * nq)) - 1);
                const __m512i flip = _mm512_set1_epi8((char)0x80);
                __m256i c[4];
                for (int q = 0; q < 4; ++q)
                    c[q] = q < nq ? _mm256_loadu_si256((const __m256i *)(p + q * bb + 2))
                                  : _mm256_setzero_si256();
                const __m512i b01 = _mm512_inserti64x4(_mm512_castsi256_si512(c[0]), c[1], 1);
                const __m512i b23 = _mm512_inserti64x4(_mm512_castsi256_si512(c[2]), c[3], 1);
                w0[i] = _mm512_mask_xor_epi32(
                    zero, valid, _mm512_shuffle_i64x2(b01, b23, _MM_SHUFFLE(2, 0, 2, 0)), flip);
                w1[i] = _mm512_mask_xor_epi32(
                    zero, valid, _mm512_shuffle_i64x2(b01, b23, _MM_SHUFFLE(3, 1, 3, 1)), flip);
                head[i] = quarter_loads(p, bb, 0, nq);
                continue;
            }
            const __m512i n = quarter_loads(p, bb, five ? 6 : 2, nq);
            w0[i] = _mm512_and_si512(n, low);
            w1[i] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low);
            if (five) {
                head[i] = quarter_loads(p, bb, 0, nq);
                w0[i] = _mm512_mask_add_epi8(
                    w0[i], _mm512_test_epi8_mask(_mm512_shuffle_epi8(head[i], h_lo), bit), w0[i],
                    fifth);
                w1[i] = _mm512_mask_add_epi8(
                    w1[i], _mm512_test_epi8_mask(_mm512_shuffle_epi8(head[i], h_hi), bit), w1[i],
                    fifth);
            } else if (nq == 4) {
                head[i] = _mm512_loadu_si512((const void *)p);
            } else {
                head[i] = _mm512_maskz_loadu_epi8(((__mmask64)1 << (18 * nq)) - 1, p);
            }
        }
        __m512i dh = _mm512_permutex2var_epi16(head[0], d01, head[1]);
        if (nr > 2)
            dh = _mm512_mask_mov_epi16(dh, 0xCCCCCCCCu,
                                       _mm512_permutex2var_epi16(head[2], d23, head[3]));
        const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dh));
        for (int r = 0; r < nt; ++r) {
            const uint8_t *a = act + r * stride;
            const int8_t *xq = ACT_Q(a) + code_at(b, 0);
            /* The act's pair order: block pairs of [b lo, b+1 lo, b hi, b+1 hi] 16-byte runs. */
            const __m512i x0 = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)xq)),
                _mm256_load_si256((const __m256i *)(xq + 64)), 1);
            const __m512i x1 = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq + 32))),
                _mm256_load_si256((const __m256i *)(xq + 96)), 1);
            __m512i s[4];
            for (int i = 0; i < 4; ++i)
                s[i] = i < nr ? _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w0[i], x0), w1[i], x1)
                              : zero;
            /* tot4 is -8 * sum x: Q5_0's offset is twice it, Q8_0's (128) 16 times. */
            __m512i off = _mm512_load_si512((const void *)(ACT_TOT4(a, k) + 4 * b));
            if (five) off = _mm512_add_epi32(off, off);
            if (eight) off = _mm512_slli_epi32(off, 4);
            const __m512i sums = _mm512_add_epi32(quad_sums(s[0], s[1], s[2], s[3]), off);
            const __m512 scale = _mm512_mul_ps(dw, _mm512_load_ps(ACT_D4(a, k) + 4 * b));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) quad_store(acc[r], acc[r], 0, nr, out + r * ldo);
}

/* The [d, m] halves of rows 0..nr-1 at blocks b and b+1 (`at` = b's byte offset; absent rows
 * and an absent b+1: zeros) as floats: (row i, b) in lanes 2i, 2i+1, (row i, b+1) in 8+2i, 9+2i.
 * Eight dword loads put together, not a gather: on the measured Xeon a gather of eight cost
 * more than the rest of a 4-row pair step (docs/model-runtime.md). */
static inline __m512 pair_scales(const uint8_t *const *wr, int nr, int64_t at, int64_t bb,
                                 int two) {
    int32_t g[8];
    for (int i = 0; i < 4; ++i) {
        g[i] = g[4 + i] = 0;
        if (i < nr) memcpy(&g[i], wr[i] + at, 4);
        if (i < nr && two) memcpy(&g[4 + i], wr[i] + at + bb, 4);
    }
    return _mm512_cvtph_ps(_mm256_setr_epi32(g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]));
}

/* Up to 4 rows x nt tokens. Each row's integer dot over a block pair is summed per 128-bit
 * quarter (exact), the 4 rows' quarter sums share one vector, and one conversion, one scale
 * multiply and one FMA cover all of them: per (row, token) the sequence is the same for every
 * tile shape (absent rows add zeros in their own lanes), so batches match single steps. */
static inline __attribute__((always_inline)) void tile512(int type, const uint8_t *const *wr,
                                                         int nr, int64_t k, const uint8_t *act,
                                                         int64_t stride, int nt, float *out,
                                                         int64_t ldo, const int stream) {
    if (type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0) {
        tile512_quads(type, wr, nr, k, act, stride, nt, out, ldo, stream);
        return;
    }
    /* Q4_1 and Q5_1 from here. */
    const int64_t nb = k / QK, bb = blk_bytes_q(type);
    /* acc lane 4q + i: row i's quarter q; macc lanes 2i+1 / 9+2i: row i's m * s, blocks b / b+1 */
    __m512 acc[NT_WIDE], macc[NT_WIDE];
    for (int r = 0; r < nt; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
    /* The same bytes of the rows PREFETCH_TILES tiles on (rows are adjacent), requested while
     * this tile computes: a steady stream of requests rather than a burst per tile. */
    const int64_t ahead = nr > 1 ? (int64_t)(wr[1] - wr[0]) * nr * PREFETCH_TILES(stream) : 0;
    const __m512i dsel = _mm512_set_epi32(14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i ssel = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        __m512i wv[NR_MAX];
        if (ahead)
            for (int i = 0; i < nr; ++i) {
                PREFETCH_AHEAD(stream, wr[i] + ahead + b * bb);
                if (2 * bb > 64) PREFETCH_AHEAD(stream, wr[i] + ahead + b * bb + 64);
            }
        for (int i = 0; i < nr; ++i) wv[i] = pair_codes(type, wr[i] + b * bb, bb, two);
        const __m512 dm = pair_scales(wr, nr, b * bb, bb, two);
        const __m512 dw = _mm512_permutexvar_ps(dsel, dm);
        for (int r = 0; r < nt; ++r) {
            const uint8_t *a = act + r * stride;
            const float *d = ACT_D(a, k);
            const __m512i x = _mm512_load_si512((const void *)(ACT_Q(a) + b * QK));
            const __m512 dx = pair_ps(two ? _mm_castpd_ps(_mm_load_sd((const double *)(d + b)))
                                          : _mm_load_ss(d + b));
            const __m512i zero = _mm512_setzero_si512();
            __m512i p[4];
            for (int i = 0; i < 4; ++i) p[i] = i < nr ? _mm512_dpbusd_epi32(zero, wv[i], x) : zero;
            const __m512i s = quad_sums(p[0], p[1], p[2], p[3]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s), acc[r]);
            /* s_b in the odd lanes 1-7, s_b1 in 9-15: times dm gives m * s there. */
            const __m128 s2 = two ? _mm_castpd_ps(_mm_load_sd((const double *)(d + nb + b)))
                                  : _mm_load_ss(d + nb + b);
            macc[r] = _mm512_fmadd_ps(
                dm, _mm512_maskz_permutexvar_ps(0xAAAA, ssel, _mm512_castps128_ps512(s2)), macc[r]);
        }
    }
    for (int r = 0; r < nt; ++r) quad_store(acc[r], macc[r], 1, nr, out + r * ldo);
}
#define TILE_KERNEL tile512
#endif

#if defined(TILED)

/* One function per (type, rows, tokens): each compiles to straight code for its constants. */
typedef void (*tile_fn)(const uint8_t *const *wr, int64_t k, const uint8_t *act, int64_t stride,
                        float *out, int64_t ldo);
#define TILE_FN(TYPE, NRC, NTC)                                                                    \
    static void tile_##TYPE##_##NRC##x##NTC(const uint8_t *const *wr, int64_t k,                   \
                                            const uint8_t *act, int64_t stride, float *out,        \
                                            int64_t ldo) {                                         \
        TILE_KERNEL(TYPE, wr, NRC, k, act, stride, NTC, out, ldo, 0);                              \
    }                                                                                              \
    static void tile_##TYPE##_##NRC##x##NTC##_s(const uint8_t *const *wr, int64_t k,               \
                                                const uint8_t *act, int64_t stride, float *out,    \
                                                int64_t ldo) {                                     \
        TILE_KERNEL(TYPE, wr, NRC, k, act, stride, NTC, out, ldo, 1);                              \
    }
#define TILE_SET(TYPE)                                                                             \
    TILE_FN(TYPE, 4, 1)                                                                            \
    TILE_FN(TYPE, 2, 1)                                                                            \
    TILE_FN(TYPE, 2, 2)                                                                            \
    TILE_FN(TYPE, 2, 3)                                                                            \
    TILE_FN(TYPE, 2, 4)                                                                            \
    TILE_FN(TYPE, 1, 1)                                                                            \
    TILE_FN(TYPE, 1, 2)                                                                            \
    TILE_FN(TYPE, 1, 3)                                                                            \
    TILE_FN(TYPE, 1, 4)                                                                            \
    TILE_FN(TYPE, 4, 2)                                                                            \
    TILE_FN(TYPE, 4, 3)                                                                            \
    TILE_FN(TYPE, 4, 4)                                                                            \
    /* [prefetch mode][rows, tokens]: 2 rows x nt at nt, 1 row at 4 + nt, 4 rows at 8 + nt. */ \
    static const tile_fn tiles_##TYPE[2][13] = {                                                   \
        {0, tile_##TYPE##_2x1, tile_##TYPE##_2x2, tile_##TYPE##_2x3, tile_##TYPE##_2x4,          \
         tile_##TYPE##_1x1, tile_##TYPE##_1x2, tile_##TYPE##_1x3, tile_##TYPE##_1x4,             \
         tile_##TYPE##_4x1, tile_##TYPE##_4x2, tile_##TYPE##_4x3, tile_##TYPE##_4x4},            \
        {0, tile_##TYPE##_2x1_s, tile_##TYPE##_2x2_s, tile_##TYPE##_2x3_s, tile_##TYPE##_2x4_s,  \
         tile_##TYPE##_1x1_s, tile_##TYPE##_1x2_s, tile_##TYPE##_1x3_s, tile_##TYPE##_1x4_s,     \
         tile_##TYPE##_4x1_s, tile_##TYPE##_4x2_s, tile_##TYPE##_4x3_s, tile_##TYPE##_4x4_s}};
TILE_SET(T_Q4_0)
TILE_SET(T_Q4_1)
TILE_SET(T_Q5_0)
TILE_SET(T_Q5_1)
TILE_SET(T_Q8_0)

/* 4 rows x NT_WIDE tokens where a prefill has them: each decoded weight block serves twice the
 * tokens. Q5_0, Q4_0 and Q8_0 (tile512_quads), whose per-block work (the codes, Q5_0's fifth
 * bits, the scales) is the most to share; 0.5B-class Q4_K_M files hold most of their products
 * in Q5_0 (docs/model-runtime.md). */
#if defined(PAIRED)
TILE_FN(T_Q5_0, 4, NT_WIDE)
TILE_FN(T_Q4_0, 4, NT_WIDE)
TILE_FN(T_Q8_0, 4, NT_WIDE)
static tile_fn wide_tile_of(int type, int stream) {
    if (type == T_Q4_0) return stream ? tile_T_Q4_0_4xNT_WIDE_s : tile_T_Q4_0_4xNT_WIDE;
    if (type == T_Q8_0) return stream ? tile_T_Q8_0_4xNT_WIDE_s : tile_T_Q8_0_4xNT_WIDE;
    if (type != T_Q5_0) return 0;
    return stream ? tile_T_Q5_0_4xNT_WIDE_s : tile_T_Q5_0_4xNT_WIDE;
}
#else
static tile_fn wide_tile_of(int type, int stream) {
    (void)type, (void)stream;
    return 0;
}
#endif

static const tile_fn *tiles_of(int type, int stream) {
    switch (type) {
    case T_Q4_0: return tiles_T_Q4_0[stream];
    case T_Q4_1: return tiles_T_Q4_1[stream];
    case T_Q5_0: return tiles_T_Q5_0[stream];
    case T_Q5_1: return tiles_T_Q5_1[stream];
    default: return tiles_T_Q8_0[stream];
    }
}

static int tiled_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0;
}

/* Rows [r0, r1) x every token through the tiles: 4 rows at a time for single tokens (independent
 * FMA chains hide their latency), 2 rows x up to 4 tokens otherwise (AVX2's Q4_0: 4 rows). */
#if defined(PAIRED)
#define WIDE_TILES 1
#define FOUR_ROW_SUM_TILES(type) 0
#else
#define WIDE_TILES 0
/* AVX2's Q4_0 and Q8_0 tile keeps one accumulator per two tokens: 4 rows of several tokens
 * fit. */
#define FOUR_ROW_SUM_TILES(type) ((type) == T_Q4_0 || (type) == T_Q8_0)
#endif
static void rows_tiled(int type, const uint8_t *w, int64_t rb, int64_t k, int64_t n_out,
                       int64_t r0, int64_t r1, const uint8_t *act, int64_t stride, int64_t t,
                       float *y) {
    const int stream = stream_prefetch;
    const tile_fn *tiles = tiles_of(type, stream);
    const tile_fn wide = wide_tile_of(type, stream);
    for (int64_t j = 0; j < t; j += NT) {
        const int nt = t - j < NT ? (int)(t - j) : NT;
        const uint8_t *a = act + j * stride;
        float *o = y + j * n_out;
        int64_t n = r0;
        const uint8_t *wr[NR_MAX];
        /* The first tiles' rows; each tile requests the rows of the tiles after it. */
        const int64_t ahead = PREFETCH_TILES(stream) * 4;
        const int64_t first = r1 - r0 < ahead ? r1 - r0 : ahead;
        if (j == 0) PREFETCH_ROWS(w + r0 * rb, first * rb);
        if (wide && t - j >= NT_WIDE) {
            /* NT_WIDE tokens: 4-row tiles, the rows left over in NT-token tiles. */
            for (; n + 4 <= r1; n += 4) {
                for (int i = 0; i < 4; ++i) wr[i] = w + (n + i) * rb;
                wide(wr, k, a, stride, o + n, n_out);
            }
            for (int h = 0; h < NT_WIDE; h += NT)
                for (int64_t m = n; m < r1; m += 2) {
                    const int two = m + 2 <= r1;
                    wr[0] = w + m * rb;
                    wr[1] = w + (m + 1) * rb;
                    tiles[two ? NT : 4 + NT](wr, k, a + h * stride, stride, o + h * n_out + m, n_out);
                }
            j += NT_WIDE - NT;
            continue;
        }
        /* 4 rows x several tokens only where 32 vector registers hold their accumulators
         * (AVX-512): there a 2-row tile leaves half of each vector's rows empty, and 2 or 3
         * tokens cost more than 4. */
        if (nt == 1 || WIDE_TILES || FOUR_ROW_SUM_TILES(type))
            for (; n + 4 <= r1; n += 4) {
                for (int i = 0; i < 4; ++i) wr[i] = w + (n + i) * rb;
                tiles[8 + nt](wr, k, a, stride, o + n, n_out);
            }
        for (; n + 2 <= r1; n += 2) {
            wr[0] = w + n * rb;
            wr[1] = w + (n + 1) * rb;
            tiles[nt](wr, k, a, stride, o + n, n_out);
        }
        for (; n < r1; ++n) {
            wr[0] = w + n * rb;
            tiles[4 + nt](wr, k, a, stride, o + n, n_out);
        }
    }
}
#endif

/* ---- float dot products (F32, F16, BF16 weights; activations already rounded to the type) ---- */

#if defined(__AVX512F__)
#define FW 16
static inline __m512 load_w16(int type, const uint8_t *w, int64_t i) {
    if (type == T_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * i)));
    if (type == T_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 2 * i))), 16));
    return _mm512_loadu_ps((const float *)(w + 4 * i));
}
#elif defined(__AVX2__)
#define FW 8
static inline __m256 load_w8(int type, const uint8_t *w, int64_t i) {
    if (type == T_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
    if (type == T_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * i))), 16));
    return _mm256_loadu_ps((const float *)(w + 4 * i));
}
#else
#define FW 16
#endif

static inline float load_w1(int type, const uint8_t *w, int64_t i) {
    if (type == T_F16) return fp16(rd16(w + 2 * i));
    if (type == T_BF16) return bf16(rd16(w + 2 * i));
    float v;
    memcpy(&v, w + 4 * i, 4);
    return v;
}

/* NACC accumulators per token, NACC vectors per step (one FMA chain would wait on its latency);
 * they are summed in a fixed order, the same for every token count. */
static inline __attribute__((always_inline)) void dot_float(int type, const uint8_t *w, int64_t k,
                                                           const uint8_t *act, int64_t stride,
                                                           int nt, float *out) {
    const int64_t main = k / FW * FW;
    float tail[NT];
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
#define NACC 4
#define VF __m512
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VLOAD _mm512_load_ps
#define VW load_w16
#define VSUM _mm512_reduce_add_ps
#else
#define NACC 2
#define VF __m256
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VLOAD _mm256_load_ps
#define VW load_w8
#define VSUM hsum8
#endif
    const int64_t wide = k / (NACC * FW) * (NACC * FW);
    VF acc[NT][NACC];
    for (int r = 0; r < nt; ++r)
        for (int c = 0; c < NACC; ++c) acc[r][c] = VZERO();
    for (int64_t i = 0; i < wide; i += NACC * FW) {
        VF wv[NACC];
        for (int c = 0; c < NACC; ++c) wv[c] = VW(type, w, i + c * FW);
        for (int r = 0; r < nt; ++r) {
            const float *x = (const float *)(act + r * stride) + i;
            for (int c = 0; c < NACC; ++c) acc[r][c] = VFMA(wv[c], VLOAD(x + c * FW), acc[r][c]);
        }
    }
    for (int64_t i = wide; i < main; i += FW) {
        const VF wv = VW(type, w, i);
        for (int r = 0; r < nt; ++r)
            acc[r][0] = VFMA(wv, VLOAD((const float *)(act + r * stride) + i), acc[r][0]);
    }
    for (int r = 0; r < nt; ++r) {
        VF total = acc[r][0];
        for (int c = 1; c < NACC; ++c) total = VADD(total, acc[r][c]);
        tail[r] = VSUM(total);
    }
#undef NACC
#undef VF
#undef VZERO
#undef VFMA
#undef VADD
#undef VLOAD
#undef VW
#undef VSUM
#else
    /* FW independent lanes per token, summed in a fixed order: a loop compilers vectorize. */
    float acc[NT][FW];
    for (int r = 0; r < nt; ++r)
        for (int l = 0; l < FW; ++l) acc[r][l] = 0.0f;
    for (int64_t i = 0; i < main; i += FW) {
        float wv[FW];
        for (int l = 0; l < FW; ++l) wv[l] = load_w1(type, w, i + l);
        for (int r = 0; r < nt; ++r) {
            const float *x = (const float *)(act + r * stride) + i;
            for (int l = 0; l < FW; ++l) acc[r][l] += wv[l] * x[l];
        }
    }
    for (int r = 0; r < nt; ++r) {
        float s = 0.0f;
        for (int l = 0; l < FW; ++l) s += acc[r][l];
        tail[r] = s;
    }
#endif
    for (int64_t i = main; i < k; ++i) {
        const float wv = load_w1(type, w, i);
        for (int r = 0; r < nt; ++r) tail[r] += wv * ((const float *)(act + r * stride))[i];
    }
    for (int r = 0; r < nt; ++r) out[r] = tail[r];
}

/* ---- one weight row against nt tokens --------------------------------------------------------- */

static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *w, int64_t k,
                                                         const uint8_t *act, int64_t stride,
                                                         int nt, float *out) {
    switch (type) {
    case T_Q4_0: dot_q(T_Q4_0, w, k, act, stride, nt, out); break;
    case T_Q4_1: dot_q(T_Q4_1, w, k, act, stride, nt, out); break;
    case T_Q5_0: dot_q(T_Q5_0, w, k, act, stride, nt, out); break;
    case T_Q5_1: dot_q(T_Q5_1, w, k, act, stride, nt, out); break;
    case T_Q8_0: dot_q(T_Q8_0, w, k, act, stride, nt, out); break;
    case T_F32: case T_F16: case T_BF16: dot_float(type, w, k, act, stride, nt, out); break;
#ifdef MESHD_HAVE_K_QUANTS
    /* blocks_k.c's tiles: the row decoded once for all nt tokens, each token's bits those of
     * its single-token dot. */
    case T_Q4_K: meshd_rows_q4_K_q8_K(k, w, act, stride, nt, out); break;
    case T_Q5_K: meshd_rows_q5_K_q8_K(k, w, act, stride, nt, out); break;
    case T_Q6_K: meshd_rows_q6_K_q8_K(k, w, act, stride, nt, out); break;
#endif
    default: break;
    }
}

/* Separate copies for each token count, so each keeps its accumulators in registers. */
static void row_dot_1(int type, const uint8_t *w, int64_t k, const uint8_t *a, int64_t s, float *o) {
    row_dot(type, w, k, a, s, 1, o);
}
static void row_dot_2(int type, const uint8_t *w, int64_t k, const uint8_t *a, int64_t s, float *o) {
    row_dot(type, w, k, a, s, 2, o);
}
static void row_dot_3(int type, const uint8_t *w, int64_t k, const uint8_t *a, int64_t s, float *o) {
    row_dot(type, w, k, a, s, 3, o);
}
static void row_dot_4(int type, const uint8_t *w, int64_t k, const uint8_t *a, int64_t s, float *o) {
    row_dot(type, w, k, a, s, 4, o);
}

/* How many rows on a row of the row loop requests (0: none), one rule per case: 2 rows on into
 * L1 where the weights fit the cache; where every step streams them from memory, into L2, 4
 * rows on, 8 for Q4_K's eight-row groups (1 to 3 tokens), and none for Q6_K against one
 * token, whose rows (the wide ffn_down, the head) then run faster on the hardware prefetcher
 * alone; against several tokens a Q6_K row computes long enough for the request to pay
 * (docs/model-runtime.md, "Weights beyond the cache", "Narrow windows in 4-row tiles";
 * docs/benchmarks.md, "Streamed Q6_K rows"). */
static int rows_ahead(int type, int nt) {
    if (!stream_prefetch) return 2;
    if (type == T_Q6_K) return nt == 1 ? 0 : 4;
    return type == T_Q4_K && nt < NT ? 8 : 4;
}

/* Rows [r0, r1) of W against every token: tokens in groups of NT, each group sweeping the rows
 * (a chunk's rows stay in cache between groups), each row requesting the one `rows_ahead` on,
 * as the tiles do. */
static void rows_mm(int type, const uint8_t *w, int64_t rb, int64_t k, int64_t n_out, int64_t r0,
                    int64_t r1, const uint8_t *act, int64_t stride, int64_t t, float *y) {
    float out[NT];
#ifdef Q4_K_TILE
    /* Q4_K against Q4_K_TILE_MIN tokens or more (a unit holds them all, token_block): a tile
     * of rows against up to Q4_K_TILE_NT tokens per call, which unpacks each super-block of the
     * rows once for them; what is left of the rows takes the loop below. */
    if (type == T_Q4_K && t >= Q4_K_TILE_MIN) {
        const int64_t end = r0 + (r1 - r0) / Q4_K_TILE * Q4_K_TILE;
        for (int64_t n = r0; n < end; n += Q4_K_TILE)
            for (int64_t j = 0; j < t; j += Q4_K_TILE_NT) {
                const int nt = t - j < Q4_K_TILE_NT ? (int)(t - j) : Q4_K_TILE_NT;
                Q4_K_TILE_FN(k, w + n * rb, rb, act + j * stride, stride, nt, y + j * n_out + n,
                             n_out);
            }
        r0 = end;
    }
#endif
    for (int64_t j = 0; j < t; j += NT) {
        const int nt = t - j < NT ? (int)(t - j) : NT;
        const uint8_t *a = act + j * stride;
        const int ahead = rows_ahead(type, nt);
        int64_t n = r0;
#ifdef MESHD_HAVE_K_QUANTS
        /* Q4_K against 1 to 3 tokens (blocks_k.c's KQ8_NT): eight rows per call, each 64-value
         * step decoded once for the tokens, their float steps in one vector per token (the
         * bits of the single-row dot); against 4, one row at a time. */
        if (type == T_Q4_K && nt < NT) {
            for (; n + 8 <= r1; n += 8) {
                const int64_t later = n + 8 + ahead <= n_out ? rb : 0;
                meshd_rows8_q4_K_q8_K_nt(k, w + n * rb, rb, a, stride, nt, y + j * n_out + n,
                                         n_out, w + (n + ahead) * rb, later, stream_prefetch);
            }
        }
#ifdef Q4_K_ROW_PAIRS
        if (type == T_Q4_K && nt == NT)
            for (; n + 2 <= r1; n += 2) {
                const int64_t later = ahead > 0 && n + 1 + ahead < n_out ? 2 * rb : 0;
                if (stream_prefetch)
                    PREFETCH_ROWS_L2(w + (n + ahead) * rb, later);
                else
                    PREFETCH_ROWS(w + (n + ahead) * rb, later);
                meshd_rows2_q4_K_q8_K(k, w + n * rb, rb, a, stride, y + j * n_out + n, n_out);
            }
#endif
#endif
        for (; n < r1; ++n) {
            const uint8_t *wr = w + n * rb;
            const int64_t later = ahead > 0 && n + ahead < n_out ? rb : 0;
            if (stream_prefetch)
                PREFETCH_ROWS_L2(w + (n + ahead) * rb, later);
            else
                PREFETCH_ROWS(w + (n + ahead) * rb, later);
            switch (nt) {
            case 1: row_dot_1(type, wr, k, a, stride, out); break;
            case 2: row_dot_2(type, wr, k, a, stride, out); break;
            case 3: row_dot_3(type, wr, k, a, stride, out); break;
            default: row_dot_4(type, wr, k, a, stride, out); break;
            }
            for (int r = 0; r < nt; ++r) y[(j + r) * n_out + n] = out[r];
        }
    }
}

/* Tokens per unit of work for a weight type against t tokens: TOKEN_BLOCK, but all of them for
 * the Q4_K tiles, whose rows then stay in cache for every token rather than stream
 * from memory once per block of tokens (the activations it re-reads are the smaller). */
static int64_t token_block(int type, int64_t t) {
#ifdef Q4_K_TILE
    if (type == T_Q4_K && t >= Q4_K_TILE_MIN) return t;
#else
    (void)type, (void)t;
#endif
    return TOKEN_BLOCK;
}

/* y[t][n_out] = x[t][k] · W^T on `threads` threads (1: no parallel region). Returns 0, or -1 for a
 * type without a kernel or a k its blocks do not divide. */
int meshd_blocks_mm_threads(int type, const void *w, int64_t k, int64_t n_out, const float *x,
                            int64_t t, float *y, void *scratch, int threads) {
    const int64_t rb = meshd_blocks_row_bytes(type, k);
    if (!meshd_blocks_supported(type) || rb < 0 || t < 0 || n_out < 0) return -1;
    if (t == 0 || n_out == 0) return 0;
    const int64_t stride = act_stride(type, k);
    uint8_t *act = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const int64_t chunks = (n_out + CHUNK - 1) / CHUNK;
    const int64_t tb = token_block(type, t), tblocks = (t + tb - 1) / tb;
    const int64_t work = rb * n_out * t, most = 1 + work / BYTES_PER_THREAD;
    if (threads > most) threads = (int)most;
    if (threads < 1) threads = 1;
    const int serial_convert = threads == 1 || t <= SERIAL_CONVERT_TOKENS;
    if (serial_convert)
        for (int64_t i = 0; i < t; ++i) convert_act(type, x + i * k, k, act + i * stride);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (!serial_convert) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < t; ++i) convert_act(type, x + i * k, k, act + i * stride);
        }
        /* Units of CHUNK rows x token_block tokens, token block outermost: the activations a
         * unit reads stay in L2 while the threads sweep the rows. */
#pragma omp for schedule(guided) nowait
        for (int64_t u = 0; u < chunks * tblocks; ++u) {
            const int64_t c = u % chunks, j0 = u / chunks * tb;
            const int64_t r0 = c * CHUNK, r1 = r0 + CHUNK < n_out ? r0 + CHUNK : n_out;
            const int64_t tn = t - j0 < tb ? t - j0 : tb;
            const uint8_t *a = act + j0 * stride;
            float *yb = y + j0 * n_out;
#if defined(TILED)
            if (tiled_type(type)) {
                rows_tiled(type, (const uint8_t *)w, rb, k, n_out, r0, r1, a, stride, tn, yb);
                continue;
            }
#endif
            rows_mm(type, (const uint8_t *)w, rb, k, n_out, r0, r1, a, stride, tn, yb);
        }
    }
    return 0;
}

/* The same on OpenMP's default thread count for the calling thread. */
int meshd_blocks_mm(int type, const void *w, int64_t k, int64_t n_out, const float *x, int64_t t,
                    float *y, void *scratch) {
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    return meshd_blocks_mm_threads(type, w, k, n_out, x, t, y, scratch, threads);
}

/* ---- fused operands: several tensors against one input ---------------------------------------
 * q/k/v and gate/up are each several GGUF tensors multiplied by the same rows. One call converts
 * each row once per vec_dot type (not once per tensor) and runs every tensor's units in one
 * parallel region (one hand-off between threads, not one per tensor). What each output computes
 * is unchanged, so the bits are those of meshd_blocks_mm_threads per tensor. */

/* One tensor [out][k] of a fused operand: its ggml type, rows and bytes as stored, and the order
 * of its output columns (perm[c]: the tensor's row for column c; NULL: in order). layers.c's
 * meshd_block_part has the same layout. */
typedef struct {
    int64_t type, out;
    const void *data;
    const int64_t *perm;
} meshd_blocks_part;

#define PARTS_MAX 8

/* Parts whose activations are the same bytes: the Q8_0/Q8_1 formats share one conversion (it
 * writes both the codes and the block sums), the float types each their own rounding. */
static int act_key(int type) { return act_kind(type) == ACT_FLOAT ? 64 + type : act_kind(type); }

/* Rows [r0, r1) x tn tokens of one tensor, by its tiles where it has them. */
static void unit_mm(int type, const uint8_t *w, int64_t rb, int64_t k, int64_t n_out, int64_t r0,
                    int64_t r1, const uint8_t *act, int64_t stride, int64_t tn, float *y) {
#if defined(TILED)
    if (tiled_type(type)) {
        rows_tiled(type, w, rb, k, n_out, r0, r1, act, stride, tn, y);
        return;
    }
#endif
    rows_mm(type, w, rb, k, n_out, r0, r1, act, stride, tn, y);
}

/* Part p's columns of out [t][ldo] (its block of columns follows the earlier parts'), permuted
 * as it says, plus res (the same layout) where given. */
static void place_part(const meshd_blocks_part *part, const float *y, int64_t t, int64_t col,
                       float *out, int64_t ldo, const float *res) {
    for (int64_t r = 0; r < t; ++r) {
        const float *src = y + r * part->out;
        float *dst = out + r * ldo + col;
        const float *add = res == NULL ? NULL : res + r * ldo + col;
        for (int64_t c = 0; c < part->out; ++c) {
            const float v = src[part->perm == NULL ? c : part->perm[c]];
            dst[c] = add == NULL ? v : add[c] + v;
        }
    }
}

/* out[t][ldo] = the parts' products x[t][k] · W_p^T side by side (+ res). Returns 0, or -1 for
 * a part without a kernel, a k its blocks do not divide, more than PARTS_MAX parts or no memory. */
int meshd_blocks_parts_mm(const meshd_blocks_part *parts, int64_t n_parts, int64_t k,
                          const float *x, int64_t t, float *out, int64_t ldo, const float *res,
                          int threads) {
    int64_t rb[PARTS_MAX], stride[PARTS_MAX], act_at[PARTS_MAX], y_at[PARTS_MAX + 1];
    int64_t unit_at[PARTS_MAX + 1], col[PARTS_MAX], act_bytes = 0, work = 0;
    int direct[PARTS_MAX];
    int owner[PARTS_MAX], owners[PARTS_MAX], n_owners = 0;
    if (n_parts < 1 || n_parts > PARTS_MAX || t < 0) return -1;
    int64_t tb[PARTS_MAX];
    y_at[0] = unit_at[0] = 0;
    for (int p = 0; p < n_parts; ++p) {
        col[p] = p == 0 ? 0 : col[p - 1] + parts[p - 1].out;
        /* Columns in order and nothing to add: the tiles write into out (one row, or the
         * whole of out), rather than into y and a copy. */
        direct[p] = parts[p].perm == NULL && res == NULL &&
                    (t == 1 || (n_parts == 1 && ldo == parts[p].out));
        const int type = (int)parts[p].type;
        rb[p] = meshd_blocks_row_bytes(type, k);
        if (!meshd_blocks_supported(type) || rb[p] < 0 || parts[p].out < 0) return -1;
        stride[p] = act_stride(type, k);
        owner[p] = p;
        for (int q = 0; q < p && owner[p] == p; ++q)
            if (act_key((int)parts[q].type) == act_key(type)) owner[p] = owner[q];
        if (owner[p] == p) {
            owners[n_owners++] = p;
            act_at[p] = act_bytes;
            act_bytes += stride[p] * t;
        }
        y_at[p + 1] = y_at[p] + (direct[p] ? 0 : parts[p].out * t);
        tb[p] = token_block(type, t);
        unit_at[p + 1] = unit_at[p] + (parts[p].out + CHUNK - 1) / CHUNK * ((t + tb[p] - 1) / tb[p]);
        work += rb[p] * parts[p].out * t;
    }
    if (t == 0) return 0;
    uint8_t *buf = (uint8_t *)malloc((size_t)(act_bytes + 64 + y_at[n_parts] * 4));
    if (buf == NULL) return -1;
    uint8_t *act = (uint8_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *y = (float *)(act + act_bytes);
    const int64_t most = 1 + work / BYTES_PER_THREAD;
    if (threads > most) threads = (int)most;
    if (threads < 1) threads = 1;
    const int serial_convert = threads == 1 || t <= SERIAL_CONVERT_TOKENS;
    const int64_t converts = n_owners * t;
    if (serial_convert)
        for (int64_t i = 0; i < converts; ++i) {
            const int p = owners[i / t];
            convert_act((int)parts[p].type, x + i % t * k, k, act + act_at[p] + i % t * stride[p]);
        }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (!serial_convert) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < converts; ++i) {
                const int p = owners[i / t];
                convert_act((int)parts[p].type, x + i % t * k, k,
                            act + act_at[p] + i % t * stride[p]);
            }
        }
        /* Each part's units of CHUNK rows x its token_block tokens, token block outermost. */
#pragma omp for schedule(guided) nowait
        for (int64_t u = 0; u < unit_at[n_parts]; ++u) {
            int p = 0;
            while (u >= unit_at[p + 1]) ++p;
            const int64_t n_out = parts[p].out, chunks = (n_out + CHUNK - 1) / CHUNK;
            const int64_t c = (u - unit_at[p]) % chunks, j0 = (u - unit_at[p]) / chunks * tb[p];
            const int64_t r0 = c * CHUNK, r1 = r0 + CHUNK < n_out ? r0 + CHUNK : n_out;
            const int64_t tn = t - j0 < tb[p] ? t - j0 : tb[p];
            float *yp = direct[p] ? out + col[p] : y + y_at[p];
            unit_mm((int)parts[p].type, (const uint8_t *)parts[p].data, rb[p], k, n_out, r0, r1,
                    act + act_at[owner[p]] + j0 * stride[p], stride[p], tn, yp + j0 * n_out);
        }
    }
    for (int p = 0; p < n_parts; ++p)
        if (!direct[p]) place_part(parts + p, y + y_at[p], t, col[p], out, ldo, res);
    free(buf);
    return 0;
}

/* ---- dequantization (ggml's dequantize_row_*: the same fp32 operations) ----------------------- */

static inline void k4_scale_min(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

static void dequantize_row(int type, const uint8_t *w, int64_t k, float *y) {
    const int64_t nb = k / block_elems(type);
    switch (type) {
    case T_F32: memcpy(y, w, (size_t)k * 4); break;
    case T_F16: for (int64_t i = 0; i < k; ++i) y[i] = fp16(rd16(w + 2 * i)); break;
    case T_BF16: for (int64_t i = 0; i < k; ++i) y[i] = bf16(rd16(w + 2 * i)); break;
    case T_Q4_0:
        for (int64_t b = 0; b < nb; ++b, y += QK) {
            const uint8_t *p = w + b * 18;
            const float d = fp16(rd16(p));
            for (int j = 0; j < 16; ++j) {
                y[j] = d * (float)((p[2 + j] & 0x0F) - 8);
                y[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
            }
        }
        break;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; ++b, y += QK) {
            const uint8_t *p = w + b * 20;
            const float d = fp16(rd16(p)), m = fp16(rd16(p + 2));
            for (int j = 0; j < 16; ++j) {
                y[j] = d * (float)(p[4 + j] & 0x0F) + m;
                y[j + 16] = d * (float)(p[4 + j] >> 4) + m;
            }
        }
        break;
    case T_Q5_0:
    case T_Q5_1: {
        const int one = type == T_Q5_1;
        const int64_t bytes = one ? 24 : 22;
        for (int64_t b = 0; b < nb; ++b, y += QK) {
            const uint8_t *p = w + b * bytes;
            const float d = fp16(rd16(p)), m = one ? fp16(rd16(p + 2)) : 0.0f;
            uint32_t h;
            memcpy(&h, p + 2 + 2 * one, 4);
            const uint8_t *qs = p + 6 + 2 * one;
            for (int j = 0; j < 16; ++j) {
                const int lo = (qs[j] & 0x0F) | (int)(((h >> j) & 1) << 4);
                const int hi = (qs[j] >> 4) | (int)(((h >> (j + 16)) & 1) << 4);
                if (one) {
                    y[j] = d * (float)lo + m;
                    y[j + 16] = d * (float)hi + m;
                } else {
                    y[j] = d * (float)(lo - 16);
                    y[j + 16] = d * (float)(hi - 16);
                }
            }
        }
        break;
    }
    case T_Q8_0:
        for (int64_t b = 0; b < nb; ++b, y += QK) {
            const uint8_t *p = w + b * 34;
            const float d = fp16(rd16(p));
            for (int j = 0; j < QK; ++j) y[j] = d * (float)(int8_t)p[2 + j];
        }
        break;
    case T_Q4_K:
    case T_Q5_K:
        /* block_q4_K: d, dmin (fp16), scales[12], qs[128]; block_q5_K adds qh[32] before qs. */
        for (int64_t b = 0; b < nb; ++b) {
            const int five = type == T_Q5_K;
            const uint8_t *p = w + b * (five ? 176 : 144);
            const float d = fp16(rd16(p)), dmin = fp16(rd16(p + 2));
            const uint8_t *scales = p + 4, *qh = p + 16, *q = p + (five ? 48 : 16);
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0, is = 0; j < QKK; j += 64, is += 2, q += 32) {
                uint8_t sc, m;
                k4_scale_min(is, scales, &sc, &m);
                const float d1 = d * sc, m1 = dmin * m;
                k4_scale_min(is + 1, scales, &sc, &m);
                const float d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; ++l) {
                    const int hi = five && (qh[l] & u1) ? 16 : 0;
                    *y++ = d1 * (float)((q[l] & 0xF) + hi) - m1;
                }
                for (int l = 0; l < 32; ++l) {
                    const int hi = five && (qh[l] & u2) ? 16 : 0;
                    *y++ = d2 * (float)((q[l] >> 4) + hi) - m2;
                }
                u1 = (uint8_t)(u1 << 2);
                u2 = (uint8_t)(u2 << 2);
            }
        }
        break;
    case T_Q6_K:
        /* block_q6_K: ql[128], qh[64], int8 scales[16], d (fp16). */
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *p = w + b * 210;
            const float d = fp16(rd16(p + 208));
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            for (int n = 0; n < QKK; n += 128) {
                for (int l = 0; l < 32; ++l) {
                    const int is = l / 16;
                    const int q1 = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is] * q1;
                    y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3;
                    y[l + 96] = d * sc[is + 6] * q4;
                }
                y += 128;
                ql += 64;
                qh += 32;
                sc += 8;
            }
        }
        break;
    default: break;
    }
}

/* out[i][k] = row rows[i] of W (n rows), dequantized. Returns 0, or -1 for an unknown type. */
int meshd_blocks_dequantize_rows(int type, const void *w, int64_t k, const int64_t *rows, int64_t n,
                                 float *out) {
    const int64_t rb = meshd_blocks_row_bytes(type, k);
    if (rb < 0) return -1;
    for (int64_t i = 0; i < n; ++i)
        dequantize_row(type, (const uint8_t *)w + rows[i] * rb, k, out + i * k);
    return 0;
}

/* out[r] = the index of row r's largest element (rows of n floats, `stride` floats apart), as
 * torch.argmax picks it: the first of equal maxima, and the first NaN where a row holds one. The
 * greedy token of a step or of each verify row: torch's argmax walks 151,936 logits in ~0.25 ms,
 * a sixtieth of a small model's decode step. The vector paths read the row once, each lane
 * keeping its maximum and where it first saw it (strictly greater replaces, so a lane keeps its
 * first); the lanes then give the largest value at the smallest index. A row holding a NaN
 * (vector compares are false for it) is searched again for its first NaN. */
/* The lanes' answer: the largest maximum, at the smallest index among equal ones. */
static void best_lane(const float *lane_max, const int32_t *lane_at, int lanes, float *best,
                      int64_t *at) {
    *best = lane_max[0], *at = lane_at[0];
    for (int j = 1; j < lanes; ++j)
        if (lane_max[j] > *best || (lane_max[j] == *best && lane_at[j] < *at))
            *best = lane_max[j], *at = lane_at[j];
}

static int64_t row_argmax(const float *p, int64_t n) {
    float best = p[0];
    int64_t at = 0, i = 1;
    int nan = p[0] != p[0];
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 m = _mm512_loadu_ps(p);
        __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = where;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(p + i);
            index = _mm512_add_epi32(index, step);
            const __mmask16 more = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
            m = _mm512_mask_mov_ps(m, more, v);
            where = _mm512_mask_mov_epi32(where, more, index);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        float lane_max[16];
        int32_t lane_at[16];
        _mm512_storeu_ps(lane_max, m);
        _mm512_storeu_si512(lane_at, where);
        best_lane(lane_max, lane_at, 16, &best, &at);
        nan = unordered != 0;
    }
#elif defined(__AVX2__)
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(p);
        __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i index = where;
        const __m256i step = _mm256_set1_epi32(8);
        __m256 unordered = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(p + i);
            index = _mm256_add_epi32(index, step);
            const __m256 more = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
            m = _mm256_blendv_ps(m, v, more);
            where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(more));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lane_max[8];
        int32_t lane_at[8];
        _mm256_storeu_ps(lane_max, m);
        _mm256_storeu_si256((__m256i *)lane_at, where);
        best_lane(lane_max, lane_at, 8, &best, &at);
        nan = _mm256_movemask_ps(unordered) != 0;
    }
#endif
    for (; i < n; ++i) {
        if (p[i] > best) best = p[i], at = i;
        nan |= p[i] != p[i];
    }
    if (nan)
        for (at = 0; p[at] == p[at]; ++at) {
        }
    return at;
}

/* Rows of fewer than 2^31 elements (the lanes count positions in int32). */
void meshd_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) out[r] = n > 0 ? row_argmax(x + r * stride, n) : 0;
}
