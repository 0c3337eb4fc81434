/*
 * Multi-adapter LoRA on the CPU for every token of a step: decodes, short chunks and
 * prefill runs, one call per projection, on weights packed for it (kernels/cpu/lora_layout.py).
 *
 *   for each work item (up to ITEM_TOKENS tokens of one adapter):
 *     for each slot (page) of the adapter's page table:
 *       r[t, :] = scale[slot] * x[t] @ At[slot]                  (shrink, every slice at once)
 *       for each slice s, panel p of 64 output columns:
 *         y[t, off_s + 64p : +64] += r[t, s*rank : (s+1)*rank] @ Bp[s, slot, p]   (expand)
 *
 * A slot holds `rank` rank rows; an adapter of a larger rank is several slots (pages of
 * the adapter page pool, adapters/page_pool.py), whose deltas add up: LoRA is a sum over
 * rank rows. The pages of one adapter are walked inside one work item, so two threads
 * never add into the same rows of y.
 *
 * Both halves are register tiles with no horizontal reductions:
 * - the shrink holds rows x vectors of r in registers (6 x 4, 8 x 3, 12 x 2 or 12 x 1
 *   vectors: the slices' rank columns side by side, 16 per vector, a last half vector of 8
 *   where n_pad is an odd multiple of 8) and, per input
 *   feature d, loads the vectors of At's row d once and broadcasts x[t, d] to each row.
 *   The input dimension is walked in chunks of D_CHUNK so a chunk of At (<= 24 KiB at
 *   3 slices x rank 16) stays in L1 while every row tile of the item uses it;
 * - the expand keeps 4 tokens x 64 columns of the delta in registers while it adds
 *   the rank terms of one panel of B (rank x 64 floats, contiguous: one stream the
 *   prefetcher follows), then adds it into y, which it loads only then, so the FMAs
 *   never wait on y. On a prefill step y is hundreds of MB of read-modify-write: a
 *   block of 4 tokens walks its rows end to end before the next block starts.
 *
 * Padding: rows of a short tile repeat the item's last token (their pointers), so the
 * loads are valid; their shrink rows land in scratch rows past n and the expand never
 * stores them. The vectors are GCC/Clang vector extensions of 16 floats (vec_tiles.h).
 * Work items write disjoint rows of y, so no two threads touch the same element.
 *
 * Layouts (contiguous unless a stride is given):
 *   x          [num_tokens, in_features], row stride x_stride
 *   y          [num_tokens, sum(slice_sizes)], row stride y_stride
 *   lora_at    [num_slots, in_features, n_pad]   column s * rank + k = row k of slice s's A;
 *                                                n_pad = num_slices * rank rounded up to 8
 *   lora_bp    [num_slices, num_slots, num_panels, rank, PW]   Bp[.., p, k, c] = B[64p + c, k]
 *   scales     [num_slots] float32
 *   tokens     [group_starts[num_groups]] int64, token indices grouped by adapter
 *   group_starts [num_groups + 1] int64
 *   group_page_starts [num_groups + 1] int64: group g's slots are
 *                group_slots[group_page_starts[g] : group_page_starts[g + 1]]
 *   slice_sizes  [num_slices] int64, each <= num_panels * PW
 *
 * Returns the number of groups with a slot outside [0, num_slots) (skipped; the
 * launcher raises), or -1 if scratch memory could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_tiles.h"

#define MAX_RANK 512
#define MAX_SLICES 8
#define PW 64           /* output columns per B panel: 4 vectors */
#define TB 4            /* token rows per expand tile */
#define ITEM_TOKENS 16  /* tokens per work item: enough to reuse A and B, small enough to balance */
#define PAD_ROWS 12     /* the largest shrink tile: scratch rows past an item's tokens */
#define D_CHUNK 128     /* input features per shrink pass over an item's row tiles */

int64_t loraplex_lora_max_rank(void) { return MAX_RANK; }
int64_t loraplex_lora_max_slices(void) { return MAX_SLICES; }
int64_t loraplex_lora_panel_width(void) { return PW; }

/* r[t][c0 .. c0 + nv*VL) = (first ? 0 : r) + sum_{d0 <= d < d1} x_t[d] * at[d][c0 ..] for
 * `rows` rows; rows and nv are constants at each call site, so the accumulators live
 * in registers. */
static inline __attribute__((always_inline)) void shrink_tile(const float *const *xs, const float *at,
                                                              int64_t n_pad, int64_t c0, int64_t d0,
                                                              int64_t d1, float *r, int first,
                                                              const int rows, const int nv) {
    v16 acc[PAD_ROWS][4];
    for (int t = 0; t < rows; ++t)
        for (int j = 0; j < nv; ++j)
            acc[t][j] = first ? vsplat(0.0f) : vload(r + t * n_pad + c0 + j * VL);
    for (int64_t d = d0; d < d1; ++d) {
        v16 av[4];
        for (int j = 0; j < nv; ++j) av[j] = vload(at + d * n_pad + c0 + j * VL);
        for (int t = 0; t < rows; ++t) {
            const v16 xv = vsplat(xs[t][d]);
            for (int j = 0; j < nv; ++j) acc[t][j] += xv * av[j];
        }
    }
    for (int t = 0; t < rows; ++t)
        for (int j = 0; j < nv; ++j) vstore(r + t * n_pad + c0 + j * VL, acc[t][j]);
}

