/* y = x @ W.T for a 4-bit weight W and bfloat16 activations x, on the CPU.
 *
 * torch's CPU int4 op unpacks the weight again for every 4 rows of x, so a decode step of
 * 8 or 32 requests pays for the unpacking 2 or 8 times. This kernel unpacks each weight tile
 * once into registers and multiplies it with up to 8 rows at a time, so a step of a few
 * requests costs about what the weight's bytes cost to read.
 *
 * Layout (built by localpaged/quant/cpu_w4.py):
 *   packed  uint8 [N/16][K/2][16]  byte j of pair p of tile t holds
 *                                  q[2p][16t+j] | q[2p+1][16t+j] << 4   (codes 0..15)
 *   sb      fp16  [N/16][G][2][16] per group and column: scale s, then offset b,
 *                                  W[n][k] = q[k][n] * s + b
 *           (float16, not bf16: the files' own scales are float16, so GGUF Q4_0/Q4_1 and
 *           AWQ/GPTQ weights are kept exactly; bf16 rounded the offset, the value at code 0,
 *           by up to 2^-9 of ~8 steps, and doubled the weights' error against the file.)
 *   x       bf16  [M][K],  y bf16 [M][N]
 *
 * With AVX512-BF16 the codes become bf16 numbers 128 + q by bit operations alone
 * (0x4300 | q), and VDPBF16PS multiplies two of them with two activations per lane, exactly,
 * summing in float32; the 128 is taken out per group with the group's sum of x.
 * Without it, plain C loops (vectorized by the compiler for the variant's instruction set)
 * compute the same sums in float32, unpacking each pair of codes once for all rows.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall(), for the AMX permission, under -std=c11 */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define W4_AVX512BF16 1
#endif

#define TILE 16
#define MAX_ROWS 8
/* Up to this many rows of bf16 x (a decode step of one or two chats), a 4-bit product on AMX
 * takes int8 activations and `vpdpbusd` (int8_dot.c), as float32 models do: AMX unpacks the
 * weight to bf16 first, which costs more than a row's products (measured on Sapphire Rapids,
 * 2048 x 2048: 54 vs 42 GMAC/s at 1 row; about even from 4 to 8 rows; AMX twice as fast from
 * 16). From 3 rows on AMX, where the AVX512-BF16 tile's boundary was: a step of 3 or more
 * rows gives each row the same numbers whatever their count (AMX computes rows apart), so a
 * chat's decode rows in a step beside others' prompt chunks equal a decode-only step's, as
 * before. Without AMX, int8 activations serve every M (VDPBF16PS: 58-98 GMAC/s, vpdpbusd
 * 60-125). */
#ifndef I8_BF16_MAX_ROWS
#define I8_BF16_MAX_ROWS 2
#endif
/* How far ahead of the unpacking the weight stream is fetched (the hardware prefetcher alone
 * leaves the unpacking waiting on memory when the weights are not in cache). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

/* Sum of each group of each row of float x: xs[m][g]. */
static void group_sums_f32(const float *x, int m_rows, int k, int gs, float *xs) {
    int groups = k / gs;
    for (int m = 0; m < m_rows; m++)
        for (int g = 0; g < groups; g++) {
            float s = 0.f;
            const float *xp = x + (size_t)m * k + (size_t)g * gs;
            for (int i = 0; i < gs; i++) s += xp[i];
            xs[(size_t)m * groups + g] = s;
        }
}

/* bf16 rows as float32 (the plain-C paths compute on float rows). */
static float *rows_to_f32(const uint16_t *x, size_t count) {
    float *out = malloc(sizeof(float) * (count ? count : 1));
    if (out != NULL)
        for (size_t i = 0; i < count; i++) out[i] = bf16_to_f32(x[i]);
    return out;
}

#ifdef W4_AVX512BF16

