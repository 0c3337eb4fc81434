/*
 * Scalar helpers shared by the CPU kernels: bfloat16 <-> float and a vectorisable exp.
 * Each inlines into the callers' vector loops (no libm call per element).
 */
#ifndef LORAPLEX_SCALAR_OPS_H
#define LORAPLEX_SCALAR_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float v) { *p = v; }

static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline void store_bf16(uint16_t *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep it a quiet NaN */
        *p = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    *p = (uint16_t)(bits >> 16);
}

/*
 * exp(x) in float32. libm's expf is a scalar call per element, which made the softmax
 * exponentials about half of the decode kernel's time; this inlines into a vector loop.
 * Cody-Waite reduction x = n ln2 + r with |r| <= ln2 / 2, then a degree-6 Taylor
 * polynomial: relative error ~2e-7, about one float32 ulp. x is clamped to [-87, 88]
 * (e^-87 ~ 1.6e-38 next to a softmax's max term of 1; e^88 ~ 1.6e38).
 */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* rintf, not the add-and-subtract 1.5 * 2^23 trick, which -fassociative-math folds away */
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    const float p =
        1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
