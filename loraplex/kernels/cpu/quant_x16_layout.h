/*
 * The row-interleaved block formats shared by the quant_x16*.c files (VNNI / AVX2 / generic
 * kernels) and quant_amx.c (AMX): their format ids, the bytes of a block of 16 rows, and the
 * entry points these files call in each other.
 *
 * Layout of a group of 16 rows (rows g*16 .. g*16+15), block b (32 weights) of each:
 *     Q8_0x16: d[16] f16 | 8 chunks of [16 rows x 4 bytes] (q + 128, unsigned)     544 bytes
 *     Q4_0x16: d[16] f16 | 4 chunks of [16 rows x 4 bytes of qs]                    288 bytes
 *     Q4_1x16: d[16] f16 | m[16] f16 | 4 chunks of [16 rows x 4 bytes of qs]        320 bytes
 * A chunk is one 64-byte vector: lane r holds 4 consecutive bytes of row r. In a Q4 chunk c,
 * the low nibbles are weights 4c .. 4c+3 of the block, the high nibbles 16+4c .. 16+4c+3
 * (ggml's nibble order). quant_x16_layout.c converts GGUF rows into it and reads rows back.
 */
#ifndef LORAPLEX_QUANT_X16_LAYOUT_H
#define LORAPLEX_QUANT_X16_LAYOUT_H

#include <stdint.h>

enum { X_Q8_0 = 10, X_Q4_0 = 11, X_Q4_1 = 12 }; /* + 3: the same layouts with int8 activations */

/* Bytes of one block (32 weights) of a group of 16 rows: the scales, then the quant chunks. */
static inline int64_t x_block_bytes(const int fmt) { return fmt == X_Q8_0 ? 544 : fmt == X_Q4_0 ? 288 : 320; }
/* Bytes of a block's scales: d[16] f16 (and m[16] for Q4_1). */
static inline int x_head_bytes(const int fmt) { return fmt == X_Q4_1 ? 64 : 32; }

/* quant_x16_quantize.c */
void loraplex_qx16_quantize_row_i8(const float *x, int64_t k, int8_t *q, int64_t block_stride, float *dx,
                                   int32_t *sx, float *ms);
/* x's rows as int16 pairs for quant_x16.c's int16 dot products: hidden, the library exports the
 * same symbols as when quant_x16.c held it (static) */
__attribute__((visibility("hidden"))) void loraplex_qx16_quantize_row16(const float *x, int64_t k, int32_t *xp,
                                                                        float *dx, int32_t *sx, float *ms,
                                                                        const float qmax);
/* quant_amx.c */
int64_t loraplex_qx16_has_amx(void);
int64_t loraplex_qx16_amx_min_m(int format);
int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format);

#endif
