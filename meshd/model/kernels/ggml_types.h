/* ggml's tensor type ids (gguf.GGMLQuantizationType), the ones meshd's block kernels read:
 * one list for every kernel source, so an id can never mean two types. */
#ifndef MESHD_GGML_TYPES_H
#define MESHD_GGML_TYPES_H

enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_BF16 = 30,
};

#endif
