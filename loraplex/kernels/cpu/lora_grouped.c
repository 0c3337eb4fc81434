/*
 * Multi-adapter LoRA for short runs of tokens (decodes, short chunks) on the CPU.
 *
 *   for each (group of tokens on one adapter slot, slice) (one work item, OpenMP):
 *     for each block of up to 4 tokens t of the group:
 *       r = scale[slot] * A[slice, slot] @ x[t]                    (rank dots of length in)
 *       y[t, off : off + size] += sum_k r[k] * B^T[slice, slot, k, :size]   (rank axpys)
 *
 * B is read transposed ([rank, max_out] per slot, as the CPU slot buffers store it)
 * so the expand is a few long vector axpys instead of one short dot product per
 * output. The torch path serves these tokens with padded buckets of batched GEMMs,
 * a dozen ops per bucket in every projection of every layer; here a whole step's
 * short runs of one projection are one call, and each adapter's A and B are read
 * once per group, while still in cache for the group's next token.
 *
 * Work items write disjoint parts of y (a group's token rows x a slice's columns),
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
 * launcher raises).
 */
#include <stdint.h>

#define MAX_RANK 512
#define MAX_SLICES 8
#define TOKEN_BLOCK 4  /* the shrink below is written for exactly 4 */
#define OUT_CHUNK 512  /* output columns per pass: 4 rows of B^T = 8 KiB */

int64_t loraplex_lora_max_rank(void) { return MAX_RANK; }
int64_t loraplex_lora_max_slices(void) { return MAX_SLICES; }

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
    const int64_t num_items = num_groups * num_slices;
    int64_t bad_groups = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad_groups)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t g = item / num_slices, s = item % num_slices;
        const int64_t slot = group_slots[g];
        if (slot < 0 || slot >= num_slots) {
            bad_groups += s == 0;
            continue;
        }
        const float scale = scales[slot];
        if (scale == 0.0f) continue; /* a free slot: no delta, by the slot buffers' contract */
        const float *a = lora_a + (s * num_slots + slot) * rank * in_features;
        const float *bt = lora_bt + (s * num_slots + slot) * rank * max_out;
        const int64_t size = slice_sizes[s];
        const int64_t first = group_starts[g], last = group_starts[g + 1];
        /* TOKEN_BLOCK tokens at a time: each row of A and B^T read from cache once per
         * block instead of once per token. */
        for (int64_t i0 = first; i0 < last; i0 += TOKEN_BLOCK) {
            const int64_t nb = last - i0 < TOKEN_BLOCK ? last - i0 : TOKEN_BLOCK;
            const float *xs[TOKEN_BLOCK];
            float *ys[TOKEN_BLOCK];
            for (int64_t j = 0; j < TOKEN_BLOCK; ++j) {
                /* a short block repeats its first token; those results are dropped */
                const int64_t t = tokens[i0 + (j < nb ? j : 0)];
                xs[j] = x + t * x_stride;
                ys[j] = y + t * y_stride + offsets[s];
            }
            float r[TOKEN_BLOCK][MAX_RANK];
            for (int64_t k = 0; k < rank; ++k) {
                const float *ak = a + k * in_features;
                const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int64_t d = 0; d < in_features; ++d) {
                    const float av = ak[d];
                    d0 += av * x0[d];
                    d1 += av * x1[d];
                    d2 += av * x2[d];
                    d3 += av * x3[d];
                }
                r[0][k] = d0 * scale;
                r[1][k] = d1 * scale;
                r[2][k] = d2 * scale;
                r[3][k] = d3 * scale;
            }
            /* y[t, o] += sum_k r[t][k] * B^T[k][o], over column chunks that keep a chunk
             * of four B^T rows in L1 while every token of the block uses it */
            for (int64_t o0 = 0; o0 < size; o0 += OUT_CHUNK) {
                const int64_t o1 = o0 + OUT_CHUNK < size ? o0 + OUT_CHUNK : size;
                int64_t k = 0;
                for (; k + 4 <= rank; k += 4) {
                    const float *b0 = bt + k * max_out, *b1 = b0 + max_out, *b2 = b1 + max_out,
                                *b3 = b2 + max_out;
                    for (int64_t j = 0; j < nb; ++j) {
                        const float r0 = r[j][k], r1 = r[j][k + 1], r2 = r[j][k + 2], r3 = r[j][k + 3];
                        float *yt = ys[j];
#pragma omp simd
                        for (int64_t o = o0; o < o1; ++o) yt[o] += r0 * b0[o] + r1 * b1[o] + r2 * b2[o] + r3 * b3[o];
                    }
                }
                for (; k < rank; ++k) {
                    const float *bk = bt + k * max_out;
                    for (int64_t j = 0; j < nb; ++j) {
                        const float rk = r[j][k];
                        float *yt = ys[j];
#pragma omp simd
                        for (int64_t o = o0; o < o1; ++o) yt[o] += rk * bk[o];
                    }
                }
            }
        }
    }
    return bad_groups;
}
