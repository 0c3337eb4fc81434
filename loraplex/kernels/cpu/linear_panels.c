/*
 * Dense projection y = x @ W^T (+ bias) on the CPU from weights packed in column panels.
 *
 *   for each panel p of PANEL output columns (one work item, OpenMP):
 *     for each block of TBL rows t of x:
 *       acc[t, 0:PANEL] = bias
 *       for k in 0 .. K-1: acc[t, :] += x[t, k] * Wp[p, k, :]     (a TBL x PANEL register tile)
 *       y[t, p*PANEL : (p+1)*PANEL] = acc
 *
 * Wp[p, k, c] = W[p*PANEL + c, k] (zero past N): a panel is one contiguous run that
 * the hardware prefetcher streams, and the micro-kernel needs no reductions (each
 * accumulator is one output vector), so it is FMA-bound with the panel in L2 and x in L1.
 *
 * The tile is sized to the vector registers the library is compiled for:
 *   AVX-512 (and anything without AVX2): PANEL 64 = 4 vectors of 16 floats, TBL 6:
 *     24 accumulators + 4 weight vectors of AVX-512's 32 registers.
 *   AVX2 + FMA without AVX-512: PANEL 16 = 2 registers of 8 floats, TBL 6: 12
 *     accumulators + 2 weight registers + 1 broadcast of AVX2's 16. The 64-column tile
 *     spills there (48 half-width accumulators; measured 8-10x slower than F.linear on
 *     an AVX2-only EPYC), and so did an array-of-vectors 6 x 16 tile (GCC kept the
 *     accumulator array on the stack and stored it every step: 25 GFLOP/s of the core's
 *     114); named accumulators stay in registers (70-80 GFLOP/s on one core in cache).
 * PANEL is exported, so packing (linear.py) follows whichever the library was built with.
 *
 * Layouts: x [m, k] row stride x_stride; wp [ceil(n / PANEL), k, PANEL]; bias [n] or
 * NULL; y [m, n] row stride y_stride. Returns 0.
 */
#include <stdint.h>

#include "vec_tiles.h"

#define CHUNK_ROWS 96 /* rows of x per work item (16 tiles): splits large batches across threads */
#define TBL 6         /* rows of x per tile */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define PANEL 16 /* output columns per panel: 2 AVX2 registers */
#define LINEAR_REGISTER_TILE 1

/* acc (two registers per row) + bias, stored to `rows` rows of y (the last panel: `cols` only). */
static inline void avx2_store_rows(float *y, int64_t y_stride, const __m256 *acc, const float *bias, int64_t cols,
                                   int rows) {
    float b[PANEL] = {0};
    if (bias != NULL) memcpy(b, bias, sizeof(float) * (size_t)cols);
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int t = 0; t < rows; ++t) {
        const __m256 lo = _mm256_add_ps(acc[2 * t], b0), hi = _mm256_add_ps(acc[2 * t + 1], b1);
        if (cols == PANEL) {
            _mm256_storeu_ps(y + t * y_stride, lo);
            _mm256_storeu_ps(y + t * y_stride + 8, hi);
        } else {
            float tmp[PANEL];
            _mm256_storeu_ps(tmp, lo);
            _mm256_storeu_ps(tmp + 8, hi);
            memcpy(y + t * y_stride, tmp, sizeof(float) * (size_t)cols);
        }
    }
}

/* `rows` (2 .. 6, a constant at each call site) rows by one panel. The accumulators are
 * named one by one (see the header) and each row's work sits behind `rows > r`, which
 * the constant folds away: one body serves the full tile and the tails. */
static inline __attribute__((always_inline)) void avx2_tile(const float *x, int64_t x_stride, const float *panel,
                                                            const float *bias, float *y, int64_t y_stride, int64_t k,
                                                            int64_t cols, const int rows, const char *pf,
                                                            int64_t pf_every) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    /* rows past `rows` alias row 0 (never read: their FMAs are folded away) */
    const float *x0 = x, *x1 = rows > 1 ? x + x_stride : x, *x2 = rows > 2 ? x + 2 * x_stride : x;
    const float *x3 = rows > 3 ? x + 3 * x_stride : x, *x4 = rows > 4 ? x + 4 * x_stride : x;
    const float *x5 = rows > 5 ? x + 5 * x_stride : x;
    int64_t since = 0; /* steps of d since the last prefetch */
    for (int64_t d = 0; d < k; ++d) {
        if (pf_every > 0 && ++since == pf_every) { /* this tile's share of the next panel, evenly spaced */
            since = 0;
            __builtin_prefetch(pf, 0, 2);
            pf += 64;
        }
        const __m256 w0 = _mm256_loadu_ps(panel + d * PANEL), w1 = _mm256_loadu_ps(panel + d * PANEL + 8);
        __m256 b;
#define LINEAR_ROW(r)                              \
    if (rows > r) {                                \
        b = _mm256_broadcast_ss(x##r + d);         \
        a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0); \
        a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1); \
    }
        LINEAR_ROW(0) LINEAR_ROW(1) LINEAR_ROW(2) LINEAR_ROW(3) LINEAR_ROW(4) LINEAR_ROW(5)
