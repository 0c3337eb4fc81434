/*
 * The interleaved formats' activation quantizers (quant_x16.c's formula, step one): every row of
 * x per 32-block, q = round(x / dx) (half to even, as torch.round), dx = amax / 127 (int8,
 * llama.cpp's Q8 activations, ids 13-15; also quant_amx.c's int8 tiles) or amax / 32767 (int16,
 * ids 10-12), with the block's sum of q and dx * sum(q) (Q4_1's min term). A NaN or inf in a block
 * makes its scale NaN, so the outputs are NaN as in float32.
 */
#include <math.h>
#include <stdint.h>

#include "quant_x16_layout.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* One row of x per 32-block: q (int8; block b's 32 values at q + b * block_stride: 32 for the
 * row's order, quant_amx.c passes its tile layout's), dx and the sum of q. */
void loraplex_qx16_quantize_row_i8(const float *x, int64_t k, int8_t *q, int64_t block_stride, float *dx,
                                   int32_t *sx, float *ms) {
#if defined(__AVX512F__)
    /* the same values with whole-block vectors (GCC's loop below is ~1.2x slower: a 2,048-row
     * prefill's int8 AMX projections spent a tenth of their time here) */
    const __m512 flt_max = _mm512_set1_ps(3.4028235e38f);
    for (int64_t b = 0; b < k / 32; ++b) {
        const __m512 a0 = _mm512_loadu_ps(x + 32 * b), a1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __m512 b0 = _mm512_abs_ps(a0), b1 = _mm512_abs_ps(a1);
        const int finite = _mm512_cmp_ps_mask(b0, flt_max, _CMP_LE_OQ) == 0xFFFF &&
                           _mm512_cmp_ps_mask(b1, flt_max, _CMP_LE_OQ) == 0xFFFF; /* false for NaN, inf */
        const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(b0, b1)) : 0.0f;
        const float d = finite ? amax / 127.0f : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        /* the current rounding mode: half to even, as nearbyintf and torch.round */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + block_stride * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + block_stride * b + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        dx[b] = d;
        sx[b] = s;
        ms[b] = d * (float)s; /* Q4_1's min term: m * dx * sum(q) */
    }
#else
    for (int64_t b = 0; b < k / 32; ++b) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < 32; ++i) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax; /* not fmaxf: a libm call per value; NaN is caught below */
            finite &= fabsf(xb[i]) <= 3.4028235e38f; /* false for NaN and inf */
        }
        /* a NaN or inf makes the block's scale NaN, so the outputs are NaN as in float32 */
        const float d = finite ? amax / 127.0f : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < 32; ++i) {
            const int v = (int)nearbyintf(xb[i] * id); /* round half to even, as torch.round */
            q[block_stride * b + i] = (int8_t)v;
            s += v;
        }
        dx[b] = d;
        sx[b] = s;
        ms[b] = d * (float)s; /* Q4_1's min term: m * dx * sum(q) */
    }
#endif
}

/* One row of x per 32-block as int16 pairs for vpdpwssd: q = round(x / dx), dx = amax / qmax (32767;
 * 127 for int8 activations computed by the int16 kernels: the same q as loraplex_qx16_quantize_row_i8);
 * xp[16 * b + 2 * c] packs (q[4c], q[4c + 2]), xp[16 * b + 2 * c + 1] (q[4c + 1], q[4c + 3]), c = 0..7:
 * the weights a chunk's 16-bit lanes hold after masking (see quant_x16.c's dot_group). */
void loraplex_qx16_quantize_row16(const float *x, int64_t k, int32_t *xp, float *dx, int32_t *sx, float *ms,
                                  const float qmax) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < 32; ++i) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax; /* not fmaxf: a libm call per value; NaN is caught below */
            finite &= fabsf(xb[i]) <= 3.4028235e38f;
        }
        const float d = finite ? amax / qmax : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        int32_t q[32], s = 0;
        for (int i = 0; i < 32; ++i) {
            q[i] = (int32_t)nearbyintf(xb[i] * id);
            s += q[i];
        }
        for (int c = 0; c < 8; ++c) {
            xp[16 * b + 2 * c] = (int32_t)(((uint32_t)q[4 * c] & 0xFFFF) | ((uint32_t)q[4 * c + 2] << 16));
            xp[16 * b + 2 * c + 1] = (int32_t)(((uint32_t)q[4 * c + 1] & 0xFFFF) | ((uint32_t)q[4 * c + 3] << 16));
        }
        dx[b] = d;
        sx[b] = s;
        ms[b] = d * (float)s; /* Q4_1's min term: m * dx * sum(q) */
    }
}
