/*
 * quant_x16.c's AVX2 path (AVX2 + F16C + FMA, no AVX-512): the dot products of a group of 16
 * weight rows on two 8-lane halves, up to 4 rows of x at a time, int16 pairs with vpmaddwd or
 * (Q4 only) int8 with vpmaddubsw. The builds that have it are chosen at compile time, as the rest
 * of the library (-march=native): QX_AVX2 is 1 in them, 0 elsewhere, where dot_group runs its
 * VNNI / GCC-vector loop. The functions are always_inline: included once, by quant_x16.c, so
 * dot_group's tiles (a constant row count each) get them unrolled. QX_ATTR_16 / QX_ATTR_8 are the
 * attributes of quant_x16.c's per-format dot functions.
 */
#ifndef LORAPLEX_QUANT_X16_AVX2_H
#define LORAPLEX_QUANT_X16_AVX2_H

#include "quant_x16_common.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512F__)
#define QX_AVX2 1
/* The AVX2 kernels' per-block epilogue for rows t < tm of x, one 8-row half of a group:
 * acc[t] += d[r] * dx * (isum[t] - offset * sum(q)) (+ m[r] * dx * sum(q) for Q4_1), where
 * offset is 128 for Q8_0 (its weights are stored + 128), 8 for Q4_0. */
static inline __attribute__((always_inline)) void block_scale_avx2(const int fmt, const uint8_t *blk, const int half,
                                                                   const __m256i *isum, const float *dx,
                                                                   const int32_t *sx, const float *ms, int64_t nb,
                                                                   int64_t b, __m256 *acc, const int tm) {
    const int offset = fmt == X_Q8_0 ? 128 : fmt == X_Q4_0 ? 8 : 0;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
    _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) {
        __m256i v = isum[t];
        if (offset) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset * sx[t * nb + b]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(d, _mm256_set1_ps(dx[t * nb + b])), acc[t]);
        if (fmt == X_Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * half)));
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(ms[t * nb + b]), acc[t]);
        }
    }
}

/* y[t, 8 half .. +8] = acc[t] (+ bias) for rows t < tm. */
static inline __attribute__((always_inline)) void store_half_avx2(const __m256 *acc, const float *bias, float *y,
                                                                  int64_t y_stride, const int tm, const int half) {
    _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) {
        const __m256 v = bias != NULL ? _mm256_add_ps(acc[t], _mm256_loadu_ps(bias + 8 * half)) : acc[t];
        _mm256_storeu_ps(y + t * y_stride + 8 * half, v);
    }
}

/* AVX2 (no AVX-512): the int16-activation dot products on 8 lanes (half a group: rows
 * 8h .. 8h+7, bytes 32h .. 32h+31 of each chunk) with vpmaddwd, up to 4 rows of x per call:
 * the 512-bit GCC vectors of dot_group's generic loop would need 32 ymm registers for a tile and spill. */
static inline __attribute__((always_inline)) void dot16_half_avx2(const int fmt, const uint8_t *wg, int64_t nb,
                                                                  const int32_t *xp, int64_t k, const float *dx,
                                                                  const int32_t *sx, const float *ms, const float *bias, float *y,
                                                                  int64_t y_stride, const int tm, const int half) {
    const int64_t bb = x_block_bytes(fmt);
    const int hb = x_head_bytes(fmt);
    const __m256i mask = _mm256_set1_epi32(fmt == X_Q8_0 ? 0x00FF00FF : 0x000F000F);
    __m256 acc[4];
    _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * bb, *qs = blk + hb + 32 * half;
        __m256i s[4];
        _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) s[t] = _mm256_setzero_si256();
        _Pragma("GCC unroll 1") for (int c = 0; c < (fmt == X_Q8_0 ? 8 : 4); ++c) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 64 * c));
            const __m256i q0 = _mm256_and_si256(w, mask), q1 = _mm256_and_si256(_mm256_srli_epi32(w, 8), mask);
            _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) {
                const int32_t *xb = xp + t * (k / 2) + 16 * b;
                s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(q0, _mm256_set1_epi32(xb[2 * c])));
                s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(q1, _mm256_set1_epi32(xb[2 * c + 1])));
            }
            if (fmt != X_Q8_0) { /* the high nibbles: weights 16 + 4c .. */
                const __m256i q2 = _mm256_and_si256(_mm256_srli_epi32(w, 4), mask);
                const __m256i q3 = _mm256_and_si256(_mm256_srli_epi32(w, 12), mask);
                _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) {
                    const int32_t *xb = xp + t * (k / 2) + 16 * b;
                    s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(q2, _mm256_set1_epi32(xb[2 * c + 8])));
                    s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(q3, _mm256_set1_epi32(xb[2 * c + 9])));
                }
            }
        }
        block_scale_avx2(fmt, blk, half, s, dx, sx, ms, k / 32, b, acc, tm);
    }
    store_half_avx2(acc, bias, y, y_stride, tm, half);
}

