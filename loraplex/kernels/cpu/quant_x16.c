/*
 * Projections from the row-interleaved block formats (``formats/interleaved.py``: Q8_0 / Q4_0 /
 * Q4_1 blocks of 16 weight rows stored side by side) with integer activations, laid out so
 * that one vector lane is one weight row.
 *
 * The layout (a group of 16 rows, per block its scales then 64-byte chunks, one row per 32-bit
 * lane) is described in quant_x16_layout.h; this file is the projection itself:
 *
 *     every row of x is quantized per 32-block: q = round(x / dx), dx = amax / 32767 (int16,
 *     format ids 10-12) or amax / 127 (int8, llama.cpp's Q8 activations, ids 13-15), and the
 *     block's sum of q;
 *     for each group of 16 weight rows (OpenMP), for each tile of up to 8 rows of x, each block:
 *         isum[lane r] = sum_i wq[r][i] * xq[i]      (VNNI: vpdpwssd, 2 weights x 16 rows, or
 *                                                     vpdpbusd, 4 x 16, per instruction)
 *         y[r] += d[r] * dx * (isum[r] - offset * sum(xq))  (+ m[r] * dx * sum(xq) for Q4_1)
 *     where offset is 128 for Q8_0 (its weights are stored + 128) and 8 for Q4_0. The weights
 *     need a mask and a shift (Q4 nibbles; Q8_0 bytes in 16-bit lanes); a group stays in L1
 *     for all tiles of x, so a prefill streams the weights once too.
 * The "panels" plan (tests, comparison) decodes each group to floats into a panel, exactly,
 * and runs the float panel kernel on it, as quant_linear.c's panel plan.
 *
 * Without AVX-512 VNNI the same loops run on GCC vectors (shifted lanes, multiply, add), or on
 * AVX2 (no AVX-512) the 8-lane tiles of quant_x16_avx2.h: the AVX2 and generic builds compute the
 * same integers.
 *
 * The quantizers are in quant_x16_quantize.c, the layout's conversions (GGUF rows interleaved in
 * place, rows read back for the tied embedding) in quant_x16_layout.c, what they share in
 * quant_x16_common.h; AMX (steps of many rows) in quant_amx.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_x16_common.h"

#if defined(_OPENMP)
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define QX_TILE 8 /* rows of x per register tile of the dot products */
#define QX_ROW_CHUNK 128 /* rows of x per pass over the weights */
#define QX_PRIVATE_X_M 4 /* rows of x each thread quantizes for itself (no barrier) */
#define QX16_DIRECT_MAX_M_NO_VNNI 32 /* "auto": rows of x past it run the float panels (int16 x, no VNNI) */

int64_t loraplex_linear_panel_width(void);
int64_t loraplex_qx16_has_vnni(void);
int64_t loraplex_qx16_direct_max_m(int format);
int64_t loraplex_linear_f32(const float *x, int64_t x_stride, const float *wp, const float *bias, float *y,
                            int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads);

/* isum += (lane's low int16 pair member) * x_lo + (high) * x_hi, pairs of x packed in x32;
 * the weights' 16-bit lanes are non-negative here (masked nibbles or bytes + 128). */
static inline i32x16 dot2(i32x16 isum, const i32x16 w, const int32_t x32) {
#if defined(__AVX512VNNI__)
    __m512i a, wv, r;
    memcpy(&a, &isum, 64);
    memcpy(&wv, &w, 64);
    r = _mm512_dpwssd_epi32(a, wv, _mm512_set1_epi32(x32));
    memcpy(&isum, &r, 64);
    return isum;
#elif defined(__AVX512BW__)
    /* vpmaddwd: the same pair products summed into 32 bits, then an add */
    __m512i a, wv;
    memcpy(&a, &isum, 64);
    memcpy(&wv, &w, 64);
    a = _mm512_add_epi32(a, _mm512_madd_epi16(wv, _mm512_set1_epi32(x32)));
    memcpy(&isum, &a, 64);
    return isum;
#elif defined(__AVX2__)
    /* two 8-lane halves; the lanes' int16 members are non-negative (<= 255), so the signed
     * vpmaddwd is exact, and a lane's two products fit int32 */
    __m256i a0, a1, w0, w1;
    memcpy(&a0, &isum, 32);
    memcpy(&a1, (const char *)&isum + 32, 32);
    memcpy(&w0, &w, 32);
    memcpy(&w1, (const char *)&w + 32, 32);
    const __m256i xv = _mm256_set1_epi32(x32);
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, xv));
    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, xv));
    memcpy(&isum, &a0, 32);
    memcpy((char *)&isum + 32, &a1, 32);
    return isum;