#undef LINEAR_ROW
    }
    const __m256 acc[12] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
    avx2_store_rows(y, y_stride, acc, bias, cols, rows);
}

/* One row by one panel (decode steps, the LM head of a step): two chains per register
 * over even and odd k, so the FMA latency does not bound a single row. */
static inline void avx2_row(const float *x, const float *panel, const float *bias, float *y, int64_t k,
                            int64_t cols) {
    __m256 e0 = _mm256_setzero_ps(), e1 = e0, o0 = e0, o1 = e0;
    int64_t d = 0;
    for (; d + 2 <= k; d += 2) {
        const __m256 be = _mm256_broadcast_ss(x + d), bo = _mm256_broadcast_ss(x + d + 1);
        e0 = _mm256_fmadd_ps(be, _mm256_loadu_ps(panel + d * PANEL), e0);
        e1 = _mm256_fmadd_ps(be, _mm256_loadu_ps(panel + d * PANEL + 8), e1);
        o0 = _mm256_fmadd_ps(bo, _mm256_loadu_ps(panel + (d + 1) * PANEL), o0);
        o1 = _mm256_fmadd_ps(bo, _mm256_loadu_ps(panel + (d + 1) * PANEL + 8), o1);
    }
    if (d < k) {
        const __m256 be = _mm256_broadcast_ss(x + d);
        e0 = _mm256_fmadd_ps(be, _mm256_loadu_ps(panel + d * PANEL), e0);
        e1 = _mm256_fmadd_ps(be, _mm256_loadu_ps(panel + d * PANEL + 8), e1);
    }
    const __m256 acc[2] = {_mm256_add_ps(e0, o0), _mm256_add_ps(e1, o1)};
    avx2_store_rows(y, 0, acc, bias, cols, 1);
}

/* `rows` (1 .. TBL, a constant at each call site) rows of x by one panel; `pf`, `pf_arg`
 * from next_panel_prefetch (a single row, a decode step, leaves it to the hardware). */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride, const float *panel,
                                                             const float *bias, float *y, int64_t y_stride, int64_t k,
                                                             int64_t cols, const int rows, const char *pf,
                                                             int64_t pf_arg) {
    if (rows == 1)
        avx2_row(x, panel, bias, y, k, cols);
    else
        avx2_tile(x, x_stride, panel, bias, y, y_stride, k, cols, rows, pf, pf_arg);
}

/* Which lines of the next panel (k of them, one per step of d) full tile `tile` of
 * `full_tiles` asks for: a contiguous share, one line every `full_tiles` steps of d, so the
 * whole item streams the next panel at an even rate. Asking for it all in the first tile
 * (AVX-512's plan below) ran 12% slower here: a burst the miss queues cannot hold. */
static inline int64_t next_panel_prefetch(int64_t tile, int64_t full_tiles, int64_t k, int64_t *first_line) {
    *first_line = tile * (k / full_tiles);
    return full_tiles;
}

#else /* AVX-512, or portable vectors */

#define PANEL 64 /* output columns per panel: 4 vectors of 16 floats */
/* 1: a tile that fits the vector registers (AVX-512); 0: the compiler splits the vectors (spills). */
#if defined(__AVX512F__)
#define LINEAR_REGISTER_TILE 1
#else
#define LINEAR_REGISTER_TILE 0
#endif

