/*
 * Projection y = x @ W^T (+ bias) from a weight kept in a block format (GGUF's Q8_0 / Q4_0 /
 * Q4_1 / Q4_K / Q6_K, F16 / BF16 / F32, per-channel int8): fp32 activations, fp32 accumulation.
 *
 * W is [n, row_bytes]: each output row's blocks are contiguous (GGUF's layout). Two plans:
 *
 *   few rows of x (m <= QL_DIRECT_MAX_M: decode steps, the LM head):
 *     for each group of TN weight rows (one work item, OpenMP):
 *       for each tile of TM rows of x:
 *         for each block, for each 16-weight chunk of it:
 *           w[r] = decode(chunk of row r)             (in registers: never written to memory)
 *           acc[r][t] += w[r] * x[t, chunk]            (TN x TM vector accumulators)
 *         y[t, row r] = row_scale[r] * sum(acc[r][t]) + bias[r]
 *   many rows (prefill chunks, large batches):
 *     for each panel of PANEL weight rows (one work item):
 *       decode the panel into a thread's buffer in linear_panels.c's layout (L2-resident)
 *       loraplex_linear_f32 on it (its register tile, one thread)
 *
 * The first streams the packed bytes once per step (a decode step is bound by those bytes,
 * 4.5 bits a weight for Q4_1 against 32 for float32); the second decodes each weight once per
 * step and then runs at the float kernel's FLOP rate (the step is compute-bound).
 *
 * Each format is one decoder, `decode_chunk` below (and a block prologue for the k-quants);
 * format ids are the Python side's `WeightFormat.c_id`. Returns 0, or -1 for an unknown format.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_tiles.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { F_Q8_0 = 1, F_Q4_0 = 2, F_Q4_1 = 3, F_F16 = 4, F_BF16 = 5, F_INT8 = 6, F_F32 = 7, F_Q4_K = 8, F_Q6_K = 9 };

#if defined(__AVX512F__)
#define TN 4 /* weight rows per tile: 16 accumulators + 4 weight vectors of 32 registers */
#define TM 4 /* rows of x per tile */
#else
#define TN 2 /* AVX2 / generic: a v16 is two registers; 8 of 16 for accumulators */
#define TM 2
#endif
#define QL_DIRECT_MAX_M 4

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

int64_t loraplex_linear_panel_width(void);
int64_t loraplex_qx16_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format, int plan);
int64_t loraplex_linear_f32(const float *x, int64_t x_stride, const float *wp, const float *bias, float *y,
                            int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads);

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline u8x16 load_u8(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

/* Widen to int32 first: GCC scalarises a direct uint8 -> float vector conversion (measured 7x slower). */
static inline v16 u8_to_v(u8x16 v) {
#if defined(__AVX512F__)
    __m128i b;
    memcpy(&b, &v, 16);
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    v16 out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16);
#endif
}

static inline v16 i8_to_v(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    v16 out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    i8x16 v;
    memcpy(&v, p, 16);
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16);
#endif
}

static inline v16 f16x16_to_v(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    v16 v;
    memcpy(&v, &f, sizeof v);
    return v;
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    float tmp[16];
    _mm256_storeu_ps(tmp, lo);
    _mm256_storeu_ps(tmp + 8, hi);
    return vload(tmp);
#else
    float tmp[16];
    for (int i = 0; i < 16; ++i) tmp[i] = f16_at(p + 2 * i);
    return vload(tmp);
#endif
}