#else
    const int32_t lo = (int16_t)(x32 & 0xFFFF), hi = x32 >> 16;
    return isum + (w & 0xFFFF) * lo + (i32x16)((u32x16)w >> 16) * hi;
#endif
}

/* isum += (4 unsigned bytes of each lane of w) . (the 4 signed bytes of x32), per lane. */
static inline i32x16 dot4(i32x16 isum, const i32x16 w, const int32_t x32) {
#if defined(__AVX512VNNI__)
    __m512i a, r;
    memcpy(&a, &isum, 64);
    __m512i wv;
    memcpy(&wv, &w, 64);
    r = _mm512_dpbusd_epi32(a, wv, _mm512_set1_epi32(x32));
    memcpy(&isum, &r, 64);
    return isum;
#else
    const u32x16 u = (u32x16)w;
    for (int p = 0; p < 4; ++p) {
        const int32_t xp = (int8_t)(uint8_t)((uint32_t)x32 >> (8 * p));
        isum += (i32x16)((u >> (8 * p)) & 0xFF) * xp;
    }
    return isum;
#endif
}

static inline i32x16 load_i32x16(const uint8_t *p) {
    i32x16 v;
    memcpy(&v, p, 64);
    return v;
}

static inline v16 to_float(const i32x16 v) { return __builtin_convertvector(v, v16); }

#include "quant_x16_avx2.h" /* QX_AVX2: the AVX2 tiles dot_group runs where the build has them */

