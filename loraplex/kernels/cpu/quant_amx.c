/*
 * The interleaved formats' projections on AMX, the tile unit of Intel Xeons since Sapphire
 * Rapids, for steps of many rows of x (a prefill, a large batch). Two kernels:
 *
 * int8 x (ids 13-15, gguf_a8: llama.cpp's arithmetic, the same integers as quant_x16.c):
 *     C = A . B per 32-block with TDPBSSD; A = 16 rows of x quantized per block (int8), B = a
 *     block of 16 weight rows as signed bytes (8 tile rows x 64 bytes: row j = weights 4j ..
 *     4j+3 of each column, quant_x16.c's chunk layout); each block has its own scales, so the
 *     int32 tile is stored after every block and scaled into 16 float accumulators:
 *     acc[t] += d * dx[t] * C[t] (+ m * dx[t] * sum(q[t]) for Q4_1).
 *
 * float x (ids 10-12, gguf): x and the de-quantized weights w = d * q (+ m) each split into two
 *     bf16 halves, v = hi + lo (hi = bf16(v), lo = bf16(v - hi), to nearest even: within 2^-17
 *     of v), and C += x_hi . w_hi + x_hi . w_lo + x_lo . w_hi with TDPBF16PS (fp32 sums); the
 *     dropped x_lo . w_lo is below 2^-18 of a product. The scales are inside w, so C accumulates every
 *     block in the tile and is stored once: no per-block epilogue. This is closer to float32
 *     than quant_x16.c's int16 blocks (which the "gguf" contract allows, and this meets: every
 *     value keeps 16 significant bits, not 16 bits of its block's largest), and is how the
 *     tests hold it: against x itself.
 *
 * A group's weights are unpacked into B tiles once per group (per row chunk), the rows of x
 * into A tiles once per call, in tile order (16 rows x 64 bytes contiguous a block).
 *
 * AMX needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM) and its state in the
 * XSAVE area (XCR0 bits 17-18); loraplex_qx16_has_amx checks the CPU, the OS and the
 * permission once. LORAPLEX_AMX=0 turns it off (A/B runs). Built only with AVX-512 (the
 * unpacking); GCC compiles the tile code through a target attribute, so -march need not name AMX.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__GNUC__) && __GNUC__ >= 11 &&  \
    defined(__linux__)
#define QA_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define QA_BUILD 0
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

enum { QA_Q8_0 = 10, QA_Q4_0 = 11, QA_Q4_1 = 12 }; /* quant_x16.c's format ids; + 3: int8 x */
#define QA_ROWS 16                                  /* rows of x per tile */
#define QA_X_CHUNK_BYTES (1 << 20) /* x's tiles per pass over the weights: they stay in L2 */
#define QA_MIN_M_I8 16  /* "auto": fewest rows on AMX, int8 x (a tile's rows) */
#define QA_MIN_M_BF16 32 /* float x: unpacking a group to bf16 costs about two tiles' products */
#define QA_SEG 6         /* float x: blocks of two groups unpacked at a time (2 x 6 x 2 KB: L1) */

int64_t loraplex_qx16_has_amx(void);
int64_t loraplex_qx16_amx_min_m(int format);
int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format);

/* Fewest rows of x "auto" runs on AMX for format id `format`. */
int64_t loraplex_qx16_amx_min_m(int format) { return format >= QA_Q8_0 + 3 ? QA_MIN_M_I8 : QA_MIN_M_BF16; }

#if QA_BUILD

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Tile registers (the intrinsics take them as constants). int8: C0 / C1 the sums of two
 * blocks, A0 x, B0 / B1 the weights. bf16: C0 / C1 two tiles of rows, A0-A3 their x halves,
 * B0 / B1 the weights' halves. */
#define T_C0 0
#define T_C1 1
#define T_A0 2
#define T_A1 3
#define T_A2 4
#define T_A3 5
#define T_B0 6
#define T_B1 7
/* GCC's tile intrinsics paste their tile argument into the instruction text unexpanded: these
 * expand the names above to digits first */
