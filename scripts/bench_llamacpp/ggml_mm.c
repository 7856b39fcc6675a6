// ggml as a kernel library: the per-call cost of one ggml_mul_mat on the CPU.
//
//   meshd-ggml-mm [SECONDS_PER_CASE]
//
// For each weight shape (out x in), block type, batch (1 and 16 activation rows, f32) and
// thread count (1 and 2): a ggml graph holding one ggml_mul_mat(weight, x), computed with
// ggml_graph_compute on a thread pool made once (as llama.cpp keeps one), timed call by call
// (clock_gettime, after a warm-up) for SECONDS_PER_CASE (default 0.4 s, at least 30 calls);
// prints one JSON line per case: the median and 10th percentile microseconds per call, and
// the weight bytes over the median time in GB/s. The weight is random data quantized with
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

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float frand(void) {  // xorshift64*, uniform in [-1, 1)
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (float) ((rng * 0x2545F4914F6CDD1Dull) >> 40) / (float) (1 << 23) - 1.0f;
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
    struct ggml_init_params params = {
        .mem_size = wbytes + (size_t) (in + out) * batch * sizeof(float) * 2 + 64u * 1024 * 1024,
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, in, out);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, in, batch);
    float * src = malloc(sizeof(float) * (size_t) in * out);
    for (size_t i = 0; i < (size_t) in * out; ++i) {
        src[i] = frand();
    }
    if (type == GGML_TYPE_F32) {
        memcpy(w->data, src, sizeof(float) * (size_t) in * out);
    } else {
        ggml_quantize_chunk(type, src, w->data, 0, out, in, NULL);
    }
    free(src);
    for (int i = 0; i < in * batch; ++i) {
        ((float *) x->data)[i] = frand();
    }
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, y);
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    void * work = plan.work_size ? malloc(plan.work_size) : NULL;
    plan.work_data = work;

    for (int i = 0; i < 10; ++i) {
        ggml_graph_compute(graph, &plan);
    }
    int cap = 200000, n = 0;
    double * t = malloc(sizeof(double) * cap);
    const double end = now_us() + budget_s * 1e6;
    while (n < cap && (n < 30 || now_us() < end)) {
        const double t0 = now_us();
        ggml_graph_compute(graph, &plan);
        t[n++] = now_us() - t0;
    }
    qsort(t, n, sizeof(double), cmp_double);
    const double med = t[n / 2], p10 = t[n / 10];
    printf("{\"out\": %d, \"in\": %d, \"type\": \"%s\", \"batch\": %d, \"threads\": %d, "
           "\"calls\": %d, \"median_us\": %.2f, \"p10_us\": %.2f, \"weight_bytes\": %zu, "
           "\"gb_s\": %.2f}\n",
           out, in, ggml_type_name(type), batch, threads, n, med, p10, wbytes,
           wbytes / (med * 1e3));
    fflush(stdout);
    free(t);
    free(work);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    const double budget_s = argc > 1 ? atof(argv[1]) : 0.4;
    const int shapes[][2] = {{1536, 576}, {576, 1536}, {8960, 1536}, {256, 256}};
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
