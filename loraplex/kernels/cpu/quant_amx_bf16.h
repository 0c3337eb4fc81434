/*
 * quant_amx.c's float-activation kernel (gguf on AMX): rows of x and a group's de-quantized
 * weights as bf16 halves in tile order, TDPBF16PS with the sums kept in the tile across blocks,
 * groups in pairs and blocks in segments. Included once by quant_amx.c, after its tile macros
 * and lane_ints; no include guard on purpose.
 */

/* One row of x per 32-block as bf16 halves, hi = bf16(x) and lo = bf16(x - hi), to
 * out + b * stride and + 1024 (the row's place in its tiles). */
static AMX_TARGET void split_row_bf16(const float *x, int64_t k, uint8_t *out, int64_t stride) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const __m512 a0 = _mm512_loadu_ps(x + 32 * b), a1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(a1, a0); /* round to nearest even */
        const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        const __m512 h1 =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        const __m512i l = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a1, h1), _mm512_sub_ps(a0, h0));
        _mm512_storeu_si512(out + b * stride, h);
        _mm512_storeu_si512(out + b * stride + 1024, l);
    }
}

/* Weights 2j (f0) and 2j + 1 (f1) of 16 columns as B tile rows of bf16 pairs (paired per
 * column): hi = v rounded to bf16, lo = v - hi rounded to bf16, so hi + lo is within 2^-17 of v.
 * Rounding is an integer add (to nearest, ties away: any nearby hi will do, lo keeps the rest)
 * and a pair is (v0 >> 16) | (v1 & top): no permutes, which held the unpacking up on port 5. */
static inline __attribute__((always_inline)) void bf16_pair_rows(const __m512 f0, const __m512 f1, uint8_t *hi,
                                                                 uint8_t *lo) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000), half = _mm512_set1_epi32(0x8000);
    const __m512i t0 = _mm512_add_epi32(_mm512_castps_si512(f0), half);
    const __m512i t1 = _mm512_add_epi32(_mm512_castps_si512(f1), half);
    /* 0xF8: a | (b & c) */
    _mm512_store_si512(hi, _mm512_ternarylogic_epi32(_mm512_srli_epi32(t0, 16), t1, top, 0xF8));
    const __m512i u0 = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_sub_ps(f0, _mm512_castsi512_ps(_mm512_and_si512(t0, top)))), half);
    const __m512i u1 = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_sub_ps(f1, _mm512_castsi512_ps(_mm512_and_si512(t1, top)))), half);
    _mm512_store_si512(lo, _mm512_ternarylogic_epi32(_mm512_srli_epi32(u0, 16), u1, top, 0xF8));
}

/* A group's blocks as bf16 B tiles into ub, 2 KB a block: w = d * q (+ m) in float, then the
 * hi tile (16 rows x 64 bytes: row j = weights 2j, 2j + 1 of each column) and the lo tile. */
static inline __attribute__((always_inline)) void unpack_bf16(const int fmt, const uint8_t *wg, int64_t b0,
                                                              int64_t b1, uint8_t *ub) {
    const int chunks = fmt == X_Q8_0 ? 8 : 4;
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t *blk = wg + b * x_block_bytes(fmt), *qs = blk + x_head_bytes(fmt);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = fmt == X_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                         : fmt == X_Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                                          : _mm512_setzero_ps();
        uint8_t *out = ub + 2048 * (b - b0);
        for (int c = 0; c < chunks; ++c) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            for (int half = 0; half < (fmt == X_Q8_0 ? 1 : 2); ++half) {
                const int row4 = half == 0 ? c : 4 + c; /* weights 4 row4 .. 4 row4 + 3 */
                __m512i e[4];
                lane_ints(fmt, v, fmt == X_Q8_0 ? 0 : 1 + half, 0, e);
                __m512 f[4];
                /* as the reference de-quantizes: d * q (Q8_0), d * q + m (Q4_1, Q4_0 with m = -8 d) */
                for (int j = 0; j < 4; ++j)
                    f[j] = fmt == X_Q8_0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(e[j]), d)
                                          : _mm512_fmadd_ps(_mm512_cvtepi32_ps(e[j]), d, m);
                bf16_pair_rows(f[0], f[1], out + 128 * row4, out + 1024 + 128 * row4);
                bf16_pair_rows(f[2], f[3], out + 128 * row4 + 64, out + 1024 + 128 * row4 + 64);
            }
        }
    }
}

/* unpack_bf16 with the format a constant: blocks [b0, b1) of a group, block b at ub + 2 KB (b - b0). */
static void unpack_group_bf16(const int fmt, const uint8_t *wg, int64_t b0, int64_t b1, uint8_t *ub) {
    switch (fmt) {
        case X_Q8_0: unpack_bf16(X_Q8_0, wg, b0, b1, ub); break;
        case X_Q4_0: unpack_bf16(X_Q4_0, wg, b0, b1, ub); break;
        default: unpack_bf16(X_Q4_1, wg, b0, b1, ub); break;
    }
}