static inline v16 bf16x16_to_v(const uint8_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Per-format geometry: weights and bytes per block. */
static inline int64_t block_weights(const int fmt) { return fmt == F_Q4_K || fmt == F_Q6_K ? 256 : fmt <= F_Q4_1 ? 32 : 16; }
static inline int64_t block_bytes(const int fmt) {
    switch (fmt) {
        case F_Q8_0: return 34;
        case F_Q4_0: return 18;
        case F_Q4_1: return 20;
        case F_F16: case F_BF16: return 32;
        case F_INT8: return 16;
        case F_F32: return 64;
        case F_Q4_K: return 144;
        case F_Q6_K: return 210;
        default: return 0;
    }
}

/* What a block's chunks share, read once per block: scales (and Q4_K's eight sub-block pairs). */
typedef struct {
    float d, m;
    float sc[8], mn[8]; /* Q4_K: d * scale and dmin * min of each 32-weight sub-block */
} block_head;

static inline void read_head(const int fmt, const uint8_t *b, block_head *h) {
    switch (fmt) {
        case F_Q8_0: case F_Q4_0: h->d = f16_at(b); break;
        case F_Q4_1: h->d = f16_at(b); h->m = f16_at(b + 2); break;
        case F_Q6_K: h->d = f16_at(b + 208); break;
        case F_Q4_K: {
            const float d = f16_at(b), dmin = f16_at(b + 2);
            const uint8_t *s = b + 4; /* ggml's get_scale_min_k4 */
            for (int j = 0; j < 8; ++j) {
                uint8_t sc, mn;
                if (j < 4) {
                    sc = s[j] & 63;
                    mn = s[j + 4] & 63;
                } else {
                    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
                }
                h->sc[j] = d * (float)sc;
                h->mn[j] = dmin * (float)mn;
            }
            break;
        }
        default: break;
    }
}

/* Weights 16 * j .. 16 * j + 15 of block `b` as floats (the format's value formula). */
static inline __attribute__((always_inline)) v16 decode_chunk(const int fmt, const uint8_t *b, const block_head *h,
                                                              const int j) {
    switch (fmt) {
        case F_Q8_0: return i8_to_v(b + 2 + 16 * j) * h->d;
        case F_Q4_0: {
            const u8x16 q = load_u8(b + 2);
            return (u8_to_v(j ? q >> 4 : q & 0xF) - 8.0f) * h->d;
        }
        case F_Q4_1: {
            const u8x16 q = load_u8(b + 4);
            return u8_to_v(j ? q >> 4 : q & 0xF) * h->d + h->m;
        }
        case F_F16: return f16x16_to_v(b);
        case F_BF16: return bf16x16_to_v(b);
        case F_INT8: return i8_to_v(b);
        case F_F32: return vload((const float *)b);
        case F_Q4_K: { /* 64 weights per 32 bytes: low nibbles (sub-block 2g), then high (2g + 1) */
            const int g = j / 4, half = (j % 4) / 2, part = j % 2;
            const u8x16 q = load_u8(b + 16 + 32 * g + 16 * part);
            const int s = 2 * g + half;
            return u8_to_v(half ? q >> 4 : q & 0xF) * h->sc[s] - h->mn[s];
        }
        case F_Q6_K: { /* 128 weights per half: ql[l] & F, ql[l + 32] & F, ql[l] >> 4, ql[l + 32] >> 4 */
            const int half = j / 8, quarter = (j % 8) / 2, l0 = 16 * (j % 2);
            const u8x16 ql = load_u8(b + 64 * half + l0 + 32 * (quarter % 2));
            const u8x16 qh = load_u8(b + 128 + 32 * half + l0);
            const u8x16 lo = quarter < 2 ? ql & 0xF : ql >> 4;
            const u8x16 q = lo | (((qh >> (2 * quarter)) & 3) << 4);
            const float scale = h->d * (float)(int8_t)b[192 + j];
            return (u8_to_v(q) - 32.0f) * scale;
        }
        default: return vsplat(0.0f);
    }
}

static inline float row_scale(const int fmt, const uint8_t *row, int64_t k) {
    if (fmt != F_INT8) return 1.0f;
    float s;
    memcpy(&s, row + k, 4); /* per-channel int8: the scale follows the row's weights */
    return s;
}

static inline float hsum(v16 v) {
    float t[VL];
    vstore(t, v);
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += t[i];
    return s;
}

/* `tn` weight rows (from n0) by `tm` rows of x (from t0); both constants at each call site. */
static inline __attribute__((always_inline)) void direct_tile(const int fmt, const float *x, int64_t x_stride,
                                                              const uint8_t *w, int64_t row_bytes,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              int64_t k, const int tn, const int tm) {
    const int64_t bw = block_weights(fmt), bb = block_bytes(fmt), nb = k / bw;
    const int chunks = (int)(bw / VL);
    v16 acc[TN][TM];
    for (int r = 0; r < tn; ++r)
        for (int t = 0; t < tm; ++t) acc[r][t] = vsplat(0.0f);
    for (int64_t bi = 0; bi < nb; ++bi) {
        block_head head[TN];
        for (int r = 0; r < tn; ++r) read_head(fmt, w + r * row_bytes + bi * bb, &head[r]);
        for (int j = 0; j < chunks; ++j) {
            v16 xv[TM];
            for (int t = 0; t < tm; ++t) xv[t] = vload(x + t * x_stride + bi * bw + j * VL);
            for (int r = 0; r < tn; ++r) {
                const v16 wv = decode_chunk(fmt, w + r * row_bytes + bi * bb, &head[r], j);
                for (int t = 0; t < tm; ++t) acc[r][t] += wv * xv[t];
            }
        }
    }
    for (int r = 0; r < tn; ++r) {
        const float s = row_scale(fmt, w + r * row_bytes, k), b = bias != NULL ? bias[r] : 0.0f;
        for (int t = 0; t < tm; ++t) y[t * y_stride + r] = hsum(acc[r][t]) * s + b;
    }
}

/* All rows of x (m <= QL_DIRECT_MAX_M) by weight rows n0 .. n0 + tn. */
static inline __attribute__((always_inline)) void direct_rows(const int fmt, const float *x, int64_t x_stride,
                                                              const uint8_t *w, int64_t row_bytes,
                                                              const float *bias, float *y, int64_t y_stride,
                                                              int64_t m, int64_t k, const int tn) {
    int64_t t0 = 0;
    for (; t0 + TM <= m; t0 += TM)
        direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, TM);
    switch (m - t0) {
#if TM > 3
        case 3: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 3); break;
#endif
#if TM > 2
        case 2: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 2); break;
