/*
 * Vector helpers shared by the CPU kernels (LoRA and linear).
 *
 * Vectors are GCC/Clang vector extensions of 16 floats: one AVX-512 register where
 * the CPU has it, split by the compiler into AVX2/SSE/NEON registers elsewhere.
 */
#ifndef LORAPLEX_VEC_TILES_H
#define LORAPLEX_VEC_TILES_H

#include <stdint.h>
#include <string.h>

#define VL 16 /* floats per vector */

typedef float v16 __attribute__((vector_size(VL * sizeof(float))));

static inline v16 vload(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 vsplat(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

#endif
