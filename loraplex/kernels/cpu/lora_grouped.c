/*
 * Multi-adapter LoRA on the CPU for every token of a step: decodes, short chunks and
 * prefill runs, one call per projection.
 *
 *   for each (group of tokens on one adapter slot, chunk of up to ITEM_TOKENS of them):
 *     for each slice s, for each block of 4 tokens t:
 *       r[t] = scale[slot] * A[s, slot] @ x[t]                           (shrink: rank dots)
 *       y[t, off_s : off_s + size_s] += r[t] @ B^T[s, slot, :, :size_s]   (expand: rank axpys)
 *
 * Both halves are register tiles: the shrink computes 4 tokens x 4 rank rows of dot
 * products per pass over in_features (16 vector accumulators; each vector of x and of
 * A loaded once feeds 4 FMAs), the expand keeps 4 tokens x 64 output columns of y in
 * registers while it adds all rank terms (each B^T vector loaded once feeds 4 FMAs,
 * y is read and written once). A group's A and B stay in L1/L2 while its tokens use
 * them, so a decode group of a few tokens reads its adapter's bytes about once, and
 * a prefill run is compute-bound. B is read transposed ([rank, max_out] per slot, as
 * the CPU slot buffers store it), so the expand's inner loop runs along y's rows.
 *
 * The vectors are GCC/Clang vector extensions of 16 floats (vec_tiles.h).
 *
 * Work items write disjoint parts of y (a chunk of a group's token rows, all columns),
 * so no two threads touch the same element.
 *
 * Layouts (contiguous unless a stride is given):
 *   x          [num_tokens, in_features], row stride x_stride
 *   y          [num_tokens, sum(slice_sizes)], row stride y_stride
 *   lora_a     [num_slices, num_slots, rank, in_features]
 *   lora_bt    [num_slices, num_slots, rank, max_out]
 *   scales     [num_slots] float32
 *   tokens     [group_starts[num_groups]] int64, token indices grouped by slot
 *   group_starts [num_groups + 1] int64, group_slots [num_groups] int64
 *   slice_sizes  [num_slices] int64
 *
 * Returns the number of groups whose slot is outside [0, num_slots) (skipped; the
 * launcher raises), or -1 if the work list could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_tiles.h"

#define MAX_RANK 512
#define MAX_SLICES 8
#define ITEM_TOKENS 16  /* tokens per work item: enough to reuse A and B, small enough to balance */
#define EXPAND_COLS 1024 /* columns per expand pass: rank x 1024 floats of B^T, 64 KiB at rank 16 */

int64_t loraplex_lora_max_rank(void) { return MAX_RANK; }
int64_t loraplex_lora_max_slices(void) { return MAX_SLICES; }

/* r[t][k0 + j] = a_{k0+j} . x_t for 4 tokens and RB rank rows k0.. (rows past `rank`
 * repeat row k0 and are not stored). */
static inline void shrink_tile(const float *const xs[TB], const float *a, int64_t k0, int64_t rank,
                               int64_t in_features, float *r) {
    const float *rows[RB];
    for (int j = 0; j < RB; ++j) rows[j] = a + (k0 + j < rank ? k0 + j : k0) * in_features;
    dot_tile(xs, rows, in_features, r + k0, rank, TB, rank - k0);
}

/* y_t[o .. o + NV*VL) += sum_k r[t][k] * bt[k][o ..] for 4 tokens; NV is a constant at
 * each call site, so the 4 x NV accumulators live in registers. Padding rows of a short
 * block repeat its last real row and hold its values, so storing them rewrites the same
 * numbers. */
static inline __attribute__((always_inline)) void expand_tile(float *const *ys, const float *bt,
                                                              int64_t max_out, int64_t rank,
                                                              const float *r, int64_t o,
                                                              const int nv) {
    v16 acc[TB][4];
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < nv; ++j) acc[t][j] = vload(ys[t] + o + j * VL);
    for (int64_t k = 0; k < rank; ++k) {
        v16 bv[4];
        for (int j = 0; j < nv; ++j) bv[j] = vload(bt + k * max_out + o + j * VL);
        for (int t = 0; t < TB; ++t) {
            const v16 rv = vsplat(r[t * rank + k]);
            for (int j = 0; j < nv; ++j) acc[t][j] += rv * bv[j];
        }
    }
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < nv; ++j) vstore(ys[t] + o + j * VL, acc[t][j]);
}

/* Columns c0 .. c1 of a block of 4 token rows, `real` of them not padding. */
static inline void expand_rows(float *const *yt, const float *bt, int64_t max_out, int64_t rank,
                               const float *rt, int64_t c0, int64_t c1, int64_t real) {
    int64_t o = c0;
    for (; o + 4 * VL <= c1; o += 4 * VL) expand_tile(yt, bt, max_out, rank, rt, o, 4);
    for (; o + VL <= c1; o += VL) expand_tile(yt, bt, max_out, rank, rt, o, 1);
    for (; o < c1; ++o) { /* the slice's last size % 16 columns */
        for (int64_t t = 0; t < real; ++t) {
            float acc = yt[t][o];
            for (int64_t k = 0; k < rank; ++k) acc += rt[t * rank + k] * bt[k * max_out + o];
            yt[t][o] = acc;
        }
    }
}

