/*
 * The inline helpers the interleaved formats' weight readers share (quant_x16.c, quant_x16_avx2.h,
 * quant_x16_layout.c): the group of 16 weight rows, the 16-lane integer vectors and the f16 scale
 * loader. The format ids, block sizes and the entry points the files call in each other
 * (quant_amx.c too) are in quant_x16_layout.h. The files:
 *
 *     quant_x16_layout.h    the layout, format ids, cross-file declarations
 *     quant_x16_quantize.c  the activation quantizers (int8 rows, int16 pairs)
 *     quant_x16.c           the projection: launcher, VNNI / generic dot products, float panels
 *     quant_x16_avx2.h      its AVX2 dot products (inlined into quant_x16.c's tiles)
 *     quant_x16_layout.c    the layout: GGUF rows interleaved in place, rows read back as floats
 */
#ifndef LORAPLEX_QUANT_X16_COMMON_H
#define LORAPLEX_QUANT_X16_COMMON_H

#include <stdint.h>
#include <string.h>

#include "quant_x16_layout.h"
#include "vec_tiles.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 16 /* weight rows per group: one row per 32-bit lane of a chunk */

typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* 16 float16 values (one per row) as floats. */
static inline v16 f16x16(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    v16 v;
    memcpy(&v, &f, sizeof v);
    return v;
#elif defined(__F16C__)
    float tmp[16];
    _mm256_storeu_ps(tmp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps(tmp + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
    return vload(tmp);
#else
    float tmp[16];
    for (int i = 0; i < 16; ++i) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        tmp[i] = half_to_float(h);
    }
    return vload(tmp);
#endif
}

#endif
