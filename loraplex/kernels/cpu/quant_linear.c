/*
 * Projection y = x @ W^T (+ bias) from a weight kept in a block format (GGUF's Q8_0 / Q4_0 /
 * Q4_1 / Q4_K / Q6_K, F16 / BF16 / F32, per-channel int8): fp32 activations, fp32 accumulation.
 *
 * W is [n, row_bytes]: each output row's blocks are contiguous (GGUF's layout). Two plans:
 *
 *   few rows of x (m <= QL_DIRECT_MAX_M: decode steps, the LM head):
 *     for each group of TN weight rows (one work item, OpenMP):
 *       for each tile of TM rows of x:
 *         for each block, for each 16-weight chunk of it:
 *           w[r] = decode(chunk of row r)             (in registers: never written to memory)
 *           acc[r][t] += w[r] * x[t, chunk]            (TN x TM vector accumulators)
 *         y[t, row r] = row_scale[r] * sum(acc[r][t]) + bias[r]
 *   many rows (prefill chunks, large batches):
 *     for each panel of PANEL weight rows (one work item):
 *       decode the panel into a thread's buffer in linear_panels.c's layout (L2-resident)
 *       loraplex_linear_f32 on it (its register tile, one thread)
 *
 * The first streams the packed bytes once per step (a decode step is bound by those bytes,
 * 4.5 bits a weight for Q4_1 against 32 for float32); the second decodes each weight once per
 * step and then runs at the float kernel's FLOP rate (the step is compute-bound).
 *
 * Each format is one decoder, `decode_chunk` (and a block prologue for the k-quants, `read_head`);
 * format ids are the Python side's `WeightFormat.c_id`. Returns 0, or -1 for an unknown format.
 * The files:
 *
 *     quant_blocks.h   the block formats: ids, geometry, block heads, 16-weight chunk decoders
 *     quant_linear.c   the projection: direct tiles, panel decoding, per-format functions, entry points
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "vec_tiles.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define TN 4 /* weight rows per tile: 16 accumulators + 4 weight vectors of 32 registers */
#define TM 4 /* rows of x per tile */
#else
#define TN 2 /* AVX2 / generic: a v16 is two registers; 8 of 16 for accumulators */
#define TM 2
#endif
#define QL_DIRECT_MAX_M 4

int64_t loraplex_linear_panel_width(void);
int64_t loraplex_qx16_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format, int plan);
int64_t loraplex_linear_f32(const float *x, int64_t x_stride, const float *wp, const float *bias, float *y,
                            int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads);

static inline float hsum(v16 v) {
    float t[VL];
    vstore(t, v);
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += t[i];
    return s;
}

/* `tn` weight rows (from n0) by `tm` rows of x (from t0); both constants at each call site. */
static inline __attribute__((always_inline)) void direct_tile(const int fmt, const float *x, int64_t x_stride,
                                                              const uint8_t *w, int64_t row_bytes,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              int64_t k, const int tn, const int tm) {
    const int64_t bw = block_weights(fmt), bb = block_bytes(fmt), nb = k / bw;
    const int chunks = (int)(bw / VL);
    v16 acc[TN][TM];
    for (int r = 0; r < tn; ++r)
        for (int t = 0; t < tm; ++t) acc[r][t] = vsplat(0.0f);
    for (int64_t bi = 0; bi < nb; ++bi) {
        block_head head[TN];
        for (int r = 0; r < tn; ++r) read_head(fmt, w + r * row_bytes + bi * bb, &head[r]);
        for (int j = 0; j < chunks; ++j) {
            v16 xv[TM];
            for (int t = 0; t < tm; ++t) xv[t] = vload(x + t * x_stride + bi * bw + j * VL);
            for (int r = 0; r < tn; ++r) {
                const v16 wv = decode_chunk(fmt, w + r * row_bytes + bi * bb, &head[r], j);
                for (int t = 0; t < tm; ++t) acc[r][t] += wv * xv[t];
            }
        }
    }
    for (int r = 0; r < tn; ++r) {
        const float s = row_scale(fmt, w + r * row_bytes, k), b = bias != NULL ? bias[r] : 0.0f;
        for (int t = 0; t < tm; ++t) y[t * y_stride + r] = hsum(acc[r][t]) * s + b;
    }
}

/* All rows of x (m <= QL_DIRECT_MAX_M) by weight rows n0 .. n0 + tn. */
static inline __attribute__((always_inline)) void direct_rows(const int fmt, const float *x, int64_t x_stride,
                                                              const uint8_t *w, int64_t row_bytes,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              int64_t m, int64_t k, const int tn) {
    int64_t t0 = 0;
    for (; t0 + TM <= m; t0 += TM)
        direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, TM);
    switch (m - t0) {
#if TM > 3
        case 3: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 3); break;
