/*
 * Body of one paged extend entry point; paged_extend.c includes this file once per
 * element type with EXT_T (storage type), EXT_LOAD / EXT_STORE (to and from float),
 * EXT_ITEM (a private name for the per-item function) and EXT_NAME (the exported
 * symbol) defined. No include guard on purpose.
 */

/* One work item: tokens j0 .. j0 + ntok - 1 of one sequence (at flat rows q_tok0 + j)
 * against KV head h. Its GQA group of query heads makes rows = ntok * group <= 16 * nv:
 * row r is token j0 + r / group, query head h * group + r % group; the lanes past
 * ``rows`` are padding (zero queries, never stored). ``nv`` (row vectors) and
 * ``head_dim`` are constants at each call site, so the tiles below stay in registers.
 * Returns 1 if a block id was outside the cache, else 0. */
static inline __attribute__((always_inline)) int EXT_ITEM(
    const EXT_T *query, const EXT_T *k_cache, const EXT_T *v_cache, const int32_t *table, int64_t prefix,
    int64_t q_tok0, int64_t q_stride, int64_t j0, int64_t ntok, int64_t h, int64_t group, int64_t num_heads,
    int64_t head_dim,
    int64_t block_size, int64_t token_stride, int64_t num_cache_blocks, float scale, int64_t window, float softcap,
    EXT_T *out, const int nv) {
#if EXT_AVX2
#define EXT_OT(d, r) ((r) * head_dim + (d)) /* row-major: the AVX2 P.V tile loads V rows as vectors */
#else
#define EXT_OT(d, r) ((d) * width + (r)) /* O^T: rows in lanes, as Q^T and P */
#endif
    const int64_t rows = ntok * group;
    const int64_t width = (int64_t)nv * EXT_VL; /* row lanes, padding included */
    /* Generic tiles: K.Q^T of EXT_QK_KEYS keys x nv row vectors, P.V of EXT_PV_DIMS dims x nv
     * row vectors (<= 24 accumulators: AVX-512's registers); AVX2 has its own (see the .c). */
    float qt[EXT_MAX_HEAD_DIM * EXT_MAX_ROWS]; /* scaled Q^T: qt[d * width + r] */
    float ot[EXT_MAX_HEAD_DIM * EXT_MAX_ROWS]; /* unnormalised O: ot[EXT_OT(d, r)] */
    float p[EXT_KEYS * EXT_MAX_ROWS];          /* a chunk's scores, then probabilities: p[t * width + r] */
    float m[EXT_MAX_ROWS], l[EXT_MAX_ROWS], corr[EXT_MAX_ROWS], lim[EXT_MAX_ROWS], cmax[EXT_MAX_ROWS];
    float first_key[EXT_MAX_ROWS]; /* the first key each row sees (a sliding window; else 0) */

    for (int64_t r = 0; r < width; ++r) {
        if (r < rows) {
            const int64_t jl = r / group, g = r % group;
            const EXT_T *qr = query + (q_tok0 + j0 + jl) * q_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) qt[d * width + r] = EXT_LOAD(qr + d) * scale;
            lim[r] = (float)(prefix + j0 + jl); /* the last key this row sees */
        } else {
            for (int64_t d = 0; d < head_dim; ++d) qt[d * width + r] = 0.0f;
            lim[r] = (float)(prefix + j0 + ntok - 1); /* sees at least its last key: never all -inf */
        }
        first_key[r] = window > 0 ? lim[r] - (float)window + 1.0f : 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(ot, 0, sizeof(float) * (size_t)(head_dim * width));

    const int64_t all_see = prefix + j0;        /* every row sees keys .. all_see */
    const int64_t key_end = prefix + j0 + ntok; /* keys read: key_start .. key_end - 1 */
    /* A sliding window: the first row sees keys from all_see - window + 1 on; blocks before
     * that key's may have been freed (PAD_BLOCK_ID) and are never read. Keys before
     * `window_end` are out of some row's window and get masked. */
    const int64_t key_start = window > 0 && all_see + 1 > window ? all_see + 1 - window : 0;
    const int64_t window_end = window > 0 ? key_end - window : 0;
    /* The first keys' rows now; later ones EXT_PREFETCH_KEYS ahead, in the loop. */
    ext_prefetch_keys((const char *)k_cache, (const char *)v_cache, table, key_start, EXT_PREFETCH_KEYS, key_end,
                      block_size, token_stride, h * head_dim, head_dim, (int64_t)sizeof(EXT_T), num_cache_blocks);
    int64_t c0 = key_start;
    while (c0 < key_end) {
        /* A chunk: up to EXT_KEYS keys, in runs of consecutive keys within one cache block. */
        const EXT_T *kseg[EXT_MAX_SEGMENTS];
        const EXT_T *vseg[EXT_MAX_SEGMENTS];
        int64_t seg_len[EXT_MAX_SEGMENTS];
        int nseg = 0;
        int64_t n = 0;
        while (n < EXT_KEYS && c0 + n < key_end && nseg < EXT_MAX_SEGMENTS) {
            const int64_t key = c0 + n;
            const int64_t off = key % block_size;
            int64_t len = block_size - off;
            if (len > EXT_KEYS - n) len = EXT_KEYS - n;
            if (len > key_end - key) len = key_end - key;
            const int32_t block = table[key / block_size];
            if (block < 0 || block >= num_cache_blocks) return 1; /* never read out of bounds */
            const int64_t base = ((int64_t)block * block_size + off) * token_stride + h * head_dim;
            kseg[nseg] = k_cache + base;
            vseg[nseg] = v_cache + base;
            seg_len[nseg++] = len;
            n += len;
        }

        /* S[t][rows] = K[t] . Q^T: each K element is one broadcast feeding the row vectors. */
#if EXT_AVX2
        const EXT_T *krow[EXT_KEYS]; /* key t's row of this head, across the chunk's segments */
#endif
        int64_t row = 0; /* the chunk's key index of the segment's first key */
        for (int sg = 0; sg < nseg; row += seg_len[sg], ++sg) {
            const EXT_T *kc = kseg[sg];
            const int64_t len = seg_len[sg];
            /* A segment's worth at a time: hundreds of prefetches at once overflow the
             * miss queues (cold chunks of 64 keys ran 1.3x slower issued together). */
            ext_prefetch_keys((const char *)k_cache, (const char *)v_cache, table, c0 + row + EXT_PREFETCH_KEYS, len,
                              key_end, block_size, token_stride, h * head_dim, head_dim, (int64_t)sizeof(EXT_T),
                              num_cache_blocks);
#if EXT_AVX2
            for (int64_t t = 0; t < len; ++t) krow[row + t] = kc + t * token_stride;
#else
            int64_t t = 0;
            for (; t + EXT_QK_KEYS <= len; t += EXT_QK_KEYS) {
                ev a[EXT_QK_KEYS][EXT_MAX_NV];
                for (int u = 0; u < EXT_QK_KEYS; ++u)
                    for (int v = 0; v < nv; ++v) a[u][v] = ev_splat(0.0f);
                const EXT_T *k0 = kc + t * token_stride;
                for (int64_t d = 0; d < head_dim; ++d) {
                    ev q[EXT_MAX_NV];
                    for (int v = 0; v < nv; ++v) q[v] = ev_load(qt + d * width + v * EXT_VL);
                    for (int u = 0; u < EXT_QK_KEYS; ++u) {
                        const ev kb = ev_splat(EXT_LOAD(k0 + u * token_stride + d));
                        for (int v = 0; v < nv; ++v) a[u][v] += q[v] * kb;
                    }
                }
                for (int u = 0; u < EXT_QK_KEYS; ++u)
                    for (int v = 0; v < nv; ++v) ev_store(p + (row + t + u) * width + v * EXT_VL, a[u][v]);
            }
            for (; t < len; ++t) {
                ev a[EXT_MAX_NV];
                for (int v = 0; v < nv; ++v) a[v] = ev_splat(0.0f);
                const EXT_T *kt = kc + t * token_stride;
                for (int64_t d = 0; d < head_dim; ++d) {
                    const ev kb = ev_splat(EXT_LOAD(kt + d));
                    for (int v = 0; v < nv; ++v) a[v] += ev_load(qt + d * width + v * EXT_VL) * kb;
                }
                for (int v = 0; v < nv; ++v) ev_store(p + (row + t) * width + v * EXT_VL, a[v]);
            }
#endif
        }
#if EXT_AVX2
        EXT_QK_AVX2(qt, nv, krow, n, head_dim, p);
#endif

        /* Gemma 2's soft-capping of the scaled scores (qt carries the scale), before the mask. */
        if (softcap > 0.0f) {
            const float inv_cap = 1.0f / softcap;
            for (int64_t i = 0; i < n * width; ++i) p[i] = softcap * tanhf(p[i] * inv_cap);
        }

        /* Causal mask, only where some key lies past some row's position (or, with a
         * sliding window, before some row's window). */
        const int masked = c0 + n - 1 > all_see || c0 < window_end;
        if (masked) {
            for (int64_t tt = 0; tt < n; ++tt) {
                const float key = (float)(c0 + tt);
                float *pt = p + tt * width;
#pragma omp simd
                for (int64_t r = 0; r < width; ++r) pt[r] = key > lim[r] || key < first_key[r] ? -INFINITY : pt[r];
            }
        }

        /* Online softmax, rows in lanes: a vertical max, exp and sum over the chunk's keys.
         * Without a window key 0 is in the first chunk and every row sees it, so the max is
         * finite from there on; with one, a row may see nothing in a chunk (its max stays
         * -inf: nothing to correct yet). Masked keys get probability 0 exactly. */
        memcpy(cmax, m, sizeof(float) * (size_t)width);
        for (int64_t tt = 0; tt < n; ++tt) {
            const float *pt = p + tt * width;
#pragma omp simd
            for (int64_t r = 0; r < width; ++r) cmax[r] = pt[r] > cmax[r] ? pt[r] : cmax[r];
        }
#pragma omp simd
        for (int64_t r = 0; r < width; ++r) {
            corr[r] = cmax[r] == -INFINITY ? 1.0f : fast_expf(m[r] - cmax[r]); /* ~0 on the first seen chunk */
            m[r] = cmax[r];
            l[r] *= corr[r];
        }
        for (int64_t tt = 0; tt < n; ++tt) {
            float *pt = p + tt * width;
            if (masked) { /* fast_expf(-inf) is e^-87, not 0: masked keys are set apart */
#pragma omp simd
                for (int64_t r = 0; r < width; ++r) {
                    const float e = pt[r] == -INFINITY ? 0.0f : fast_expf(pt[r] - cmax[r]);
                    pt[r] = e;
                    l[r] += e;
                }
            } else {
#pragma omp simd
                for (int64_t r = 0; r < width; ++r) {
                    const float e = fast_expf(pt[r] - cmax[r]);
                    pt[r] = e;
                    l[r] += e;
                }
            }
        }

#if EXT_AVX2
        EXT_PV_AVX2(ot, corr, p, width, vseg, seg_len, nseg, token_stride, head_dim);
#else
        /* O^T[d][rows] = O^T * corr + sum_t V[t][d] * P[t][rows]: each V element is one
         * broadcast feeding nv FMAs; the tile stays in registers across the chunk's segments. */
        ev c[EXT_MAX_NV];
        for (int v = 0; v < nv; ++v) c[v] = ev_load(corr + v * EXT_VL);
        for (int64_t d0 = 0; d0 < head_dim; d0 += EXT_PV_DIMS) {
            ev acc[EXT_PV_DIMS][EXT_MAX_NV];
            for (int i = 0; i < EXT_PV_DIMS; ++i)
                for (int v = 0; v < nv; ++v) acc[i][v] = ev_load(ot + (d0 + i) * width + v * EXT_VL) * c[v];
            int64_t tt = 0;
            for (int sg = 0; sg < nseg; ++sg) {
                const EXT_T *vr = vseg[sg] + d0;
                for (int64_t t = 0; t < seg_len[sg]; ++t, ++tt, vr += token_stride) {
                    ev pv[EXT_MAX_NV];
                    for (int v = 0; v < nv; ++v) pv[v] = ev_load(p + tt * width + v * EXT_VL);
                    for (int i = 0; i < EXT_PV_DIMS; ++i) {
                        const ev vb = ev_splat(EXT_LOAD(vr + i));
                        for (int v = 0; v < nv; ++v) acc[i][v] += vb * pv[v];
                    }
                }
            }
            for (int i = 0; i < EXT_PV_DIMS; ++i)
                for (int v = 0; v < nv; ++v) ev_store(ot + (d0 + i) * width + v * EXT_VL, acc[i][v]);
        }
#endif
        c0 += n;
    }

    for (int64_t r = 0; r < rows; ++r) {
        const int64_t jl = r / group, g = r % group;
        EXT_T *orow = out + ((q_tok0 + j0 + jl) * num_heads + h * group + g) * head_dim;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < head_dim; ++d) EXT_STORE(orow + d, ot[EXT_OT(d, r)] * inv);
    }
    return 0;
}