/* y[t, g*16 .. +16] for rows t < tm of x (quantized) and group g; tm a constant at each call. */
static inline __attribute__((always_inline)) void dot_group(const int fmt, const int bits, const uint8_t *wg,
                                                            int64_t nb, const int8_t *xq, int64_t k, const float *dx,
                                                            const int32_t *sx, const float *ms, const float *bias, float *y,
                                                            int64_t y_stride, const int tm) {
#if QX_AVX2
    if (bits == 16 || fmt != X_Q8_0) { /* tiles of up to 4 rows on 8-lane halves (see half_avx2) */
        for (int t0 = 0; t0 < tm; t0 += 4) {
            const int8_t *xt = xq + t0 * (bits == 8 ? k : 2 * k);
            const float *dt = dx + t0 * (k / 32);
            const int32_t *st = sx + t0 * (k / 32);
            const float *mt = ms + t0 * (k / 32);
            float *yt = y + t0 * y_stride;
            const int n = tm - t0 < 4 ? tm - t0 : 4;
            for (int half = 0; half < 2; ++half) {
                switch (n) {
                    case 4: half_avx2(fmt, bits, wg, nb, xt, k, dt, st, mt, bias, yt, y_stride, 4, half); break;
                    case 3: half_avx2(fmt, bits, wg, nb, xt, k, dt, st, mt, bias, yt, y_stride, 3, half); break;
                    case 2: half_avx2(fmt, bits, wg, nb, xt, k, dt, st, mt, bias, yt, y_stride, 2, half); break;
                    default: half_avx2(fmt, bits, wg, nb, xt, k, dt, st, mt, bias, yt, y_stride, 1, half); break;
                }
            }
        }
        return;
    }
#endif
    const int64_t bb = x_block_bytes(fmt);
    const int hb = x_head_bytes(fmt);
    v16 acc[QX_TILE];
    for (int t = 0; t < tm; ++t) acc[t] = vsplat(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * bb, *qs = blk + hb;
        /* two chains per row of x for one or two rows (the adds' latency), one for more */
        i32x16 s0[QX_TILE], s1_[QX_TILE];
#define s1 (tm > 2 ? s0 : s1_)
        for (int t = 0; t < tm; ++t) s0[t] = s1_[t] = (i32x16){0};
        if (bits == 16) { /* xq holds int32 pairs: 16 per block per row of x (quantize_row16) */
            const int32_t *xp = (const int32_t *)xq;
            for (int c = 0; c < (fmt == X_Q8_0 ? 8 : 4); ++c) {
                const i32x16 w = load_i32x16(qs + 64 * c);
                for (int t = 0; t < tm; ++t) {
                    const int32_t *xb = xp + t * (k / 2) + 16 * b;
                    if (fmt == X_Q8_0) {
                        s0[t] = dot2(s0[t], w & 0x00FF00FF, xb[2 * c]);
                        s1[t] = dot2(s1[t], (i32x16)(((u32x16)w >> 8) & 0x00FF00FF), xb[2 * c + 1]);
                    } else {
                        s0[t] = dot2(s0[t], w & 0x000F000F, xb[2 * c]);
                        s1[t] = dot2(s1[t], (i32x16)(((u32x16)w >> 8) & 0x000F000F), xb[2 * c + 1]);
                        s0[t] = dot2(s0[t], (i32x16)(((u32x16)w >> 4) & 0x000F000F), xb[2 * c + 8]);
                        s1[t] = dot2(s1[t], (i32x16)(((u32x16)w >> 12) & 0x000F000F), xb[2 * c + 9]);
                    }
                }
            }
        } else if (fmt == X_Q8_0) {
            for (int c = 0; c < 8; c += 2) {
                const i32x16 w0 = load_i32x16(qs + 64 * c), w1 = load_i32x16(qs + 64 * (c + 1));
                for (int t = 0; t < tm; ++t) {
                    const int32_t *x32 = (const int32_t *)(xq + t * k + 32 * b);
                    s0[t] = dot4(s0[t], w0, x32[c]);
                    s1[t] = dot4(s1[t], w1, x32[c + 1]);
                }
            }
        } else {
            for (int c = 0; c < 4; ++c) {
                const i32x16 w = load_i32x16(qs + 64 * c);
                const i32x16 lo = w & 0x0F0F0F0F, hi = (i32x16)(((u32x16)w >> 4) & 0x0F0F0F0F);
                for (int t = 0; t < tm; ++t) {
                    const int32_t *x32 = (const int32_t *)(xq + t * k + 32 * b);
                    s0[t] = dot4(s0[t], lo, x32[c]);
                    s1[t] = dot4(s1[t], hi, x32[4 + c]);
                }
            }
        }
        const v16 d = f16x16(blk);
        const int offset = fmt == X_Q8_0 ? 128 : fmt == X_Q4_0 ? 8 : 0;
        for (int t = 0; t < tm; ++t) {
            const float dxb = dx[t * (k / 32) + b];
            const int32_t sxb = sx[t * (k / 32) + b];
            const i32x16 isum = (tm > 2 ? s0[t] : s0[t] + s1_[t]) - offset * sxb;
            acc[t] += to_float(isum) * (d * dxb);
            if (fmt == X_Q4_1) acc[t] += f16x16(blk + 32) * ms[t * (k / 32) + b];
        }
#undef s1
    }
    for (int t = 0; t < tm; ++t) {
        if (bias != NULL) acc[t] += vload(bias);
        vstore(y + t * y_stride, acc[t]);
    }
}