#define TLOAD(t, p, s) _tile_loadd(t, p, s)
#define TSTORE(t, p, s) _tile_stored(t, p, s)
#define TZERO(t) _tile_zero(t)
#define TDP_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TDP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state = -1; /* -1 not checked yet, 0 unavailable, 1 usable */

static int amx_probe(void) {
    const char *env = getenv("LORAPLEX_AMX");
    if (env != NULL && (strcmp(env, "0") == 0 || strcmp(env, "off") == 0 || strcmp(env, "false") == 0)) return 0;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1) || !((d >> 25) & 1)) return 0; /* AMX-BF16, -TILE, -INT8 */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;           /* AVX512-BF16 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0;                    /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0; /* the OS saves the tile state */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* 1 when the tile unit may be used here (checked once; the permission is per process). */
int64_t loraplex_qx16_has_amx(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) { /* racing first callers probe alike */
        state = amx_probe();
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state;
}

static inline int64_t block_bytes(const int fmt) { return fmt == QA_Q8_0 ? 544 : fmt == QA_Q4_0 ? 288 : 320; }
static inline int64_t head_bytes(const int fmt) { return fmt == QA_Q4_1 ? 64 : 32; }

/* ---- int8 x ---------------------------------------------------------------------------- */

/* One row of x per 32-block, quant_x16.c's int8 quantization: q = round(x / dx), dx = amax / 127;
 * ms = dx * sum(q) (Q4_1's min term). Block b's 32 bytes go to out + b * stride: the row's place
 * in its tiles. */
static void quantize_row_i8(const float *x, int64_t k, uint8_t *out, int64_t stride, float *dx, float *ms) {
    const __m512 flt_max = _mm512_set1_ps(3.4028235e38f);
    for (int64_t b = 0; b < k / 32; ++b) {
        const __m512 a0 = _mm512_loadu_ps(x + 32 * b), a1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __m512 b0 = _mm512_abs_ps(a0), b1 = _mm512_abs_ps(a1);
        /* false lanes for NaN and inf: the block's scale is NaN then, so its outputs are too */
        const int finite = _mm512_cmp_ps_mask(b0, flt_max, _CMP_LE_OQ) == 0xFFFF &&
                           _mm512_cmp_ps_mask(b1, flt_max, _CMP_LE_OQ) == 0xFFFF;
        const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(b0, b1)) : 0.0f;
        const float d = finite ? amax / 127.0f : NAN, id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        /* the current rounding mode: half to even, as nearbyintf and torch.round */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(out + b * stride), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(out + b * stride + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = d;
        ms[b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* The 4 weights of each lane (column) of a chunk as signed ints: Q8_0's q (stored + 128), a Q4
 * block's nibbles (nib 1: the low ones, weights 4c ..; 2: the high ones, 16 + 4c ..), minus 8
 * for Q4_0 when `offset` (the int8 tiles hold the integers; the bf16 ones fold it into m). */
static inline __attribute__((always_inline)) void lane_ints(const int fmt, const __m512i v, const int nib,
                                                            const int offset, __m512i e[4]) {
    if (nib == 0) {
        const __m512i s = _mm512_xor_si512(v, _mm512_set1_epi32((int)0x80808080));
        for (int j = 0; j < 4; ++j) e[j] = _mm512_srai_epi32(_mm512_slli_epi32(s, 24 - 8 * j), 24);
        return;
    }
    const __m512i mask = _mm512_set1_epi32(0xF), bias = _mm512_set1_epi32(offset && fmt == QA_Q4_0 ? 8 : 0);
    const __m512i w = nib == 2 ? _mm512_srli_epi32(v, 4) : v;
    for (int j = 0; j < 4; ++j) e[j] = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(w, 8 * j), mask), bias);
}

/* A group's blocks as int8 B tiles (8 rows x 64 bytes a block) into ub. */
static void unpack_group_i8(const int fmt, const uint8_t *wg, int64_t nb, uint8_t *ub) {
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *qs = wg + b * block_bytes(fmt) + head_bytes(fmt);
        uint8_t *out = ub + 512 * b;
        if (fmt == QA_Q8_0) { /* the chunks themselves, as signed bytes */
            for (int c = 0; c < 8; ++c)
                _mm512_store_si512(out + 64 * c, _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * c),
                                                                  _mm512_set1_epi8((char)0x80)));
            continue;
        }
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            for (int half = 0; half < 2; ++half) {
                __m512i e[4];
                lane_ints(fmt, v, 1 + half, 1, e);
                const __m512i packed = _mm512_or_si512(
                    _mm512_or_si512(_mm512_and_si512(e[0], byte), _mm512_slli_epi32(_mm512_and_si512(e[1], byte), 8)),
                    _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(e[2], byte), 16), _mm512_slli_epi32(e[3], 24)));
                _mm512_store_si512(out + 64 * (half == 0 ? c : 4 + c), packed);
            }
        }
    }
}