#endif
#if TM > 2
        case 2: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 2); break;
#endif
        case 1: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 1); break;
        default: break;
    }
}

/* Weight rows n0 .. n0 + TN (fewer at the end) by all rows of x. */
static inline __attribute__((always_inline)) void direct_group(const int fmt, const float *x, int64_t x_stride,
                                                               const uint8_t *w, int64_t row_bytes,
                                                               const float *bias, float *y, int64_t y_stride,
                                                               int64_t m, int64_t n, int64_t k, int64_t n0) {
    const uint8_t *wg = w + n0 * row_bytes;
    const float *bg = bias != NULL ? bias + n0 : NULL;
    if (n0 + TN <= n) {
        direct_rows(fmt, x, x_stride, wg, row_bytes, bg, y + n0, y_stride, m, k, TN);
    } else {
        for (int64_t r = n0; r < n; ++r)
            direct_rows(fmt, x, x_stride, w + r * row_bytes, row_bytes, bias != NULL ? bias + r : NULL, y + r,
                        y_stride, m, k, 1);
    }
}

/* 16 vectors (16 weight rows' chunk of 16 weights) to 16 vectors of 16 rows each, stored at
 * out[i * stride .. + 16] for weight i of the chunk: a 16 x 16 transpose in registers. */
static inline void store_transposed(const v16 *rows, float *out, int64_t stride) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) memcpy(&r[i], &rows[i], sizeof r[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        for (int j = 0; j < 2; ++j) {
            r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
            r[i + j + 2] =
                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
        }
    }
    /* r[4q + s] now holds, in each 128-bit lane L, rows 4q..4q+3 of column 4L + s' (s' = 0, 2, 1, 3 order) */
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j) {
            t[4 * i + j] = r[4 * j + i];
        }
    }
    /* t[4i + j]: rows 4j..4j+3, columns {L*4 + c(i)} per lane L; combine lanes across j */
    for (int i = 0; i < 4; ++i) {
        const __m512 a = _mm512_shuffle_f32x4(t[4 * i + 0], t[4 * i + 1], 0x44); /* lanes 0,1 of j0 | 0,1 of j1 */
        const __m512 b = _mm512_shuffle_f32x4(t[4 * i + 2], t[4 * i + 3], 0x44);
        const __m512 c = _mm512_shuffle_f32x4(t[4 * i + 0], t[4 * i + 1], 0xEE); /* lanes 2,3 */
        const __m512 d = _mm512_shuffle_f32x4(t[4 * i + 2], t[4 * i + 3], 0xEE);
        r[4 * i + 0] = _mm512_shuffle_f32x4(a, b, 0x88); /* lane 0 of each: column c(i) */
        r[4 * i + 1] = _mm512_shuffle_f32x4(a, b, 0xDD); /* lane 1: column 4 + c(i) */
        r[4 * i + 2] = _mm512_shuffle_f32x4(c, d, 0x88); /* lane 2: column 8 + c(i) */
        r[4 * i + 3] = _mm512_shuffle_f32x4(c, d, 0xDD); /* lane 3: column 12 + c(i) */
    }
    static const int col_of[4] = {0, 2, 1, 3}; /* which column within a lane each r[4q + s] group holds */
    for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 4; ++l) _mm512_storeu_ps(out + (4 * l + col_of[i]) * stride, r[4 * i + l]);
#else
    float tmp[16][16];
    for (int i = 0; i < 16; ++i) vstore(tmp[i], rows[i]);
    for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 16; ++i) out[j * stride + i] = tmp[i][j];
#endif
}

/* Weight rows c0 .. c0 + 16 (rows past `rows` read as zero) into panel columns c .. c + 16:
 * panel[d * width + c + i] = W[c0 + i, d] (linear_panels.c's layout). */
static inline __attribute__((always_inline)) void decode_rows16(const int fmt, const uint8_t *w, int64_t row_bytes,
                                                                int64_t rows, int64_t k, float *panel,
                                                                int64_t width) {
    const int64_t bw = block_weights(fmt), bb = block_bytes(fmt), nb = k / bw;
    const int chunks = (int)(bw / VL);
    float scale[16];
    for (int i = 0; i < 16; ++i) scale[i] = i < rows ? row_scale(fmt, w + i * row_bytes, k) : 0.0f;
    for (int64_t bi = 0; bi < nb; ++bi) {
        block_head head[16];
        for (int i = 0; i < rows; ++i) read_head(fmt, w + i * row_bytes + bi * bb, &head[i]);
        for (int j = 0; j < chunks; ++j) {
            v16 v[16];
            for (int i = 0; i < 16; ++i) {
                v[i] = i < rows ? decode_chunk(fmt, w + i * row_bytes + bi * bb, &head[i], j) : vsplat(0.0f);
                if (fmt == F_INT8) v[i] *= scale[i];
            }
            store_transposed(v, panel + (bi * bw + j * VL) * width, width);
        }
    }
}

