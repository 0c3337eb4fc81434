/*
 * Paged decode attention for the CPU, reading K/V in place through the block table.
 *
 *   for each sequence s and chunk of its KV heads (one work item, OpenMP-parallel):
 *     for each block of s's context: scores = scale * Q_rows . K_block^T
 *       online softmax: rescale running sums and accumulators by exp(m_old - m_new)
 *       acc += exp(scores - m_new) @ V_block
 *     out = acc / sum
 *
 * The query rows of KV head h are the query heads h*G .. h*G+G-1 (GQA), so each K/V
 * row is read once per group, not once per query head. Nothing is gathered: the
 * torch path copies every block into a contiguous buffer first, which costs another
 * pass over the KV bytes and a dozen small ops per chunk of sequences.
 *
 * A work item takes several KV heads of one sequence so that it reads each token's
 * K (and V) row for those heads as one contiguous run: one head's row alone is
 * 256-512 bytes at a stride of the whole token, which the hardware prefetcher serves
 * badly. Sequences are split into more items (fewer heads each) only when there are
 * too few sequences to keep every thread busy.
 *
 * Layouts (all contiguous):
 *   query, out        [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, table_stride] int32
 *   seq_lens          [num_seqs] int32, >= 1
 *
 * Each entry point returns the number of work items with a length < 1 or a block id
 * outside the cache (their output is garbage; the launcher raises). float32 and
 * bfloat16 versions come from paged_decode_impl.h, included once per element type;
 * accumulation is float32 in both.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Per-work-item stack buffers: query rows (heads * group) and rows * head_dim. */
#define MAX_ROWS 32
#define MAX_ROWS_DIM 8192
#define MAX_BLOCK_SIZE 256
#define MAX_HEAD_DIM 512

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float v) { *p = v; }

static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline void store_bf16(uint16_t *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep it a quiet NaN */
        *p = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    *p = (uint16_t)(bits >> 16);
}

/*
 * exp(x) for the softmax probabilities, x = score - running max <= 0. libm's expf is
 * a scalar call per score, which made the exponentials about half of the kernel's
 * time; this inlines into a vector loop. Cody-Waite reduction x = n ln2 + r with
 * |r| <= ln2 / 2, then a degree-6 Taylor polynomial: relative error ~2e-7, about one
 * float32 ulp. x below -87 is clamped (e^-87 ~ 1e-38 next to the max term's 1).
 */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* rintf, not the add-and-subtract 1.5 * 2^23 trick, which -fassociative-math folds away */
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    const float p =
        1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Ask for a run of bytes ahead of use, into L2 (one prefetch per 64-byte line). */
static inline void prefetch_row(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* KV heads per work item: as many as the buffers hold, fewer when sequences are scarce. */
static int64_t heads_per_item(int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                              int64_t head_dim, int num_threads) {
    int64_t fit = MAX_ROWS / group;
    if (fit * group * head_dim > MAX_ROWS_DIM) fit = MAX_ROWS_DIM / (group * head_dim);
    if (fit < 1) fit = 1;
    int64_t splits = (2 * (int64_t)num_threads + num_seqs - 1) / num_seqs;
    if (splits < 1) splits = 1;
    int64_t want = (num_kv_heads + splits - 1) / splits;
    if (want < 1) want = 1;
    return want < fit ? want : fit;
}

/* Largest GQA group * head_dim the kernel accepts (one KV head per item at least). */
int64_t loraplex_paged_decode_max_rows_dim(void) { return MAX_ROWS_DIM; }
int64_t loraplex_paged_decode_max_rows(void) { return MAX_ROWS; }
int64_t loraplex_paged_decode_max_block_size(void) { return MAX_BLOCK_SIZE; }
int64_t loraplex_paged_decode_max_head_dim(void) { return MAX_HEAD_DIM; }

#define KV_T float
#define KV_LOAD load_f32
#define KV_STORE store_f32
#define KV_ITEM paged_decode_item_f32
#define KV_NAME loraplex_paged_decode_f32
#include "paged_decode_impl.h"

#define KV_T uint16_t
#define KV_LOAD load_bf16
#define KV_STORE store_bf16
#define KV_ITEM paged_decode_item_bf16
#define KV_NAME loraplex_paged_decode_bf16
#include "paged_decode_impl.h"
