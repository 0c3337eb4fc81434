/*
 * AVX2 register tiles of the paged extend kernel: its two products for one work item,
 * written with intrinsics and accumulators named one by one. paged_extend.c includes this
 * file once per element type (before paged_extend_impl.h) with EXT_T, EXT_LOAD, EXT_VLOAD8
 * (8 elements to floats), EXT_SUFFIX (names its functions) and EXT_QK_AVX2 / EXT_PV_AVX2 (the
 * two entry points, which paged_extend_impl.h calls) defined. No include guard on purpose.
 *
 * Why not the generic vector code: GCC keeps arrays of vectors on the stack when the tile
 * does not fit AVX2's 16 registers with room to spare (the 8-key x 3-vector AVX-512 tile,
 * or even 6 x 2 written as arrays, stored accumulators every step), and turned the Q^T row
 * vectors into memory operands of every FMA (16 loads per 12 FMAs). Named accumulators with
 * the key / row / dimension counts as constants at each call site stay in registers.
 *
 * Layouts (one work item, `width` = row lanes, a multiple of 8):
 *   qt  [head_dim][width]   scaled Q^T, rows in lanes
 *   p   [keys][width]       a chunk's scores, then probabilities, rows in lanes
 *   ot  [width][head_dim]   unnormalised O, one row per query row (row-major, unlike the
 *                           generic path's O^T: here V rows are the vector operand)
 */

#define EXT_QK_AVX2_TILE EXT_CAT(ext_qk_tile, EXT_SUFFIX)
#define EXT_QK_AVX2_ROWS EXT_CAT(ext_qk_rows, EXT_SUFFIX)
#define EXT_PV_AVX2_TILE EXT_CAT(ext_pv_tile, EXT_SUFFIX)
#define EXT_PV_AVX2_ROWS EXT_CAT(ext_pv_rows, EXT_SUFFIX)

/* p[u][r] = sum_d qt[d][r] * K[u][d] for `keys` (<= 6) keys and 8 or 16 rows (`two`). */
static inline __attribute__((always_inline)) void EXT_QK_AVX2_TILE(const float *qt, int64_t width,
                                                                   const EXT_T *const *k, int64_t head_dim, float *p,
                                                                   const int keys, const int two) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    /* keys past `keys` alias key 0 (never read: their FMAs fold away) */
    const EXT_T *k0 = k[0], *k1 = keys > 1 ? k[1] : k0, *k2 = keys > 2 ? k[2] : k0;
    const EXT_T *k3 = keys > 3 ? k[3] : k0, *k4 = keys > 4 ? k[4] : k0, *k5 = keys > 5 ? k[5] : k0;
    for (int64_t d = 0; d < head_dim; ++d) {
        const __m256 q0 = _mm256_loadu_ps(qt + d * width);
        const __m256 q1 = two ? _mm256_loadu_ps(qt + d * width + 8) : q0;
        __m256 b;
#define EXT_KEY(u)                                                 \
    if (keys > u) {                                                \
        b = _mm256_set1_ps(EXT_LOAD(k##u + d));                    \
        a##u##0 = _mm256_fmadd_ps(b, q0, a##u##0);                 \
        if (two) a##u##1 = _mm256_fmadd_ps(b, q1, a##u##1);        \
    }
        EXT_KEY(0) EXT_KEY(1) EXT_KEY(2) EXT_KEY(3) EXT_KEY(4) EXT_KEY(5)
#undef EXT_KEY
    }
    const __m256 lo[6] = {a00, a10, a20, a30, a40, a50}, hi[6] = {a01, a11, a21, a31, a41, a51};
    for (int u = 0; u < keys; ++u) {
        _mm256_storeu_ps(p + u * width, lo[u]);
        if (two) _mm256_storeu_ps(p + u * width + 8, hi[u]);
    }
}

/* Scores of a chunk's keys (`n` rows of K, wherever their blocks put them) against row
 * vectors 2 at a time (`two`) or the last one alone. */
static inline __attribute__((always_inline)) void EXT_QK_AVX2_ROWS(const float *qt, int64_t width,
                                                                   const EXT_T *const *keys, int64_t n,
                                                                   int64_t head_dim, float *p, const int two) {
    int64_t t = 0;
    for (; t + 6 <= n; t += 6) EXT_QK_AVX2_TILE(qt, width, keys + t, head_dim, p + t * width, 6, two);
    const EXT_T *const *kt = keys + t;
    float *pt = p + t * width;
    switch (n - t) {
        case 5: EXT_QK_AVX2_TILE(qt, width, kt, head_dim, pt, 5, two); break;
        case 4: EXT_QK_AVX2_TILE(qt, width, kt, head_dim, pt, 4, two); break;
        case 3: EXT_QK_AVX2_TILE(qt, width, kt, head_dim, pt, 3, two); break;
        case 2: EXT_QK_AVX2_TILE(qt, width, kt, head_dim, pt, 2, two); break;
        case 1: EXT_QK_AVX2_TILE(qt, width, kt, head_dim, pt, 1, two); break;
        default: break;
    }
}

/* p[t][r] = qt[.][r] . K[t] for the `n` keys of a chunk (`keys[t]`: key t's row of this
 * head) and all `nv` row vectors: tiles of 6 keys run across cache-block boundaries. */
static __attribute__((noinline)) void EXT_QK_AVX2(const float *qt, int nv, const EXT_T *const *keys, int64_t n,
                                                  int64_t head_dim, float *p) {
    const int64_t width = (int64_t)nv * 8;
    int v = 0;
    for (; v + 2 <= nv; v += 2) EXT_QK_AVX2_ROWS(qt + v * 8, width, keys, n, head_dim, p + v * 8, 1);
    if (v < nv) EXT_QK_AVX2_ROWS(qt + v * 8, width, keys, n, head_dim, p + v * 8, 0);
}

/* ot[r][d0 ..] = ot[r][d0 ..] * corr[r] + sum_t P[t][r] * V[t][d0 ..] for `rows` (<= 6) rows
 * and 8 or 16 dims (`two`), over every key of the chunk's segments. */
static inline __attribute__((always_inline)) void EXT_PV_AVX2_TILE(float *ot, const float *corr, const float *p,
                                                                   int64_t width, const EXT_T *const *vseg,
                                                                   const int64_t *seg_len, int nseg,
                                                                   int64_t token_stride, int64_t head_dim, int64_t d0,
                                                                   const int rows, const int two) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define EXT_ROW_INIT(r)                                                                                   \
    if (rows > r) {                                                                                       \
        const __m256 c = _mm256_set1_ps(corr[r]);                                                         \
        a##r##0 = _mm256_mul_ps(_mm256_loadu_ps(ot + r * head_dim + d0), c);                              \
        if (two) a##r##1 = _mm256_mul_ps(_mm256_loadu_ps(ot + r * head_dim + d0 + 8), c);                 \
    }
    EXT_ROW_INIT(0) EXT_ROW_INIT(1) EXT_ROW_INIT(2) EXT_ROW_INIT(3) EXT_ROW_INIT(4) EXT_ROW_INIT(5)
#undef EXT_ROW_INIT
    const float *pt = p;
    for (int sg = 0; sg < nseg; ++sg) {
        const EXT_T *vr = vseg[sg] + d0;
        for (int64_t t = 0; t < seg_len[sg]; ++t, pt += width, vr += token_stride) {
            const __m256 v0 = EXT_VLOAD8(vr);
            const __m256 v1 = two ? EXT_VLOAD8(vr + 8) : v0;
            __m256 b;
#define EXT_ROW(r)                                              \
    if (rows > r) {                                             \
        b = _mm256_broadcast_ss(pt + r);                        \
        a##r##0 = _mm256_fmadd_ps(b, v0, a##r##0);              \
        if (two) a##r##1 = _mm256_fmadd_ps(b, v1, a##r##1);     \
    }
            EXT_ROW(0) EXT_ROW(1) EXT_ROW(2) EXT_ROW(3) EXT_ROW(4) EXT_ROW(5)
#undef EXT_ROW
        }
    }
    const __m256 lo[6] = {a00, a10, a20, a30, a40, a50}, hi[6] = {a01, a11, a21, a31, a41, a51};
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_ps(ot + r * head_dim + d0, lo[r]);
        if (two) _mm256_storeu_ps(ot + r * head_dim + d0 + 8, hi[r]);
    }
}