/* acc[t] += d * dx[t] * C[t] (+ m * ms[t] for Q4_1) for the 16 rows of a tile; the per-row
 * values at stride nb. */
static inline __attribute__((always_inline)) void scale_block_i8(const int fmt, const int32_t *cs,
                                                                 const uint8_t *blk, const float *dx, const float *ms,
                                                                 int64_t nb, __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 mv = fmt == QA_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : d;
    _Pragma("GCC unroll 16") for (int t = 0; t < QA_ROWS; ++t) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cs + 16 * t)),
                                 _mm512_mul_ps(d, _mm512_set1_ps(dx[t * nb])), acc[t]);
        if (fmt == QA_Q4_1) acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ms[t * nb]), acc[t]);
    }
}

/* One block's int8 products into C_p (the tile zeroed first); XA the block's x tile. */
#define TILE_BLOCK_I8(P, XA, BSRC)                                                                                 \
    do {                                                                                                           \
        TLOAD(T_B##P, (BSRC), 64);                                                                                 \
        TLOAD(T_A0, (XA), 32);                                                                                     \
        TZERO(T_C##P);                                                                                             \
        TDP_SS(T_C##P, T_A0, T_B##P);                                                                              \
    } while (0)

/* acc for 16 rows of x (xa: their tiles, block after block) against a group (ub: its B tiles):
 * two sets of tiles, each block scaled one block after its tile store (a vector load right
 * after a tile store waits for the store to reach the cache). */
static inline __attribute__((always_inline)) AMX_TARGET void tile_rows_i8(const int fmt, const uint8_t *wg,
                                                                          const uint8_t *ub, int64_t nb,
                                                                          const uint8_t *xa, const float *dx,
                                                                          const float *ms, int32_t *cbuf,
                                                                          __m512 *acc) {
    const int64_t bb = block_bytes(fmt);
    int32_t *c0 = cbuf, *c1 = cbuf + 256;
    TILE_BLOCK_I8(0, xa, ub);
    TSTORE(T_C0, c0, 64);
    int64_t b = 1;
    for (; b + 1 < nb; b += 2) {
        TILE_BLOCK_I8(1, xa + 512 * b, ub + 512 * b);
        TSTORE(T_C1, c1, 64);
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
        TILE_BLOCK_I8(0, xa + 512 * (b + 1), ub + 512 * (b + 1));
        TSTORE(T_C0, c0, 64);
        scale_block_i8(fmt, c1, wg + b * bb, dx + b, ms + b, nb, acc);
    }
    if (b < nb) { /* nb even: block nb - 1 is left */
        TILE_BLOCK_I8(1, xa + 512 * b, ub + 512 * b);
        TSTORE(T_C1, c1, 64);
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
        scale_block_i8(fmt, c1, wg + b * bb, dx + b, ms + b, nb, acc);
    } else {
        scale_block_i8(fmt, c0, wg + (b - 1) * bb, dx + b - 1, ms + b - 1, nb, acc);
    }
}

/* Every tile of rows [r0, r1) against group g, int8 x; y rows below m. */
static AMX_TARGET void group_rows_i8(const int fmt, const uint8_t *wg, const uint8_t *ub, int64_t nb,
                                     const uint8_t *xa, const float *dx, const float *ms, int32_t *cbuf,
                                     const float *bias, float *y, int64_t y_stride, int64_t r0, int64_t r1, int64_t m) {
    const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t t0 = r0; t0 < r1; t0 += QA_ROWS) {
        __m512 acc[QA_ROWS];
        for (int t = 0; t < QA_ROWS; ++t) acc[t] = _mm512_setzero_ps();
        const uint8_t *at = xa + t0 / QA_ROWS * nb * 512;
        const float *dt = dx + t0 * nb, *mt = ms + t0 * nb;
        /* constants per instantiation: GCC keeps the 16 accumulators in registers */
        switch (fmt) {
            case QA_Q8_0: tile_rows_i8(QA_Q8_0, wg, ub, nb, at, dt, mt, cbuf, acc); break;
            case QA_Q4_0: tile_rows_i8(QA_Q4_0, wg, ub, nb, at, dt, mt, cbuf, acc); break;
            default: tile_rows_i8(QA_Q4_1, wg, ub, nb, at, dt, mt, cbuf, acc); break;
        }
        for (int t = 0; t < QA_ROWS && t0 + t < m; ++t) _mm512_storeu_ps(y + (t0 + t) * y_stride, _mm512_add_ps(acc[t], bv));
    }
}

/* ---- float x, bf16 halves --------------------------------------------------------------- */

/* One row of x per 32-block as bf16 halves, hi = bf16(x) and lo = bf16(x - hi), to
 * out + b * stride and + 1024 (the row's place in its tiles). */
static AMX_TARGET void split_row_bf16(const float *x, int64_t k, uint8_t *out, int64_t stride) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const __m512 a0 = _mm512_loadu_ps(x + 32 * b), a1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(a1, a0); /* round to nearest even */
        const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        const __m512 h1 =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        const __m512i l = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(a1, h1), _mm512_sub_ps(a0, h0));
        _mm512_storeu_si512(out + b * stride, h);
        _mm512_storeu_si512(out + b * stride + 1024, l);
    }
}