/* Sum of each group of each row of bf16 x, in float32: xs[m][g]. */
static void group_sums(const uint16_t *x, int m_rows, int k, int gs, float *xs) {
    int groups = k / gs;
    for (int m = 0; m < m_rows; m++)
        for (int g = 0; g < groups; g++) {
            float s = 0.f;
            const uint16_t *xp = x + (size_t)m * k + (size_t)g * gs;
            for (int i = 0; i < gs; i++) s += bf16_to_f32(xp[i]);
            xs[(size_t)m * groups + g] = s;
        }
}

static inline __m512 load_f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* One tile of 16 output columns for `rows` (1..MAX_ROWS) rows of x starting at x; inlined
 * once per row count, so the row loops unroll into registers. */
static inline __attribute__((always_inline)) void tile_rows_n(const uint8_t *wp, const uint16_t *sbp, const uint16_t *x,
                             const float *xs, uint16_t *y, int rows, int k, int n, int gs) {
    const int groups = k / gs, pairs = gs / 2;
    const __m512i low = _mm512_set1_epi32(0x0f), high = _mm512_set1_epi32(0xf0);
    const __m512i magic = _mm512_set1_epi32(0x43004300); /* bf16 128.0 in both halves */
    const uint32_t *xw = (const uint32_t *)x;             /* pairs of bf16 activations */
    __m512 acc[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        /* Two sums per row (even and odd pairs): with few rows, one chain of dependent
         * VDPBF16PS would wait on its own latency. */
        __m512 dot[MAX_ROWS], dot2[MAX_ROWS];
        for (int m = 0; m < MAX_ROWS; m++) dot[m] = dot2[m] = _mm512_setzero_ps();
        const uint8_t *gp = wp + (size_t)g * pairs * TILE;
        const int p0 = g * pairs;
        for (int p = 0; p < pairs; p++) {
            if (p % 4 == 0) _mm_prefetch((const char *)(gp + p * TILE) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gp + p * TILE)));
            __m512i w = _mm512_or_si512(
                _mm512_or_si512(_mm512_and_si512(v, low),
                                _mm512_slli_epi32(_mm512_and_si512(v, high), 12)),
                magic);
            __m512bh wb = (__m512bh)w;
#pragma GCC unroll 8
            for (int m = 0; m < MAX_ROWS; m++) {
                if (m >= rows) continue;
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xw[(size_t)m * (k / 2) + p0 + p]);
                if (rows <= 4 && p % 2)
                    dot2[m] = _mm512_dpbf16_ps(dot2[m], wb, xb);
                else
                    dot[m] = _mm512_dpbf16_ps(dot[m], wb, xb);
            }
        }
        if (rows <= 4)
            for (int m = 0; m < rows; m++) dot[m] = _mm512_add_ps(dot[m], dot2[m]);
        const __m512 s = load_f16x16(sbp + (size_t)g * 2 * TILE);
        const __m512 b = load_f16x16(sbp + (size_t)g * 2 * TILE + TILE);
#pragma GCC unroll 8
        for (int m = 0; m < MAX_ROWS; m++)
            if (m < rows) {
                const float sx = xs[(size_t)m * groups + g];
                __m512 t = _mm512_sub_ps(dot[m], _mm512_set1_ps(128.f * sx));
                acc[m] = _mm512_fmadd_ps(s, t, acc[m]);
                acc[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(sx), acc[m]);
            }
    }
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + (size_t)m * n), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

static void tile_rows_bf16(const uint8_t *wp, const uint16_t *sbp, const uint16_t *x,
                           const float *xs, uint16_t *y, int rows, int k, int n, int gs) {
    switch (rows) {
#define W4_CASE(r) case r: tile_rows_n(wp, sbp, x, xs, y, r, k, n, gs); break;
        W4_CASE(1) W4_CASE(2) W4_CASE(3) W4_CASE(4) W4_CASE(5) W4_CASE(6) W4_CASE(7) W4_CASE(8)
#undef W4_CASE
    }
}

#endif

/* GCC 12's vectorizer, left to choose, vectorized these row loops so that they read past the
 * rows of x (a segfault where x ended a thread's heap): only the `omp simd` loops over the 16
 * columns are vectorized. */
