/*
 * Dense projection y = x @ W^T (+ bias) on the CPU from weights packed in column panels.
 *
 *   for each panel p of PANEL output columns (one work item, OpenMP):
 *     for each block of TBL rows t of x:
 *       acc[t, 0:PANEL] = bias
 *       for k in 0 .. K-1: acc[t, :] += x[t, k] * Wp[p, k, :]     (TBL x 4 vectors of FMAs)
 *       y[t, p*PANEL : (p+1)*PANEL] = acc
 *
 * Wp[p, k, c] = W[p*PANEL + c, k] (zero past N): a panel is one contiguous run that
 * the hardware prefetcher streams, and the micro-kernel needs no reductions (each
 * accumulator is one output vector), so it is FMA-bound with the panel in L2 and x in L1.
 *
 * Layouts: x [m, k] row stride x_stride; wp [ceil(n / PANEL), k, PANEL]; bias [n] or
 * NULL; y [m, n] row stride y_stride. Returns 0.
 */
#include <stdint.h>

#include "vec_tiles.h"

#define PANEL 64 /* output columns per panel: 4 vectors */
#define CHUNK_ROWS 96 /* rows of x per work item (16 tiles): splits large batches across threads */
#ifndef TBL
#define TBL 6 /* rows of x per tile: 6 x 4 accumulators + 4 weight vectors fit 32 registers */
#endif

int64_t loraplex_linear_panel_width(void) { return PANEL; }

/* One tile: `rows` rows of x (a constant at each call site) by one panel. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t x_stride,
                                                             const float *panel, const float *bias,
                                                             float *y, int64_t y_stride, int64_t k,
                                                             int64_t cols, const int rows,
                                                             const char *pf, int64_t pf_lines) {
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
        const int64_t num_tiles = (r1 - r0 + TBL - 1) / TBL;
        const int prefetch = item % num_chunks == num_chunks - 1 && p + 1 < num_panels && num_tiles > 1;
        const char *pf = (const char *)(panel + k * PANEL);
        /* the next panel's 4k lines, spread over this item's tiles: pf_lines per d */
        const int64_t pf_lines = prefetch ? (4 + num_tiles - 1) / num_tiles : 0;
        int64_t t0 = r0;
        for (int64_t tile = 0; t0 + TBL <= r1; t0 += TBL, ++tile) {
            const int64_t lines = tile * pf_lines < 4 ? pf_lines : 0;
            panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, TBL,
                       pf + tile * pf_lines * k * 64, lines);
        }
        const int64_t tail_tile = (t0 - r0) / TBL;
        const int64_t tail_lines = tail_tile * pf_lines < 4 ? pf_lines : 0;
        const char *tail_pf = pf + tail_tile * pf_lines * k * 64;
        switch (r1 - t0) { /* the last rows: a constant row count per case keeps registers */
            case 5: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 5, tail_pf, tail_lines); break;
            case 4: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 4, tail_pf, tail_lines); break;
            case 3: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 3, tail_pf, tail_lines); break;
            case 2: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 2, tail_pf, tail_lines); break;
            case 1: panel_tile(x + t0 * x_stride, x_stride, panel, b, y + t0 * y_stride + c0, y_stride, k, cols, 1, tail_pf, tail_lines); break;
            default: break;
        }
    }
    return 0;
}