int64_t EXT_NAME(const EXT_T *query, const EXT_T *k_cache, const EXT_T *v_cache, const int32_t *block_tables,
                 const int32_t *seq_lens, const int32_t *query_start, EXT_T *out, int64_t q_stride, int64_t num_tokens,
                 int64_t num_seqs,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t table_stride, int64_t num_cache_blocks, float scale, int64_t window, float softcap,
                 int64_t max_nv, int num_threads) {
    if (num_seqs <= 0) return 0;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    if (group > EXT_MAX_ROWS || head_dim > EXT_MAX_HEAD_DIM || head_dim % EXT_DIM_MULTIPLE != 0) return num_seqs;
    int64_t bad_items = 0;
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        if (ext_seq_ok(query_start, seq_lens, s, num_tokens)) total_tokens += (int64_t)query_start[s + 1] - query_start[s];
    /* Row vectors per item: as many as hold, fewer when that leaves threads idle (more
     * rows per item read each K/V element for more FMAs; fewer make more items). */
    int nv = max_nv >= 1 && max_nv < EXT_MAX_NV ? (int)max_nv : EXT_MAX_NV;
    while (nv > 1) {
        const int64_t tokens_per_tile = (int64_t)nv * EXT_VL / group;
        const int64_t items = num_kv_heads * ((total_tokens + tokens_per_tile - 1) / (tokens_per_tile > 0 ? tokens_per_tile : 1));
        if (tokens_per_tile >= 1 && items >= 2 * (int64_t)num_threads) break;
        --nv;
    }
    while (nv * EXT_VL < group) ++nv; /* one token's group must fit (group <= EXT_MAX_ROWS) */
    const int64_t tokens_per_tile = (int64_t)nv * EXT_VL / group;

    /* first[s]: the first work item of sequence s (bad sequences get none and are counted). */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (first == NULL) return num_seqs;
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t query_len = (int64_t)query_start[s + 1] - query_start[s];
        const int ok = ext_seq_ok(query_start, seq_lens, s, num_tokens);
        bad_items += !ok;
        first[s + 1] = first[s] + (ok ? ext_items_of(query_len, num_kv_heads, tokens_per_tile) : 0);
    }
    const int64_t num_items = first[num_seqs];

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : bad_items)
    for (int64_t item = 0; item < num_items; ++item) {
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence s with first[s] <= item < first[s + 1] */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first[mid] <= item) lo = mid;
            else hi = mid - 1;
        }
        const int64_t s = lo;
        const int64_t query_len = (int64_t)query_start[s + 1] - query_start[s];
        const int64_t num_tiles = (query_len + tokens_per_tile - 1) / tokens_per_tile;
        const int64_t local = item - first[s];
        /* Consecutive items take different KV heads, so the threads start on different heads'
         * K/V (the next item of a head then finds it in L3); with a head's tiles consecutive,
         * both threads waited on DRAM for the same rows (a 32-token step over 1,024 cached
         * tokens ran ~3% slower). The longest (last) tiles first, so the causal tail does
         * not finish alone. */
        const int64_t h = local % num_kv_heads;
        const int64_t tile = num_tiles - 1 - local / num_kv_heads;
        const int64_t j0 = tile * tokens_per_tile;
        const int64_t ntok = j0 + tokens_per_tile <= query_len ? tokens_per_tile : query_len - j0;
        const int64_t prefix = (int64_t)seq_lens[s] - query_len;
        const int32_t *table = block_tables + s * table_stride;
        const int64_t q_tok0 = query_start[s];