#ifdef __clang__ /* clang has no `optimize` attribute (and not GCC 12's vectorizer) */
#define PLAIN_ROWS __attribute__((noinline))
#else
#define PLAIN_ROWS __attribute__((noinline, optimize("no-tree-vectorize")))
#endif

/* Plain C, on float rows: for each pair of K, the two codes of the 16 columns become floats
 * once, then every row takes its two products; per group, the scale and offset are applied. */
static PLAIN_ROWS void tile_rows_f32(const uint8_t *wp, const uint16_t *sbp, const float *x, const float *xs,
                          float acc[MAX_ROWS][TILE], int rows, int k, int gs) {
    const int groups = k / gs, pairs = gs / 2;
    float dot[MAX_ROWS][TILE], lo[TILE], hi[TILE], s[TILE], b[TILE];
    memset(acc, 0, sizeof(float) * MAX_ROWS * TILE);
    for (int g = 0; g < groups; g++) {
        memset(dot, 0, sizeof dot);
        const uint8_t *gp = wp + (size_t)g * pairs * TILE;
        for (int p = 0; p < pairs; p++) {
#pragma omp simd
            for (int j = 0; j < TILE; j++) {
                lo[j] = (float)(gp[p * TILE + j] & 15);
                hi[j] = (float)(gp[p * TILE + j] >> 4);
            }
            for (int m = 0; m < rows; m++) {
                const float *xm = x + (size_t)m * k + (size_t)g * gs + 2 * p;
                const float x0 = xm[0], x1 = xm[1];
#pragma omp simd
                for (int j = 0; j < TILE; j++) dot[m][j] += lo[j] * x0 + hi[j] * x1;
            }
        }
        const uint16_t *sp = sbp + (size_t)g * 2 * TILE;
        for (int j = 0; j < TILE; j++) {
            s[j] = f16_to_f32(sp[j]);
            b[j] = f16_to_f32(sp[TILE + j]);
        }
        for (int m = 0; m < rows; m++) {
            const float sx = xs[(size_t)m * groups + g];
#pragma omp simd
            for (int j = 0; j < TILE; j++) acc[m][j] += s[j] * dot[m][j] + b[j] * sx;
        }
    }
}

/* y = x @ W.T on float rows x, y bf16 (`y_bf16`) or float32: the plain-C path. */
static int w4_gemm_rows_f32(const float *x, const uint8_t *packed, const uint16_t *sb, void *y,
                            int y_bf16, int m_rows, int k, int n, int gs, int threads) {
    const int groups = k / gs, tiles = n / TILE;
    float *xs = malloc(sizeof(float) * ((size_t)m_rows * groups + 1));
    if (xs == NULL) return -1;
    group_sums_f32(x, m_rows, k, gs, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *wp = packed + (size_t)t * (k / 2) * TILE;
        const uint16_t *sbp = sb + (size_t)t * groups * 2 * TILE;
        float acc[MAX_ROWS][TILE];
        for (int m0 = 0; m0 < m_rows; m0 += MAX_ROWS) {
            const int rows = m_rows - m0 < MAX_ROWS ? m_rows - m0 : MAX_ROWS;
            tile_rows_f32(wp, sbp, x + (size_t)m0 * k, xs + (size_t)m0 * groups, acc, rows, k, gs);
            for (int m = 0; m < rows; m++) {
                const size_t at = (size_t)(m0 + m) * n + (size_t)t * TILE;
                for (int j = 0; j < TILE; j++) {
                    if (y_bf16)
                        ((uint16_t *)y)[at + j] = f32_to_bf16(acc[m][j]);
                    else
                        ((float *)y)[at + j] = acc[m][j];
                }
            }
        }
    }
    free(xs);
    return 0;
}

#if defined(W4_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define W4_AMX 1
/* Below this many rows AMX gains nothing on the unpacking, and AVX512-BF16 reads the weight
 * with fewer steps (measured on SmolLM2's shapes). */
#define AMX_MIN_ROWS 3
#include "amx.h"
#include "omp_compat.h"

