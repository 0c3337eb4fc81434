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

#if defined(__F16C__)
#include <immintrin.h>
#endif

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

/* One IEEE float16 as a float (F16C's instruction where the CPU has it). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#endif
