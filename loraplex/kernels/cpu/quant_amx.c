/*
 * The interleaved formats' projections on AMX, the tile unit of Intel Xeons since Sapphire
 * Rapids, for steps of many rows of x (a prefill, a large batch). Two kernels:
 *
 * int8 x (ids 13-15, gguf_a8: llama.cpp's arithmetic, the same integers as quant_x16.c):
 *     C = A . B per 32-block with TDPBSSD; A = 16 rows of x quantized per block (int8), B = a
 *     block of 16 weight rows as signed bytes (8 tile rows x 64 bytes: row j = weights 4j ..
 *     4j+3 of each column, quant_x16_layout.h's chunk layout); each block has its own scales, so the
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
 * into A tiles once per call, in tile order (16 rows x 64 bytes contiguous a block). This file
 * holds the probe, the shared helpers and the launcher; the kernels are quant_amx_i8.h and
 * quant_amx_bf16.h (included once, below).
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

#include "quant_x16_layout.h"

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

#define QA_ROWS 16                                  /* rows of x per tile */
#define QA_X_CHUNK_BYTES (1 << 20) /* x's tiles per pass over the weights: they stay in L2 */
#define QA_MIN_M_I8 64  /* "auto": fewest rows on AMX, int8 x (below, the VNNI kernel is as fast) */
#define QA_MIN_M_BF16 32 /* float x: unpacking a group to bf16 costs about two tiles' products */
#define QA_SEG 6         /* float x: blocks of two groups unpacked at a time (2 x 6 x 2 KB: L1) */


/* Fewest rows of x "auto" runs on AMX for format id `format`. */
int64_t loraplex_qx16_amx_min_m(int format) { return format >= X_Q8_0 + 3 ? QA_MIN_M_I8 : QA_MIN_M_BF16; }

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
    const __m512i mask = _mm512_set1_epi32(0xF), bias = _mm512_set1_epi32(offset && fmt == X_Q4_0 ? 8 : 0);
    const __m512i w = nib == 2 ? _mm512_srli_epi32(v, 4) : v;
    for (int j = 0; j < 4; ++j) e[j] = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(w, 8 * j), mask), bias);
}

/* The two kernels (each included once: static functions of this file) */
#include "quant_amx_i8.h"
#include "quant_amx_bf16.h"

/* ---- the launcher ------------------------------------------------------------------------ */

/* y[m, n] = x[m, k] @ W^T + bias on AMX for W in an interleaved format: ids 13-15 (int8 x) with
 * llama.cpp's int8 arithmetic, ids 10-12 with bf16 halves. Returns 0, -1 for a bad format or
 * shape, -2 without memory, -3 without AMX. */
AMX_TARGET int64_t loraplex_qx16_amx(const float *x, int64_t x_stride, const uint8_t *w, const float *bias, float *y,
                                     int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads, int format) {
    if (!loraplex_qx16_has_amx()) return -3;
    const int bf16 = format < X_Q8_0 + 3;
    const int fmt = bf16 ? format : format - 3;
    if (fmt < X_Q8_0 || fmt > X_Q4_1 || n % 16 != 0 || k % 32 != 0 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t nb = k / 32, groups = n / 16, mp = (m + QA_ROWS - 1) / QA_ROWS * QA_ROWS;
    const int64_t group_bytes = nb * x_block_bytes(fmt), tb = bf16 ? 2048 : 512;
    /* x in tile order: per tile of 16 rows, per block, its A tile(s); padded rows are zeros
     * (with scale 0 for int8), so their products are 0 */
    uint8_t *xa = calloc((size_t)(mp / QA_ROWS * nb * tb), 1);
    float *dx = bf16 ? NULL : calloc((size_t)(mp * nb), sizeof(float));
    float *ms = bf16 ? NULL : calloc((size_t)(mp * nb), sizeof(float));
    int32_t *sx = bf16 ? NULL : malloc(sizeof(int32_t) * (size_t)(mp * nb));
    int failed = xa == NULL || (!bf16 && (dx == NULL || ms == NULL || sx == NULL));
    /* the weights against a chunk of rows at a time (as quant_x16.c), no barrier between chunks
     * (disjoint rows of y); a group is unpacked once per chunk, so the chunk is as large as L2
     * keeps (448 rows of k = 576, 160 of 1,536) */
    int64_t chunk = QA_X_CHUNK_BYTES / (k * (bf16 ? 4 : 1)) / (2 * QA_ROWS) * (2 * QA_ROWS);
    chunk = chunk < 4 * QA_ROWS ? 4 * QA_ROWS : chunk > 32 * QA_ROWS ? 32 * QA_ROWS : chunk;
    if (!failed) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) {
                uint8_t *row = xa + t / QA_ROWS * nb * tb + t % QA_ROWS * (bf16 ? 64 : 32);
                if (bf16)
                    split_row_bf16(x + t * x_stride, k, row, tb);
                else /* quant_x16_quantize.c's int8 quantization, into the tile layout */
                    loraplex_qx16_quantize_row_i8(x + t * x_stride, k, (int8_t *)row, tb, dx + t * nb, sx + t * nb,
                                                  ms + t * nb);
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
    free(sx);
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