/* Tiles: 0 = C (16 rows x 16 float32), 1 = A (16 rows of x, 32 bf16),
 * 2 = B (16 pairs of K x 16 columns, bf16 pairs: the unpacked weight). */
static void amx_configure(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* word i of the result: bf16 i/2 of `lo` if i is even, of `hi` if odd (a B-tile row) */
static inline __m512i interleave_bf16(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* A 4-bit tile of 16 columns dequantized to B-tile rows (pairs of K per column, bf16, rounded
 * as a dense bf16 copy would be). */
static void unpack_w4(const uint8_t *wp, const uint16_t *sbp, uint32_t *bbuf, int k, int gs) {
    const int pairs = gs / 2;
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int g = 0; g < k / gs; g++) {
        const uint8_t *gp = wp + (size_t)g * pairs * TILE;
        const __m512 s = load_f16x16(sbp + (size_t)g * 2 * TILE);
        const __m512 b = load_f16x16(sbp + (size_t)g * 2 * TILE + TILE);
        for (int p = 0; p < pairs; p++) {
            if (p % 4 == 0) _mm_prefetch((const char *)(gp + p * TILE) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gp + p * TILE)));
            __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s, b);
            __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, b);
            _mm512_store_si512((__m512i *)(bbuf + ((size_t)g * pairs + p) * TILE),
                               interleave_bf16(lo, hi));
        }
    }
}

/* An 8-bit tile of 16 columns as B-tile rows: the codes themselves, exact in bf16 (the
 * per-column scale is applied to the result). */
static void unpack_w8(const int8_t *wp, uint32_t *bbuf, int k) {
    for (int p = 0; p < k / 2; p++) {
        const int8_t *pp = wp + (size_t)p * 2 * TILE;
        if (p % 2 == 0) _mm_prefetch((const char *)pp + PREFETCH_BYTES, _MM_HINT_T0);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pp)));
        __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pp + TILE))));
        _mm512_store_si512((__m512i *)(bbuf + (size_t)p * TILE), interleave_bf16(lo, hi));
    }
}

/* A quads-layout tile of 16 columns (int8_dot.c: 4-bit or 6-bit codes with `hp`, any form of
 * scales `zp`) dequantized to B-tile rows: each chunk's four values of K per column (one
 * int32 lane, `w4q_chunk512`) become code * s + o in float32, then two rows of bf16 pairs. */
static void unpack_w4q(const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp,
                       uint32_t *bbuf, int k, int gs) {
    const int chunks = gs / 4, six = hp != NULL, nl = zp == I8_NL;
    const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)I8_NL_VALUES));
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (int g = 0; g < k / gs; g++) {
        __m512 s, o;
        w4_group_scales512(sbp, zp, g, &s, &o);
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
        const uint8_t *hg = six ? hp + (size_t)g * chunks * I8_TILE : NULL;
        uint32_t *rows = bbuf + (size_t)g * chunks * 2 * TILE;
        for (int c = 0; c < chunks; c++) {
            if (c % 2 == 0) _mm_prefetch((const char *)(gp + c * 32) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i w = w4q_chunk512(gp, hg, c, six);
            if (nl) w = _mm512_shuffle_epi8(book, w); /* the code book's bytes */
            const __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(w, byte)), s, o);
            const __m512 v1 = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8), byte)), s, o);
            const __m512 v2 = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 16), byte)), s, o);
            const __m512 v3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 24)), s, o);
            _mm512_store_si512((__m512i *)(rows + (size_t)(2 * c) * TILE), interleave_bf16(v0, v1));
            _mm512_store_si512((__m512i *)(rows + (size_t)(2 * c + 1) * TILE), interleave_bf16(v2, v3));
        }
    }
}

