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
 * Layouts (contiguous but for the query rows):
 *   query             [num_seqs, num_heads, head_dim], sequence s's row at query + s * q_stride
 *                     (a fused qkv row's q part: its heads contiguous)
 *   out               [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, table_stride] int32
 *   seq_lens          [num_seqs] int32, >= 1
 *   window            sliding window (0: none): the query at seq_len - 1 sees the last
 *                     `window` keys; blocks before the first are never read (may be freed)
 *   softcap           attention logit soft-capping (0: none): s = softcap * tanh(s / softcap)
 *
 * Each entry point returns the number of work items with a length < 1 or a block id
 * outside the cache (their output is garbage; the launcher raises). float32 and
 * bfloat16 versions come from paged_decode_impl.h, included once per element type;
 * accumulation is float32 in both.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scalar_ops.h"

/* Per-work-item stack buffers: query rows (heads * group) and rows * head_dim. */
#define MAX_ROWS 32
#define MAX_ROWS_DIM 8192
#define MAX_BLOCK_SIZE 256
#define MAX_HEAD_DIM 512

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
