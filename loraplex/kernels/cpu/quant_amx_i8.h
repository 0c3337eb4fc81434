/*
 * quant_amx.c's int8-activation kernel (gguf_a8: llama.cpp's arithmetic on AMX's int8 tiles):
 * a group's blocks as signed-byte B tiles, TDPBSSD per block and the per-block scaling into
 * float accumulators (x is quantized by quant_x16_quantize.c's loraplex_qx16_quantize_row_i8). Included once by quant_amx.c, after
 * its tile macros and lane_ints; no include guard on purpose.
 */

/* A group's blocks as int8 B tiles (8 rows x 64 bytes a block) into ub. */
static void unpack_group_i8(const int fmt, const uint8_t *wg, int64_t nb, uint8_t *ub) {
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *qs = wg + b * x_block_bytes(fmt) + x_head_bytes(fmt);
        uint8_t *out = ub + 512 * b;
        if (fmt == X_Q8_0) { /* the chunks themselves, as signed bytes */
            for (int c = 0; c < 8; ++c)
                _mm512_store_si512(out + 64 * c, _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * c),
                                                                  _mm512_set1_epi8((char)0x80)));
            continue;
        }
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            for (int half = 0; half < 2; ++half) {
                __m512i e[4];
                lane_ints(fmt, v, 1 + half, 1, e);
                const __m512i packed = _mm512_or_si512(
                    _mm512_or_si512(_mm512_and_si512(e[0], byte), _mm512_slli_epi32(_mm512_and_si512(e[1], byte), 8)),
                    _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(e[2], byte), 16), _mm512_slli_epi32(e[3], 24)));
                _mm512_store_si512(out + 64 * (half == 0 ? c : 4 + c), packed);
            }
        }
    }
}

/* acc[t] += d * dx[t] * C[t] (+ m * ms[t] for Q4_1) for the 16 rows of a tile; the per-row
 * values at stride nb. */
static inline __attribute__((always_inline)) void scale_block_i8(const int fmt, const int32_t *cs,
                                                                 const uint8_t *blk, const float *dx, const float *ms,
                                                                 int64_t nb, __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 mv = fmt == X_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : d;
    _Pragma("GCC unroll 16") for (int t = 0; t < QA_ROWS; ++t) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cs + 16 * t)),
                                 _mm512_mul_ps(d, _mm512_set1_ps(dx[t * nb])), acc[t]);
        if (fmt == X_Q4_1) acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ms[t * nb]), acc[t]);
    }
}

/* One block's int8 products into C_p (the tile zeroed first); XA the block's x tile. */
#define TILE_BLOCK_I8(P, XA, BSRC)                                                                                 \
    do {                                                                                                           \
        TLOAD(T_B##P, (BSRC), 64);                                                                                 \
        TLOAD(T_A0, (XA), 32);                                                                                     \
        TZERO(T_C##P);                                                                                             \
        TDP_SS(T_C##P, T_A0, T_B##P);                                                                              \
    } while (0)

/* acc for 16 rows of x (xa: their tiles, block after block) against a group (ub: its B tiles):
 * two sets of tiles, each block scaled one block after its tile store (a vector load right
 * after a tile store waits for the store to reach the cache). */
static inline __attribute__((always_inline)) AMX_TARGET void tile_rows_i8(const int fmt, const uint8_t *wg,
                                                                          const uint8_t *ub, int64_t nb,
                                                                          const uint8_t *xa, const float *dx,
                                                                          const float *ms, int32_t *cbuf,
                                                                          __m512 *acc) {
    const int64_t bb = x_block_bytes(fmt);
    int32_t *c0 = cbuf, *c1 = cbuf + 256;
    TILE_BLOCK_I8(0, xa, ub);
    TSTORE(T_C0, c0, 64);
    int64_t b = 1;
    for (; b + 1 < nb; b += 2) {
        TILE_BLOCK_I8(1, xa + 512 * b, ub + 512 * b);
        TSTORE(T_C1, c1, 64);
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
        TILE_BLOCK_I8(0, xa + 512 * (b + 1), ub + 512 * (b + 1));
        TSTORE(T_C0, c0, 64);
        scale_block_i8(fmt, c1, wg + b * bb, dx + b, ms + b, nb, acc);
    }
    if (b < nb) { /* nb even: block nb - 1 is left */
        TILE_BLOCK_I8(1, xa + 512 * b, ub + 512 * b);
        TSTORE(T_C1, c1, 64);
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
        scale_block_i8(fmt, c1, wg + b * bb, dx + b, ms + b, nb, acc);
    } else {
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
    }
}

/* Every tile of rows [r0, r1) against group g, int8 x; y rows below m. */
static AMX_TARGET void group_rows_i8(const int fmt, const uint8_t *wg, const uint8_t *ub, int64_t nb,
                                     const uint8_t *xa, const float *dx, const float *ms, int32_t *cbuf,
                                     const float *bias, float *y, int64_t y_stride, int64_t r0, int64_t r1, int64_t m) {
    const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t t0 = r0; t0 < r1; t0 += QA_ROWS) {
        __m512 acc[QA_ROWS];
        for (int t = 0; t < QA_ROWS; ++t) acc[t] = _mm512_setzero_ps();
        const uint8_t *at = xa + t0 / QA_ROWS * nb * 512;
        const float *dt = dx + t0 * nb, *mt = ms + t0 * nb;
        /* constants per instantiation: GCC keeps the 16 accumulators in registers */
        switch (fmt) {
            case X_Q8_0: tile_rows_i8(X_Q8_0, wg, ub, nb, at, dt, mt, cbuf, acc); break;
            case X_Q4_0: tile_rows_i8(X_Q4_0, wg, ub, nb, at, dt, mt, cbuf, acc); break;
            default: tile_rows_i8(X_Q4_1, wg, ub, nb, at, dt, mt, cbuf, acc); break;
        }
        for (int t = 0; t < QA_ROWS && t0 + t < m; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride, _mm512_add_ps(acc[t], bv));
    }
}