/* Group g's 16 rows as floats into panel columns (panel[d * width + c + r] = W[g*16 + r, d]). */
static inline __attribute__((always_inline)) void decode_group(const int fmt, const uint8_t *wg, int64_t nb,
                                                               float *panel, int64_t width) {
    const int64_t bb = x_block_bytes(fmt);
    const int hb = x_head_bytes(fmt);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * bb, *qs = blk + hb;
        const v16 d = f16x16(blk);
        float *out = panel + 32 * b * width;
        if (fmt == X_Q8_0) {
            for (int c = 0; c < 8; ++c) {
                const u32x16 w = (u32x16)load_i32x16(qs + 64 * c);
                for (int p = 0; p < 4; ++p) {
                    const i32x16 q = (i32x16)((w >> (8 * p)) & 0xFF) - 128;
                    vstore(out + (4 * c + p) * width, to_float(q) * d);
                }
            }
        } else {
            const v16 m = fmt == X_Q4_1 ? f16x16(blk + 32) : d * -8.0f;
            for (int c = 0; c < 4; ++c) {
                const u32x16 w = (u32x16)load_i32x16(qs + 64 * c);
                for (int p = 0; p < 4; ++p) {
                    const i32x16 lo = (i32x16)((w >> (8 * p)) & 0xF), hi = (i32x16)((w >> (8 * p + 4)) & 0xF);
                    vstore(out + (4 * c + p) * width, to_float(lo) * d + m);
                    vstore(out + (16 + 4 * c + p) * width, to_float(hi) * d + m);
                }
            }
        }
    }
}

typedef void (*dot_fn)(const uint8_t *, int64_t, const int8_t *, int64_t, const float *, const int32_t *,
                       const float *, const float *, float *, int64_t, int64_t);
typedef struct {
    dot_fn dot8, dot16;
} dot_fns;
typedef void (*dec_fn)(const uint8_t *, int64_t, float *, int64_t);

/* One function per format (a constant inside: see quant_linear.c on OpenMP's outlined bodies). */
#define QX_DOT(F, BITS)                                                                                             \
    static QX_ATTR_##BITS void dot##BITS##_##F(const uint8_t *wg, int64_t nb, const int8_t *xq, int64_t k, const float *dx,       \
                                const int32_t *sx, const float *ms, const float *bias, float *y, int64_t ys, int64_t m) {           \
        /* every tile of rows against this group: its weights stay in L1 */                                     \
        const int64_t xrow = BITS == 8 ? k : 2 * k;                                                                 \
        for (int64_t t0 = 0; t0 < m; t0 += QX_TILE) {                                                               \
            const int8_t *xt = xq + t0 * xrow;                                                                      \
            const float *dt = dx + t0 * (k / 32);                                                                   \
            const int32_t *st = sx + t0 * (k / 32);                                                               \
            const float *mt = ms + t0 * (k / 32);                                                                 \
            float *yt = y + t0 * ys;                                                                                \
            switch (m - t0 < QX_TILE ? m - t0 : QX_TILE) {                                                          \
                case 8: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 8); break;                          \
                case 7: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 7); break;                          \
                case 6: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 6); break;                          \
                case 5: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 5); break;                          \
                case 4: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 4); break;                          \
                case 3: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 3); break;                          \
                case 2: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 2); break;                          \
                default: dot_group(F, BITS, wg, nb, xt, k, dt, st, mt, bias, yt, ys, 1); break;                         \
            }                                                                                                       \
        }                                                                                                           \
    }
#define QX_FORMAT(F)                                                                                                \
    QX_DOT(F, 8)                                                                                                    \
    QX_DOT(F, 16)                                                                                                   \
    static void dec_##F(const uint8_t *wg, int64_t nb, float *panel, int64_t width) {                              \
        decode_group(F, wg, nb, panel, width);                                                                      \
    }
QX_FORMAT(X_Q8_0)
QX_FORMAT(X_Q4_0)
QX_FORMAT(X_Q4_1)
#undef QX_FORMAT
#undef QX_DOT