#define EXT_CALL(NV, D)                                                                                     \
    EXT_ITEM(query, k_cache, v_cache, table, prefix, q_tok0, q_stride, j0, ntok, h, group, num_heads, D, block_size, \
             token_stride, num_cache_blocks, scale, window, softcap, out, NV)
#if EXT_MAX_NV > 3
#define EXT_CASES_WIDE(D)                              \
        case 4: bad_items += EXT_CALL(4, D); break;    \
        case 5: bad_items += EXT_CALL(5, D); break;    \
        case 6: bad_items += EXT_CALL(6, D); break;
#else
#define EXT_CASES_WIDE(D)
#endif
#define EXT_CASES(D)                                   \
    switch (nv) {                                      \
        case 1: bad_items += EXT_CALL(1, D); break;    \
        case 2: bad_items += EXT_CALL(2, D); break;    \
        case 3: bad_items += EXT_CALL(3, D); break;    \
        EXT_CASES_WIDE(D)                              \
        default: break;                                \
    }
#if EXT_AVX2 /* its products take head_dim at run time (one copy per row count builds in half the time) */
        EXT_CASES(head_dim)
#else
        if (head_dim == 64) {
            EXT_CASES(64)
        } else if (head_dim == 128) {
            EXT_CASES(128)
        } else {
            EXT_CASES(head_dim)
        }
#endif
#undef EXT_CASES
#undef EXT_CASES_WIDE
#undef EXT_CALL
    }
    free(first);
    return bad_items;
}

#undef EXT_OT
#undef EXT_T
#undef EXT_SUFFIX
#undef EXT_LOAD
#undef EXT_STORE
#undef EXT_ITEM
#undef EXT_NAME
#if EXT_AVX2
#undef EXT_VLOAD8
#undef EXT_QK_AVX2
#undef EXT_PV_AVX2
#endif