/* Tiles of the bf16 kernel: the sums of two groups, x's halves, each group's weight halves. */
#define T_X_HI T_A0
#define T_X_LO T_A1
#define T_W0_HI T_A2
#define T_W0_LO T_A3
#define T_W1_HI T_B0
#define T_W1_LO T_B1

/* Blocks [b0, b1) of rows [r0, r1) against a pair of groups (ub0, ub1; `two` = 0: ub0 alone).
 * Each 16-row tile's sums start as the bias (b0 = 0) or as what the last segment stored, take
 * x_hi w_hi + x_hi w_lo + x_lo w_hi of each block, and are stored: into y (at c, row stride cs
 * bytes), or into `part` (rows of 32 floats) for a tile with rows past m. One load of x's tiles
 * serves both groups. */
static inline __attribute__((always_inline)) AMX_TARGET void pair_segment(
    const int two, const uint8_t *ub0, const uint8_t *ub1, int64_t nb, int64_t b0, int64_t b1, const uint8_t *xa,
    const float *bias_tiles, float *y, int64_t y_stride, float *part, int64_t r0, int64_t r1, int64_t m) {
    for (int64_t t0 = r0; t0 < r1; t0 += QA_ROWS) {
        const int full = t0 + QA_ROWS <= m;
        float *c = full ? y + t0 * y_stride : part;
        const int64_t cs = full ? 4 * y_stride : 128;
        if (b0 == 0) {
            TLOAD(T_C0, bias_tiles, 64);
            if (two) TLOAD(T_C1, bias_tiles + 256, 64);
        } else {
            TLOAD(T_C0, c, cs);
            if (two) TLOAD(T_C1, c + 16, cs);
        }
        const uint8_t *at = xa + t0 / QA_ROWS * nb * 2048;
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t *xb = at + 2048 * b, *w0 = ub0 + 2048 * (b - b0), *w1 = ub1 + 2048 * (b - b0);
            TLOAD(T_X_HI, xb, 64);
            TLOAD(T_W0_HI, w0, 64);
            TLOAD(T_W0_LO, w0 + 1024, 64);
            TDP_BF16(T_C0, T_X_HI, T_W0_HI);
            TDP_BF16(T_C0, T_X_HI, T_W0_LO);
            TLOAD(T_X_LO, xb + 1024, 64);
            TDP_BF16(T_C0, T_X_LO, T_W0_HI);
            if (two) {
                TLOAD(T_W1_HI, w1, 64);
                TLOAD(T_W1_LO, w1 + 1024, 64);
                TDP_BF16(T_C1, T_X_HI, T_W1_HI);
                TDP_BF16(T_C1, T_X_HI, T_W1_LO);
                TDP_BF16(T_C1, T_X_LO, T_W1_HI);
            }
        }
        TSTORE(T_C0, c, cs);
        if (two) TSTORE(T_C1, c + 16, cs);
    }
}

/* Rows [r0, r1) of y for groups g (and g + 1 when `two`), float x: the blocks a segment at a
 * time (QA_SEG blocks of both groups unpacked stay in L1 while x's tiles stream from L2), the
 * sums carried in y between segments. */
static AMX_TARGET void pair_rows_bf16(const int fmt, const int two, const uint8_t *wg0, const uint8_t *wg1,
                                      int64_t nb, const uint8_t *xa, uint8_t *ub, float *scratch,
                                      const float *bias, float *y, int64_t y_stride, int64_t r0, int64_t r1,
                                      int64_t m) {
    float *bias_tiles = scratch, *part = scratch + 512; /* [2][16 x 16], [16 x 32] */
    for (int g = 0; g < 2; ++g) {
        const __m512 bv = bias != NULL && (g == 0 || two) ? _mm512_loadu_ps(bias + 16 * g) : _mm512_setzero_ps();
        for (int t = 0; t < QA_ROWS; ++t) _mm512_store_ps(bias_tiles + 256 * g + 16 * t, bv);
    }
    uint8_t *ub0 = ub, *ub1 = ub + QA_SEG * 2048;
    for (int64_t b0 = 0; b0 < nb; b0 += QA_SEG) {
        const int64_t b1 = nb - b0 < QA_SEG ? nb : b0 + QA_SEG;
        unpack_group_bf16(fmt, wg0, b0, b1, ub0);
        if (two) {
            unpack_group_bf16(fmt, wg1, b0, b1, ub1);
            pair_segment(1, ub0, ub1, nb, b0, b1, xa, bias_tiles, y, y_stride, part, r0, r1, m);
        } else {
            pair_segment(0, ub0, ub1, nb, b0, b1, xa, bias_tiles, y, y_stride, part, r0, r1, m);
        }
    }
    if (r1 > m) /* the last tile had rows past m: its rows below m from `part` */
        for (int64_t t = r1 - QA_ROWS; t < m; ++t)
            memcpy(y + t * y_stride, part + 32 * (t - (r1 - QA_ROWS)), sizeof(float) * (two ? 32 : 16));
}