/* Weights 2j (f0) and 2j + 1 (f1) of 16 columns as B tile rows of bf16 pairs (paired per
 * column): hi = v rounded to bf16, lo = v - hi rounded to bf16, so hi + lo is within 2^-17 of v.
 * Rounding is an integer add (to nearest, ties away: any nearby hi will do, lo keeps the rest)
 * and a pair is (v0 >> 16) | (v1 & top): no permutes, which held the unpacking up on port 5. */
static inline __attribute__((always_inline)) void bf16_pair_rows(const __m512 f0, const __m512 f1, uint8_t *hi,
                                                                 uint8_t *lo) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000), half = _mm512_set1_epi32(0x8000);
    const __m512i t0 = _mm512_add_epi32(_mm512_castps_si512(f0), half);
    const __m512i t1 = _mm512_add_epi32(_mm512_castps_si512(f1), half);
    /* 0xF8: a | (b & c) */
    _mm512_store_si512(hi, _mm512_ternarylogic_epi32(_mm512_srli_epi32(t0, 16), t1, top, 0xF8));
    const __m512i u0 = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_sub_ps(f0, _mm512_castsi512_ps(_mm512_and_si512(t0, top)))), half);
    const __m512i u1 = _mm512_add_epi32(
        _mm512_castps_si512(_mm512_sub_ps(f1, _mm512_castsi512_ps(_mm512_and_si512(t1, top)))), half);
    _mm512_store_si512(lo, _mm512_ternarylogic_epi32(_mm512_srli_epi32(u0, 16), u1, top, 0xF8));
}

/* A group's blocks as bf16 B tiles into ub, 2 KB a block: w = d * q (+ m) in float, then the
 * hi tile (16 rows x 64 bytes: row j = weights 2j, 2j + 1 of each column) and the lo tile. */