#endif
        case 1: direct_tile(fmt, x + t0 * x_stride, x_stride, w, row_bytes, bias, y + t0 * y_stride, y_stride, k, tn, 1); break;
        default: break;
    }
}

/* Weight rows n0 .. n0 + TN (fewer at the end) by all rows of x. */
static inline __attribute__((always_inline)) void direct_group(const int fmt, const float *x, int64_t x_stride,
                                                               const uint8_t *w, int64_t row_bytes,
                                                               const float *bias, float *y, int64_t y_stride,
                                                               int64_t m, int64_t n, int64_t k, int64_t n0) {
    const uint8_t *wg = w + n0 * row_bytes;
    const float *bg = bias != NULL ? bias + n0 : NULL;
    if (n0 + TN <= n) {
        direct_rows(fmt, x, x_stride, wg, row_bytes, bg, y + n0, y_stride, m, k, TN);
    } else {
        for (int64_t r = n0; r < n; ++r)
            direct_rows(fmt, x, x_stride, w + r * row_bytes, row_bytes, bias != NULL ? bias + r : NULL, y + r,
                        y_stride, m, k, 1);
    }
}

/* 16 vectors (16 weight rows' chunk of 16 weights) to 16 vectors of 16 rows each, stored at
 * out[i * stride .. + 16] for weight i of the chunk: a 16 x 16 transpose in registers. */