/* y[:, 16 columns] = xpad (16-row blocks) @ the unpacked tile, times `col_scale` if given. */
static void amx_product(const uint32_t *bbuf, const uint16_t *xpad, uint16_t *y,
                        const float *col_scale, int m_rows, int k, int n) {
    _Alignas(64) float cbuf[16 * TILE];
    const __m512 scale = col_scale != NULL ? _mm512_loadu_ps(col_scale) : _mm512_set1_ps(1.f);
    for (int blk = 0; blk < (m_rows + 15) / 16; blk++) {
        _tile_zero(0);
        for (int step = 0; step < k / 32; step++) {
            _tile_loadd(1, xpad + (size_t)blk * 16 * k + step * 32, k * 2);
            _tile_loadd(2, bbuf + (size_t)step * 16 * TILE, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, cbuf, 64);
        const int rows = m_rows - blk * 16 < 16 ? m_rows - blk * 16 : 16;
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + (size_t)(blk * 16 + r) * n),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(cbuf + r * TILE), scale)));
    }
}

/* A weight in the quads layout (int8_dot.c), for gemm_amx: its top bits (6-bit codes, else
 * NULL), the form of its scales and their uint16 words per tile. */
struct quads_weight {
    const uint8_t *high;
    int zp;
    size_t sb_words;
};

/* Any weight kind on AMX: each thread unpacks its tiles one at a time and multiplies every
 * 16-row block of x with them. `sb` is the w4 scales/offsets (the quads layout's when `quads`),
 * `col_scale` the w8 scales. */
static int gemm_amx(const uint16_t *x, const void *packed, const uint16_t *sb,
                    const float *col_scale, uint16_t *y, int m_rows, int k, int n, int gs,
                    int threads, const struct quads_weight *quads) {
    const int tiles = n / TILE, m_pad = (m_rows + 15) / 16 * 16;
    const size_t bwords = (size_t)(k / 2) * TILE;
    uint16_t *xpad = m_pad == m_rows ? NULL : calloc((size_t)m_pad * k, sizeof(uint16_t));
    uint32_t *bbuf = aligned_alloc(64, sizeof(uint32_t) * bwords * threads);
    if ((m_pad != m_rows && xpad == NULL) || bbuf == NULL) {
        free(xpad);
        free(bbuf);
        return -1;
    }
    if (xpad != NULL) memcpy(xpad, x, sizeof(uint16_t) * (size_t)m_rows * k);
    const uint16_t *xa = xpad != NULL ? xpad : x;
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
        uint32_t *mine = bbuf + bwords * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            if (quads != NULL)
                unpack_w4q((const uint8_t *)packed + (size_t)t * (k / 2) * TILE,
                           quads->high != NULL ? quads->high + (size_t)t * (k / 4) * TILE : NULL,
                           sb + (size_t)t * quads->sb_words, quads->zp, mine, k, gs);
            else if (col_scale == NULL)
                unpack_w4((const uint8_t *)packed + (size_t)t * (k / 2) * TILE,
                          sb + (size_t)t * (k / gs) * 2 * TILE, mine, k, gs);
            else
                unpack_w8((const int8_t *)packed + (size_t)t * k * TILE, mine, k);
            amx_product(mine, xa, y + (size_t)t * TILE,
                        col_scale != NULL ? col_scale + (size_t)t * TILE : NULL, m_rows, k, n);
        }
        _tile_release();
    }
    free(xpad);
    free(bbuf);
    return 0;
}
#endif

