/*
 * Vector helpers shared by the CPU kernels (LoRA, linear, paged extend).
 *
 * Vectors are GCC/Clang vector extensions: v16 (16 floats) is one AVX-512 register where
 * the CPU has it, split by the compiler into AVX2/SSE/NEON registers elsewhere. A kernel
 * with its own vector width declares the type and gets the same helpers from
 * VEC_HELPERS(type, prefix): prefix##load (unaligned), prefix##store, prefix##splat.
 */
#ifndef LORAPLEX_VEC_TILES_H
#define LORAPLEX_VEC_TILES_H

#include <stdint.h>
#include <string.h>

#define VL 16 /* floats per vector */

#define VEC_HELPERS(T, P)                                                              \
    static inline T P##load(const float *p) {                                          \
        T v;                                                                           \
        memcpy(&v, p, sizeof v); /* unaligned load */                                  \
        return v;                                                                      \
    }                                                                                  \
    static inline void P##store(float *p, T v) { memcpy(p, &v, sizeof v); }           \
    static inline T P##splat(float s) { return (T){0} + s; }

typedef float v16 __attribute__((vector_size(VL * sizeof(float))));
VEC_HELPERS(v16, v)

#endif