/* Rows r0 .. r0 + rows - 1 (`rows` a constant), every 16 dims, then an 8-dim tail. */
static inline __attribute__((always_inline)) void EXT_PV_AVX2_ROWS(float *ot, const float *corr, const float *p,
                                                                   int64_t width, const EXT_T *const *vseg,
                                                                   const int64_t *seg_len, int nseg,
                                                                   int64_t token_stride, int64_t head_dim,
                                                                   const int rows) {
    int64_t d0 = 0;
    for (; d0 + 16 <= head_dim; d0 += 16)
        EXT_PV_AVX2_TILE(ot, corr, p, width, vseg, seg_len, nseg, token_stride, head_dim, d0, rows, 1);
    if (d0 < head_dim) /* head_dim is a multiple of 8 */
        EXT_PV_AVX2_TILE(ot, corr, p, width, vseg, seg_len, nseg, token_stride, head_dim, d0, rows, 0);
}

/* O = O * corr + P^T V for one chunk: all `width` rows, 6 at a time. */
static __attribute__((noinline)) void EXT_PV_AVX2(float *ot, const float *corr, const float *p, int64_t width,
                                                  const EXT_T *const *vseg, const int64_t *seg_len, int nseg,
                                                  int64_t token_stride, int64_t head_dim) {
    int64_t r0 = 0;
    for (; r0 + 6 <= width; r0 += 6)
        EXT_PV_AVX2_ROWS(ot + r0 * head_dim, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 6);
    float *o = ot + r0 * head_dim;
    switch (width - r0) {
        case 5: EXT_PV_AVX2_ROWS(o, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 5); break;
        case 4: EXT_PV_AVX2_ROWS(o, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 4); break;
        case 3: EXT_PV_AVX2_ROWS(o, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 3); break;
        case 2: EXT_PV_AVX2_ROWS(o, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 2); break;
        case 1: EXT_PV_AVX2_ROWS(o, corr + r0, p + r0, width, vseg, seg_len, nseg, token_stride, head_dim, 1); break;
        default: break;
    }
}

#undef EXT_QK_AVX2_TILE
#undef EXT_QK_AVX2_ROWS
#undef EXT_PV_AVX2_TILE
#undef EXT_PV_AVX2_ROWS
