/* fp16 / bf16 <-> fp32, exact, rounding to nearest even as ggml does (the software forms of
 * ggml-impl.h's conversions, from the FP16 library): one copy for every kernel source that
 * reads or writes half-precision values, so they all round alike.
 *
 * Ported from ggml (https://github.com/ggml-org/ggml, src/ggml-impl.h), MIT License,
 * Copyright (c) 2023-2026 The ggml authors (the full notice is in blocks_quantize.c).
 */
#ifndef MESHD_HALF_H
#define MESHD_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ggml's GGML_COMPUTE_FP16_TO_FP32 without F16C: exact. */
static inline float fp16_soft(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    return u2f(sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

/* ggml's GGML_COMPUTE_FP32_TO_FP16 without F16C: round to nearest even, NaN kept NaN. */
static inline uint16_t to_fp16_soft(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f2u(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f2u(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : exp_bits + mantissa_bits));
}

static inline float bf16(uint16_t h) { return u2f((uint32_t)h << 16); }

/* ggml_compute_fp32_to_bf16: NaN made quiet, otherwise round to nearest even. */
static inline uint16_t to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

#endif