/* 1 when this build has the VNNI dot product (else the GCC-vector one). */
int64_t loraplex_qx16_has_vnni(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Most rows of x "auto" gives the integer plan for format id `format` (-1: any number). int16
 * activations without VNNI do one vpmaddwd and one add per 16 multiply-adds, an FMA does 8:
 * past a few dozen rows (compute-bound) the exact float panels of SmolLM2's projections are
 * faster (64 rows: 3.2 against 4.9 ms). The int8 formats stay integer: their contract is
 * llama.cpp's arithmetic (Q8_0's runs the int16 kernel on AVX2; its panels were slower on the
 * 49,152-row LM head, 24 against 18 ms at 48 rows, the panel decode costing ~0.3 ns a weight). */
int64_t loraplex_qx16_direct_max_m(int format) {
    return format < X_Q8_0 + 3 && !loraplex_qx16_has_vnni() ? QX16_DIRECT_MAX_M_NO_VNNI : -1;
}

/* y[m, n] = x[m, k] @ W^T + bias for W [n / 16 groups] in an interleaved format; n % 16 == 0.
 * plan: 0 = by m (AMX from loraplex_qx16_amx_min_m rows where the CPU has it), 1 = integer dot products (any m),
 * 2 = float panels (exact; kept for tests and comparison), 3 = AMX (quant_amx.c).
 * Returns 0, -1 for a bad format or shape, -2 when a buffer could not be allocated, -3 for plan 3
 * without AMX. */