/* Which instruction set this build uses: 2 = AMX, 1 = AVX512-BF16, 0 = generic C. */
int w4_gemm_isa(void) {
#ifdef W4_AMX
    if (amx_allowed()) return 2;
#endif
#ifdef W4_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

/* 1 where bf16 models keep the quads layout (w4q_gemm_bf16, w6_gemm_bf16), as float32 ones
 * do: the builds with AVX512-BF16. Their rows go through int8 activations, and on AMX the
 * products of many rows through AMX from the same layout. */
int w4_bf16_quads(void) {
#if defined(W4_AVX512BF16) && defined(I8_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* From this many rows of bf16 x a quads-layout product goes to AMX (unpacked to bf16 a tile
 * at a time, the unpacking shared by the 16-row blocks); below it, int8 activations and
 * `vpdpbusd` in the wide tile (8 rows a pass) cost less than the unpacking. Measured on
 * Sapphire Rapids, 2 cores, 4-bit groups of 32, 2048x2048 to 8192x2048, GMAC/s int8 / AMX:
 * 8 rows 300 / 150, 16 rows 330 / 260, 28 rows ~300 / ~320, 32 rows 340 / 410, 64 rows
 * 345 / 570. */
#ifndef AMX_QUADS_MIN_ROWS
#define AMX_QUADS_MIN_ROWS 28
#endif

/* The least row count that takes AMX in quads_gemm_bf16 (0: never, in this build or process),
 * for the tests. */
int w4_bf16_quads_amx_rows(void) {
#if defined(W4_AMX) && defined(I8_AVX512)
    return amx_allowed() ? AMX_QUADS_MIN_ROWS : 0;
#else
    return 0;
#endif
}

#if defined(W4_AVX512BF16) && defined(I8_AVX512)
/* y = x @ W.T for bf16 x and y and a quads-layout weight (int8_dot.c's forms). */
static int quads_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint8_t *high,
                           const uint16_t *sb, int zp, uint16_t *y, int m_rows, int k, int n,
                           int gs, int threads) {
#ifdef W4_AMX
    if (m_rows >= AMX_QUADS_MIN_ROWS && k % 32 == 0 && amx_allowed()) {
        const size_t per_tile = zp == I8_KQ ? (size_t)k / 256 : (size_t)(k / gs);
        const struct quads_weight q = {high, zp, per_tile * sb_stride(zp)};
        return gemm_amx(x, packed, sb, NULL, y, m_rows, k, n, gs, threads, &q);
    }
#endif
    return w4_gemm_i8(x, packed, high, sb, zp, y, 1, m_rows, k, n, gs, threads, 0, 1);
}
#endif

/* y[M][N] = x[M][K] @ W.T for the quads layout, bf16 x and y, where w4_bf16_quads();
 * returns -2 on other builds (the layout is not kept there for bf16). */
int w4q_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sb, uint16_t *y,
                  int m_rows, int k, int n, int gs, int threads) {
#if defined(W4_AVX512BF16) && defined(I8_AVX512)
    return quads_gemm_bf16(x, packed, NULL, sb, 0, y, m_rows, k, n, gs, threads);
#else
    (void)x, (void)packed, (void)sb, (void)y, (void)m_rows, (void)k, (void)n, (void)gs, (void)threads;
    return -2;
#endif
}

/* The 6-bit layout's product (int8_dot.c: w6_gemm_f32) for bf16 x and y: the rows read as they
 * are, the products rounded to bf16; on AMX from AMX_QUADS_MIN_ROWS rows through bf16 weights. */
int w6_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint8_t *high,
                 const uint16_t *sb, int zp, uint16_t *y, int m_rows, int k, int n, int gs,
                 int threads) {
    if (!w6_fits(high, zp, k, gs)) return -2;
#if defined(W4_AVX512BF16) && defined(I8_AVX512)
    return quads_gemm_bf16(x, packed, high, sb, zp, y, m_rows, k, n, gs, threads);
#else
    return w4_gemm_i8(x, packed, high, sb, zp, y, 1, m_rows, k, n, gs, threads, 0, 1);
#endif
}

/* y[M][N] = x[M][K] @ W.T. Needs N % 16 == 0, K % gs == 0, gs even.
 * Returns 0, or -1 when scratch memory cannot be had. */
