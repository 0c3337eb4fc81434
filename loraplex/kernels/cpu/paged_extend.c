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
 * Layouts (contiguous but for the query rows):
 *   query, out        [num_tokens, num_heads, head_dim], sequence s's tokens at
 *                     query_start[s] .. query_start[s + 1] - 1; token t's query row at
 *                     query + t * q_stride (its heads contiguous: a fused qkv row's q part)
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

/* Register tiles, by the vector unit the library is built for:
 *   AVX-512 (and without AVX2): the generic tiles of paged_extend_impl.h over row vectors of
 *     16 floats: K.Q^T tiles of 8 keys and P.V tiles of 8 dims by up to 3 row vectors = 24
 *     accumulators of the 32 registers. Measured on SmolLM2 and Llama-3-8B heads (32 new
 *     tokens over 1,024 cached, and 1,056-token prefills): 3 row vectors ran 1.1-2.1x faster
 *     than 1, 2 or 4-6 (smaller tiles of 6 or 4 keys).
 *   AVX2 (+ FMA): paged_extend_avx2.h, intrinsics over row vectors of 8 floats: K.Q^T tiles of
 *     6 keys x 2 row vectors, P.V tiles of 6 rows x 16 dims (12 accumulators each), up to 6
 *     row vectors (48 rows) per work item, so fewer items read each head's K/V. The AVX-512
 *     tiles built for AVX2 spilled (3.2 ms for 32 tokens over 1,056 where torch took 0.74).
 */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define EXT_AVX2 1
#define EXT_VL 8
#define EXT_MAX_NV 6
#else
#define EXT_AVX2 0
#define EXT_VL 16
#define EXT_MAX_NV 3
#endif
#define EXT_QK_KEYS 8 /* generic tiles (AVX-512 and the rest) */
#define EXT_PV_DIMS 8
#define EXT_MAX_ROWS (EXT_MAX_NV * EXT_VL) /* query rows (tokens x GQA group) per work item: 48 */
/* 1: the tiles fit this vector unit's registers (AVX-512, AVX2); 0: generic vectors, which the
 * compiler may split and spill (the backend then prefers torch, see paged_extend.py). */
#if defined(__AVX512F__) || EXT_AVX2
#define EXT_REGISTER_TILE 1
#else
#define EXT_REGISTER_TILE 0
#endif
#define EXT_CAT2(a, b) a##_##b
#define EXT_CAT(a, b) EXT_CAT2(a, b)

typedef float ev __attribute__((vector_size(EXT_VL * sizeof(float))));
VEC_HELPERS(ev, ev_)
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
int64_t loraplex_paged_extend_register_tile(void) { return EXT_REGISTER_TILE; }
int64_t loraplex_paged_extend_max_row_vectors(void) { return EXT_MAX_NV; }
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

#if EXT_AVX2
/* 8 bfloat16 values to floats: each one's bits are the high half of a float's. */
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

#define EXT_T float
#define EXT_LOAD load_f32
#define EXT_STORE store_f32
#define EXT_SUFFIX f32
#define EXT_ITEM paged_extend_item_f32
#define EXT_NAME loraplex_paged_extend_f32
#if EXT_AVX2
#define EXT_VLOAD8 _mm256_loadu_ps
#define EXT_QK_AVX2 ext_qk_avx2_f32
#define EXT_PV_AVX2 ext_pv_avx2_f32
#include "paged_extend_avx2.h"
#endif
#include "paged_extend_impl.h"

#define EXT_T uint16_t
#define EXT_LOAD load_bf16
#define EXT_STORE store_bf16
#define EXT_SUFFIX bf16
#define EXT_ITEM paged_extend_item_bf16
#define EXT_NAME loraplex_paged_extend_bf16
#if EXT_AVX2
#define EXT_VLOAD8 load8_bf16
#define EXT_QK_AVX2 ext_qk_avx2_bf16
#define EXT_PV_AVX2 ext_pv_avx2_bf16
#include "paged_extend_avx2.h"
#endif
#include "paged_extend_impl.h"