static inline void store_transposed(const v16 *rows, float *out, int64_t stride) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) memcpy(&r[i], &rows[i], sizeof r[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        for (int j = 0; j < 2; ++j) {
            r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
            r[i + j + 2] =
                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
        }
    }
    /* r[4q + s] now holds, in each 128-bit lane L, rows 4q..4q+3 of column 4L + s' (s' = 0, 2, 1, 3 order) */
    for (int i = 0; i < 4; ++i) {
        for (int j = 0; j < 4; ++j) {
            t[4 * i + j] = r[4 * j + i];
        }
    }
    /* t[4i + j]: rows 4j..4j+3, columns {L*4 + c(i)} per lane L; combine lanes across j */
    for (int i = 0; i < 4; ++i) {
        const __m512 a = _mm512_shuffle_f32x4(t[4 * i + 0], t[4 * i + 1], 0x44); /* lanes 0,1 of j0 | 0,1 of j1 */
        const __m512 b = _mm512_shuffle_f32x4(t[4 * i + 2], t[4 * i + 3], 0x44);
        const __m512 c = _mm512_shuffle_f32x4(t[4 * i + 0], t[4 * i + 1], 0xEE); /* lanes 2,3 */
        const __m512 d = _mm512_shuffle_f32x4(t[4 * i + 2], t[4 * i + 3], 0xEE);
        r[4 * i + 0] = _mm512_shuffle_f32x4(a, b, 0x88); /* lane 0 of each: column c(i) */
        r[4 * i + 1] = _mm512_shuffle_f32x4(a, b, 0xDD); /* lane 1: column 4 + c(i) */
        r[4 * i + 2] = _mm512_shuffle_f32x4(c, d, 0x88); /* lane 2: column 8 + c(i) */
        r[4 * i + 3] = _mm512_shuffle_f32x4(c, d, 0xDD); /* lane 3: column 12 + c(i) */
    }
    static const int col_of[4] = {0, 2, 1, 3}; /* which column within a lane each r[4q + s] group holds */
    for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 4; ++l) _mm512_storeu_ps(out + (4 * l + col_of[i]) * stride, r[4 * i + l]);
#else
    float tmp[16][16];
    for (int i = 0; i < 16; ++i) vstore(tmp[i], rows[i]);
    for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 16; ++i) out[j * stride + i] = tmp[i][j];
#endif
}

/* Weight rows c0 .. c0 + 16 (rows past `rows` read as zero) into panel columns c .. c + 16:
 * panel[d * width + c + i] = W[c0 + i, d] (linear_panels.c's layout). */
static inline __attribute__((always_inline)) void decode_rows16(const int fmt, const uint8_t *w, int64_t row_bytes,
                                                                int64_t rows, int64_t k, float *panel,
                                                                int64_t width) {
    const int64_t bw = block_weights(fmt), bb = block_bytes(fmt), nb = k / bw;
    const int chunks = (int)(bw / VL);
    float scale[16];
    for (int i = 0; i < 16; ++i) scale[i] = i < rows ? row_scale(fmt, w + i * row_bytes, k) : 0.0f;
    for (int64_t bi = 0; bi < nb; ++bi) {
        block_head head[16];
        for (int i = 0; i < rows; ++i) read_head(fmt, w + i * row_bytes + bi * bb, &head[i]);
        for (int j = 0; j < chunks; ++j) {
            v16 v[16];
            for (int i = 0; i < 16; ++i) {
                v[i] = i < rows ? decode_chunk(fmt, w + i * row_bytes + bi * bb, &head[i], j) : vsplat(0.0f);
                if (fmt == F_INT8) v[i] *= scale[i];
            }
            store_transposed(v, panel + (bi * bw + j * VL) * width, width);
        }
    }
}

/* One function per format with the format a constant in it: the loops below run inside
 * OpenMP regions, whose outlined bodies would otherwise receive the format as a variable (and
 * keep the switch, the tile arrays and the accumulators in memory: measured 15x slower). */
typedef void (*group_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t);
typedef void (*row_fn)(const uint8_t *, int64_t, int64_t, int64_t, float *, int64_t);