int w4_gemm_bf16(const uint16_t *x, const uint8_t *packed, const uint16_t *sb, uint16_t *y,
                 int m_rows, int k, int n, int gs, int threads) {
#if defined(W4_AVX512BF16) && defined(I8_AVX512)
    /* int8 activations: every M without AMX (VDPBF16PS measured slower than `vpdpbusd` at
     * every M), up to I8_BF16_MAX_ROWS rows with it */
    if ((w4_gemm_isa() < 2 || m_rows <= I8_BF16_MAX_ROWS) && gs % 8 == 0)
        return w4_gemm_i8(x, packed, NULL, sb, 0, y, 1, m_rows, k, n, gs, threads, 0, 0);
#endif
#ifdef W4_AMX
    if (m_rows >= AMX_MIN_ROWS && k % 32 == 0 && amx_allowed())
        return gemm_amx(x, packed, sb, NULL, y, m_rows, k, n, gs, threads, NULL);
#endif
#ifdef W4_AVX512BF16
    const int groups = k / gs, tiles = n / TILE;
    float *xs = malloc(sizeof(float) * ((size_t)m_rows * groups + 1));
    if (xs == NULL) return -1;
    group_sums(x, m_rows, k, gs, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *wp = packed + (size_t)t * (k / 2) * TILE;
        const uint16_t *sbp = sb + (size_t)t * groups * 2 * TILE;
        for (int m0 = 0; m0 < m_rows; m0 += MAX_ROWS) {
            const int rows = m_rows - m0 < MAX_ROWS ? m_rows - m0 : MAX_ROWS;
            tile_rows_bf16(wp, sbp, x + (size_t)m0 * k, xs + (size_t)m0 * groups,
                           y + (size_t)m0 * n + (size_t)t * TILE, rows, k, n, gs);
        }
    }
    free(xs);
    return 0;
#else
    float *xf = rows_to_f32(x, (size_t)m_rows * k);
    if (xf == NULL) return -1;
    int rc = w4_gemm_rows_f32(xf, packed, sb, y, 1, m_rows, k, n, gs, threads);
    free(xf);
    return rc;
#endif
}

/* The same for float32 x and y (CPUs without native bf16 compute in float32): through int8
 * activations where the build has integer dot products (int8_dot.c), else in float32.
 * (LOCALPAGED_I8_PLAIN takes the int8 path in plain C on any build: scripts/check_arm.py's
 * x86 reference for the NEON build.) */
int w4_gemm_f32(const float *x, const uint8_t *packed, const uint16_t *sb, float *y,
                int m_rows, int k, int n, int gs, int threads) {
#if defined(I8_AVX2) || defined(I8_NEON) || defined(LOCALPAGED_I8_PLAIN)
    return w4_gemm_i8(x, packed, NULL, sb, 0, y, 0, m_rows, k, n, gs, threads, 0, 0);
#else
    return w4_gemm_rows_f32(x, packed, sb, y, 0, m_rows, k, n, gs, threads);
#endif
}

/* The float32 product without int8 activations, on every build (the reference). */
int w4_gemm_f32_exact(const float *x, const uint8_t *packed, const uint16_t *sb, float *y,
                      int m_rows, int k, int n, int gs, int threads) {
    return w4_gemm_rows_f32(x, packed, sb, y, 0, m_rows, k, n, gs, threads);
}

/* One tile of the int8 product for up to MAX_ROWS rows of float x: each pair of weight rows
 * made float once for all rows. */
#if !defined(__AVX512F__) /* (the AVX-512 builds: w8_tile_rows_avx512 below) */
static PLAIN_ROWS void w8_tile_rows_f32(const int8_t *wp, const float *x, const float *scale,
                                        void *y, int y_bf16, int rows, int k, int n) {
    float acc[MAX_ROWS][TILE], w0[TILE], w1[TILE];
    memset(acc, 0, sizeof acc);
    for (int p = 0; p < k / 2; p++) {
#pragma omp simd
        for (int j = 0; j < TILE; j++) {
            w0[j] = (float)wp[(size_t)p * 2 * TILE + j];
            w1[j] = (float)wp[(size_t)p * 2 * TILE + TILE + j];
        }
        for (int m = 0; m < rows; m++) {
            const float x0 = x[(size_t)m * k + 2 * p], x1 = x[(size_t)m * k + 2 * p + 1];
#pragma omp simd
            for (int j = 0; j < TILE; j++) acc[m][j] += w0[j] * x0 + w1[j] * x1;
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < TILE; j++) {
            const float v = acc[m][j] * scale[j];
            if (y_bf16)
                ((uint16_t *)y)[(size_t)m * n + j] = f32_to_bf16(v);
            else
                ((float *)y)[(size_t)m * n + j] = v;
        }
}

#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* w8_tile_rows_f32 with its rows' sums in registers, by fused multiply-adds (the plain loop
 * kept them in memory: Qwen2.5-1.5B's int8 head, 151936 x 1536, took 67 / 140 ms for 3 / 8
 * rows). */
