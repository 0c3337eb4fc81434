/*
 * Body of one paged decode entry point; paged_decode.c includes this file once per
 * element type with KV_T (storage type), KV_LOAD / KV_STORE (to and from float),
 * KV_ITEM (a private name for the per-item function) and KV_NAME (the exported
 * symbol) defined. No include guard on purpose.
 */

/* One work item: query rows h0*G .. (h0+nh)*G - 1 of sequence s. Inlined into call
 * sites with a constant head_dim, so the row loops keep their accumulators in
 * vector registers. Returns 1 if a block id was outside the cache, else 0. */
static inline __attribute__((always_inline)) int KV_ITEM(
    const KV_T *query, const KV_T *k_cache, const KV_T *v_cache, const int32_t *table,
    int64_t seq_len, KV_T *out, int64_t q_off, int64_t o_off, int64_t h0, int64_t nh, int64_t group,
    int64_t head_dim, int64_t block_size, int64_t token_stride, int64_t num_cache_blocks,
    float scale, int64_t window, float softcap) {
    const int64_t rows = nh * group;
    const int64_t block_stride = block_size * token_stride;
    float q[MAX_ROWS_DIM], acc[MAX_ROWS_DIM];
    float scores[MAX_ROWS][MAX_BLOCK_SIZE];
    float run_max[MAX_ROWS], run_sum[MAX_ROWS];
    for (int64_t i = 0; i < rows * head_dim; ++i) q[i] = KV_LOAD(query + q_off + i) * scale;
    memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
    for (int64_t r = 0; r < rows; ++r) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
    }
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    /* A sliding window sees keys seq_len - window .. seq_len - 1: the blocks before the
     * first of them may have been freed (PAD_BLOCK_ID) and are never read. */
    const int64_t lo = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int64_t b = lo / block_size; b < num_blocks; ++b) {
        if (table[b] < 0 || table[b] >= num_cache_blocks) return 1; /* never read out of bounds */
        const int64_t n = b + 1 < num_blocks ? block_size : seq_len - b * block_size;
        const int64_t t0 = b * block_size < lo ? lo - b * block_size : 0; /* first visible token */
        const int64_t base = (int64_t)table[b] * block_stride + h0 * head_dim;
        /* Later blocks lie elsewhere in the pool, out of the hardware prefetcher's
         * sight: ask for the K and V rows (this item's heads of each token) of the block
         * after next during this block's dot products, into L2. With the pool far larger
         * than the caches, this took the kernel from ~8 to ~19 GB/s of KV read on two
         * cores (one block ahead, or into L1, helped less). */
        int64_t next = b + 2 < num_blocks ? table[b + 2] : -1;
        if (next >= num_cache_blocks) next = -1; /* bad ids are reported when reached */
        const int64_t next_base = next * block_stride + h0 * head_dim;
        const int64_t row_bytes = nh * head_dim * (int64_t)sizeof(KV_T);

        /* scores[r][t] = q_r . k_t */
        for (int64_t r = 0; r < rows; ++r) {
            const float *qr = q + r * head_dim;
            const KV_T *kh = k_cache + base + (r / group) * head_dim;
            for (int64_t t = t0; t < n; ++t) {
                if (next >= 0 && t % rows == r) { /* each token's rows once, spread over the rows */
                    prefetch_row(k_cache + next_base + t * token_stride, row_bytes);
                    prefetch_row(v_cache + next_base + t * token_stride, row_bytes);
                }
                const KV_T *k = kh + t * token_stride;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * KV_LOAD(k + d);
                /* Gemma 2's soft-capping of the scaled score (q carries the scale) */
                scores[r][t] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
            }
        }
        /* online softmax: probabilities replace the scores, accumulators are rescaled */
        for (int64_t r = 0; r < rows; ++r) {
            float *sr = scores[r];
            float block_max = sr[t0];
#pragma omp simd reduction(max : block_max)
            for (int64_t t = t0 + 1; t < n; ++t) block_max = sr[t] > block_max ? sr[t] : block_max;
            const float new_max = block_max > run_max[r] ? block_max : run_max[r];
            const float correction = expf(run_max[r] - new_max); /* 0 on the first block */
            float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
            for (int64_t t = t0; t < n; ++t) {
                const float p = fast_expf(sr[t] - new_max);
                sr[t] = p;
                block_sum += p;
            }
            run_sum[r] = run_sum[r] * correction + block_sum;
            run_max[r] = new_max;
            /* acc_r = acc_r * correction + sum_t p[r][t] * v_t, in a local copy the
             * compiler can hold in registers across the tokens */
            float a[MAX_HEAD_DIM];
            float *ar = acc + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] = ar[d] * correction;
            const KV_T *vh = v_cache + base + (r / group) * head_dim;
            for (int64_t t = t0; t < n; ++t) {
                const KV_T *v = vh + t * token_stride;
                const float p = sr[t];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * KV_LOAD(v + d);
            }
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ar[d] = a[d];
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / run_sum[r];
        for (int64_t d = 0; d < head_dim; ++d) KV_STORE(out + o_off + r * head_dim + d, acc[r * head_dim + d] * inv);
    }
    return 0;
}

int64_t KV_NAME(const KV_T *query, const KV_T *k_cache, const KV_T *v_cache,
                const int32_t *block_tables, const int32_t *seq_lens, KV_T *out, int64_t q_stride, int64_t num_seqs,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int64_t table_stride, int64_t num_cache_blocks, float scale, int64_t window, float softcap,
                int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t chunk = heads_per_item(num_seqs, num_kv_heads, group, head_dim, num_threads);
    const int64_t chunks_per_seq = (num_kv_heads + chunk - 1) / chunk;
    const int64_t num_items = num_seqs * chunks_per_seq;
    int64_t bad_items = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad_items)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t s = item / chunks_per_seq;
        const int64_t h0 = (item % chunks_per_seq) * chunk;
        const int64_t nh = h0 + chunk <= num_kv_heads ? chunk : num_kv_heads - h0;
        const int64_t seq_len = seq_lens[s];
        if (seq_len < 1) {
            ++bad_items;
            continue;
        }
        const int32_t *table = block_tables + s * table_stride;
        const int64_t q_off = s * q_stride + h0 * group * head_dim;    /* query rows may be strided */
        const int64_t o_off = (s * num_heads + h0 * group) * head_dim; /* out is contiguous */
        /* Constant head dims for the common sizes: fully unrolled row loops. */
        if (head_dim == 64)
            bad_items += KV_ITEM(query, k_cache, v_cache, table, seq_len, out, q_off, o_off, h0, nh, group, 64,
                                 block_size, token_stride, num_cache_blocks, scale, window, softcap);
        else if (head_dim == 128)
            bad_items += KV_ITEM(query, k_cache, v_cache, table, seq_len, out, q_off, o_off, h0, nh, group, 128,
                                 block_size, token_stride, num_cache_blocks, scale, window, softcap);
        else
            bad_items += KV_ITEM(query, k_cache, v_cache, table, seq_len, out, q_off, o_off, h0, nh, group,
                                 head_dim, block_size, token_stride, num_cache_blocks, scale, window, softcap);
    }
    return bad_items;
}

#undef KV_T
#undef KV_LOAD
#undef KV_STORE
#undef KV_ITEM
#undef KV_NAME
