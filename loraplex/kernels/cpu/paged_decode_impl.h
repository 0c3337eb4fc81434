/*
 * Body of one paged decode entry point; paged_decode.c includes this file once per
 * element type with KV_T (storage type), KV_LOAD / KV_STORE (to and from float) and
 * KV_NAME (the exported symbol) defined. No include guard on purpose.
 */
int64_t KV_NAME(const KV_T *query, const KV_T *k_cache, const KV_T *v_cache,
                const int32_t *block_tables, const int32_t *seq_lens, KV_T *out, int64_t num_seqs,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                int64_t table_stride, int64_t num_cache_blocks, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t chunk = heads_per_item(num_seqs, num_kv_heads, group, head_dim, num_threads);
    const int64_t chunks_per_seq = (num_kv_heads + chunk - 1) / chunk;
    const int64_t num_items = num_seqs * chunks_per_seq;
    int64_t bad_items = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad_items)
    for (int64_t item = 0; item < num_items; ++item) {
        const int64_t s = item / chunks_per_seq;
        const int64_t h0 = (item % chunks_per_seq) * chunk;
        const int64_t nh = h0 + chunk <= num_kv_heads ? chunk : num_kv_heads - h0;
        const int64_t rows = nh * group; /* query rows: heads h0*G .. (h0+nh)*G - 1 */
        const int64_t seq_len = seq_lens[s];
        if (seq_len < 1) {
            ++bad_items;
            continue;
        }
        const int32_t *table = block_tables + s * table_stride;
        const int64_t q_off = (s * num_heads + h0 * group) * head_dim;
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
        for (int64_t b = 0; b < num_blocks; ++b) {
            if (table[b] < 0 || table[b] >= num_cache_blocks) { /* never read out of bounds */
                ++bad_items;
                break;
            }
            const int64_t n = b + 1 < num_blocks ? block_size : seq_len - b * block_size;
            const int64_t base = (int64_t)table[b] * block_stride + h0 * head_dim;
            const KV_T *kb = k_cache + base;
            const KV_T *vb = v_cache + base;
            /* scores[r][t] = q_r . k_t, reading token t's heads h0 .. h0+nh-1 in order */
            for (int64_t t = 0; t < n; ++t) {
                const KV_T *k_row = kb + t * token_stride;
                for (int64_t r = 0; r < rows; ++r) {
                    const KV_T *k = k_row + (r / group) * head_dim;
                    const float *qr = q + r * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * KV_LOAD(k + d);
                    scores[r][t] = dot;
                }
            }
            /* online softmax: probabilities in place of the scores, rescaled accumulators */
            for (int64_t r = 0; r < rows; ++r) {
                float block_max = scores[r][0];
                for (int64_t t = 1; t < n; ++t) block_max = scores[r][t] > block_max ? scores[r][t] : block_max;
                const float new_max = block_max > run_max[r] ? block_max : run_max[r];
                const float correction = expf(run_max[r] - new_max); /* 0 on the first block */
                float block_sum = 0.0f;
                for (int64_t t = 0; t < n; ++t) {
                    const float p = expf(scores[r][t] - new_max);
                    scores[r][t] = p;
                    block_sum += p;
                }
                run_sum[r] = run_sum[r] * correction + block_sum;
                run_max[r] = new_max;
                if (correction != 1.0f) {
                    float *ar = acc + r * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) ar[d] *= correction;
                }
            }
            /* acc[r] += sum_t p[r][t] * v_t */
            for (int64_t t = 0; t < n; ++t) {
                const KV_T *v_row = vb + t * token_stride;
                for (int64_t r = 0; r < rows; ++r) {
                    const KV_T *v = v_row + (r / group) * head_dim;
                    float *ar = acc + r * head_dim;
                    const float p = scores[r][t];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * KV_LOAD(v + d);
                }
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const float inv = 1.0f / run_sum[r];
            for (int64_t d = 0; d < head_dim; ++d) KV_STORE(out + q_off + r * head_dim + d, acc[r * head_dim + d] * inv);
        }
    }
    return bad_items;
}

#undef KV_T
#undef KV_LOAD
#undef KV_STORE
#undef KV_NAME