/* One work item's tokens (up to ITEM_TOKENS: n real ones; rows past n repeat token n - 1,
 * so a short last block pads with its own last row) and one slice: shrink every token
 * into r, then expand column chunk by column chunk, each chunk's B^T rows (rank x
 * EXPAND_COLS floats) staying in L2 while all the item's tokens add their terms, so B
 * is read from memory about once per item, not once per 4 tokens. */
static void item_slice(const float *const xs[ITEM_TOKENS + TB], float *const ys[ITEM_TOKENS + TB],
                       int64_t n, const float *a, const float *bt, float scale, int64_t rank,
                       int64_t in_features, int64_t max_out, int64_t size) {
    /* r[t * rank + k], packed: with a row stride of MAX_RANK the rows of r fell into two
     * L1 sets and the kernel ran ~20% slower */
    float r[(ITEM_TOKENS + TB) * MAX_RANK];
    for (int64_t t0 = 0; t0 < n; t0 += TB)
        for (int64_t k0 = 0; k0 < rank; k0 += RB)
            shrink_tile(xs + t0, a, k0, rank, in_features, r + t0 * rank);
    for (int64_t i = 0; i < n * rank; ++i) r[i] *= scale;
    /* A padded row must hold the values of the real row it repeats, which is in the same
     * tile, so that storing it rewrites the same numbers (all loads precede the stores). */
    for (int64_t t = n; t < n + TB; ++t)
        memcpy(r + t * rank, r + (n - 1) * rank, sizeof(float) * (size_t)rank);
    for (int64_t c0 = 0; c0 < size; c0 += EXPAND_COLS) {
        const int64_t c1 = c0 + EXPAND_COLS < size ? c0 + EXPAND_COLS : size;
        for (int64_t t0 = 0; t0 < n; t0 += TB) {
            const int64_t real = n - t0 < TB ? n - t0 : TB;
            expand_rows(ys + t0, bt, max_out, rank, r + t0 * rank, c0, c1, real);
        }
    }
}

int64_t loraplex_lora_grouped_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride,
                                  const float *lora_a, const float *lora_bt, const float *scales,
                                  const int64_t *tokens, const int64_t *group_starts,
                                  const int64_t *group_slots, const int64_t *slice_sizes,
                                  int64_t num_groups, int64_t num_slices, int64_t num_slots,
                                  int64_t rank, int64_t in_features, int64_t max_out,
                                  int num_threads) {
    int64_t offsets[MAX_SLICES];
    int64_t total = 0;
    for (int64_t s = 0; s < num_slices; ++s) {
        offsets[s] = total;
        total += slice_sizes[s];
    }
    /* Work items: (group, first token index) for every ITEM_TOKENS tokens of a group. */
    int64_t num_items = 0;
    for (int64_t g = 0; g < num_groups; ++g)
        num_items += (group_starts[g + 1] - group_starts[g] + ITEM_TOKENS - 1) / ITEM_TOKENS;
    int64_t *items = malloc(sizeof(int64_t) * 2 * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
        for (int64_t i = group_starts[g]; i < group_starts[g + 1]; i += ITEM_TOKENS) {
            items[2 * n] = g;
            items[2 * n + 1] = i;
            ++n;
        }
    }
    int64_t bad_groups = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad_groups)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t g = items[2 * item], first = items[2 * item + 1];
        const int64_t slot = group_slots[g];
        if (slot < 0 || slot >= num_slots) {
            bad_groups += first == group_starts[g]; /* count each group once */
            continue;
        }
        const float scale = scales[slot];
        if (scale == 0.0f) continue; /* a free slot: no delta, by the slot buffers' contract */
        const int64_t end = group_starts[g + 1];
        const int64_t n = end - first < ITEM_TOKENS ? end - first : ITEM_TOKENS;
        const float *xs[ITEM_TOKENS + TB];
        float *ys[ITEM_TOKENS + TB];
        for (int64_t j = 0; j < ITEM_TOKENS + TB; ++j) {
            /* padding rows repeat the last real token (see item_slice) */
            const int64_t t = tokens[first + (j < n ? j : n - 1)];
            xs[j] = x + t * x_stride;
            ys[j] = y + t * y_stride;
        }
        for (int64_t s = 0; s < num_slices; ++s) {
            float *yso[ITEM_TOKENS + TB];
            for (int j = 0; j < ITEM_TOKENS + TB; ++j) yso[j] = ys[j] + offsets[s];
            item_slice(xs, yso, n, lora_a + (s * num_slots + slot) * rank * in_features,
                       lora_bt + (s * num_slots + slot) * rank * max_out, scale, rank, in_features,
                       max_out, slice_sizes[s]);
        }
    }
    free(items);
    return bad_groups;
}