static void w8_tile_rows_avx512(const int8_t *wp, const float *x, const float *scale, void *y,
                                int y_bf16, int rows, int k, int n) {
    __m512 acc[MAX_ROWS];
    const float *xr[MAX_ROWS];
    for (int m = 0; m < MAX_ROWS; m++) {
        acc[m] = _mm512_setzero_ps();
        xr[m] = x + (size_t)(m < rows ? m : 0) * k;
    }
    for (int p = 0; p < k / 2; p++) {
        const int8_t *w = wp + (size_t)p * 2 * TILE;
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + TILE))));
#pragma GCC unroll 8
        for (int m = 0; m < MAX_ROWS; m++)
            if (m < rows)
                acc[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[m][2 * p + 1]),
                                         _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[m][2 * p]), acc[m]));
    }
    const __m512 sv = _mm512_loadu_ps(scale);
    for (int m = 0; m < rows; m++) {
        float v[TILE];
        _mm512_storeu_ps(v, _mm512_mul_ps(acc[m], sv));
        for (int j = 0; j < TILE; j++)
            if (y_bf16)
                ((uint16_t *)y)[(size_t)m * n + j] = f32_to_bf16(v[j]);
            else
                ((float *)y)[(size_t)m * n + j] = v[j];
    }
}
#define W8_TILE_ROWS w8_tile_rows_avx512
#else
#define W8_TILE_ROWS w8_tile_rows_f32
#endif

/* y = (x @ codes.T) * scale on float rows, y bf16 (`y_bf16`) or float32. */
static void w8_gemm_rows_f32(const float *x, const int8_t *packed, const float *scale, void *y,
                             int y_bf16, int m_rows, int k, int n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < n / TILE; t++)
        for (int m0 = 0; m0 < m_rows; m0 += MAX_ROWS) {
            const int rows = m_rows - m0 < MAX_ROWS ? m_rows - m0 : MAX_ROWS;
            const size_t at = (size_t)m0 * n + (size_t)t * TILE;
            W8_TILE_ROWS(packed + (size_t)t * k * TILE, x + (size_t)m0 * k,
                             scale + (size_t)t * TILE,
                             y_bf16 ? (void *)((uint16_t *)y + at) : (void *)((float *)y + at),
                             y_bf16, rows, k, n);
        }
}

/* y[M][N] = (x[M][K] @ codes.T) * scale[N] for int8 codes in tiles: int8 [N/16][K/2][2][16]
 * (for pair p of tile t: 16 codes of row 2p, then 16 of row 2p + 1). Needs N % 16 == 0 and
 * K even. Returns 0, or -1 when scratch memory cannot be had. */
int w8_gemm_bf16(const uint16_t *x, const int8_t *packed, const float *scale, uint16_t *y,
                 int m_rows, int k, int n, int threads) {
#ifdef W4_AMX
    if (k % 32 == 0 && amx_allowed())
        return gemm_amx(x, packed, NULL, scale, y, m_rows, k, n, 0, threads, NULL);
#endif
    float *xf = rows_to_f32(x, (size_t)m_rows * k);
    if (xf == NULL) return -1;
    w8_gemm_rows_f32(xf, packed, scale, y, 1, m_rows, k, n, threads);
    free(xf);
    return 0;
}

/* The same for float32 x and y. */
int w8_gemm_f32(const float *x, const int8_t *packed, const float *scale, float *y,
                int m_rows, int k, int n, int threads) {
    w8_gemm_rows_f32(x, packed, scale, y, 0, m_rows, k, n, threads);
    return 0;
}