/* One function per format with the format a constant in it: the loops below run inside
 * OpenMP regions, whose outlined bodies would otherwise receive the format as a variable (and
 * keep the switch, the tile arrays and the accumulators in memory: measured 15x slower). */
typedef void (*group_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t);
typedef void (*row_fn)(const uint8_t *, int64_t, int64_t, int64_t, float *, int64_t);

#define QL_FORMAT(F)                                                                                                 \
    static void group_##F(const float *x, int64_t xs, const uint8_t *w, int64_t rb, const float *bias, float *y,     \
                          int64_t ys, int64_t m, int64_t n, int64_t k, int64_t n0) {                                 \
        direct_group(F, x, xs, w, rb, bias, y, ys, m, n, k, n0);                                                     \
    }                                                                                                                \
    static void row_##F(const uint8_t *w, int64_t rb, int64_t rows, int64_t k, float *panel, int64_t width) {       \
        decode_rows16(F, w, rb, rows, k, panel, width);                                                              \
    }
QL_FORMAT(F_Q8_0)
QL_FORMAT(F_Q4_0)
QL_FORMAT(F_Q4_1)
QL_FORMAT(F_F16)
QL_FORMAT(F_BF16)
QL_FORMAT(F_INT8)
QL_FORMAT(F_F32)
QL_FORMAT(F_Q4_K)
QL_FORMAT(F_Q6_K)
#undef QL_FORMAT

static void format_fns(int format, group_fn *group, row_fn *row) {
    switch (format) {
#define QL_CASE(F)      \
    case F:             \
        *group = group_##F; \
        *row = row_##F; \
        break;
        QL_CASE(F_Q8_0) QL_CASE(F_Q4_0) QL_CASE(F_Q4_1) QL_CASE(F_F16) QL_CASE(F_BF16) QL_CASE(F_INT8)
        QL_CASE(F_F32) QL_CASE(F_Q4_K) QL_CASE(F_Q6_K)
#undef QL_CASE
        default: *group = NULL; *row = NULL;
    }
}

static int64_t paneled(row_fn decode, const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                       const float *bias, float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                       int num_threads) {
    const int64_t width = loraplex_linear_panel_width(), num_panels = (n + width - 1) / width;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *panel = aligned_alloc(64, (size_t)((k * width * 4 + 63) / 64 * 64));
        if (panel == NULL) failed = 1;
        /* every thread reaches the worksharing loop (an OpenMP rule); one without buffers skips its items */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            if (panel == NULL) continue;
            const int64_t c0 = p * width, cols = n - c0 < width ? n - c0 : width;
            for (int64_t c = 0; c < width; c += 16) {
                const int64_t rows = cols - c > 16 ? 16 : cols - c > 0 ? cols - c : 0;
                decode(w + (c0 + c) * row_bytes, row_bytes, rows, k, panel + c, width);
            }
            loraplex_linear_f32(x, x_stride, panel, bias != NULL ? bias + c0 : NULL, y + c0, y_stride, m, cols, k, 1);
        }
        free(panel);
    }
    return failed ? -2 : 0;
}

/* The rows of x above which a step decodes panels (exported for tests and the launcher). */
int64_t loraplex_qlinear_direct_max_m(void) { return QL_DIRECT_MAX_M; }

/* y[m, n] = x[m, k] @ W^T + bias; W [n, row_bytes] in `format`; `plan` 0 = by m, 1 = direct, 2 = panels
 * (3 = AMX: quant_x16.c's formats only; the others take it as direct).
 * The argument order is loraplex_linear_f32's, then the packed weight's format, row bytes and plan. */
int64_t loraplex_qlinear_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                             int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format,
                             int64_t row_bytes, int plan) {
    if (format >= 10) /* the row-interleaved formats: quant_x16.c */
        return loraplex_qx16_f32(x, x_stride, w, bias, y, y_stride, m, n, k, num_threads, format, plan);
    group_fn group;
    row_fn decode;
    format_fns(format, &group, &decode);
    if (group == NULL || k % block_weights(format) != 0) return -1;
    if (plan == 2 || (plan == 0 && m > QL_DIRECT_MAX_M))
        return paneled(decode, x, x_stride, w, row_bytes, bias, y, y_stride, m, n, k, num_threads);
    const int64_t groups = (n + TN - 1) / TN;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; ++g) group(x, x_stride, w, row_bytes, bias, y, y_stride, m, n, k, g * TN);
    return 0;
}
