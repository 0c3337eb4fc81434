/*
 * The row-interleaved block formats shared by quant_x16.c (VNNI / AVX2 / generic kernels) and
 * quant_amx.c (AMX): their format ids, the bytes of a block of 16 rows, and the entry points
 * the two files call in each other. The layout itself is described in quant_x16.c.
 */
#ifndef LORAPLEX_QUANT_X16_LAYOUT_H
#define LORAPLEX_QUANT_X16_LAYOUT_H

#include <stdint.h>

enum { X_Q8_0 = 10, X_Q4_0 = 11, X_Q4_1 = 12 }; /* + 3: the same layouts with int8 activations */

/* Bytes of one block (32 weights) of a group of 16 rows: the scales, then the quant chunks. */
static inline int64_t x_block_bytes(const int fmt) { return fmt == X_Q8_0 ? 544 : fmt == X_Q4_0 ? 288 : 320; }
/* Bytes of a block's scales: d[16] f16 (and m[16] for Q4_1). */
static inline int x_head_bytes(const int fmt) { return fmt == X_Q4_1 ? 64 : 32; }

/* quant_x16.c */
void loraplex_qx16_quantize_row_i8(const float *x, int64_t k, int8_t *q, int64_t block_stride, float *dx,
                                   int32_t *sx, float *ms);
/* quant_amx.c */
int64_t loraplex_qx16_has_amx(void);
int64_t loraplex_qx16_amx_min_m(int format);
int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format);

#endif