/* AVX2, int8 activations, Q4_0 / Q4_1 (Q8_0's a8 runs dot16_half_avx2 on int8-valued pairs: see
 * loraplex_qx16_f32): vpmaddubsw multiplies a lane's 4 unsigned nibbles by 4 signed bytes of x
 * into two int16 pair sums, 32 multiply-adds an instruction. A pair sum is at most
 * 2 * 15 * 127 = 3810, so a block's 8 of them add up in int16 (<= 30480) and one vpmaddwd by
 * ones widens them per block. */
static inline __attribute__((always_inline)) void dot8_half_avx2(const int fmt, const uint8_t *wg, int64_t nb,
                                                                 const int8_t *xq, int64_t k, const float *dx,
                                                                 const int32_t *sx, const float *ms, const float *bias, float *y,
                                                                 int64_t y_stride, const int tm, const int half) {
    const int64_t bb = x_block_bytes(fmt);
    const int hb = x_head_bytes(fmt);
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * bb, *qs = blk + hb + 32 * half;
        __m256i s[4];
        _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) s[t] = _mm256_setzero_si256();
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 64 * c));
            const __m256i lo = _mm256_and_si256(w, mask), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
            _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) {
                const int32_t *x32 = (const int32_t *)(xq + t * k + 32 * b);
                s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x32[c])));
                s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x32[4 + c])));
                /* keep the sum in order: GCC reassociates the integer adds into a tree of all
                 * the block's products, which needs 32 live registers and spills */
                __asm__("" : "+x"(s[t]));
            }
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < tm; ++t) s[t] = _mm256_madd_epi16(s[t], ones); /* widen */
        block_scale_avx2(fmt, blk, half, s, dx, sx, ms, k / 32, b, acc, tm);
    }
    store_half_avx2(acc, bias, y, y_stride, tm, half);
}

/* One 8-row half of a group against up to 4 rows of x: int16 pairs (vpmaddwd) or int8 (Q4 only). */
static inline __attribute__((always_inline)) void half_avx2(const int fmt, const int bits, const uint8_t *wg,
                                                            int64_t nb, const int8_t *xq, int64_t k, const float *dx,
                                                            const int32_t *sx, const float *ms, const float *bias,
                                                            float *y, int64_t y_stride, const int tm, const int half) {
    if (bits == 16)
        dot16_half_avx2(fmt, wg, nb, (const int32_t *)xq, k, dx, sx, ms, bias, y, y_stride, tm, half);
    else
        dot8_half_avx2(fmt, wg, nb, xq, k, dx, sx, ms, bias, y, y_stride, tm, half);
}
/* GCC's -O3 schedules the unrolled tiles' products far ahead of their adds and spills them
 * (~900 ymm stack moves in dot16_X_Q4_1); -O2 keeps them in registers. */
#define QX_ATTR_16 __attribute__((optimize("O2")))
#define QX_ATTR_8 QX_ATTR_16
#else
#define QX_AVX2 0
#define QX_ATTR_16
#define QX_ATTR_8
#endif

#endif