static inline __attribute__((always_inline)) void unpack_bf16(const int fmt, const uint8_t *wg, int64_t b0,
                                                              int64_t b1, uint8_t *ub) {
    const int chunks = fmt == QA_Q8_0 ? 8 : 4;
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t *blk = wg + b * block_bytes(fmt), *qs = blk + head_bytes(fmt);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = fmt == QA_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                         : fmt == QA_Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                                          : _mm512_setzero_ps();
        uint8_t *out = ub + 2048 * (b - b0);
        for (int c = 0; c < chunks; ++c) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * c);
            for (int half = 0; half < (fmt == QA_Q8_0 ? 1 : 2); ++half) {
                const int row4 = half == 0 ? c : 4 + c; /* weights 4 row4 .. 4 row4 + 3 */
                __m512i e[4];
                lane_ints(fmt, v, fmt == QA_Q8_0 ? 0 : 1 + half, 0, e);
                __m512 f[4];
                /* as the reference de-quantizes: d * q (Q8_0), d * q + m (Q4_1, Q4_0 with m = -8 d) */
                for (int j = 0; j < 4; ++j)
                    f[j] = fmt == QA_Q8_0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(e[j]), d)
                                          : _mm512_fmadd_ps(_mm512_cvtepi32_ps(e[j]), d, m);
                bf16_pair_rows(f[0], f[1], out + 128 * row4, out + 1024 + 128 * row4);
                bf16_pair_rows(f[2], f[3], out + 128 * row4 + 64, out + 1024 + 128 * row4 + 64);
            }
        }
    }
}

/* unpack_bf16 with the format a constant: blocks [b0, b1) of a group, block b at ub + 2 KB (b - b0). */
static void unpack_group_bf16(const int fmt, const uint8_t *wg, int64_t b0, int64_t b1, uint8_t *ub) {
    switch (fmt) {
        case QA_Q8_0: unpack_bf16(QA_Q8_0, wg, b0, b1, ub); break;
        case QA_Q4_0: unpack_bf16(QA_Q4_0, wg, b0, b1, ub); break;
        default: unpack_bf16(QA_Q4_1, wg, b0, b1, ub); break;
    }
}

/* Tiles of the bf16 kernel: the sums of two groups, x's halves, each group's weight halves. */
#define T_X_HI T_A0
#define T_X_LO T_A1
#define T_W0_HI T_A2
#define T_W0_LO T_A3
#define T_W1_HI T_B0
#define T_W1_LO T_B1

/* Blocks [b0, b1) of rows [r0, r1) against a pair of groups (ub0, ub1; `two` = 0: ub0 alone).
 * Each 16-row tile's sums start as the bias (b0 = 0) or as what the last segment stored, take
 * x_hi w_hi + x_hi w_lo + x_lo w_hi of each block, and are stored: into y (at c, row stride cs
 * bytes), or into `part` (rows of 32 floats) for a tile with rows past m. One load of x's tiles
 * serves both groups. */
static inline __attribute__((always_inline)) AMX_TARGET void pair_segment(
    const int two, const uint8_t *ub0, const uint8_t *ub1, int64_t nb, int64_t b0, int64_t b1, const uint8_t *xa,
    const float *bias_tiles, float *y, int64_t y_stride, float *part, int64_t r0, int64_t r1, int64_t m) {
    for (int64_t t0 = r0; t0 < r1; t0 += QA_ROWS) {
        const int full = t0 + QA_ROWS <= m;
        float *c = full ? y + t0 * y_stride : part;
        const int64_t cs = full ? 4 * y_stride : 128;
        if (b0 == 0) {
            TLOAD(T_C0, bias_tiles, 64);
            if (two) TLOAD(T_C1, bias_tiles + 256, 64);
        } else {
            TLOAD(T_C0, c, cs);
            if (two) TLOAD(T_C1, c + 16, cs);
        }
        const uint8_t *at = xa + t0 / QA_ROWS * nb * 2048;
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t *xb = at + 2048 * b, *w0 = ub0 + 2048 * (b - b0), *w1 = ub1 + 2048 * (b - b0);
            TLOAD(T_X_HI, xb, 64);
            TLOAD(T_W0_HI, w0, 64);
            TLOAD(T_W0_LO, w0 + 1024, 64);
            TDP_BF16(T_C0, T_X_HI, T_W0_HI);
            TDP_BF16(T_C0, T_X_HI, T_W0_LO);
            TLOAD(T_X_LO, xb + 1024, 64);
            TDP_BF16(T_C0, T_X_LO, T_W0_HI);
            if (two) {
                TLOAD(T_W1_HI, w1, 64);
                TLOAD(T_W1_LO, w1 + 1024, 64);
                TDP_BF16(T_C1, T_X_HI, T_W1_HI);
                TDP_BF16(T_C1, T_X_HI, T_W1_LO);
                TDP_BF16(T_C1, T_X_LO, T_W1_HI);
            }
        }
        TSTORE(T_C0, c, cs);
        if (two) TSTORE(T_C1, c + 16, cs);
    }
}