/* The widest row tile for nv vectors that fits 32 registers with its loads. */
static inline int big_rows(int nv) { return nv == 4 ? 6 : nv == 3 ? 8 : 12; }

static void shrink_rows(const float *const *xs, const float *at, int64_t n_pad, int64_t c0,
                        int64_t d0, int64_t d1, float *r, int first, int rows, int nv) {
#define SHRINK_CASE(R, NV) \
    case (R) * 8 + (NV): shrink_tile(xs, at, n_pad, c0, d0, d1, r, first, R, NV); break;
    switch (rows * 8 + nv) {
        SHRINK_CASE(4, 1) SHRINK_CASE(4, 2) SHRINK_CASE(4, 3) SHRINK_CASE(4, 4)
        SHRINK_CASE(12, 1) SHRINK_CASE(12, 2) SHRINK_CASE(8, 3) SHRINK_CASE(6, 4)
        default: break;
    }
#undef SHRINK_CASE
}

/* The same for the last 8 columns of a row (n_pad % 16 == 8): one half vector per row, so a
 * slot's A carries no column of padding past its 8-column multiple (a rank-8 page of o or
 * down was 8 real columns in 16: half of the bytes a decode streams). */
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
VEC_HELPERS(v8, h)

static inline __attribute__((always_inline)) void shrink_tile_half(const float *const *xs, const float *at,
                                                                   int64_t n_pad, int64_t c0, int64_t d0,
                                                                   int64_t d1, float *r, int first,
                                                                   const int rows) {
    v8 acc[PAD_ROWS];
    for (int t = 0; t < rows; ++t) acc[t] = first ? hsplat(0.0f) : hload(r + t * n_pad + c0);
    for (int64_t d = d0; d < d1; ++d) {
        const v8 av = hload(at + d * n_pad + c0);
        for (int t = 0; t < rows; ++t) acc[t] += hsplat(xs[t][d]) * av;
    }
    for (int t = 0; t < rows; ++t) hstore(r + t * n_pad + c0, acc[t]);
}

/* r[t, :n_pad] = x_t @ at for the item's n tokens (rows past n: scratch). Each chunk of
 * D_CHUNK input features serves every column group and the half vector before the next, so
 * a slot's A streams from memory once. */
static void item_shrink(const float *const *xs, int64_t n, const float *at, int64_t n_pad,
                        int64_t in_features, float *r) {
    const int64_t n_full = n_pad - n_pad % VL; /* columns in whole 16-float vectors */
    for (int64_t d0 = 0; d0 < in_features; d0 += D_CHUNK) {
        const int64_t d1 = d0 + D_CHUNK < in_features ? d0 + D_CHUNK : in_features;
        for (int64_t c0 = 0; c0 < n_full; c0 += 4 * VL) {
            const int nv = n_full - c0 >= 4 * VL ? 4 : (int)((n_full - c0) / VL);
            const int big = big_rows(nv);
            for (int64_t t0 = 0; t0 < n;) {
                const int rows = n - t0 >= big ? big : 4;
                shrink_rows(xs + t0, at, n_pad, c0, d0, d1, r + t0 * n_pad, d0 == 0, rows, nv);
                t0 += rows;
            }
        }
        if (n_full == n_pad) continue;
        for (int64_t t0 = 0; t0 < n;) {
            if (n - t0 >= 12) {
                shrink_tile_half(xs + t0, at, n_pad, n_full, d0, d1, r + t0 * n_pad, d0 == 0, 12);
                t0 += 12;
            } else {
                shrink_tile_half(xs + t0, at, n_pad, n_full, d0, d1, r + t0 * n_pad, d0 == 0, 4);
                t0 += 4;
            }
        }
    }
}

/* y_t[o .. o + nv*VL) += sum_k r_t[k] * panel[k][c ..] for 4 token rows, `real` of them
 * stored; nv is a constant at each call site. */
static inline __attribute__((always_inline)) void expand_tile(float *const *ys, const float *panel,
                                                              int64_t rank, const float *r,
                                                              int64_t r_stride, int64_t o,
                                                              int64_t real, const int nv) {
    v16 acc[TB][4];
    for (int t = 0; t < TB; ++t)
        for (int j = 0; j < nv; ++j) acc[t][j] = vsplat(0.0f);
    for (int64_t k = 0; k < rank; ++k) {
        v16 bv[4];
        for (int j = 0; j < nv; ++j) bv[j] = vload(panel + k * PW + j * VL);
        for (int t = 0; t < TB; ++t) {
            const v16 rv = vsplat(r[t * r_stride + k]);
            for (int j = 0; j < nv; ++j) acc[t][j] += rv * bv[j];
        }
    }
    for (int t = 0; t < TB && t < real; ++t)
        for (int j = 0; j < nv; ++j) vstore(ys[t] + o + j * VL, vload(ys[t] + o + j * VL) + acc[t][j]);
}