#define QL_FORMAT(F)                                                                                                 \
    static void group_##F(const float *x, int64_t xs, const uint8_t *w, int64_t rb, const float *bias, float *y,     \
                          int64_t ys, int64_t m, int64_t n, int64_t k, int64_t n0) {                                 \
        direct_group(F, x, xs, w, rb, bias, y, ys, m, n, k, n0);                                                     \
    }                                                                                                                \
    static void row_##F(const uint8_t *w, int64_t rb, int64_t rows, int64_t k, float *panel, int64_t width) {       \
        decode_rows16(F, w, rb, rows, k, panel, width);                                                              \
    }
QL_FORMAT(F_Q8_0)
QL_FORMAT(F_Q4_0)
QL_FORMAT(F_Q4_1)
QL_FORMAT(F_F16)
QL_FORMAT(F_BF16)
QL_FORMAT(F_INT8)
QL_FORMAT(F_F32)
QL_FORMAT(F_Q4_K)
QL_FORMAT(F_Q6_K)
#undef QL_FORMAT

static void format_fns(int format, group_fn *group, row_fn *row) {
    switch (format) {
#define QL_CASE(F)      \
    case F:             \
        *group = group_##F; \
        *row = row_##F; \
        break;
        QL_CASE(F_Q8_0) QL_CASE(F_Q4_0) QL_CASE(F_Q4_1) QL_CASE(F_F16) QL_CASE(F_BF16) QL_CASE(F_INT8)
        QL_CASE(F_F32) QL_CASE(F_Q4_K) QL_CASE(F_Q6_K)
#undef QL_CASE
        default: *group = NULL; *row = NULL;
    }
}

static int64_t paneled(row_fn decode, const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                       const float *bias, float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                       int num_threads) {
    const int64_t width = loraplex_linear_panel_width(), num_panels = (n + width - 1) / width;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *panel = aligned_alloc(64, (size_t)((k * width * 4 + 63) / 64 * 64));
        if (panel == NULL) failed = 1;
        /* every thread reaches the worksharing loop (an OpenMP rule); one without buffers skips its items */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            if (panel == NULL) continue;
            const int64_t c0 = p * width, cols = n - c0 < width ? n - c0 : width;
            for (int64_t c = 0; c < width; c += 16) {
                const int64_t rows = cols - c > 16 ? 16 : cols - c > 0 ? cols - c : 0;
                decode(w + (c0 + c) * row_bytes, row_bytes, rows, k, panel + c, width);
            }
            loraplex_linear_f32(x, x_stride, panel, bias != NULL ? bias + c0 : NULL, y + c0, y_stride, m, cols, k, 1);
        }
        free(panel);
    }
    return failed ? -2 : 0;
}

/* The rows of x above which a step decodes panels (exported for tests and the launcher). */
int64_t loraplex_qlinear_direct_max_m(void) { return QL_DIRECT_MAX_M; }

/* y[m, n] = x[m, k] @ W^T + bias; W [n, row_bytes] in `format`; `plan` 0 = by m, 1 = direct, 2 = panels
 * (3 = AMX: quant_x16.c's formats only; the others take it as direct).
 * The argument order is loraplex_linear_f32's, then the packed weight's format, row bytes and plan. */
int64_t loraplex_qlinear_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                             int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format,
                             int64_t row_bytes, int plan) {
    if (format >= 10) /* the row-interleaved formats: quant_x16.c */
        return loraplex_qx16_f32(x, x_stride, w, bias, y, y_stride, m, n, k, num_threads, format, plan);
    group_fn group;
    row_fn decode;
    format_fns(format, &group, &decode);
    if (group == NULL || k % block_weights(format) != 0) return -1;
    if (plan == 2 || (plan == 0 && m > QL_DIRECT_MAX_M))
        return paneled(decode, x, x_stride, w, row_bytes, bias, y, y_stride, m, n, k, num_threads);
    const int64_t groups = (n + TN - 1) / TN;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; ++g) group(x, x_stride, w, row_bytes, bias, y, y_stride, m, n, k, g * TN);
    return 0;
}
