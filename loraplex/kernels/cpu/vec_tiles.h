/*
 * Vector helpers and the dot-product register tile shared by the CPU kernels.
 *
 * Vectors are GCC/Clang vector extensions of 16 floats: one AVX-512 register where
 * the CPU has it, split by the compiler into AVX2/SSE/NEON registers elsewhere.
 */
#ifndef LORAPLEX_VEC_TILES_H
#define LORAPLEX_VEC_TILES_H

#include <stdint.h>
#include <string.h>

#define VL 16 /* floats per vector */
#define TB 4  /* tokens (rows of x) per register tile */
#define RB 4  /* weight rows per dot tile */

typedef float v16 __attribute__((vector_size(VL * sizeof(float))));

static inline v16 vload(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 vsplat(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

static inline float vsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += v[i];
    return s;
}

/* out[t * out_stride + j] = xs[t] . rows[j] over `len` floats, for TB rows of x and RB
 * weight rows: 16 vector accumulators, so each vector of x and of the weights loaded
 * feeds 4 FMAs. Every pointer must be readable (callers repeat a real row as padding);
 * only the first `nt` x rows and `nr` weight rows are stored. */
static inline __attribute__((always_inline)) void dot_tile(const float *const xs[TB],
                                                           const float *const rows[RB], int64_t len,
                                                           float *out, int64_t out_stride, int64_t nt,
                                                           int64_t nr) {
    v16 acc[TB][RB];
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < RB; ++j) acc[t][j] = vsplat(0.0f);
    int64_t d = 0;
    for (; d + VL <= len; d += VL) {
        v16 wv[RB];
        for (int j = 0; j < RB; ++j) wv[j] = vload(rows[j] + d);
        for (int t = 0; t < TB; ++t) {
            const v16 xv = vload(xs[t] + d);
            for (int j = 0; j < RB; ++j) acc[t][j] += xv * wv[j];
        }
    }
    for (int t = 0; t < TB && t < nt; ++t) {
        for (int j = 0; j < RB && j < nr; ++j) {
            float s = vsum(acc[t][j]);
            for (int64_t e = d; e < len; ++e) s += xs[t][e] * rows[j][e];
            out[t * out_stride + j] = s;
        }
    }
}

#endif
