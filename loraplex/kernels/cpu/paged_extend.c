/*
 * Paged extend (prefill and chunked-prefill) attention for the CPU, reading K/V in
 * place through the block table.
 *
 * Each prefill sequence s brings query_len(s) new tokens at positions
 * prefix .. prefix + query_len - 1 (prefix = seq_len - query_len, the tokens already
 * in the cache: a prefix-cache hit or earlier chunks). New token j attends causally
 * to keys 0 .. prefix + j, all read through the block table.
 *
 *   work item = (sequence, KV head, tile of query tokens), OpenMP-parallel
 *     rows = the tile's tokens x the KV head's GQA group of query heads (<= 32)
 *     for each chunk of <= 16 keys (within one cache block):
 *       S[t][rows] = scale * K[t] . Q^T          (keys broadcast, rows in vector lanes)
 *       causal mask only on the chunks past the tile's first token
 *       online softmax per row (vector max / exp / sum: no horizontal reductions)
 *       O^T[d][rows] = O^T * correction + sum_t V[t][d] * P[t][rows]
 *     out = O / sum
 *
 * Why this shape: one prefill chunk is a handful of long sequences, where the torch
 * path gathers every block into a contiguous copy and runs SDPA with a boolean mask
 * (or two GEMMs of 32-96 rows, which MKL runs at ~130 GFLOP/s on two cores). Here the
 * query rows of one KV head live in two 16-float vectors, each K or V element is one
 * broadcast that feeds two FMAs per row vector, and nothing is copied: the register
 * tiles of the two products run at the FMA rate. The GQA group shares each K/V row
 * (folded into the rows), as in the decode kernel.
 *
 * Layouts (all contiguous):
 *   query, out        [num_tokens, num_heads, head_dim], sequence s's tokens at
 *                     query_start[s] .. query_start[s + 1] - 1
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, table_stride] int32
 *   seq_lens          [num_seqs] int32 (context after this step, >= query_len >= 1)
 *   query_start       [num_seqs + 1] int32
 *
 * Returns the number of sequences whose query rows fall outside [0, num_tokens), are
 * empty or longer than their context, plus the work items that met a block id outside
 * the cache (their output is garbage; the launcher raises). float32 and bfloat16 K/V and query
 * (float32 accumulation); head_dim a multiple of 8, at most EXT_MAX_HEAD_DIM.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar_ops.h"
#include "vec_tiles.h"

/* Row vectors per work item, at most: 3 x 8 keys (or dims) = 24 accumulators. Measured
 * on SmolLM2 and Llama-3-8B heads (32 new tokens over 1,024 cached, and 1,056-token
 * prefills): 3 ran 1.1-2.1x faster than 1, 2 or 4-6 (smaller tiles of 6 or 4 keys). */
#define EXT_MAX_NV 3
#define EXT_MAX_ROWS (EXT_MAX_NV * VL) /* query rows (tokens x GQA group) per work item */
/* Keys per softmax step, across cache blocks: each step rescales the O^T accumulators
 * (a load, multiply and store per tile), which at 16 keys was ~19% of the P.V work. */
#define EXT_KEYS 64
#define EXT_MAX_SEGMENTS (EXT_KEYS / 8) /* runs of one cache block per step (block_size >= 8) */
#define EXT_MAX_HEAD_DIM 256
#define EXT_DIM_MULTIPLE 8 /* head dims per register tile of the P.V product */
#define EXT_PREFETCH_KEYS 96 /* how far ahead K/V rows are prefetched (64-128 measured alike) */

/* Ask for one head's K and V rows of keys start .. start + count - 1, into L2. Blocks
 * lie anywhere in the pool and one head's row is a few cache lines at the stride of a
 * whole token, which the hardware prefetcher does not follow: cold from DRAM (the
 * layer's weights have just streamed through the caches) the kernel took about twice
 * its in-cache time without this. Offsets are in elements. */
static inline void ext_prefetch_keys(const char *k_cache, const char *v_cache, const int32_t *table, int64_t start,
                                     int64_t count, int64_t key_end, int64_t block_size, int64_t token_stride,
                                     int64_t head_off, int64_t head_dim, int64_t elem_size, int64_t num_cache_blocks) {
    const int64_t row_bytes = head_dim * elem_size;
    for (int64_t key = start; key < start + count && key < key_end; ++key) {
        const int32_t block = table[key / block_size];
        if (block < 0 || block >= num_cache_blocks) return; /* reported when reached */
        const int64_t off = (((int64_t)block * block_size + key % block_size) * token_stride + head_off) * elem_size;
        for (int64_t line = 0; line < row_bytes; line += 64) {
            __builtin_prefetch(k_cache + off + line, 0, 2);
            __builtin_prefetch(v_cache + off + line, 0, 2);
        }
    }
}

int64_t loraplex_paged_extend_max_rows(void) { return EXT_MAX_ROWS; }
int64_t loraplex_paged_extend_max_head_dim(void) { return EXT_MAX_HEAD_DIM; }
int64_t loraplex_paged_extend_head_dim_multiple(void) { return EXT_DIM_MULTIPLE; }

/* Sequence s's query rows lie inside the batch and its context holds them. */
static inline int ext_seq_ok(const int32_t *query_start, const int32_t *seq_lens, int64_t s, int64_t num_tokens) {
    const int64_t lo = query_start[s], hi = query_start[s + 1];
    return lo >= 0 && hi <= num_tokens && hi - lo >= 1 && seq_lens[s] >= hi - lo;
}

/* Work items of sequence s: KV heads x query tiles; cumulative over sequences. */
static int64_t ext_items_of(int64_t query_len, int64_t num_kv_heads, int64_t tokens_per_tile) {
    return num_kv_heads * ((query_len + tokens_per_tile - 1) / tokens_per_tile);
}

#define EXT_T float
#define EXT_LOAD load_f32
#define EXT_STORE store_f32
#define EXT_ITEM paged_extend_item_f32
#define EXT_NAME loraplex_paged_extend_f32
#include "paged_extend_impl.h"

#define EXT_T uint16_t
#define EXT_LOAD load_bf16
#define EXT_STORE store_bf16
#define EXT_ITEM paged_extend_item_bf16
#define EXT_NAME loraplex_paged_extend_bf16
#include "paged_extend_impl.h"