/* Rows [r0, r1) of y for groups g (and g + 1 when `two`), float x: the blocks a segment at a
 * time (QA_SEG blocks of both groups unpacked stay in L1 while x's tiles stream from L2), the
 * sums carried in y between segments. */
static AMX_TARGET void pair_rows_bf16(const int fmt, const int two, const uint8_t *wg0, const uint8_t *wg1,
                                      int64_t nb, const uint8_t *xa, uint8_t *ub, float *scratch,
                                      const float *bias, float *y, int64_t y_stride, int64_t r0, int64_t r1,
                                      int64_t m) {
    float *bias_tiles = scratch, *part = scratch + 512; /* [2][16 x 16], [16 x 32] */
    for (int g = 0; g < 2; ++g) {
        const __m512 bv = bias != NULL && (g == 0 || two) ? _mm512_loadu_ps(bias + 16 * g) : _mm512_setzero_ps();
        for (int t = 0; t < QA_ROWS; ++t) _mm512_store_ps(bias_tiles + 256 * g + 16 * t, bv);
    }
    uint8_t *ub0 = ub, *ub1 = ub + QA_SEG * 2048;
    for (int64_t b0 = 0; b0 < nb; b0 += QA_SEG) {
        const int64_t b1 = nb - b0 < QA_SEG ? nb : b0 + QA_SEG;
        unpack_group_bf16(fmt, wg0, b0, b1, ub0);
        if (two) {
            unpack_group_bf16(fmt, wg1, b0, b1, ub1);
            pair_segment(1, ub0, ub1, nb, b0, b1, xa, bias_tiles, y, y_stride, part, r0, r1, m);
        } else {
            pair_segment(0, ub0, ub1, nb, b0, b1, xa, bias_tiles, y, y_stride, part, r0, r1, m);
        }
    }
    if (r1 > m) /* the last tile had rows past m: its rows below m from `part` */
        for (int64_t t = r1 - QA_ROWS; t < m; ++t)
            memcpy(y + t * y_stride, part + 32 * (t - (r1 - QA_ROWS)), sizeof(float) * (two ? 32 : 16));
}

/* ---- the launcher ------------------------------------------------------------------------ */

/* y[m, n] = x[m, k] @ W^T + bias on AMX for W in an interleaved format: ids 13-15 (int8 x) with
 * llama.cpp's int8 arithmetic, ids 10-12 with bf16 halves. Returns 0, -1 for a bad format or
 * shape, -2 without memory, -3 without AMX. */