int64_t loraplex_qx16_f32(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format, int plan) {
    dot_fn dot;
    dec_fn dec;
    /* many rows on a CPU with AMX: the tile unit (quant_amx.c: int8 x as here, float x as bf16 halves) */
    if (plan == 3 || (plan == 0 && m >= loraplex_qx16_amx_min_m(format) && loraplex_qx16_has_amx()))
        return loraplex_qx16_amx(x, x_stride, w, bias, y, y_stride, m, n, k, num_threads, format);
    /* format ids 10-12: int16 activations; 13-15: the same layouts with int8 activations */
    const int int8_x = format >= X_Q8_0 + 3;
    const int64_t direct_max_m = loraplex_qx16_direct_max_m(format);
    int bits = int8_x ? 8 : 16;
    /* int8-valued x in int16 pairs (the same integer sums): on AVX2 vpmaddubsw would need
     * llama.cpp's sign trick for Q8_0's signed weights, no fewer instructions than vpmaddwd */
    const float qmax = bits == 8 ? 127.0f : 32767.0f;
    if (QX_AVX2 && format == X_Q8_0 + 3) bits = 16;
    switch (int8_x ? format - 3 : format) {
        case X_Q8_0: dot = bits == 8 ? dot8_X_Q8_0 : dot16_X_Q8_0; dec = dec_X_Q8_0; format = X_Q8_0; break;
        case X_Q4_0: dot = bits == 8 ? dot8_X_Q4_0 : dot16_X_Q4_0; dec = dec_X_Q4_0; format = X_Q4_0; break;
        case X_Q4_1: dot = bits == 8 ? dot8_X_Q4_1 : dot16_X_Q4_1; dec = dec_X_Q4_1; format = X_Q4_1; break;
        default: return -1;
    }
    if (n % GROUP != 0 || k % 32 != 0) return -1;
    if (plan == 0 && direct_max_m >= 0 && m > direct_max_m) plan = 2; /* see loraplex_qx16_direct_max_m */
    const int64_t nb = k / 32, groups = n / GROUP, group_bytes = nb * x_block_bytes(format);
    if (plan != 2) {
        /* every row of x quantized first (int8 rows, or int16 pairs), then each group of weights
         * against all of them. A decode step's few rows are quantized by every thread for
         * itself: a barrier between the two loops costs more than quantizing k values twice. */
        const int private_x = m <= QX_PRIVATE_X_M;
        const int64_t copies = private_x ? num_threads : 1, xq_bytes = m * 2 * k + 64;
        int8_t *xq = malloc((size_t)(copies * xq_bytes));
        float *dx = malloc(sizeof(float) * (size_t)(copies * m * nb));
        int32_t *sx = malloc(sizeof(int32_t) * (size_t)(copies * m * nb));
        float *ms = malloc(sizeof(float) * (size_t)(copies * m * nb));
        const int failed = xq == NULL || dx == NULL || sx == NULL || ms == NULL;
        if (!failed) {
#pragma omp parallel num_threads(num_threads)
            {
                const int64_t c = private_x ? omp_get_thread_num() : 0;
                int8_t *xqc = xq + c * xq_bytes;
                float *dxc = dx + c * m * nb;
                int32_t *sxc = sx + c * m * nb;
                float *msc = ms + c * m * nb;
                if (private_x) {
                    for (int64_t t = 0; t < m; ++t) {
                        if (bits == 8)
                            loraplex_qx16_quantize_row_i8(x + t * x_stride, k, xqc + t * k, 32, dxc + t * nb, sxc + t * nb, msc + t * nb);
                        else
                            loraplex_qx16_quantize_row16(x + t * x_stride, k, (int32_t *)xqc + t * (k / 2), dxc + t * nb, sxc + t * nb, msc + t * nb,
                                           qmax);
                    }
                } else {
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < m; ++t) {
                        if (bits == 8)
                            loraplex_qx16_quantize_row_i8(x + t * x_stride, k, xq + t * k, 32, dx + t * nb, sx + t * nb, ms + t * nb);
                        else
                            loraplex_qx16_quantize_row16(x + t * x_stride, k, (int32_t *)xq + t * (k / 2), dx + t * nb, sx + t * nb, ms + t * nb,
                                           qmax);
                    }
                }
                /* many rows: the weights against QX_ROW_CHUNK rows of x at a time, so the rows a
                 * group meets stay in L2 (1,024 int8 rows of 576 do not). No barrier between
                 * chunks (nowait): the chunks write disjoint rows of y and read x, which is
                 * quantized by now; with one, a thread that fell behind (a busy host) made the
                 * other wait at every chunk, 15% of a quantized prefill's time on 2 cores. */
                const int64_t xrow = bits == 8 ? k : 2 * k;
                for (int64_t r0 = 0; r0 < m; r0 += QX_ROW_CHUNK) {
                    const int64_t rows = m - r0 < QX_ROW_CHUNK ? m - r0 : QX_ROW_CHUNK;
#pragma omp for schedule(static) nowait
                    for (int64_t g = 0; g < groups; ++g)
                        dot(w + g * group_bytes, nb, xqc + r0 * xrow, k, dxc + r0 * nb, sxc + r0 * nb, msc + r0 * nb,
                            bias != NULL ? bias + g * GROUP : NULL, y + r0 * y_stride + g * GROUP, y_stride, rows);
                }
            }
        }
        free(xq);
        free(dx);
        free(sx);
        free(ms);
        return failed ? -2 : 0;
    }
    const int64_t width = loraplex_linear_panel_width(), num_panels = (n + width - 1) / width;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *panel = aligned_alloc(64, (size_t)((k * width * 4 + 63) / 64 * 64));
        if (panel == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            if (panel == NULL) continue;
            const int64_t c0 = p * width, cols = n - c0 < width ? n - c0 : width;
            for (int64_t c = 0; c < cols; c += GROUP) dec(w + (c0 + c) / GROUP * group_bytes, nb, panel + c, width);
            if (cols < width) /* the last panel's columns past n read as zero */
                for (int64_t d = 0; d < k; ++d) memset(panel + d * width + cols, 0, sizeof(float) * (size_t)(width - cols));
            loraplex_linear_f32(x, x_stride, panel, bias != NULL ? bias + c0 : NULL, y + c0, y_stride, m, cols, k, 1);
        }
        free(panel);
    }
    return failed ? -2 : 0;
}
