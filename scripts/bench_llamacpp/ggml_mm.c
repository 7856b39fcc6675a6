// ggml as a kernel library: the per-call cost of one ggml_mul_mat on the CPU.
//
//   meshd-ggml-mm [SECONDS_PER_CASE]
//
// For each weight shape (out x in: SmolLM2-135M's FFN up/gate 1536x576 and down 576x1536, a
// 1.5B Qwen2.5's FFN 8960x1536, and two small ones whose time is mostly the call itself),
// block type, batch (1 and 16 activation rows, f32) and
// thread count (1 and 2): a ggml graph holding one ggml_mul_mat(weight, x), computed with
// ggml_graph_compute on a thread pool made once (as llama.cpp keeps one), timed call by call
// (clock_gettime, after a warm-up) for SECONDS_PER_CASE (default 0.4 s, at least 30 calls);
// prints one JSON line per case: the median and 10th percentile microseconds per call, and
// the weight bytes over the median time in GB/s, twice: "hot" (the same weight every call,
// in cache when it fits) and "cold" (cycling over copies of it at other addresses, 256 MB in
// all, so that each call reads its weight from memory, as a decode step reads a layer's). The weight is random data quantized with
// ggml_quantize_chunk; the call includes what a stage's call would: quantizing x to the
// type's vec_dot block type (Q8_0 / Q8_1 / Q8_K) and the dot products. Weights sit in a plain
// ggml context (no repacking into llama.cpp's AMX or interleaved "extra" buffer types).
//
// A shape whose `in` is not a multiple of the type's block (Q4_K: 256) is skipped: llama.cpp
// cannot store it, and its llama-quantize falls back to another type for such a tensor.
//
// Built by scripts/bench_llamacpp against the ggml it built (`--parts ggml`).
#define _POSIX_C_SOURCE 199309L
#include "ggml-cpu.h"
#include "ggml.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

#define STREAM_BYTES ((size_t) 256 << 20)
#define MAX_COPIES 1024

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float frand(void) {  // xorshift64*, uniform in [-1, 1)
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (float) ((rng * 0x2545F4914F6CDD1Dull) >> 40) / (float) (1 << 23) - 1.0f;
}

// Calls timed one by one for `budget_s` (at least 30), cycling over `n` graphs; sorted.
static int time_calls(struct ggml_cgraph ** graphs, struct ggml_cplan * plans, int n,
                      double budget_s, double * t, int cap) {
    int calls = 0;
    const double end = now_us() + budget_s * 1e6;
    while (calls < cap && (calls < 30 || now_us() < end)) {
        const int g = calls % n;
        const double t0 = now_us();
        ggml_graph_compute(graphs[g], &plans[g]);
        t[calls++] = now_us() - t0;
    }
    qsort(t, calls, sizeof(double), cmp_double);
    return calls;
}