AMX_TARGET int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                                     int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format) {
    if (!loraplex_qx16_has_amx()) return -3;
    const int bf16 = format < QA_Q8_0 + 3;
    const int fmt = bf16 ? format : format - 3;
    if (fmt < QA_Q8_0 || fmt > QA_Q4_1 || n % 16 != 0 || k % 32 != 0 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t nb = k / 32, groups = n / 16, mp = (m + QA_ROWS - 1) / QA_ROWS * QA_ROWS;
    const int64_t group_bytes = nb * block_bytes(fmt), tb = bf16 ? 2048 : 512;
    /* x in tile order: per tile of 16 rows, per block, its A tile(s); padded rows are zeros
     * (with scale 0 for int8), so their products are 0 */
    uint8_t *xa = calloc((size_t)(mp / QA_ROWS * nb * tb), 1);
    float *dx = bf16 ? NULL : calloc((size_t)(mp * nb), sizeof(float));
    float *ms = bf16 ? NULL : calloc((size_t)(mp * nb), sizeof(float));
    int failed = xa == NULL || (!bf16 && (dx == NULL || ms == NULL));
    if (!failed) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) {
                uint8_t *row = xa + t / QA_ROWS * nb * tb + t % QA_ROWS * (bf16 ? 64 : 32);
                if (bf16)
                    split_row_bf16(x + t * x_stride, k, row, tb);
                else
                    quantize_row_i8(x + t * x_stride, k, row, tb, dx + t * nb, ms + t * nb);
            }
            /* per thread: the tile shapes, a tile buffer, a group's B tiles */
            tile_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette_id = 1;
            for (int t = T_C0; t <= T_B1; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            if (!bf16) { /* A: 16 rows x 32 int8 (a block); B: 8 rows x 64 */
                cfg.colsb[T_A0] = 32;
                cfg.rows[T_B0] = cfg.rows[T_B1] = 8;
            }
            float *cbuf = aligned_alloc(64, 1024 * sizeof(float));
            uint8_t *ub = aligned_alloc(64, (size_t)(bf16 ? 2 * QA_SEG * 2048 : nb * 512));
            const int ok = cbuf != NULL && ub != NULL;
            if (!ok) failed = 1;
            if (ok) _tile_loadconfig(&cfg);
            /* the weights against a chunk of rows at a time (as quant_x16.c), no barrier
             * between chunks (disjoint rows of y); a group is unpacked once per chunk, so the
             * chunk is as large as L2 keeps (448 rows of k = 576, 160 of 1,536) */
            int64_t chunk = QA_X_CHUNK_BYTES / (k * (bf16 ? 4 : 1)) / (2 * QA_ROWS) * (2 * QA_ROWS);
            chunk = chunk < 4 * QA_ROWS ? 4 * QA_ROWS : chunk > 32 * QA_ROWS ? 32 * QA_ROWS : chunk;
            for (int64_t r0 = 0; r0 < mp; r0 += chunk) {
                const int64_t r1 = mp - r0 < chunk ? mp : r0 + chunk;
                if (bf16) { /* groups in pairs: one load of x's tiles serves two */
#pragma omp for schedule(static) nowait
                    for (int64_t g = 0; g < groups; g += 2) {
                        if (!ok) continue;
                        const float *bg = bias != NULL ? bias + 16 * g : NULL;
                        pair_rows_bf16(fmt, g + 1 < groups, w + g * group_bytes, w + (g + 1) * group_bytes, nb, xa,
                                       ub, cbuf, bg, y + 16 * g, y_stride, r0, r1, m);
                    }
                    continue;
                }
#pragma omp for schedule(static) nowait
                for (int64_t g = 0; g < groups; ++g) {
                    if (!ok) continue;
                    const uint8_t *wg = w + g * group_bytes;
                    unpack_group_i8(fmt, wg, nb, ub);
                    group_rows_i8(fmt, wg, ub, nb, xa, dx, ms, (int32_t *)cbuf, bias != NULL ? bias + 16 * g : NULL,
                                  y + 16 * g, y_stride, r0, r1, m);
                }
            }
            if (ok) _tile_release();
            free(cbuf);
            free(ub);
        }
    }
    free(xa);
    free(dx);
    free(ms);
    return failed ? -2 : 0;
}

#else /* no AVX-512 build (or not x86-64 Linux): quant_x16.c's kernels run */

int64_t loraplex_qx16_has_amx(void) { return 0; }

int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                          int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k;
    (void)num_threads, (void)format;
    return -3;
}

#endif
