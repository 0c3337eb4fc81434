/*
 * The interleaved layout (quant_x16_layout.h) in and out: loraplex_qx16_interleave rearranges
 * GGUF Q8_0 / Q4_0 / Q4_1 rows into it in place at load (formats/interleaved.py), and
 * loraplex_qx16_rows reads weight rows back as floats (the tied embedding's lookup).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_x16_common.h"

/* Weight rows index[0 .. count) of W (an interleaved format, k weights a row) as floats into
 * out[count, k]: an embedding lookup from the tied table. Returns 0, -1 for a bad format. */
int64_t loraplex_qx16_rows(const uint8_t *w, const int64_t *index, int64_t count, int64_t k, int format, float *out) {
    if (format >= X_Q8_0 + 3) format -= 3;
    if (format < X_Q8_0 || format > X_Q4_1 || k % 32 != 0) return -1;
    const int64_t nb = k / 32, bb = x_block_bytes(format), hb = x_head_bytes(format);
    for (int64_t i = 0; i < count; ++i) {
        const int64_t lane = index[i] % GROUP;
        const uint8_t *wg = w + index[i] / GROUP * nb * bb;
        float *row = out + i * k;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wg + b * bb, *qs = blk + hb;
            float tmp[16];
            vstore(tmp, f16x16(blk));
            const float d = tmp[lane];
            if (format == X_Q8_0) {
                for (int j = 0; j < 32; ++j) row[32 * b + j] = d * (float)((int)qs[64 * (j / 4) + 4 * lane + j % 4] - 128);
            } else {
                float m = -8.0f * d;
                if (format == X_Q4_1) {
                    vstore(tmp, f16x16(blk + 32));
                    m = tmp[lane];
                }
                for (int j = 0; j < 16; ++j) {
                    const uint8_t q = qs[64 * (j / 4) + 4 * lane + j % 4];
                    row[32 * b + j] = d * (float)(q & 0xF) + m;
                    row[32 * b + 16 + j] = d * (float)(q >> 4) + m;
                }
            }
        }
    }
    return 0;
}

/* W [n, k / 32 blocks] in the GGUF layout of `format`'s base (Q8_0 / Q4_0 / Q4_1) rearranged
 * into `format`'s interleaved layout in place, one group of 16 rows at a time (a group's bytes
 * are the same span in both layouts): no second copy of the weight. Returns 0, -1 for a bad
 * format or shape, -2 without memory for one group. */
int64_t loraplex_qx16_interleave(uint8_t *w, int64_t n, int64_t k, int format) {
    if (format >= X_Q8_0 + 3) format -= 3;
    if (format < X_Q8_0 || format > X_Q4_1 || k % 32 != 0 || n % GROUP != 0) return -1;
    const int64_t nb = k / 32, bb = format == X_Q8_0 ? 34 : format == X_Q4_0 ? 18 : 20;
    const int64_t head = format == X_Q4_1 ? 4 : 2, qbytes = bb - head, row_bytes = nb * bb;
    uint8_t *tmp = malloc((size_t)(GROUP * row_bytes));
    if (tmp == NULL) return -2;
    for (int64_t g = 0; g < n / GROUP; ++g) {
        uint8_t *span = w + g * GROUP * row_bytes;
        memcpy(tmp, span, (size_t)(GROUP * row_bytes));
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *out = span + b * GROUP * bb;
            for (int r = 0; r < GROUP; ++r) {
                const uint8_t *blk = tmp + r * row_bytes + b * bb;
                for (int64_t h = 0; h < head; h += 2) memcpy(out + GROUP * h + 2 * r, blk + h, 2);
                for (int64_t q = 0; q < qbytes; ++q) {
                    const uint8_t v = blk[head + q];
                    out[GROUP * head + (q / 4) * 64 + 4 * r + q % 4] = format == X_Q8_0 ? (uint8_t)(v ^ 0x80) : v;
                }
            }
        }
    }
    free(tmp);
    return 0;
}
