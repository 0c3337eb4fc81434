/*
 * The block formats quant_linear.c's projection reads, decoded into vectors (static inline, so
 * each decoder is inlined into its callers as if written there): GGUF's Q8_0 / Q4_0 / Q4_1 /
 * Q4_K / Q6_K, F16 / BF16 / F32 and per-channel int8. Format ids (`F_*`) are the Python side's
 * `WeightFormat.c_id`; `block_weights` / `block_bytes` are each format's geometry, `read_head`
 * reads what a block's chunks share (its scales: `block_head`), `decode_chunk` turns 16 weights
 * of a block into floats, `row_scale` is per-channel int8's row scale (1 for the others).
 */
#ifndef LORAPLEX_QUANT_BLOCKS_H
#define LORAPLEX_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "vec_tiles.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { F_Q8_0 = 1, F_Q4_0 = 2, F_Q4_1 = 3, F_F16 = 4, F_BF16 = 5, F_INT8 = 6, F_F32 = 7, F_Q4_K = 8, F_Q6_K = 9 };

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline u8x16 load_u8(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

/* Widen to int32 first: GCC scalarises a direct uint8 -> float vector conversion (measured 7x slower). */
static inline v16 u8_to_v(u8x16 v) {
#if defined(__AVX512F__)
    __m128i b;
    memcpy(&b, &v, 16);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    v16 out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16);
#endif
}

static inline v16 i8_to_v(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    v16 out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    i8x16 v;
    memcpy(&v, p, 16);
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16);
#endif
}

static inline v16 f16x16_to_v(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    v16 v;
    memcpy(&v, &f, sizeof v);
    return v;
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    float tmp[16];
    _mm256_storeu_ps(tmp, lo);
    _mm256_storeu_ps(tmp + 8, hi);
    return vload(tmp);
#else
    float tmp[16];
    for (int i = 0; i < 16; ++i) tmp[i] = f16_at(p + 2 * i);
    return vload(tmp);
#endif
}

static inline v16 bf16x16_to_v(const uint8_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Per-format geometry: weights and bytes per block. */
static inline int64_t block_weights(const int fmt) { return fmt == F_Q4_K || fmt == F_Q6_K ? 256 : fmt <= F_Q4_1 ? 32 : 16; }
static inline int64_t block_bytes(const int fmt) {
    switch (fmt) {
        case F_Q8_0: return 34;
        case F_Q4_0: return 18;
        case F_Q4_1: return 20;
        case F_F16: case F_BF16: return 32;
        case F_INT8: return 16;
        case F_F32: return 64;
        case F_Q4_K: return 144;
        case F_Q6_K: return 210;
        default: return 0;
    }
}

/* What a block's chunks share, read once per block: scales (and Q4_K's eight sub-block pairs). */
typedef struct {
    float d, m;
    float sc[8], mn[8]; /* Q4_K: d * scale and dmin * min of each 32-weight sub-block */
} block_head;

static inline void read_head(const int fmt, const uint8_t *b, block_head *h) {
    switch (fmt) {
        case F_Q8_0: case F_Q4_0: h->d = f16_at(b); break;
        case F_Q4_1: h->d = f16_at(b); h->m = f16_at(b + 2); break;
        case F_Q6_K: h->d = f16_at(b + 208); break;
        case F_Q4_K: {
            const float d = f16_at(b), dmin = f16_at(b + 2);
            const uint8_t *s = b + 4; /* ggml's get_scale_min_k4 */
            for (int j = 0; j < 8; ++j) {
                uint8_t sc, mn;
                if (j < 4) {
                    sc = s[j] & 63;
                    mn = s[j + 4] & 63;
                } else {
                    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                }
                h->sc[j] = d * (float)sc;
                h->mn[j] = dmin * (float)mn;
            }
            break;
        }
        default: break;
    }
}

/* Weights 16 * j .. 16 * j + 15 of block `b` as floats (the format's value formula). */
static inline __attribute__((always_inline)) v16 decode_chunk(const int fmt, const uint8_t *b, const block_head *h,
                                                              const int j) {
    switch (fmt) {
        case F_Q8_0: return i8_to_v(b + 2 + 16 * j) * h->d;
        case F_Q4_0: {
            const u8x16 q = load_u8(b + 2);
            return (u8_to_v(j ? q >> 4 : q & 0xF) - 8.0f) * h->d;
        }
        case F_Q4_1: {
            const u8x16 q = load_u8(b + 4);
            return u8_to_v(j ? q >> 4 : q & 0xF) * h->d + h->m;
        }
        case F_F16: return f16x16_to_v(b);
        case F_BF16: return bf16x16_to_v(b);
        case F_INT8: return i8_to_v(b);
        case F_F32: return vload((const float *)b);
        case F_Q4_K: { /* 64 weights per 32 bytes: low nibbles (sub-block 2g), then high (2g + 1) */
            const int g = j / 4, half = (j % 4) / 2, part = j % 2;
            const u8x16 q = load_u8(b + 16 + 32 * g + 16 * part);
            const int s = 2 * g + half;
            return u8_to_v(half ? q >> 4 : q & 0xF) * h->sc[s] - h->mn[s];
        }
        case F_Q6_K: { /* 128 weights per half: ql[l] & F, ql[l + 32] & F, ql[l] >> 4, ql[l + 32] >> 4 */
            const int half = j / 8, quarter = (j % 8) / 2, l0 = 16 * (j % 2);
            const u8x16 ql = load_u8(b + 64 * half + l0 + 32 * (quarter % 2));
            const u8x16 qh = load_u8(b + 128 + 32 * half + l0);
            const u8x16 lo = quarter < 2 ? ql & 0xF : ql >> 4;
            const u8x16 q = lo | (((qh >> (2 * quarter)) & 3) << 4);
            const float scale = h->d * (float)(int8_t)b[192 + j];
            return (u8_to_v(q) - 32.0f) * scale;
        }
        default: return vsplat(0.0f);
    }
}

static inline float row_scale(const int fmt, const uint8_t *row, int64_t k) {
    if (fmt != F_INT8) return 1.0f;
    float s;
    memcpy(&s, row + k, 4); /* per-channel int8: the scale follows the row's weights */
    return s;
}

#endif /* LORAPLEX_QUANT_BLOCKS_H */