/* One tile: `rows` rows of x (a constant at each call site) by one panel. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride,
                                                             const float *panel, const float *bias,
                                                             float *y, int64_t y_stride, int64_t k,
                                                             int64_t cols, const int rows,
                                                             const char *pf, int64_t pf_arg) {
    const int64_t pf_lines = pf_arg;
    v16 acc[TBL][4];
    for (int j = 0; j < 4; ++j) {
        v16 b = vsplat(0.0f);
        if (bias != NULL) {
            float tmp[VL] = {0};
            for (int c = 0; c < VL && j * VL + c < cols; ++c) tmp[c] = bias[j * VL + c];
            b = vload(tmp);
        }
        for (int t = 0; t < rows; ++t) acc[t][j] = b;
    }
    for (int64_t d = 0; d < k; ++d) {
        /* pf_lines cache lines of the next panel per step of d (see next_panel_prefetch) */
        for (int64_t l = 0; l < pf_lines; ++l) __builtin_prefetch(pf + (d * pf_lines + l) * 64, 0, 2);
        v16 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = vload(panel + d * PANEL + j * VL);
        for (int t = 0; t < rows; ++t) {
            const v16 xv = vsplat(x[t * x_stride + d]);
            for (int j = 0; j < 4; ++j) acc[t][j] += xv * wv[j];
        }
    }
    if (cols == PANEL) {
        for (int t = 0; t < rows; ++t)
            for (int j = 0; j < 4; ++j) vstore(y + t * y_stride + j * VL, acc[t][j]);
    } else { /* the last, partial panel */
        for (int t = 0; t < rows; ++t) {
            float tmp[PANEL];
            for (int j = 0; j < 4; ++j) vstore(tmp + j * VL, acc[t][j]);
            memcpy(y + t * y_stride, tmp, sizeof(float) * (size_t)cols);
        }
    }
}

/* Full tile `tile` of `full_tiles` asks for ceil(4 / full_tiles) of the next panel's 4 lines
 * per step of d, the first tiles until all 4 are covered (the first tile of a 6-row item
 * takes all: 4 lines per step, a burst that AVX-512's miss queues absorbed). */
static inline int64_t next_panel_prefetch(int64_t tile, int64_t full_tiles, int64_t k, int64_t *first_line) {
    const int64_t lines_per_d = (4 + full_tiles - 1) / full_tiles;
    *first_line = tile * lines_per_d * k;
    return tile * lines_per_d < 4 ? lines_per_d : 0;
}

#endif

int64_t loraplex_linear_panel_width(void) { return PANEL; }
int64_t loraplex_linear_register_tile(void) { return LINEAR_REGISTER_TILE; }

int64_t loraplex_linear_f32(const float *x, int64_t x_stride, const float *wp, const float *bias,
                            float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                            int num_threads) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    int64_t chunk_rows = CHUNK_ROWS;
    /* Few panels that the threads cannot share evenly (SmolLM2's o and down projections
     * have 9): with two row chunks of a panel as separate items they can. 32-row steps
     * ran those projections at 297-330 GFLOP/s against 388 for 48 panels without it. */
    if (num_panels % num_threads != 0 && num_panels < 8 * (int64_t)num_threads && m >= 2 * TBL && m <= CHUNK_ROWS)
        chunk_rows = ((m + 1) / 2 + TBL - 1) / TBL * TBL;
    const int64_t num_chunks = (m + chunk_rows - 1) / chunk_rows;

    /* Items in panel-major order: a static schedule gives each thread a run of them, so
     * consecutive items mostly reuse the panel already in L2. */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < num_panels * num_chunks; ++item) {
        const int64_t p = item / num_chunks;
        const int64_t c0 = p * PANEL;
        const int64_t cols = n - c0 < PANEL ? n - c0 : PANEL;
        const float *panel = wp + p * k * PANEL;
        const float *b = bias != NULL ? bias + c0 : NULL;
        const int64_t r0 = item % num_chunks * chunk_rows;
        const int64_t r1 = r0 + chunk_rows < m ? r0 + chunk_rows : m;
        /* The next panel streams in from DRAM while this one's tiles run from L2: without
         * it, the first tile of every panel waited on DRAM and the rest on nothing, so
         * 32-row projections ran at 237 GFLOP/s and 15 GB/s of weights where 4 rows
         * stream 40 GB/s and large batches compute at 350 GFLOP/s. Only on the last row
         * chunk of a panel (the next item reads the next panel) and not past the end. */
        const int64_t full_tiles = (r1 - r0) / TBL;
        const int prefetch = item % num_chunks == num_chunks - 1 && p + 1 < num_panels && full_tiles > 0;
        const char *pf = (const char *)(panel + k * PANEL);
        int64_t t0 = r0;
        for (int64_t tile = 0; t0 + TBL <= r1; t0 += TBL, ++tile) {
            int64_t first_line = 0;
            const int64_t pf_arg = prefetch ? next_panel_prefetch(tile, full_tiles, k, &first_line) : 0;
            panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, TBL,
                       pf + first_line * 64, pf_arg);
        }
        switch (r1 - t0) { /* the last rows: a constant row count per case keeps registers */
            case 5: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 5, NULL, 0); break;
            case 4: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 4, NULL, 0); break;
            case 3: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 3, NULL, 0); break;
            case 2: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 2, NULL, 0); break;
            case 1: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 1, NULL, 0); break;
            default: break;
        }
    }
    return 0;
}