/* One panel (cols <= PW columns at y column o) for a block of 4 token rows. */
static void expand_panel(float *const *yt, const float *panel, int64_t rank, const float *rt,
                         int64_t r_stride, int64_t o, int64_t cols, int64_t real) {
    if (cols == PW) {
        expand_tile(yt, panel, rank, rt, r_stride, o, real, 4);
        return;
    }
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) expand_tile(yt, panel + c, rank, rt, r_stride, o + c, real, 1);
    for (; c < cols; ++c) { /* the slice's last size % 16 columns */
        for (int64_t t = 0; t < real; ++t) {
            float acc = 0.0f;
            for (int64_t k = 0; k < rank; ++k) acc += rt[t * r_stride + k] * panel[k * PW + c];
            yt[t][o + c] += acc;
        }
    }
}

int64_t loraplex_lora_grouped_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride,
                                  const float *lora_at, const float *lora_bp, const float *scales,
                                  const int64_t *slice_sizes, const int64_t *tokens,
                                  const int64_t *group_starts, const int64_t *group_page_starts,
                                  const int64_t *group_slots, int64_t num_groups, int64_t num_slices, int64_t num_slots,
                                  int64_t rank, int64_t in_features, int64_t n_pad,
                                  int64_t num_panels, int num_threads) {
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
    int failed = 0;
    const int64_t panel_floats = rank * PW;

#pragma omp parallel num_threads(num_threads) reduction(+ : bad_groups) reduction(| : failed)
    {
        /* r[t * n_pad + c]: the item's rank vectors, every slice side by side */
        float *r = malloc(sizeof(float) * (size_t)((ITEM_TOKENS + PAD_ROWS) * n_pad));
        if (r == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            const int64_t g = items[2 * item], first = items[2 * item + 1];
            int bad = 0;
            for (int64_t q = group_page_starts[g]; q < group_page_starts[g + 1]; ++q)
                bad |= group_slots[q] < 0 || group_slots[q] >= num_slots;
            if (bad) {
                bad_groups += first == group_starts[g]; /* count each group once */
                continue;
            }
            if (r == NULL) continue;
            const int64_t end = group_starts[g + 1];
            const int64_t cnt = end - first < ITEM_TOKENS ? end - first : ITEM_TOKENS;
            const float *xs[ITEM_TOKENS + PAD_ROWS];
            float *ys[ITEM_TOKENS + PAD_ROWS];
            for (int64_t j = 0; j < ITEM_TOKENS + PAD_ROWS; ++j) {
                const int64_t t = tokens[first + (j < cnt ? j : cnt - 1)]; /* padding repeats the last */
                xs[j] = x + t * x_stride;
                ys[j] = y + t * y_stride;
            }
            for (int64_t q = group_page_starts[g]; q < group_page_starts[g + 1]; ++q) {
                const int64_t slot = group_slots[q];
                const float scale = scales[slot];
                if (scale == 0.0f) continue; /* a free slot or page: no delta, by the pool's contract */
                item_shrink(xs, cnt, lora_at + slot * in_features * n_pad, n_pad, in_features, r);
                for (int64_t i = 0; i < cnt * n_pad; ++i) r[i] *= scale;
                for (int64_t t = cnt; t < cnt + TB; ++t) /* the expand's padding rows: finite values */
                    memcpy(r + t * n_pad, r + (cnt - 1) * n_pad, sizeof(float) * (size_t)n_pad);
                /* Token blocks outermost: each block's 4 y rows are read and written in long
                 * runs the hardware prefetcher follows (y is the bulk of a prefill step's
                 * traffic); the slot's B panels are re-read from L2/L3 per block. */
                for (int64_t t0 = 0; t0 < cnt; t0 += TB) {
                    const int64_t real = cnt - t0 < TB ? cnt - t0 : TB;
                    for (int64_t s = 0; s < num_slices; ++s) {
                        const float *bp = lora_bp + (s * num_slots + slot) * num_panels * panel_floats;
                        for (int64_t p = 0; p * PW < slice_sizes[s]; ++p) {
                            const int64_t cols = slice_sizes[s] - p * PW < PW ? slice_sizes[s] - p * PW : PW;
                            expand_panel(ys + t0, bp + p * panel_floats, rank, r + t0 * n_pad + s * rank,
                                         n_pad, offsets[s] + p * PW, cols, real);
                        }
                    }
                }
            }
        }
        free(r);
    }
    free(items);
    return failed ? -1 : bad_groups;
}