static void bench(int out, int in, enum ggml_type type, int batch, int threads, double budget_s,
                  struct ggml_threadpool * pool) {
    const int64_t blck = ggml_blck_size(type);
    if (in % blck != 0) {
        printf("{\"out\": %d, \"in\": %d, \"type\": \"%s\", \"batch\": %d, \"threads\": %d, "
               "\"skipped\": \"in not a multiple of %lld\"}\n",
               out, in, ggml_type_name(type), batch, threads, (long long) blck);
        return;
    }
    const size_t wbytes = ggml_row_size(type, in) * (size_t) out;
    // Cold: copies of the weight at other addresses, cycled, STREAM_BYTES in all, so each call
    // reads its weight from memory as a decode step does (a model's layers do not stay in
    // cache); hot: the first copy again and again (in cache when it fits).
    int copies = (int) ((STREAM_BYTES + wbytes - 1) / wbytes);
    copies = copies < 1 ? 1 : copies > MAX_COPIES ? MAX_COPIES : copies;
    const size_t per_copy = wbytes + (size_t) out * batch * sizeof(float) +
                            ggml_graph_overhead_custom(4, false) + 4 * ggml_tensor_overhead() + 256;
    struct ggml_init_params params = {
        .mem_size = per_copy * copies + (size_t) in * batch * sizeof(float) + (1u << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, in, batch);
    for (int i = 0; i < in * batch; ++i) {
        ((float *) x->data)[i] = frand();
    }
    float * src = malloc(sizeof(float) * (size_t) in * out);
    for (size_t i = 0; i < (size_t) in * out; ++i) {
        src[i] = frand();
    }
    struct ggml_cgraph ** graphs = malloc(sizeof(*graphs) * copies);
    struct ggml_cplan * plans = malloc(sizeof(*plans) * copies);
    size_t work_size = 0;
    struct ggml_tensor * first = NULL;
    for (int c = 0; c < copies; ++c) {
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, in, out);
        if (first == NULL) {
            if (type == GGML_TYPE_F32) {
                memcpy(w->data, src, wbytes);
            } else {
                ggml_quantize_chunk(type, src, w->data, 0, out, in, NULL);
            }
            first = w;
        } else {
            memcpy(w->data, first->data, wbytes);
        }
        graphs[c] = ggml_new_graph_custom(ctx, 4, false);
        ggml_build_forward_expand(graphs[c], ggml_mul_mat(ctx, w, x));
        plans[c] = ggml_graph_plan(graphs[c], threads, pool);
        work_size = plans[c].work_size > work_size ? plans[c].work_size : work_size;
    }
    free(src);
    void * work = work_size ? malloc(work_size) : NULL;
    for (int c = 0; c < copies; ++c) {
        plans[c].work_data = work;
    }
    for (int i = 0; i < 10; ++i) {
        ggml_graph_compute(graphs[0], &plans[0]);
    }
    const int cap = 200000;
    double * t = malloc(sizeof(double) * cap);
    const int hot_n = time_calls(graphs, plans, 1, budget_s, t, cap);
    const double hot = t[hot_n / 2], hot_p10 = t[hot_n / 10];
    const int cold_n = time_calls(graphs, plans, copies, budget_s, t, cap);
    const double cold = t[cold_n / 2], cold_p10 = t[cold_n / 10];
    printf("{\"out\": %d, \"in\": %d, \"type\": \"%s\", \"batch\": %d, \"threads\": %d, "
           "\"weight_bytes\": %zu, \"calls\": %d, \"median_us\": %.2f, \"p10_us\": %.2f, "
           "\"gb_s\": %.2f, \"copies\": %d, \"cold_calls\": %d, \"cold_median_us\": %.2f, "
           "\"cold_p10_us\": %.2f, \"cold_gb_s\": %.2f}\n",
           out, in, ggml_type_name(type), batch, threads, wbytes, hot_n, hot, hot_p10,
           wbytes / (hot * 1e3), copies, cold_n, cold, cold_p10, wbytes / (cold * 1e3));
    fflush(stdout);
    free(t);
    free(work);
    free(graphs);
    free(plans);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    const double budget_s = argc > 1 ? atof(argv[1]) : 0.4;
    const int shapes[][2] = {{1536, 576}, {576, 1536}, {8960, 1536}, {256, 256}, {64, 256}};
    const enum ggml_type types[] = {GGML_TYPE_Q4_K, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                    GGML_TYPE_Q4_1, GGML_TYPE_F32};
    const int batches[] = {1, 16};
    ggml_cpu_init();
    for (int threads = 1; threads <= 2; ++threads) {
        struct ggml_threadpool_params tp = ggml_threadpool_params_default(threads);
        struct ggml_threadpool * pool = ggml_threadpool_new(&tp);
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s) {
            for (size_t k = 0; k < sizeof types / sizeof types[0]; ++k) {
                for (size_t b = 0; b < sizeof batches / sizeof batches[0]; ++b) {
                    bench(shapes[s][0], shapes[s][1], types[k], batches[b], threads, budget_s,
                          pool);
                }
            }
        }
        ggml_threadpool_free(pool);
    }
    return 0;
}
