/* Float32 activations times 4-bit or 8-bit weights through integer dot products, as the
 * fastest CPU engines do on CPUs without native bf16: each row of x is quantized to int8 per
 * block (scale dx = max|x| / 127), the block's dot products are exact integer sums, and the
 * scales are applied per block in float32.
 *
 * 4-bit (the layout of quant_gemm.c, blocks = the weight's groups):
 *   sum_k W[n][k] x[k] over a group ~ s[n] * dx * sum_k q[k][n] xq[k] + b[n] * dx * sum_k xq[k]
 *   (the weight times the rounded x: see quantize_rows_i8).
 * 4-bit in the quads layout (what float32 layers keep on builds with integer dot products):
 *   packed uint8 [N/16][K/4][32], chunk c of tile t holding rows 4c..4c+3 of its 16 columns:
 *   byte 4j + i has q[4c+i][16t+j] in its low nibble and q[4c+i][16t+8+j] in its high one;
 *   sb as for the pairs layout. One AND and one shift give two registers of 8 columns x 4
 *   values of K, each ready for `vpmaddubsw` with one broadcast of 4 activations, and
 *   `vpmaddwd` by ones sums a column's products once per 8 chunks: about half the
 *   instructions per MAC of the pairs layout at one row, 4/5 at four (measured on AVX2:
 *   1.9x and 1.25x the pairs kernel's speed).
 * 6-bit in the quads layout (GGUF Q6_K, Q5_0/1, Q5_K: codes 0..63 with a scale and offset
 * per group, sb as for 4 bits): the codes' low nibbles as the quads layout, and their top two
 * bits in `high` uint8 [N/16][K/8][32]: byte 4j + i of pair p (chunks 2p and 2p + 1) holds
 * the top bits of q[8p+i][16t+j] (bits 0-1), q[8p+i][16t+8+j] (2-3), q[8p+4+i][16t+j] (4-5)
 * and q[8p+4+i][16t+8+j] (6-7); two shifts and an AND put them above each chunk's nibbles.
 * Group sizes a multiple of 8. Symmetric groups (zero point zp > 0: Q4_0's 8, Q5_0's 16,
 * Q6_K's 32) keep only the scales, sb float16 [N/16][K/gs][16], the offset being -zp * scale
 * (exact in float32: zp is a power of two), for either code width. Super-block scales
 * (zp == I8_KQ, GGUF Q4_K's own form, groups of 32): per 256 values of K and column a float16
 * d and dmin and per group a 6-bit scale sc and min m, [N/16][K/256] records of 320 bytes
 * (d [16], dmin [16] float16, sc [8][16], m [8][16] uint8): scale d * sc, offset -(dmin * m),
 * both exact in float32 (11 by 6 bits). Their activations are quantized per super-block (as
 * llama.cpp's Q8_K), so that the AVX2 loops without VNNI widen each group's int16 sums by its
 * scales sc into one int32 sum per super-block and apply d, dmin and dx once per super-block
 * (the mins through the sums of the activations' codes per group). The products of two
 * codes of up to 63 with activations of up to 127 fill an int16 lane to 32004: `vpmaddubsw`
 * sums are widened every 2 chunks.
 * IQ4_NL's code book (zp == I8_NL, 4-bit codes, scales alone, sb as for symmetric groups):
 * code q stands for the unsigned byte I8_NL_VALUES[q] = kvalues_iq4nl[q] + 128 (1..241), the
 * weight being (I8_NL_VALUES[q] - 128) * scale, so the offset is -128 * scale (exact). The
 * vector loops look the bytes up with `vpshufb`; with VNNI they go to `vpdpbusd` as they are;
 * without it each byte is split into its nibbles (16 * hi + lo), whose `vpmaddubsw` sums are
 * those of 4-bit codes, the high ones' scaled by 16 as they are widened.
 * 8-bit blocks (GGUF Q8_0, and the other GGUF types whose codes fit in int8: Q5_0/1, Q6_K,
 * IQ4_NL ...): codes int8 [N/16][K/2][2][16] (as w8_gemm), per block of `bs` values of K a
 * float32 scale and optionally a float32 offset per column, [N/16][K/bs][16] each:
 *   W[n][k] = code * scale + offset.
 *
 * AVX2: `vpmaddubsw` multiplies the unsigned 4-bit codes with the signed int8 activations,
 * two products per 16-bit lane (at most 2 * 15 * 127, so eight lanes' worth add up without
 * saturating), widened to int32 once per 16 values of K; the 8-bit codes go through
 * `vpmaddwd` on 16-bit values. The plain-C versions of both compute the same integers; they
 * are the reference the tests hold the vector code to, and the path of other CPUs' builds
 * that call them.
 *
 * NEON (aarch64, every build: NEON is its baseline): `smlal` multiplies the codes (int8) with
 * the activations into 16-bit sums per column (4-bit: eight pairs of K, at most 8 * 2 * 15 *
 * 127; 8-bit: one pair, at most 2 * 128 * 127), widened to int32 as AVX2 does; the scales are
 * applied with the plain-C code's operations in its order, so that a build which does not fuse
 * multiply-adds (GCC) gives the plain-C results bit for bit. Where the compiler targets
 * Armv8.2's dot products (`__ARM_FEATURE_DOTPROD`: Apple's clang by default, or
 * -march=armv8.2-a+dotprod), `sdot` sums four values of K per column into int32 directly.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "work_split.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define I8_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define I8_AVX512 1 /* the quads tile 16 columns wide (one zmm per row) */
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I8_VNNI 1 /* `vpdpbusd`: four u8 x s8 products summed into each int32 lane */
#define I8_DPBUSD256(acc, u, s) i8_dpbusd256(acc, u, s)
#elif defined(__AVXVNNI__)
#define I8_VNNI 1
#define I8_DPBUSD256(acc, u, s) i8_dpbusd256_avx(acc, u, s)
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define I8_NEON 1
#endif

/* `vpdpbusd` summing into its accumulator in place. In a loop GCC 12 copies the accumulator of
 * the intrinsic into another register before each call and back after it (two moves a
 * product, seen in the tiles' assembly); the instruction written out keeps the register
 * (2-12% faster tiles, measured in one process alternating both builds). */
#if defined(__GNUC__) && !defined(__clang__)
#define I8_DPBUSD_ASM 1
#endif
#if defined(I8_VNNI) && defined(__AVX512VNNI__)
static inline __m256i i8_dpbusd256(__m256i acc, __m256i u, __m256i s) {
#ifdef I8_DPBUSD_ASM
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
#else
    return _mm256_dpbusd_epi32(acc, u, s);
#endif
}
#elif defined(I8_VNNI)
static inline __m256i i8_dpbusd256_avx(__m256i acc, __m256i u, __m256i s) {
#ifdef I8_DPBUSD_ASM
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    return acc;
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif
#if defined(I8_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline __m512i i8_dpbusd512(__m512i acc, __m512i u, __m512i s) {
#ifdef I8_DPBUSD_ASM
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, u, s);
#endif
}
#endif

/* Each thread's weight stream is fetched this far ahead of its unpacking, into L2. The
 * hardware prefetchers alone, or a short distance (1 KiB), leave the integer dot products
 * waiting on memory once a pass takes several rows of x: on a 2-core Zen 5 a 134M-weight
 * Q4_K matrix took 2.2 / 3.9 ms for 1 / 8 rows at 1 KiB and 1.8 / 2.9 ms at 16 KiB (the
 * 8-row pass then overlaps its arithmetic with the memory traffic). */
#ifndef I8_PREFETCH_BYTES
#define I8_PREFETCH_BYTES 16384
#endif
#define I8_PREFETCH_AHEAD(p, bytes) _mm_prefetch((const char *)(p) + (bytes), _MM_HINT_T1)
#define I8_PREFETCH(p) I8_PREFETCH_AHEAD(p, I8_PREFETCH_BYTES)
#define I8_TILE 16
#define I8_KQ (-1)          /* zp of super-block scales (see the top) */
#define I8_NL (-2)          /* zp of IQ4_NL's code book (see the top) */
/* The zero point of symmetric scales (IQ4_NL's: 128), as the offset -zp * scale takes it. */
#define I8_SYM_ZP(zp) ((zp) == I8_NL ? 128 : (zp))
static const uint8_t I8_NL_VALUES[16] = {1, 24, 45, 63, 79, 93, 106, 118,
                                         129, 141, 153, 166, 181, 197, 217, 241};
#define I8_KQ_RECORD 160    /* uint16 per super-block record of a tile (320 bytes) */
#define I8_ROWS 4 /* rows of x per pass over a weight tile */
#if defined(I8_AVX512) && defined(__AVX512VNNI__)
#define I8_WIDE_ROWS 8 /* the VNNI tiles' rows per pass, from 5 rows on */
#define I8_MAX_ROWS I8_WIDE_ROWS
#else
#define I8_MAX_ROWS I8_ROWS /* the most rows of x a pass over a tile takes in this build */
#endif

/* Row m of x [rows][k] quantized per block of `bs` (k % bs == 0): xq [rows][k], and per
 * block its scale dx [rows][k/bs] and the sum of its rounded values xsum (NULL: not wanted).
 * The offset term takes the rounded sum, not the exact one: then a block's product is the
 * weight times the rounded x, whose error is that of the centred weight, where the exact sum
 * leaves the rounding error on the codes' part alone (q * s, all of one sign: twice the error
 * in SmolLM2's log-probabilities, measured). */
static inline float x_value(const void *x, int x_bf16, size_t i) {
    return x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#ifdef I8_AVX512
/* 16 values of x from `i` as float32. */
static inline __m512 x_values16(const void *x, int x_bf16, size_t i) {
    if (x_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

/* One block of quantize_rows_i8 (bs % 16 == 0), 16 values at a time: the same float32
 * operations (the maximum, x * inv rounded half to even by the default rounding mode, as
 * lrintf), so the same bytes and scales. */
static inline void quantize_block16(const void *x, int x_bf16, size_t at, int bs, int8_t *qb,
                                    float *dx, float *xsum) {
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < bs; j += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x_values16(x, x_bf16, at + j)));
    const float a = _mm512_reduce_max_ps(amax);
    const float inv = a > 0.f ? 127.f / a : 0.f;
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < bs; j += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x_values16(x, x_bf16, at + j),
                                                           _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(qb + j), _mm512_cvtepi32_epi8(q));
        sum = _mm512_add_epi32(sum, q);
    }
    *dx = a / 127.f;
    if (xsum != NULL) *xsum = *dx * (float)_mm512_reduce_add_epi32(sum);
}
#elif defined(I8_AVX2)
/* 8 values of x from `i` as float32. */
static inline __m256 x_values8(const void *x, int x_bf16, size_t i) {
    if (x_bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* quantize_block16 with AVX2, 8 values at a time (bs % 16 == 0). */
static inline void quantize_block16(const void *x, int x_bf16, size_t at, int bs, int8_t *qb,
                                    float *dx, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < bs; j += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x_values8(x, x_bf16, at + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float inv = a > 0.f ? 127.f / a : 0.f;
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < bs; j += 16) {
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x_values8(x, x_bf16, at + j), _mm256_set1_ps(inv)));
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x_values8(x, x_bf16, at + j + 8), _mm256_set1_ps(inv)));
        /* |q| <= 127: the saturating packs are exact; they interleave the 128-bit halves */
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);
        const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128((__m128i *)(qb + j), b);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *dx = a / 127.f;
    if (xsum != NULL) *xsum = *dx * (float)_mm_cvtsi128_si32(s4);
}
#endif

static void quantize_rows_i8(const void *x, int x_bf16, int rows, int k, int bs, int8_t *xq,
                             float *dx, float *xsum, int threads) {
    const int blocks = k / bs;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= 65536)
    for (int i = 0; i < rows * blocks; i++) {
        const size_t at = (size_t)i * bs;
        int8_t *qb = xq + at;
#ifdef I8_AVX2
        if (bs % 16 == 0) {
            quantize_block16(x, x_bf16, at, bs, qb, dx + i, xsum != NULL ? xsum + i : NULL);
            continue;
        }
#endif
        float amax = 0.f; /* (not fmaxf, the same here: GCC 12's aarch64 vectorizer fails on
                           * that reduction beside the sum below, an internal compiler error) */
        for (int j = 0; j < bs; j++) {
            const float a = fabsf(x_value(x, x_bf16, at + j));
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < bs; j++) {
            qb[j] = (int8_t)lrintf(x_value(x, x_bf16, at + j) * inv); /* half to even */
            sum += qb[j];
        }
        dx[i] = amax / 127.f;
        if (xsum != NULL) xsum[i] = dx[i] * (float)sum;
    }
}

/* x quantized per super-block of 256 values of K (as llama.cpp's Q8_K for its K-quants), for
 * super-block scales (I8_KQ): per group of gs values its super-block's scale dx, the sum of
 * its codes (bsum) and dx times that (xs), the per-group form every loop reads. One scale per
 * super-block lets the AVX2 loops sum its groups in int32. Returns 0, or -1 without memory. */
static int quantize_rows_super(const void *x, int x_bf16, int rows, int k, int gs, int8_t *xq,
                               float *dx, float *xs, int16_t *bsum, int threads) {
    const int per = 256 / gs, groups = k / gs;
    float *d256 = malloc(sizeof(float) * ((size_t)rows * (k / 256) + 1));
    if (d256 == NULL) return -1;
    quantize_rows_i8(x, x_bf16, rows, k, 256, xq, d256, NULL, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= 65536)
    for (int i = 0; i < rows * groups; i++) {
        int32_t sum = 0;
        for (int j = 0; j < gs; j++) sum += xq[(size_t)i * gs + j];
        dx[i] = d256[i / per];
        bsum[i] = (int16_t)sum; /* |sum| <= 127 * gs */
        xs[i] = dx[i] * (float)sum;
    }
    free(d256);
    return 0;
}

/* The 4-bit product of one tile (16 columns) for `rows` rows, plain C: acc [rows][16]. */
static void w4_i8_tile_plain(const uint8_t *wp, const uint16_t *sbp, const int8_t *xq,
                             const float *dx, const float *xs, float *acc, int rows, int k,
                             int gs) {
    const int groups = k / gs, pairs = gs / 2;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < I8_TILE; j++) acc[m * I8_TILE + j] = 0.f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * pairs * I8_TILE;
        const uint16_t *sp = sbp + (size_t)g * 2 * I8_TILE;
        for (int m = 0; m < rows; m++) {
            const int8_t *xm = xq + (size_t)m * k + (size_t)g * gs;
            const float d = dx[(size_t)m * groups + g], sx = xs[(size_t)m * groups + g];
            for (int j = 0; j < I8_TILE; j++) {
                int32_t dot = 0;
                for (int p = 0; p < pairs; p++) {
                    const uint8_t v = gp[p * I8_TILE + j];
                    dot += (v & 15) * xm[2 * p] + (v >> 4) * xm[2 * p + 1];
                }
                acc[m * I8_TILE + j] += f16_to_f32(sp[j]) * (d * (float)dot) +
                                        f16_to_f32(sp[I8_TILE + j]) * sx;
            }
        }
    }
}

/* The uint16 entries of a tile's sb per group (zp > 0: scales; 0: scales and offsets), or
 * per super-block (I8_KQ). */
static inline size_t sb_stride(int zp) {
    return zp == I8_KQ ? I8_KQ_RECORD : (size_t)(zp ? 1 : 2) * I8_TILE;
}

#ifdef I8_AVX2
/* The scales of group g + ahead of a tile's `sbp` fetched (at most 64 bytes a group: one
 * line), `ahead` groups being I8_PREFETCH_BYTES of the group's 4-bit codes. */
static inline void i8_prefetch_scales(const uint16_t *sbp, int zp, int g, int gs) {
    const size_t ahead = (size_t)g + I8_PREFETCH_BYTES / (8 * gs);
    const size_t bytes = zp == I8_KQ ? ahead * I8_KQ_RECORD * 2 / 8 : ahead * sb_stride(zp) * 2;
    I8_PREFETCH_AHEAD((const char *)sbp + bytes, 0);
}
#endif

/* The scale and offset of column j of group g of a tile's `sbp` (the forms at the top). */
static inline void group_scale(const uint16_t *sbp, int zp, int g, int j, float *s, float *o) {
    if (zp == I8_KQ) {
        const uint16_t *rec = sbp + (size_t)(g / 8) * I8_KQ_RECORD;
        const uint8_t *codes = (const uint8_t *)(rec + 2 * I8_TILE) + (g % 8) * I8_TILE;
        *s = f16_to_f32(rec[j]) * (float)codes[j];
        *o = -(f16_to_f32(rec[I8_TILE + j]) * (float)codes[8 * I8_TILE + j]);
        return;
    }
    const uint16_t *sp = sbp + (size_t)g * sb_stride(zp);
    *s = f16_to_f32(sp[j]);
    *o = zp ? -(float)I8_SYM_ZP(zp) * *s : f16_to_f32(sp[I8_TILE + j]);
}

/* The top two bits of code (4c + i, column j) of a tile's 6-bit `high` plane, shifted to
 * bits 4-5 (0 without one). */
static inline int w6_top(const uint8_t *hp, int c, int i, int j) {
    if (hp == NULL) return 0;
    const int bits = hp[(size_t)(c / 2) * 2 * I8_TILE + 4 * (j % 8) + i];
    return ((bits >> (2 * (j / 8) + 4 * (c % 2))) & 3) << 4;
}

/* w4_i8_tile_plain for the quads layout (with the 6-bit layout's top bits `hp`, or NULL, and
 * the scale forms of `zp`): the same integers, the same float32 sums. */
static void w4q_i8_tile_plain(const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp,
                              int zp, const int8_t *xq, const float *dx, const float *xs,
                              float *acc, int rows, int k, int gs) {
    const int groups = k / gs, chunks = gs / 4;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < I8_TILE; j++) acc[m * I8_TILE + j] = 0.f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
        const uint8_t *hg = hp != NULL ? hp + (size_t)g * chunks * I8_TILE : NULL;
        for (int m = 0; m < rows; m++) {
            const int8_t *xm = xq + (size_t)m * k + (size_t)g * gs;
            const float d = dx[(size_t)m * groups + g], sx = xs[(size_t)m * groups + g];
            for (int j = 0; j < I8_TILE; j++) {
                int32_t dot = 0;
                for (int c = 0; c < chunks; c++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = gp[c * 2 * I8_TILE + 4 * (j % 8) + i];
                        const int top = w6_top(hg, c, i, j), q = j < 8 ? v & 15 : v >> 4;
                        dot += (zp == I8_NL ? I8_NL_VALUES[q] : q | top) * xm[4 * c + i];
                    }
                float sc, o;
                group_scale(sbp, zp, g, j, &sc, &o);
                acc[m * I8_TILE + j] += sc * (d * (float)dot) + o * sx;
            }
        }
    }
}

/* The 8-bit block product of one tile for `rows` rows, plain C: acc [rows][16]. Per block
 * b and column j: scale sp[b][j] times the int8 dot product, plus offset op[b][j] (if any)
 * times the block's sum of rounded x. */
static void q8_i8_tile_plain(const int8_t *wp, const float *sp, const float *op,
                             const int8_t *xq, const float *dx, const float *xs, float *acc,
                             int rows, int k, int bs) {
    const int blocks = k / bs;
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < I8_TILE; j++) {
            float a = 0.f;
            for (int b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int i = 0; i < bs; i++) {
                    const int kk = b * bs + i;
                    dot += wp[(size_t)(kk / 2) * 2 * I8_TILE + (kk % 2) * I8_TILE + j] *
                           xq[(size_t)m * k + kk];
                }
                const size_t at = (size_t)b * I8_TILE + j;
                a += sp[at] * (dx[(size_t)m * blocks + b] * (float)dot);
                if (op != NULL) a += op[at] * xs[(size_t)m * blocks + b];
            }
            acc[m * I8_TILE + j] = a;
        }
}

#ifdef I8_AVX2

static inline __m256 load_f16x8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* w4_i8_tile_plain with AVX2, `rows` (1..I8_ROWS) a constant after inlining. */
static inline __attribute__((always_inline)) void w4_i8_tile_n(
    const uint8_t *wp, const uint16_t *sbp, const int8_t *xq, const float *dx, const float *xs,
    float *acc, int rows, int k, int gs) {
    const int groups = k / gs, pairs = gs / 2;
    const __m256i low = _mm256_set1_epi16(0x000f), high = _mm256_set1_epi16(0x00f0);
    const int16_t *xw = (const int16_t *)xq; /* pairs of int8 activations */
    __m256 out[I8_ROWS][2];
    for (int m = 0; m < I8_ROWS; m++) out[m][0] = out[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * pairs * I8_TILE;
        __m256i dot[I8_ROWS][2];
        for (int m = 0; m < I8_ROWS; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
        for (int p0 = 0; p0 < pairs; p0 += 8) {
            __m256i d16[I8_ROWS];
            for (int m = 0; m < I8_ROWS; m++) d16[m] = _mm256_setzero_si256();
            const int end = p0 + 8 < pairs ? p0 + 8 : pairs;
            for (int p = p0; p < end; p++) {
                if (p % 4 == 0) I8_PREFETCH(gp + p * I8_TILE);
                /* 16-bit lane j: code of row 2p of column j, then of row 2p + 1 */
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(gp + p * I8_TILE)));
                const __m256i w = _mm256_or_si256(_mm256_and_si256(v, low),
                                                  _mm256_slli_epi16(_mm256_and_si256(v, high), 4));
#pragma GCC unroll 4
                for (int m = 0; m < I8_ROWS; m++) {
                    if (m >= rows) continue;
                    const __m256i xb = _mm256_set1_epi16(xw[((size_t)m * k + (size_t)g * gs) / 2 + p]);
                    d16[m] = _mm256_add_epi16(d16[m], _mm256_maddubs_epi16(w, xb));
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(d16[m])));
                dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(d16[m], 1)));
            }
        }
        const uint16_t *sp = sbp + (size_t)g * 2 * I8_TILE;
        const __m256 s0 = load_f16x8(sp), s1 = load_f16x8(sp + 8);
        const __m256 b0 = load_f16x8(sp + I8_TILE), b1 = load_f16x8(sp + I8_TILE + 8);
#pragma GCC unroll 4
        for (int m = 0; m < I8_ROWS; m++) {
            if (m >= rows) continue;
            const __m256 d = _mm256_set1_ps(dx[(size_t)m * groups + g]);
            const __m256 sx = _mm256_set1_ps(xs[(size_t)m * groups + g]);
            out[m][0] = _mm256_fmadd_ps(s0, _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[m][0])), out[m][0]);
            out[m][1] = _mm256_fmadd_ps(s1, _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[m][1])), out[m][1]);
            out[m][0] = _mm256_fmadd_ps(b0, sx, out[m][0]);
            out[m][1] = _mm256_fmadd_ps(b1, sx, out[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        _mm256_storeu_ps(acc + m * I8_TILE, out[m][0]);
        _mm256_storeu_ps(acc + m * I8_TILE + 8, out[m][1]);
    }
}

#ifndef I8_VNNI
/* Four rows' int16 sums (sRH: row R, column half H) widened to int32, each column's pair
 * of lanes times its int16 multiplier in w0 (columns 0-7) or w1 (8-15): ones, or a group's
 * scales (i8_pairs_half), and added into dot. */
static inline __attribute__((always_inline)) void i8_widen_into(
    __m256i dot[][2], __m256i s00, __m256i s01, __m256i s10, __m256i s11, __m256i s20,
    __m256i s21, __m256i s30, __m256i s31, __m256i w0, __m256i w1) {
    dot[0][0] = _mm256_add_epi32(dot[0][0], _mm256_madd_epi16(s00, w0));
    dot[0][1] = _mm256_add_epi32(dot[0][1], _mm256_madd_epi16(s01, w1));
    dot[1][0] = _mm256_add_epi32(dot[1][0], _mm256_madd_epi16(s10, w0));
    dot[1][1] = _mm256_add_epi32(dot[1][1], _mm256_madd_epi16(s11, w1));
    dot[2][0] = _mm256_add_epi32(dot[2][0], _mm256_madd_epi16(s20, w0));
    dot[2][1] = _mm256_add_epi32(dot[2][1], _mm256_madd_epi16(s21, w1));
    dot[3][0] = _mm256_add_epi32(dot[3][0], _mm256_madd_epi16(s30, w0));
    dot[3][1] = _mm256_add_epi32(dot[3][1], _mm256_madd_epi16(s31, w1));
}

/* The 8-bit values of groups g and g + 1 (16 bytes each, one a column) of column half h as
 * int16 pairs, lane 2j = column 8h + j of g, lane 2j + 1 of g + 1 (for `vpmaddwd`). */
static inline __attribute__((always_inline)) __m256i i8_pairs_half(const uint8_t *g0,
                                                                   const uint8_t *g1, int h) {
    const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g0));
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g1));
    const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
    return h ? _mm256_permute2x128_si256(lo, hi, 0x31) : _mm256_permute2x128_si256(lo, hi, 0x20);
}

static inline __attribute__((always_inline)) void w4q_chunks4(const uint8_t *gp, const int8_t *x,
                                                              int k, int c0, int end,
                                                              __m256i dot[][2], __m256i w0,
                                                              __m256i w1) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int8_t *x1 = x + k, *x2 = x + 2 * (size_t)k, *x3 = x + 3 * (size_t)k;
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00,
            s30 = s00, s31 = s00;
    for (int c = c0; c < end; c++) {
        if (c % 2 == 0) I8_PREFETCH(gp + c * 32);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gp + c * 32));
        const __m256i a = _mm256_and_si256(v, low), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        __m256i xb, t;
#define I8_ROW4(xp, s0, s1)                                                                   \
        "vpbroadcastd " xp ", %[xb]\n\t"                                                      \
        "vpmaddubsw %[xb], %[a], %[t]\n\t"                                                    \
        "vpaddw %[t], " s0 ", " s0 "\n\t"                                                     \
        "vpmaddubsw %[xb], %[b], %[t]\n\t"                                                    \
        "vpaddw %[t], " s1 ", " s1 "\n\t"
        __asm__(I8_ROW4("%[x0]", "%[s00]", "%[s01]") I8_ROW4("%[x1]", "%[s10]", "%[s11]")
                I8_ROW4("%[x2]", "%[s20]", "%[s21]") I8_ROW4("%[x3]", "%[s30]", "%[s31]")
                : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
                  [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
                  [xb] "=&x"(xb), [t] "=&x"(t)
                : [a] "x"(a), [b] "x"(b), [x0] "m"(*(const int32_t *)(x + 4 * c)),
                  [x1] "m"(*(const int32_t *)(x1 + 4 * c)), [x2] "m"(*(const int32_t *)(x2 + 4 * c)),
                  [x3] "m"(*(const int32_t *)(x3 + 4 * c)));
#undef I8_ROW4
    }
    i8_widen_into(dot, s00, s01, s10, s11, s20, s21, s30, s31, w0, w1);
}
#endif

#ifndef I8_VNNI
/* The codes of chunks c and c + 1 (c even) of a 6-bit group (`gp`, its top bits `hg`): codes
 * 0 and 1 chunk c's low and high column halves, 2 and 3 chunk c + 1's. */
static inline __attribute__((always_inline)) void w6q_unpack_pair(const uint8_t *gp,
                                                                  const uint8_t *hg, int c,
                                                                  __m256i codes[4]) {
    const __m256i low = _mm256_set1_epi8(0x0f), tops = _mm256_set1_epi8(0x30);
    I8_PREFETCH(gp + c * 32);
    if (c % 4 == 0) I8_PREFETCH_AHEAD(hg + (c / 2) * 32, I8_PREFETCH_BYTES / 2);
    const __m256i ve = _mm256_loadu_si256((const __m256i *)(gp + c * 32));
    const __m256i vo = _mm256_loadu_si256((const __m256i *)(gp + c * 32 + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(hg + (c / 2) * 32));
    codes[0] = _mm256_or_si256(_mm256_and_si256(ve, low),
                               _mm256_and_si256(_mm256_slli_epi16(h, 4), tops));
    codes[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ve, 4), low),
                               _mm256_and_si256(_mm256_slli_epi16(h, 2), tops));
    codes[2] = _mm256_or_si256(_mm256_and_si256(vo, low), _mm256_and_si256(h, tops));
    codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(vo, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(h, 2), tops));
}

/* Chunks c and c + 1 (c even) of a 6-bit group (`gp`, its top bits `hg`) against four rows of
 * x, their sums widened into dot: as w4q_chunks4, a pair at a time (the int16 sums of 6-bit
 * codes hold two chunks, see the top). Through the generic loop GCC kept 16 sums in 16
 * registers and spilled them every chunk. */
static inline __attribute__((always_inline)) void w6q_pair4(const uint8_t *gp, const uint8_t *hg,
                                                            const int8_t *x, int k, int c,
                                                            __m256i dot[][2], __m256i w0,
                                                            __m256i w1) {
    __m256i codes[4];
    w6q_unpack_pair(gp, hg, c, codes);
    const __m256i ae = codes[0], be = codes[1], ao = codes[2], bo = codes[3];
    const int8_t *x1 = x + k, *x2 = x + 2 * (size_t)k, *x3 = x + 3 * (size_t)k;
    __m256i s00, s01, s10, s11, s20, s21, s30, s31, xb, t;
#define I8_ROW6(xe, xo, s0, s1)                                                               \
    "vpbroadcastd " xe ", %[xb]\n\t"                                                          \
    "vpmaddubsw %[xb], %[ae], " s0 "\n\t"                                                     \
    "vpmaddubsw %[xb], %[be], " s1 "\n\t"                                                     \
    "vpbroadcastd " xo ", %[xb]\n\t"                                                          \
    "vpmaddubsw %[xb], %[ao], %[t]\n\t"                                                       \
    "vpaddw %[t], " s0 ", " s0 "\n\t"                                                         \
    "vpmaddubsw %[xb], %[bo], %[t]\n\t"                                                       \
    "vpaddw %[t], " s1 ", " s1 "\n\t"
    __asm__(I8_ROW6("%[x0]", "%[y0]", "%[s00]", "%[s01]") I8_ROW6("%[x1]", "%[y1]", "%[s10]", "%[s11]")
            I8_ROW6("%[x2]", "%[y2]", "%[s20]", "%[s21]") I8_ROW6("%[x3]", "%[y3]", "%[s30]", "%[s31]")
            : [s00] "=&x"(s00), [s01] "=&x"(s01), [s10] "=&x"(s10), [s11] "=&x"(s11),
              [s20] "=&x"(s20), [s21] "=&x"(s21), [s30] "=&x"(s30), [s31] "=&x"(s31),
              [xb] "=&x"(xb), [t] "=&x"(t)
            : [ae] "x"(ae), [be] "x"(be), [ao] "x"(ao), [bo] "x"(bo),
              [x0] "m"(*(const int32_t *)(x + 4 * c)), [y0] "m"(*(const int32_t *)(x + 4 * c + 4)),
              [x1] "m"(*(const int32_t *)(x1 + 4 * c)), [y1] "m"(*(const int32_t *)(x1 + 4 * c + 4)),
              [x2] "m"(*(const int32_t *)(x2 + 4 * c)), [y2] "m"(*(const int32_t *)(x2 + 4 * c + 4)),
              [x3] "m"(*(const int32_t *)(x3 + 4 * c)), [y3] "m"(*(const int32_t *)(x3 + 4 * c + 4)));
#undef I8_ROW6
    i8_widen_into(dot, s00, s01, s10, s11, s20, s21, s30, s31, w0, w1);
}

/* w4q_chunks4 for 1-3 rows (`rows` a constant after inlining), in intrinsics, two chunks a
 * step (and a last one alone). */
static inline __attribute__((always_inline)) void w4q_chunks_n(const uint8_t *gp, const int8_t *x,
                                                               int k, int c0, int end,
                                                               __m256i dot[][2], int rows,
                                                               __m256i w0, __m256i w1) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i s[3][2];
    for (int m = 0; m < rows; m++) s[m][0] = s[m][1] = _mm256_setzero_si256();
    int c = c0;
    for (; c + 1 < end; c += 2) {
        I8_PREFETCH(gp + c * 32);
        const __m256i ve = _mm256_loadu_si256((const __m256i *)(gp + c * 32));
        const __m256i vo = _mm256_loadu_si256((const __m256i *)(gp + c * 32 + 32));
        const __m256i ae = _mm256_and_si256(ve, low), be = _mm256_and_si256(_mm256_srli_epi16(ve, 4), low);
        const __m256i ao = _mm256_and_si256(vo, low), bo = _mm256_and_si256(_mm256_srli_epi16(vo, 4), low);
        for (int m = 0; m < rows; m++) {
            int32_t e, o;
            memcpy(&e, x + (size_t)m * k + 4 * c, sizeof e);
            memcpy(&o, x + (size_t)m * k + 4 * c + 4, sizeof o);
            const __m256i xe = _mm256_set1_epi32(e), xo = _mm256_set1_epi32(o);
            s[m][0] = _mm256_add_epi16(s[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(ae, xe),
                                                                 _mm256_maddubs_epi16(ao, xo)));
            s[m][1] = _mm256_add_epi16(s[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(be, xe),
                                                                 _mm256_maddubs_epi16(bo, xo)));
        }
    }
    if (c < end) { /* an odd chunk count (groups of 4 * odd values) */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(gp + c * 32));
        const __m256i a = _mm256_and_si256(v, low), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < rows; m++) {
            int32_t e;
            memcpy(&e, x + (size_t)m * k + 4 * c, sizeof e);
            const __m256i xe = _mm256_set1_epi32(e);
            s[m][0] = _mm256_add_epi16(s[m][0], _mm256_maddubs_epi16(a, xe));
            s[m][1] = _mm256_add_epi16(s[m][1], _mm256_maddubs_epi16(b, xe));
        }
    }
    for (int m = 0; m < rows; m++) {
        dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(s[m][0], w0));
        dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(s[m][1], w1));
    }
}

/* w6q_pair4 for 1-3 rows (`rows` a constant after inlining), in intrinsics: few enough sums
 * for the registers. */
static inline __attribute__((always_inline)) void w6q_pair_n(const uint8_t *gp, const uint8_t *hg,
                                                             const int8_t *x, int k, int c,
                                                             __m256i dot[][2], int rows,
                                                             __m256i w0, __m256i w1) {
    __m256i codes[4];
    w6q_unpack_pair(gp, hg, c, codes);
    const __m256i ae = codes[0], be = codes[1], ao = codes[2], bo = codes[3];
    for (int m = 0; m < rows; m++) {
        int32_t e, o;
        memcpy(&e, x + (size_t)m * k + 4 * c, sizeof e);
        memcpy(&o, x + (size_t)m * k + 4 * c + 4, sizeof o);
        const __m256i xe = _mm256_set1_epi32(e), xo = _mm256_set1_epi32(o);
        const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(ae, xe), _mm256_maddubs_epi16(ao, xo));
        const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(be, xe), _mm256_maddubs_epi16(bo, xo));
        dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(s0, w0));
        dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(s1, w1));
    }
}
#endif

#ifndef I8_VNNI
/* Super-block sb of a Q4_K tile done (I8_KQ, activations per super-block): each row's int32
 * sums of sc * (codes x activations) over its groups in sacc, out += dx * d * sacc. */
static inline __attribute__((always_inline)) void i8_kq_super_end(
    const uint16_t *sbp, int sb, const float *dx, int groups, int rows, __m256i sacc[][2],
    __m256 out[][2]) {
    const uint16_t *rec = sbp + (size_t)sb * I8_KQ_RECORD;
    const __m256 d0 = load_f16x8(rec), d1 = load_f16x8(rec + 8);
#pragma GCC unroll 4
    for (int m = 0; m < I8_ROWS; m++) {
        if (m >= rows) continue;
        const __m256 x = _mm256_set1_ps(dx[(size_t)m * groups + 8 * sb]);
        out[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(x, d0), _mm256_cvtepi32_ps(sacc[m][0]), out[m][0]);
        out[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(x, d1), _mm256_cvtepi32_ps(sacc[m][1]), out[m][1]);
    }
}

/* The mins' part of a Q4_K tile (I8_KQ, activations per super-block, `bsum` the sums of their
 * codes per group): out -= dx * dmin * sum(m * bsum) per super-block, a column half at a
 * time (apart from the loop over K, for the registers). */
static inline __attribute__((always_inline)) void i8_kq_mins(const uint16_t *sbp,
                                                             const int16_t *bsum, const float *dx,
                                                             int k, int gs, int rows,
                                                             __m256 out[][2]) {
    const int groups = k / gs;
    for (int sb = 0; sb < k / 256; sb++) {
        const uint16_t *rec = sbp + (size_t)sb * I8_KQ_RECORD;
        const uint8_t *mn = (const uint8_t *)(rec + 2 * I8_TILE) + 8 * I8_TILE;
        for (int h = 0; h < 2; h++) {
            const __m256 dmin = load_f16x8(rec + I8_TILE + 8 * h);
            __m256i mp[4]; /* the mins of groups 2p and 2p + 1, paired per column */
            for (int p = 0; p < 4; p++)
                mp[p] = i8_pairs_half(mn + 2 * p * I8_TILE, mn + (2 * p + 1) * I8_TILE, h);
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                const int16_t *bs = bsum + (size_t)m * groups + 8 * sb;
                __m256i b = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    int32_t two; /* the sums of groups 2p and 2p + 1 */
                    memcpy(&two, bs + 2 * p, sizeof two);
                    b = _mm256_add_epi32(b, _mm256_madd_epi16(mp[p], _mm256_set1_epi32(two)));
                }
                const __m256 x = _mm256_set1_ps(dx[(size_t)m * groups + 8 * sb]);
                out[m][h] = _mm256_fnmadd_ps(_mm256_mul_ps(x, dmin), _mm256_cvtepi32_ps(b), out[m][h]);
            }
        }
    }
}
#endif

/* w4q_i8_tile_plain with AVX2, `rows` (1..I8_ROWS) a constant after inlining. With `bsum`
 * (I8_KQ: activations per super-block, see w4_gemm_i8) the builds without VNNI sum a
 * super-block's groups in int32, each widened by its 6-bit scales, and apply the float32
 * scales once per super-block: the per-group float work was a quarter of the tile's time. */
static inline __attribute__((always_inline)) void w4q_i8_tile_n(
    const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp, const int8_t *xq,
    const float *dx, const float *xs, float *acc, int rows, int k, int gs, int six, int nl,
    const int16_t *bsum) {
    const int groups = k / gs, chunks = gs / 4;
    const int run = six ? 2 : 8; /* chunks per int16 sum (see the top) */
    const __m256i low = _mm256_set1_epi8(0x0f), tops = _mm256_set1_epi8(0x30);
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)I8_NL_VALUES));
#ifndef I8_VNNI
    const __m256i ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    const __m256i book_lo = _mm256_and_si256(book, low);
    const __m256i book_hi = _mm256_and_si256(_mm256_srli_epi16(book, 4), low);
#else
    (void)book;
#endif
#ifndef I8_VNNI
    const int super = zp == I8_KQ && bsum != NULL && !nl;
#else
    (void)bsum;
#endif
    __m256 out[I8_ROWS][2];
    for (int m = 0; m < I8_ROWS; m++) out[m][0] = out[m][1] = _mm256_setzero_ps();
    __m256i dot[I8_ROWS][2];
    for (int m = 0; m < I8_ROWS; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int g = 0; g < groups; g++) {
        i8_prefetch_scales(sbp, zp, g, gs);
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
#ifndef I8_VNNI
        if (!super || g % 8 == 0) /* a super-block's groups sum into dot */
#endif
            for (int m = 0; m < I8_ROWS; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
        const uint8_t *hg = six ? hp + (size_t)g * chunks * I8_TILE : NULL;
#ifndef I8_VNNI
        __m256i w0 = ones, w1 = ones; /* the widening's multipliers: the group's scales */
        if (super) {
            const uint8_t *sc = (const uint8_t *)(sbp + (size_t)(g / 8) * I8_KQ_RECORD + 2 * I8_TILE) +
                                (g % 8) * I8_TILE;
            /* each scale zero-extended into both int16 lanes of its column's pair */
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)sc));
            w0 = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                                         4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1));
            w1 = _mm256_shuffle_epi8(v, _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1,
                                                         12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1, 15, -1));
        }
#endif
        for (int c0 = 0; c0 < chunks; c0 += run) { /* int16 sums cannot saturate */
#ifndef I8_VNNI
            if (!six && !nl) { /* the common pass, its sums named (see below) */
                const int end = c0 + run < chunks ? c0 + run : chunks;
                if (rows == 4)
                    w4q_chunks4(gp, xq + (size_t)g * gs, k, c0, end, dot, w0, w1);
                else
                    w4q_chunks_n(gp, xq + (size_t)g * gs, k, c0, end, dot, rows, w0, w1);
                continue;
            }
            if (six && !nl) { /* run is 2, chunks even */
                if (rows == 4)
                    w6q_pair4(gp, hg, xq + (size_t)g * gs, k, c0, dot, w0, w1);
                else
                    w6q_pair_n(gp, hg, xq + (size_t)g * gs, k, c0, dot, rows, w0, w1);
                continue;
            }
            __m256i d16[I8_ROWS][2], h16[I8_ROWS][2]; /* h16: the code book's high nibbles */
            for (int m = 0; m < I8_ROWS; m++)
                d16[m][0] = d16[m][1] = h16[m][0] = h16[m][1] = _mm256_setzero_si256();
#endif
            const int end = c0 + run < chunks ? c0 + run : chunks;
            for (int c = c0; c < end; c++) {
                if (c % 2 == 0) I8_PREFETCH(gp + c * 32);
                if (six && c % 4 == 0) I8_PREFETCH_AHEAD(hg + (c / 2) * 32, I8_PREFETCH_BYTES / 2);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(gp + c * 32));
                __m256i a = _mm256_and_si256(v, low);                       /* cols 0-7 */
                __m256i b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low); /* 8-15 */
                if (six) { /* the top bits: 0-1 and 2-3 of the pair's byte, or 4-5 and 6-7 */
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(hg + (c / 2) * 32));
                    const int odd = c % 2;
                    a = _mm256_or_si256(a, _mm256_and_si256(odd ? h : _mm256_slli_epi16(h, 4), tops));
                    b = _mm256_or_si256(b, _mm256_and_si256(odd ? _mm256_srli_epi16(h, 2)
                                                                : _mm256_slli_epi16(h, 2), tops));
                }
#ifdef I8_VNNI
                if (nl) { /* the code book's bytes */
                    a = _mm256_shuffle_epi8(book, a);
                    b = _mm256_shuffle_epi8(book, b);
                }
#else
                __m256i ah = a, bh = b;
                if (nl) { /* the code book's bytes as their nibbles */
                    ah = _mm256_shuffle_epi8(book_hi, a);
                    bh = _mm256_shuffle_epi8(book_hi, b);
                    a = _mm256_shuffle_epi8(book_lo, a);
                    b = _mm256_shuffle_epi8(book_lo, b);
                }
#endif
#pragma GCC unroll 4
                for (int m = 0; m < I8_ROWS; m++) {
                    if (m >= rows) continue;
                    int32_t four;
                    memcpy(&four, xq + (size_t)m * k + (size_t)g * gs + 4 * c, sizeof four);
                    const __m256i xb = _mm256_set1_epi32(four);
#ifdef I8_VNNI /* straight into int32 */
                    dot[m][0] = I8_DPBUSD256(dot[m][0], a, xb);
                    dot[m][1] = I8_DPBUSD256(dot[m][1], b, xb);
#else
                    d16[m][0] = _mm256_add_epi16(d16[m][0], _mm256_maddubs_epi16(a, xb));
                    d16[m][1] = _mm256_add_epi16(d16[m][1], _mm256_maddubs_epi16(b, xb));
                    if (nl) {
                        h16[m][0] = _mm256_add_epi16(h16[m][0], _mm256_maddubs_epi16(ah, xb));
                        h16[m][1] = _mm256_add_epi16(h16[m][1], _mm256_maddubs_epi16(bh, xb));
                    }
#endif
                }
            }
#ifndef I8_VNNI
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(d16[m][0], ones));
                dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(d16[m][1], ones));
                if (nl) {
                    dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(h16[m][0], sixteens));
                    dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(h16[m][1], sixteens));
                }
            }
#endif
        }
#ifndef I8_VNNI
        if (super) {
            if (g % 8 == 7) i8_kq_super_end(sbp, g / 8, dx, groups, rows, dot, out);
            continue;
        }
#endif
        __m256 s0, s1, b0, b1;
        if (zp == I8_KQ) { /* d * sc and -(dmin * m) */
            const uint16_t *rec = sbp + (size_t)(g / 8) * I8_KQ_RECORD;
            const uint8_t *sc = (const uint8_t *)(rec + 2 * I8_TILE) + (g % 8) * I8_TILE;
            const uint8_t *mn = sc + 8 * I8_TILE;
            const __m256 neg = _mm256_set1_ps(-0.f);
#define I8_U8X8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
            s0 = _mm256_mul_ps(load_f16x8(rec), I8_U8X8(sc));
            s1 = _mm256_mul_ps(load_f16x8(rec + 8), I8_U8X8(sc + 8));
            b0 = _mm256_xor_ps(_mm256_mul_ps(load_f16x8(rec + I8_TILE), I8_U8X8(mn)), neg);
            b1 = _mm256_xor_ps(_mm256_mul_ps(load_f16x8(rec + I8_TILE + 8), I8_U8X8(mn + 8)), neg);
#undef I8_U8X8
        } else {
            const uint16_t *sp = sbp + (size_t)g * sb_stride(zp);
            const __m256 nz = _mm256_set1_ps(-(float)I8_SYM_ZP(zp));
            s0 = load_f16x8(sp);
            s1 = load_f16x8(sp + 8);
            b0 = zp ? _mm256_mul_ps(nz, s0) : load_f16x8(sp + I8_TILE);
            b1 = zp ? _mm256_mul_ps(nz, s1) : load_f16x8(sp + I8_TILE + 8);
        }
#pragma GCC unroll 4
        for (int m = 0; m < I8_ROWS; m++) {
            if (m >= rows) continue;
            const __m256 d = _mm256_set1_ps(dx[(size_t)m * groups + g]);
            const __m256 sx = _mm256_set1_ps(xs[(size_t)m * groups + g]);
            out[m][0] = _mm256_fmadd_ps(s0, _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[m][0])), out[m][0]);
            out[m][1] = _mm256_fmadd_ps(s1, _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[m][1])), out[m][1]);
            out[m][0] = _mm256_fmadd_ps(b0, sx, out[m][0]);
            out[m][1] = _mm256_fmadd_ps(b1, sx, out[m][1]);
        }
    }
#ifndef I8_VNNI
    if (super) i8_kq_mins(sbp, bsum, dx, k, gs, rows, out);
#endif
    for (int m = 0; m < rows; m++) {
        _mm256_storeu_ps(acc + m * I8_TILE, out[m][0]);
        _mm256_storeu_ps(acc + m * I8_TILE + 8, out[m][1]);
    }
}

#ifdef I8_AVX512
/* Group g's scales s and offsets o of a 16-column tile (every form of `zp`, see the top):
 * the weight is code * s + o. Also the AMX unpacking's (quant_gemm.c). */
static inline __attribute__((always_inline)) void w4_group_scales512(const uint16_t *sbp, int zp,
                                                                    int g, __m512 *s, __m512 *o) {
    if (zp == I8_KQ) { /* d * sc and -(dmin * m) */
        const uint16_t *rec = sbp + (size_t)(g / 8) * I8_KQ_RECORD;
        const uint8_t *sc = (const uint8_t *)(rec + 2 * I8_TILE) + (g % 8) * I8_TILE;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + I8_TILE)));
        *s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc))));
        *o = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(sc + 8 * I8_TILE)))));
        *o = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(*o), _mm512_set1_epi32(INT32_MIN)));
    } else {
        const uint16_t *sp = sbp + (size_t)g * sb_stride(zp);
        *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sp));
        *o = zp ? _mm512_mul_ps(_mm512_set1_ps(-(float)I8_SYM_ZP(zp)), *s)
                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + I8_TILE)));
    }
}

/* Group g of a 16-column tile done: its scales s and offsets o applied to each row's integer
 * sums, out[m] += s * (dx * dot[m]) + o * xs (both 512-bit 4-bit tiles). */
static inline __attribute__((always_inline)) void w4_i8_group512(
    const uint16_t *sbp, int zp, int g, const __m512i *dot, const float *dx, const float *xs,
    int groups, int rows, __m512 *out) {
    __m512 s, o;
    w4_group_scales512(sbp, zp, g, &s, &o);
#pragma GCC unroll 8
    for (int m = 0; m < I8_MAX_ROWS; m++) {
        if (m >= rows) continue;
        const __m512 d = _mm512_set1_ps(dx[(size_t)m * groups + g]);
        const __m512 sx = _mm512_set1_ps(xs[(size_t)m * groups + g]);
        out[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(dot[m])), out[m]);
        out[m] = _mm512_fmadd_ps(o, sx, out[m]);
    }
}

#ifdef __AVX512VNNI__
/* Super-block scales (I8_KQ, activations per super-block) in the VNNI tiles: a super-block's
 * groups are summed in float32 per row as tmp = -dmin * sum(m * bsum) + sum(d * sc * dot),
 * then applied once, out += dx * tmp. Per group and row a conversion and one multiply-add
 * remain of the four float32 operations of the per-group form (the mins' integer sums by
 * `vpdpwssd` once per super-block): 15% more integer dot products per second in an 8-row pass
 * (2-core Zen 4). Every VNNI tile takes these same steps, so that a row gets the same bits in
 * any pass. */
static inline __attribute__((always_inline)) void i8_kq_start512(const uint16_t *sbp, int sb,
                                                                const int16_t *bsum,
                                                                int groups, int rows,
                                                                __m512 *tmp) {
    const uint16_t *rec = sbp + (size_t)sb * I8_KQ_RECORD;
    const uint8_t *mn = (const uint8_t *)(rec + 2 * I8_TILE) + 8 * I8_TILE;
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + I8_TILE)));
    const __m512 ndmin = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(dmin), _mm512_set1_epi32(INT32_MIN)));
    __m512i mp[4]; /* the mins of groups 2p (low int16) and 2p + 1 (high) of each column */
    for (int p = 0; p < 4; p++)
        mp[p] = _mm512_or_si512(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mn + 2 * p * I8_TILE))),
            _mm512_slli_epi32(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(mn + (2 * p + 1) * I8_TILE))), 16));
#pragma GCC unroll 8
    for (int m = 0; m < I8_MAX_ROWS; m++) {
        if (m >= rows) continue;
        const int16_t *bs = bsum + (size_t)m * groups + 8 * sb;
        __m512i b = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            int32_t two; /* the sums of groups 2p and 2p + 1 */
            memcpy(&two, bs + 2 * p, sizeof two);
            b = _mm512_dpwssd_epi32(b, mp[p], _mm512_set1_epi32(two));
        }
        tmp[m] = _mm512_mul_ps(ndmin, _mm512_cvtepi32_ps(b)); /* |b| < 2^24: exact */
    }
}

/* Group g of a super-block: tmp += d * sc * dot, per row. */
static inline __attribute__((always_inline)) void i8_kq_group512(const uint16_t *sbp, int g,
                                                                const __m512i *dot, int rows,
                                                                __m512 *tmp) {
    const uint16_t *rec = sbp + (size_t)(g / 8) * I8_KQ_RECORD;
    const uint8_t *sc = (const uint8_t *)(rec + 2 * I8_TILE) + (g % 8) * I8_TILE;
    const __m512 s = _mm512_mul_ps(
        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec)),
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc))));
#pragma GCC unroll 8
    for (int m = 0; m < I8_MAX_ROWS; m++) {
        if (m >= rows) continue;
        tmp[m] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[m]), tmp[m]);
    }
}

/* Group g of symmetric groups with activations per super-block (Q6_K's or Q4_0's form, see
 * w4_gemm_i8): tmp += s * dot, per row, where the tile started dot at -zp * (the sum of the
 * group's codes of x), an int32 per row and group that w4_gemm_i8 leaves in place of xs (the
 * offset -zp * s folded into the integer sum: exact, and no operation but a broadcast). */
static inline __attribute__((always_inline)) void i8_sym_group512(const uint16_t *sbp, int g,
                                                                 int rows, const __m512i *dot,
                                                                 __m512 *tmp) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sbp + (size_t)g * I8_TILE)));
#pragma GCC unroll 8
    for (int m = 0; m < I8_MAX_ROWS; m++) {
        if (m >= rows) continue;
        tmp[m] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot[m]), tmp[m]);
    }
}

/* The last group g of a super-block done: out += dx * tmp, per row. */
static inline __attribute__((always_inline)) void i8_kq_end512(const float *dx, int g, int groups,
                                                              int rows, const __m512 *tmp,
                                                              __m512 *out) {
#pragma GCC unroll 8
    for (int m = 0; m < I8_MAX_ROWS; m++) {
        if (m >= rows) continue;
        out[m] = _mm512_fmadd_ps(_mm512_set1_ps(dx[(size_t)m * groups + g]), tmp[m], out[m]);
    }
}
#endif

/* Group g of a 16-column tile about to start: a super-block's sums begin (`sup` 1: super-block
 * scales, from their mins; 2: symmetric groups, from zero; 0: none, per-group scales). */
static inline __attribute__((always_inline)) void i8_super_start512(const uint16_t *sbp, int sup,
                                                                   int g, int per,
                                                                   const int16_t *bsum,
                                                                   int groups, int rows,
                                                                   __m512 *tmp) {
#ifdef __AVX512VNNI__
    if (sup == 1 && g % 8 == 0) i8_kq_start512(sbp, g / 8, bsum, groups, rows, tmp);
    if (sup == 2 && g % per == 0)
        for (int m = 0; m < rows; m++) tmp[m] = _mm512_setzero_ps();
#else
    (void)sbp, (void)sup, (void)g, (void)per, (void)bsum, (void)groups, (void)rows, (void)tmp;
#endif
}

/* Group g of a 16-column tile done, its integer sums in dot: into the super-block's sums
 * (`sup` 1 or 2, applied at the super-block's last group) or its scales applied at once. */
static inline __attribute__((always_inline)) void i8_group_done512(
    const uint16_t *sbp, int zp, int sup, int g, int per, const __m512i *dot, const float *dx,
    const float *xs, int groups, int rows, __m512 *tmp, __m512 *out) {
#ifdef __AVX512VNNI__
    if (sup == 1) {
        i8_kq_group512(sbp, g, dot, rows, tmp);
        if (g % 8 == 7) i8_kq_end512(dx, g, groups, rows, tmp, out);
        return;
    }
    if (sup == 2) {
        i8_sym_group512(sbp, g, rows, dot, tmp);
        if (g % per == per - 1) i8_kq_end512(dx, g, groups, rows, tmp, out);
        return;
    }
#else
    (void)sup, (void)per, (void)tmp;
#endif
    w4_i8_group512(sbp, zp, g, dot, dx, xs, groups, rows, out);
}

/* The codes of chunk c of a quads tile's group `gp` (with its 6-bit top bits `hg` when `six`)
 * for all 16 columns: the chunk's 32 bytes in both halves of a zmm, the upper half shifted by
 * 4, so that columns 0-7 are the low half and 8-15 the high one, 4 values of K per int32 lane. */
static inline __attribute__((always_inline)) __m512i w4q_chunk512(const uint8_t *gp,
                                                                 const uint8_t *hg, int c,
                                                                 int six) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(gp + c * 32)));
    __m512i w = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                                 _mm512_set1_epi8(0x0f));
    if (six) { /* the top bits: chunk c even takes bits 0-1 / 2-3, odd 4-5 / 6-7 */
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(hg + (c / 2) * 32)));
        const __m512i t = c % 2 ? _mm512_srlv_epi64(h, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0))
                                : _mm512_sllv_epi64(h, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4));
        w = _mm512_or_si512(w, _mm512_and_si512(t, _mm512_set1_epi8(0x30)));
    }
    return w;
}

/* w4q_i8_tile_n 16 columns wide: a chunk's 32 bytes go to both halves of a zmm, the upper
 * half shifted by 4, so that one AND gives the codes of all 16 columns x 4 values of K and
 * each row costs one broadcast and one `vpdpbusd` (with VNNI; else `vpmaddubsw` into int16
 * sums, widened once per 8 chunks) per chunk. The same integers and the same float32
 * operations per column as the 256-bit tile. */
static inline __attribute__((always_inline)) void w4q_i8_tile512_n(
    const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp, const int8_t *xq,
    const float *dx, const float *xs, float *acc, int rows, int k, int gs, int six, int nl,
    const int16_t *bsum, int sup) {
    const int groups = k / gs, chunks = gs / 4, per = 256 / gs;
    const __m512i low = _mm512_set1_epi8(0x0f);
#ifdef __AVX512VNNI__
    const __m512i tops = _mm512_set1_epi8(0x30);
#endif
    const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)I8_NL_VALUES));
    __m512 out[I8_ROWS];
    for (int m = 0; m < I8_ROWS; m++) out[m] = _mm512_setzero_ps();
    __m512 tmp[I8_ROWS]; /* a super-block's sums (sup; without VNNI the super-block sums are
                          * the 256-bit tile's) */
    for (int m = 0; m < I8_ROWS; m++) tmp[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        i8_prefetch_scales(sbp, zp, g, gs);
        i8_super_start512(sbp, sup, g, per, bsum, groups, rows, tmp);
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
        const uint8_t *hg = six ? hp + (size_t)g * chunks * I8_TILE : NULL;
        const int8_t *xg = xq + (size_t)g * gs;
        __m512i dot[I8_ROWS];
        for (int m = 0; m < I8_ROWS; m++) dot[m] = _mm512_setzero_si512();
#ifdef __AVX512VNNI__
        /* Two chunks per zmm: the low nibbles give columns 0-7 of chunk c (low half) and of
         * chunk c + 1 (high half), the high nibbles columns 8-15; each half's x is its own
         * chunk's four activations. The halves are added at the end of the group. */
        __m512i lo[I8_ROWS], hi[I8_ROWS];
        for (int m = 0; m < I8_ROWS; m++) { /* symmetric groups: from the offsets
                                             * (i8_sym_group512), in the lanes each column's
                                             * sum starts from */
            lo[m] = hi[m] = sup == 2 && m < rows
                ? _mm512_maskz_set1_epi32(0x00ff, ((const int32_t *)xs)[(size_t)m * groups + g])
                : _mm512_setzero_si512();
        }
        const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int c = 0; c + 1 < chunks; c += 2) {
            I8_PREFETCH(gp + c * 32);
            if (six && c % 4 == 0) I8_PREFETCH_AHEAD(hg + (c / 2) * 32, I8_PREFETCH_BYTES / 2);
            const __m512i v = _mm512_loadu_si512(gp + c * 32);
            __m512i a = _mm512_and_si512(v, low);
            __m512i b = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if (six) { /* chunk c (low half) takes bits 0-1 / 2-3, chunk c + 1 bits 4-5 / 6-7 */
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(hg + (c / 2) * 32)));
                const __m512i up_a = _mm512_set_epi64(0, 0, 0, 0, 4, 4, 4, 4);
                const __m512i up_b = _mm512_set_epi64(0, 0, 0, 0, 2, 2, 2, 2);
                const __m512i down_b = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
                a = _mm512_or_si512(a, _mm512_and_si512(_mm512_sllv_epi64(h, up_a), tops));
                b = _mm512_or_si512(b, _mm512_and_si512(
                    _mm512_srlv_epi64(_mm512_sllv_epi64(h, up_b), down_b), tops));
            }
            if (nl) { /* the code book's bytes */
                a = _mm512_shuffle_epi8(book, a);
                b = _mm512_shuffle_epi8(book, b);
            }
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                const __m512i xb = _mm512_permutexvar_epi32(halves, _mm512_castsi128_si512(
                    _mm_loadl_epi64((const __m128i *)(xg + (size_t)m * k + 4 * c))));
                lo[m] = i8_dpbusd512(lo[m], a, xb);
                hi[m] = i8_dpbusd512(hi[m], b, xb);
            }
        }
        if (chunks % 2) { /* a last chunk alone: its codes in the low half, zeros above */
            const int c = chunks - 1;
            const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(gp + c * 32)));
            const __m512i keep = _mm512_maskz_mov_epi64(0x0f, _mm512_set1_epi8(0x0f));
            __m512i a = _mm512_and_si512(v, keep);
            __m512i b = _mm512_and_si512(_mm512_srli_epi16(v, 4), keep);
            if (nl) { /* the code book's bytes, zeros above */
                a = _mm512_maskz_shuffle_epi8(0xffffffffULL, book, a);
                b = _mm512_maskz_shuffle_epi8(0xffffffffULL, book, b);
            }
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, xg + (size_t)m * k + 4 * c, sizeof four);
                lo[m] = i8_dpbusd512(lo[m], a, _mm512_set1_epi32(four));
                hi[m] = i8_dpbusd512(hi[m], b, _mm512_set1_epi32(four));
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < I8_ROWS; m++) {
            if (m >= rows) continue;
            dot[m] = _mm512_add_epi32(_mm512_shuffle_i64x2(lo[m], hi[m], 0x44),  /* low halves */
                                      _mm512_shuffle_i64x2(lo[m], hi[m], 0xee)); /* high ones */
        }
#else
        const __m512i ones = _mm512_set1_epi16(1), sixteens = _mm512_set1_epi16(16);
        const __m512i book_lo = _mm512_and_si512(book, low);
        const __m512i book_hi = _mm512_and_si512(_mm512_srli_epi16(book, 4), low);
        const int run = six ? 2 : 8; /* chunks per int16 sum (see the top) */
        for (int c0 = 0; c0 < chunks; c0 += run) { /* int16 sums cannot saturate */
            __m512i d16[I8_ROWS], h16[I8_ROWS]; /* h16: the code book's high nibbles */
            for (int m = 0; m < I8_ROWS; m++) d16[m] = h16[m] = _mm512_setzero_si512();
            const int end = c0 + run < chunks ? c0 + run : chunks;
            for (int c = c0; c < end; c++) {
                if (c % 2 == 0) I8_PREFETCH(gp + c * 32);
                if (six && c % 4 == 0) I8_PREFETCH_AHEAD(hg + (c / 2) * 32, I8_PREFETCH_BYTES / 2);
                __m512i w = w4q_chunk512(gp, hg, c, six);
                __m512i wh = w;
                if (nl) { /* the code book's bytes as their nibbles */
                    wh = _mm512_shuffle_epi8(book_hi, w);
                    w = _mm512_shuffle_epi8(book_lo, w);
                }
#pragma GCC unroll 4
                for (int m = 0; m < I8_ROWS; m++) {
                    if (m >= rows) continue;
                    int32_t four;
                    memcpy(&four, xg + (size_t)m * k + 4 * c, sizeof four);
                    const __m512i xb = _mm512_set1_epi32(four);
                    d16[m] = _mm512_add_epi16(d16[m], _mm512_maddubs_epi16(w, xb));
                    if (nl) h16[m] = _mm512_add_epi16(h16[m], _mm512_maddubs_epi16(wh, xb));
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                dot[m] = _mm512_add_epi32(dot[m], _mm512_madd_epi16(d16[m], ones));
                if (nl) dot[m] = _mm512_add_epi32(dot[m], _mm512_madd_epi16(h16[m], sixteens));
            }
        }
#endif
        i8_group_done512(sbp, zp, sup, g, per, dot, dx, xs, groups, rows, tmp, out);
    }
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(acc + m * I8_TILE, out[m]);
}
#ifdef I8_WIDE_ROWS
/* w4q_i8_tile512_n with VNNI for 5..8 rows: one chunk per zmm (`w4q_chunk512`, as the tile
 * without VNNI unpacks them), so that a row's four activations are
 * a `vpdpbusd` operand broadcast from memory: one instruction per row and chunk, where the
 * two-chunk form also spends a `vpermd` on each row's activations; the weights' unpacking is
 * shared by twice the rows. The same integers and the same float32 operations per column. */
static inline __attribute__((always_inline)) void w4q_i8_tile512_wide_n(
    const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp, const int8_t *xq,
    const float *dx, const float *xs, float *acc, int rows, int k, int gs, int six, int nl,
    const int16_t *bsum, int sup) {
    const int groups = k / gs, chunks = gs / 4, per = 256 / gs;
    const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)I8_NL_VALUES));
    __m512 out[I8_WIDE_ROWS], tmp[I8_WIDE_ROWS];
    for (int m = 0; m < I8_WIDE_ROWS; m++) out[m] = tmp[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        i8_prefetch_scales(sbp, zp, g, gs);
        i8_super_start512(sbp, sup, g, per, bsum, groups, rows, tmp);
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
        const uint8_t *hg = six ? hp + (size_t)g * chunks * I8_TILE : NULL;
        const int8_t *xg = xq + (size_t)g * gs;
        __m512i dot[I8_WIDE_ROWS];
        for (int m = 0; m < I8_WIDE_ROWS; m++) /* symmetric groups: from the offsets (i8_sym_group512) */
            dot[m] = sup == 2 && m < rows ? _mm512_set1_epi32(((const int32_t *)xs)[(size_t)m * groups + g])
                                          : _mm512_setzero_si512();
#define I8_WIDE_CHUNK(c)                                                                         \
    do {                                                                                         \
        __m512i w = w4q_chunk512(gp, hg, (c), six);                                              \
        if (nl) w = _mm512_shuffle_epi8(book, w); /* the code book's bytes */                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < I8_WIDE_ROWS; m++) {                         \
            if (m >= rows) continue;                                                             \
            int32_t four;                                                                        \
            memcpy(&four, xg + (size_t)m * k + 4 * (c), sizeof four);                            \
            dot[m] = i8_dpbusd512(dot[m], w, _mm512_set1_epi32(four));                           \
        }                                                                                        \
    } while (0)
        /* chunks in pairs, the even one's and the odd one's unpacking written apart: no
         * branch per chunk (6-bit codes: 4-13% faster passes, Zen 4) */
        int c0 = 0;
        for (; c0 + 1 < chunks; c0 += 2) {
            I8_PREFETCH(gp + c0 * 32);
            if (six && c0 % 4 == 0) I8_PREFETCH_AHEAD(hg + (c0 / 2) * 32, I8_PREFETCH_BYTES / 2);
            I8_WIDE_CHUNK(c0);
            I8_WIDE_CHUNK(c0 + 1);
        }
        if (c0 < chunks) { /* an odd last chunk (4-bit groups of 4 * odd) */
            I8_PREFETCH(gp + c0 * 32);
            I8_WIDE_CHUNK(c0);
        }
#undef I8_WIDE_CHUNK
        i8_group_done512(sbp, zp, sup, g, per, dot, dx, xs, groups, rows, tmp, out);
    }
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(acc + m * I8_TILE, out[m]);
}
#endif
#endif

#ifdef I8_AVX512
/* Four u8 x s8 products summed into each int32 lane of `acc`: `vpdpbusd` with VNNI, else
 * `vpmaddubsw` (two products at most 2 * 15 * 127: no saturation) widened by `vpmaddwd`. */
static inline __m512i i8_dp4(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return i8_dpbusd512(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* 64 bytes of a tile's 16 columns, four bytes of K per column spread over four 16-byte
 * rows, transposed so that int32 lane j holds column j's four bytes (`vpermd` across the
 * 128-bit lanes, then `vpshufb` within them): the 4-bit pairs tile's and the 8-bit tile's. */
static inline __m512i i8_columns_512(const void *p) {
    const __m512i across = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i within = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(across, _mm512_loadu_si512(p)), within);
}

/* The pairs layout in the 512-bit tile: the 64 bytes of four pairs (rows 2p..2p+7 of 16
 * columns) are transposed so that each int32 lane holds one column's four bytes (`vpermd`
 * across 128-bit lanes, then `vpshufb` within them); their low nibbles are the codes of rows
 * 2p, 2p+2, 2p+4, 2p+6 and their high nibbles those of the odd rows, so `xp` holds each 8
 * activations in that order (`i8_evens_odds`). Needs a group size that is a multiple of 8. */
static inline __attribute__((always_inline)) void w4_i8_tile512_n(
    const uint8_t *wp, const uint16_t *sbp, const int8_t *xp, const float *dx, const float *xs,
    float *acc, int rows, int k, int gs) {
    const int groups = k / gs, quads = gs / 8;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 out[I8_ROWS];
    for (int m = 0; m < I8_ROWS; m++) out[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * gs / 2 * I8_TILE;
        const int8_t *xg = xp + (size_t)g * gs;
        __m512i even[I8_ROWS], odd[I8_ROWS]; /* two chains: one row waits on no latency */
        for (int m = 0; m < I8_ROWS; m++) even[m] = odd[m] = _mm512_setzero_si512();
        for (int c = 0; c < quads; c++) {
            I8_PREFETCH(gp + c * 64);
            const __m512i v = i8_columns_512(gp + c * 64);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                int32_t four[2];
                memcpy(four, xg + (size_t)m * k + 8 * c, sizeof four);
                even[m] = i8_dp4(even[m], lo, _mm512_set1_epi32(four[0]));
                odd[m] = i8_dp4(odd[m], hi, _mm512_set1_epi32(four[1]));
            }
        }
        __m512i dot[I8_ROWS];
#pragma GCC unroll 4
        for (int m = 0; m < I8_ROWS; m++)
            if (m < rows) dot[m] = _mm512_add_epi32(even[m], odd[m]);
        w4_i8_group512(sbp, 0, g, dot, dx, xs, groups, rows, out);
    }
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(acc + m * I8_TILE, out[m]);
}

static void w4_i8_tile512(const uint8_t *wp, const uint16_t *sbp, const int8_t *xp,
                          const float *dx, const float *xs, float *acc, int rows, int k, int gs) {
    switch (rows) {
#define I8_CASE(r) case r: w4_i8_tile512_n(wp, sbp, xp, dx, xs, acc, r, k, gs); break;
        I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4)
#undef I8_CASE
    }
}

/* Each 8 values of int8 rows `xq` ([count], count % 8 == 0) reordered as w4_i8_tile512_n
 * reads them: the 4 at even places, then the 4 at odd places. */
static void i8_evens_odds(const int8_t *xq, int8_t *xp, size_t count) {
    for (size_t i = 0; i < count; i += 8)
        for (int j = 0; j < 4; j++) {
            xp[i + j] = xq[i + 2 * j];
            xp[i + 4 + j] = xq[i + 2 * j + 1];
        }
}
#endif

#if defined(I8_AVX512) && defined(__AVX512VNNI__)
#define I8_Q8_VNNI 1
/* q8_i8_tile_n with `vpdpbusd`: four rows of K (64 bytes: two pairs) transposed so that each
 * int32 lane holds one column's four codes, made unsigned by adding 128 (the product then
 * carries 128 times the block's sum of x, `isum`, taken out in int32: the same integers, and
 * the same float32 operations, as the AVX2 tile). Needs a block size that is a multiple of 4. */
static inline __attribute__((always_inline)) void q8_i8_tile512_n(
    const int8_t *wp, const float *sp, const float *op, const int8_t *xq, const int32_t *isum,
    const float *dx, const float *xs, float *acc, int rows, int k, int bs) {
    const int blocks = k / bs, steps = bs / 4;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 out[I8_MAX_ROWS];
    for (int m = 0; m < I8_MAX_ROWS; m++) out[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *bp = wp + (size_t)b * bs * I8_TILE;
        __m512i dot[I8_MAX_ROWS];
        for (int m = 0; m < I8_MAX_ROWS; m++) dot[m] = _mm512_setzero_si512();
        for (int st = 0; st < steps; st++) {
            I8_PREFETCH(bp + st * 64);
            const __m512i w = _mm512_xor_si512(i8_columns_512(bp + st * 64), flip);
#pragma GCC unroll 8
            for (int m = 0; m < I8_MAX_ROWS; m++) {
                if (m >= rows) continue;
                int32_t four;
                memcpy(&four, xq + (size_t)m * k + (size_t)b * bs + 4 * st, sizeof four);
                dot[m] = i8_dpbusd512(dot[m], w, _mm512_set1_epi32(four));
            }
        }
        const __m512 s = _mm512_loadu_ps(sp + (size_t)b * I8_TILE);
#pragma GCC unroll 8
        for (int m = 0; m < I8_MAX_ROWS; m++) {
            if (m >= rows) continue;
            const __m512 d = _mm512_set1_ps(dx[(size_t)m * blocks + b]);
            const __m512i exact = _mm512_sub_epi32(dot[m], _mm512_set1_epi32(128 * isum[(size_t)m * blocks + b]));
            out[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, d), _mm512_cvtepi32_ps(exact), out[m]);
        }
        if (op != NULL) {
            const __m512 o = _mm512_loadu_ps(op + (size_t)b * I8_TILE);
            for (int m = 0; m < rows; m++)
                out[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[(size_t)m * blocks + b]), out[m]);
        }
    }
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(acc + m * I8_TILE, out[m]);
}

static void q8_i8_tile512(const int8_t *wp, const float *sp, const float *op, const int8_t *xq,
                          const int32_t *isum, const float *dx, const float *xs, float *acc,
                          int rows, int k, int bs) {
    switch (rows) {
#define I8_CASE(r) case r: q8_i8_tile512_n(wp, sp, op, xq, isum, dx, xs, acc, r, k, bs); break;
        I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8)
#undef I8_CASE
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define I8_Q8_AMX 1
#include "amx.h"
/* From this many rows a pass of 16 rows over an 8-bit tile goes through AMX (`tdpbssd`), the
 * rest of the rows through the VNNI tile. */
#ifndef I8_Q8_AMX_MIN_ROWS
#define I8_Q8_AMX_MIN_ROWS 16
#endif

/* Tiles for blocks of `bs` values (4 <= bs <= 64, bs % 4 == 0): 0 = C (16 rows x 16 int32),
 * 1 = A (16 rows of x, one block of int8), 2 = B (bs / 4 rows of the tile's 16 columns, four
 * codes of K a column: what i8_columns_512 gives). */
static void q8_amx_configure(int bs) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int c = 0; c < 2; c++) { /* two blocks at once: tiles 0-2 and 3-5 */
        cfg.colsb[3 * c] = 64, cfg.rows[3 * c] = 16;
        cfg.colsb[3 * c + 1] = (uint16_t)bs, cfg.rows[3 * c + 1] = 16;
        cfg.colsb[3 * c + 2] = 64, cfg.rows[3 * c + 2] = (uint8_t)(bs / 4);
    }
    _tile_loadconfig(&cfg);
}

/* A weight tile's codes as B-tile rows (k / 4 rows of 64 bytes), made once for all the
 * 16-row passes over it. */
static void q8_amx_columns(const int8_t *wp, int8_t *bbuf, int k) {
    for (int st = 0; st < k / 4; st++) {
        I8_PREFETCH(wp + (size_t)st * 64);
        _mm512_store_si512((__m512i *)(bbuf + (size_t)st * 64), i8_columns_512(wp + (size_t)st * 64));
    }
}

/* 16 rows of int8 x against a tile's B rows: each block's exact int32 sums from `tdpbssd`
 * (the same integers as the VNNI tile's after its 128 * isum correction), then the same
 * float32 operations in the same order as q8_i8_tile512_n: a row's bits do not depend on
 * which path took it. */
static inline __attribute__((always_inline)) void q8_amx_block(
    const int32_t *cbuf, const float *sp, const float *op, const float *dx, const float *xs,
    __m512 *out, int blocks, int b) {
    const __m512 s = _mm512_loadu_ps(sp + (size_t)b * I8_TILE);
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        const __m512 d = _mm512_set1_ps(dx[(size_t)m * blocks + b]);
        const __m512i exact = _mm512_load_si512((const __m512i *)(cbuf + m * I8_TILE));
        out[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, d), _mm512_cvtepi32_ps(exact), out[m]);
    }
    if (op != NULL) {
        const __m512 o = _mm512_loadu_ps(op + (size_t)b * I8_TILE);
        for (int m = 0; m < 16; m++)
            out[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[(size_t)m * blocks + b]), out[m]);
    }
}

static void q8_amx_rows16(const int8_t *bbuf, const float *sp, const float *op, const int8_t *xq,
                          const float *dx, const float *xs, float *acc, int k, int bs) {
    const int blocks = k / bs;
    _Alignas(64) int32_t cbuf[2][16 * I8_TILE];
    __m512 out[16];
    for (int m = 0; m < 16; m++) out[m] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= blocks; b += 2) { /* two independent products in flight */
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, xq + (size_t)b * bs, k);
        _tile_loadd(2, bbuf + (size_t)b * bs * I8_TILE, 64);
        _tile_loadd(4, xq + (size_t)(b + 1) * bs, k);
        _tile_loadd(5, bbuf + (size_t)(b + 1) * bs * I8_TILE, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_dpbssd(3, 4, 5);
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(3, cbuf[1], 64);
        q8_amx_block(cbuf[0], sp, op, dx, xs, out, blocks, b);
        q8_amx_block(cbuf[1], sp, op, dx, xs, out, blocks, b + 1);
    }
    for (; b < blocks; b++) {
        _tile_zero(0);
        _tile_loadd(1, xq + (size_t)b * bs, k);
        _tile_loadd(2, bbuf + (size_t)b * bs * I8_TILE, 64);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, cbuf[0], 64);
        q8_amx_block(cbuf[0], sp, op, dx, xs, out, blocks, b);
    }
    for (int m = 0; m < 16; m++) _mm512_storeu_ps(acc + m * I8_TILE, out[m]);
}
#endif
#endif

/* Pairs [p0, p1) of code rows against four rows of x (16-bit pairs, rows k / 2 apart), their
 * products added into dot: the sums in named variables and the work in inline asm, as
 * w4q_chunks4 (kept in an array, GCC spilled and reloaded them every pair). */
static inline __attribute__((always_inline)) void q8_pairs4(const int8_t *wp, const int32_t *xw,
                                                            int k, int p0, int p1,
                                                            __m256i dot[][2]) {
    const int32_t *x1 = xw + k / 2, *x2 = xw + 2 * (size_t)(k / 2), *x3 = xw + 3 * (size_t)(k / 2);
    __m256i s00 = dot[0][0], s01 = dot[0][1], s10 = dot[1][0], s11 = dot[1][1], s20 = dot[2][0],
            s21 = dot[2][1], s30 = dot[3][0], s31 = dot[3][1];
    for (int p = p0; p < p1; p++) {
        const int8_t *pp = wp + (size_t)p * 2 * I8_TILE;
        if (p % 2 == 0) I8_PREFETCH(pp);
        /* the codes' unpacking too (in C, GCC spilled one sum: a store and reload each pair) */
        __m256i w0, w1, xb, t;
#define I8_ROWQ8(xp, s0, s1)                                                                  \
        "vpbroadcastd " xp ", %[xb]\n\t"                                                      \
        "vpmaddwd %[xb], %[w0], %[t]\n\t"                                                     \
        "vpaddd %[t], " s0 ", " s0 "\n\t"                                                     \
        "vpmaddwd %[xb], %[w1], %[t]\n\t"                                                     \
        "vpaddd %[t], " s1 ", " s1 "\n\t"
        __asm__("vmovdqu %[c0], %x[w0]\n\t"
                "vpunpckhbw %[c1], %x[w0], %x[w1]\n\t" /* columns 8-15: (row 2p, row 2p + 1) */
                "vpunpcklbw %[c1], %x[w0], %x[w0]\n\t" /* 0-7 */
                "vpmovsxbw %x[w0], %[w0]\n\t"
                "vpmovsxbw %x[w1], %[w1]\n\t"
                I8_ROWQ8("%[x0]", "%[s00]", "%[s01]") I8_ROWQ8("%[x1]", "%[s10]", "%[s11]")
                I8_ROWQ8("%[x2]", "%[s20]", "%[s21]") I8_ROWQ8("%[x3]", "%[s30]", "%[s31]")
                : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11),
                  [s20] "+x"(s20), [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31),
                  [w0] "=&x"(w0), [w1] "=&x"(w1), [xb] "=&x"(xb), [t] "=&x"(t)
                : [c0] "m"(*(const __m128i *)pp), [c1] "m"(*(const __m128i *)(pp + I8_TILE)),
                  [x0] "m"(xw[p]), [x1] "m"(x1[p]), [x2] "m"(x2[p]), [x3] "m"(x3[p]));
#undef I8_ROWQ8
    }
    dot[0][0] = s00, dot[0][1] = s01, dot[1][0] = s10, dot[1][1] = s11;
    dot[2][0] = s20, dot[2][1] = s21, dot[3][0] = s30, dot[3][1] = s31;
}

/* q8_i8_tile_plain with AVX2: each pair of code rows becomes 16-bit pairs per column,
 * multiplied with the row's pair of activations by `vpmaddwd`. */
static inline __attribute__((always_inline)) void q8_i8_tile_n(
    const int8_t *wp, const float *sp, const float *op, const int16_t *x16, const float *dx,
    const float *xs, float *acc, int rows, int k, int bs) {
    const int blocks = k / bs;
    const int32_t *xw = (const int32_t *)x16; /* pairs of 16-bit activations */
    /* The float32 sums live in `acc` (L1), not in registers: with them the tile's 16 AVX2
     * registers spilled its integer sums in the inner loop (2-4% slower, Zen 3). */
    for (int i = 0; i < rows * I8_TILE; i++) acc[i] = 0.f;
#define OUT_LD(m, h) _mm256_loadu_ps(acc + (m) * I8_TILE + 8 * (h))
#define OUT_ST(m, h, v) _mm256_storeu_ps(acc + (m) * I8_TILE + 8 * (h), v)
    for (int b = 0; b < blocks; b++) {
        __m256i dot[I8_ROWS][2];
        for (int m = 0; m < I8_ROWS; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
        if (rows == 4) q8_pairs4(wp, xw, k, b * bs / 2, (b + 1) * bs / 2, dot);
        for (int p = b * bs / 2; rows < 4 && p < (b + 1) * bs / 2; p++) {
            const int8_t *pp = wp + (size_t)p * 2 * I8_TILE;
            if (p % 2 == 0) I8_PREFETCH(pp);
            const __m128i c0 = _mm_loadu_si128((const __m128i *)pp);
            const __m128i c1 = _mm_loadu_si128((const __m128i *)(pp + I8_TILE));
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c0, c1)); /* columns 0-7 */
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(c0, c1)); /* 8-15 */
#pragma GCC unroll 4
            for (int m = 0; m < I8_ROWS; m++) {
                if (m >= rows) continue;
                const __m256i xb = _mm256_set1_epi32(xw[(size_t)m * (k / 2) + p]);
                dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(w0, xb));
                dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(w1, xb));
            }
        }
        const __m256 s0 = _mm256_loadu_ps(sp + (size_t)b * I8_TILE);
        const __m256 s1 = _mm256_loadu_ps(sp + (size_t)b * I8_TILE + 8);
#pragma GCC unroll 4
        for (int m = 0; m < I8_ROWS; m++) {
            if (m >= rows) continue;
            const __m256 d = _mm256_set1_ps(dx[(size_t)m * blocks + b]);
            OUT_ST(m, 0, _mm256_fmadd_ps(_mm256_mul_ps(s0, d), _mm256_cvtepi32_ps(dot[m][0]),
                                         OUT_LD(m, 0)));
            OUT_ST(m, 1, _mm256_fmadd_ps(_mm256_mul_ps(s1, d), _mm256_cvtepi32_ps(dot[m][1]),
                                         OUT_LD(m, 1)));
        }
        if (op != NULL) {
            const __m256 o0 = _mm256_loadu_ps(op + (size_t)b * I8_TILE);
            const __m256 o1 = _mm256_loadu_ps(op + (size_t)b * I8_TILE + 8);
            for (int m = 0; m < rows; m++) {
                const __m256 sx = _mm256_set1_ps(xs[(size_t)m * blocks + b]);
                OUT_ST(m, 0, _mm256_fmadd_ps(o0, sx, OUT_LD(m, 0)));
                OUT_ST(m, 1, _mm256_fmadd_ps(o1, sx, OUT_LD(m, 1)));
            }
        }
    }
#undef OUT_LD
#undef OUT_ST
}

static void w4_i8_tile(const uint8_t *wp, const uint16_t *sbp, const int8_t *xq, const float *dx,
                       const float *xs, float *acc, int rows, int k, int gs) {
    switch (rows) {
#define I8_CASE(r) case r: w4_i8_tile_n(wp, sbp, xq, dx, xs, acc, r, k, gs); break;
        I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4)
#undef I8_CASE
    }
}

/* `hp`: the 6-bit layout's top bits (NULL: 4-bit codes). */
static void w4q_i8_tile(const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp,
                        const int8_t *xq, const float *dx, const float *xs, const int16_t *bsum,
                        float *acc, int rows, int k, int gs) {
#if defined(I8_AVX512) && defined(__AVX512VNNI__)
    /* activations per super-block (`bsum`): super-block scales (i8_kq_start512) or Q6_K's and
     * Q4_0's symmetric groups (i8_sym_group512) summed per super-block in the VNNI tiles */
    const int kq = zp == I8_KQ && bsum != NULL, sq = zp > 0 && bsum != NULL;
#else
    const int kq = 0, sq = 0;
#endif
#ifdef I8_WIDE_ROWS /* defined with AVX-512 VNNI, as kq and sq above */
    if (rows > I8_ROWS) {
        switch (rows + I8_WIDE_ROWS * (hp != NULL) + 2 * I8_WIDE_ROWS * (zp == I8_NL) +
                4 * I8_WIDE_ROWS * kq + 6 * I8_WIDE_ROWS * sq) {
#define I8_CASE(r) case r: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 0, 0, bsum, 0); break; \
                   case r + I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 1, 0, bsum, 0); break; \
                   case r + 2 * I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 0, 1, bsum, 0); break; \
                   case r + 4 * I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 0, 0, bsum, 1); break; \
                   case r + 5 * I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 1, 0, bsum, 1); break; \
                   case r + 6 * I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 0, 0, bsum, 2); break; \
                   case r + 7 * I8_WIDE_ROWS: w4q_i8_tile512_wide_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, 1, 0, bsum, 2); break;
            I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8)
#undef I8_CASE
        }
        return;
    }
#endif
#ifdef I8_AVX512
#define I8_QUADS(r, six, nl, kq) \
    w4q_i8_tile512_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, six, nl, bsum, kq)
#else
#define I8_QUADS(r, six, nl, kq) w4q_i8_tile_n(wp, hp, sbp, zp, xq, dx, xs, acc, r, k, gs, six, nl, bsum)
#endif
    switch (rows + 4 * (hp != NULL) + 8 * (zp == I8_NL) + 12 * kq + 20 * sq) {
#define I8_CASE(r) case r: I8_QUADS(r, 0, 0, 0); break; \
                   case r + 4: I8_QUADS(r, 1, 0, 0); break; \
                   case r + 8: I8_QUADS(r, 0, 1, 0); break; \
                   case r + 12: I8_QUADS(r, 0, 0, 1); break; \
                   case r + 16: I8_QUADS(r, 1, 0, 1); break; \
                   case r + 20: I8_QUADS(r, 0, 0, 2); break; \
                   case r + 24: I8_QUADS(r, 1, 0, 2); break;
        I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4)
#undef I8_CASE
    }
#undef I8_QUADS
}

static void q8_i8_tile(const int8_t *wp, const float *sp, const float *op, const int16_t *x16,
                       const float *dx, const float *xs, float *acc, int rows, int k, int bs) {
    switch (rows) {
#define I8_CASE(r) case r: q8_i8_tile_n(wp, sp, op, x16, dx, xs, acc, r, k, bs); break;
        I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4)
#undef I8_CASE
    }
}
#endif

#ifdef I8_NEON

#ifdef __ARM_FEATURE_DOTPROD /* Armv8.2 `sdot` (Apple silicon, Graviton 2+, ...) */
#define I8_DOTPROD 1

/* The codes of four values of K (k0..k3, 16 columns each) as four vectors of four columns,
 * each column's four codes adjacent: the operand order of `sdot`. */
static inline void i8_columns4(int8x16_t k0, int8x16_t k1, int8x16_t k2, int8x16_t k3,
                               int8x16_t w[4]) {
    const int16x8_t a = vreinterpretq_s16_s8(vzip1q_s8(k0, k1));
    const int16x8_t b = vreinterpretq_s16_s8(vzip2q_s8(k0, k1));
    const int16x8_t c = vreinterpretq_s16_s8(vzip1q_s8(k2, k3));
    const int16x8_t d = vreinterpretq_s16_s8(vzip2q_s8(k2, k3));
    w[0] = vreinterpretq_s8_s16(vzip1q_s16(a, c));
    w[1] = vreinterpretq_s8_s16(vzip2q_s16(a, c));
    w[2] = vreinterpretq_s8_s16(vzip1q_s16(b, d));
    w[3] = vreinterpretq_s8_s16(vzip2q_s16(b, d));
}

/* Four activations (or two, then two zeros) in every 32-bit lane. */
static inline int8x16_t i8_x4(const int8_t *x, int four) {
    const int8_t v[4] = {x[0], x[1], four ? x[2] : 0, four ? x[3] : 0};
    int32_t w;
    memcpy(&w, v, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(w));
}
#endif

/* w4_i8_tile_plain with NEON. */
static void w4_i8_tile(const uint8_t *wp, const uint16_t *sbp, const int8_t *xq, const float *dx,
                       const float *xs, float *acc, int rows, int k, int gs) {
    const int groups = k / gs, pairs = gs / 2;
    const uint8x16_t low = vdupq_n_u8(15);
    float32x4_t out[I8_ROWS][4];
    for (int m = 0; m < I8_ROWS; m++)
        for (int q = 0; q < 4; q++) out[m][q] = vdupq_n_f32(0.f);
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * pairs * I8_TILE;
        int32x4_t dot[I8_ROWS][4];
        for (int m = 0; m < I8_ROWS; m++)
            for (int q = 0; q < 4; q++) dot[m][q] = vdupq_n_s32(0);
#ifdef I8_DOTPROD
        for (int p = 0; p < pairs; p += 2) {
            const int two = p + 1 < pairs;
            const uint8x16_t v0 = vld1q_u8(gp + p * I8_TILE);
            const uint8x16_t v1 = two ? vld1q_u8(gp + (p + 1) * I8_TILE) : vdupq_n_u8(0);
            int8x16_t w[4];
            i8_columns4(vreinterpretq_s8_u8(vandq_u8(v0, low)), vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)),
                        vreinterpretq_s8_u8(vandq_u8(v1, low)), vreinterpretq_s8_u8(vshrq_n_u8(v1, 4)), w);
            for (int m = 0; m < rows; m++) {
                const int8x16_t xv = i8_x4(xq + (size_t)m * k + (size_t)g * gs + 2 * p, two);
                for (int q = 0; q < 4; q++) dot[m][q] = vdotq_s32(dot[m][q], w[q], xv);
            }
        }
#else
        for (int p0 = 0; p0 < pairs; p0 += 8) {
            int16x8_t d16[I8_ROWS][2];
            for (int m = 0; m < I8_ROWS; m++) d16[m][0] = d16[m][1] = vdupq_n_s16(0);
            const int end = p0 + 8 < pairs ? p0 + 8 : pairs;
            for (int p = p0; p < end; p++) {
                const uint8x16_t v = vld1q_u8(gp + p * I8_TILE);
                const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, low));
                const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                for (int m = 0; m < rows; m++) {
                    const int8_t *xm = xq + (size_t)m * k + (size_t)g * gs + 2 * p;
                    const int8x8_t x0 = vdup_n_s8(xm[0]), x1 = vdup_n_s8(xm[1]);
                    d16[m][0] = vmlal_s8(d16[m][0], vget_low_s8(lo), x0);
                    d16[m][0] = vmlal_s8(d16[m][0], vget_low_s8(hi), x1);
                    d16[m][1] = vmlal_s8(d16[m][1], vget_high_s8(lo), x0);
                    d16[m][1] = vmlal_s8(d16[m][1], vget_high_s8(hi), x1);
                }
            }
            for (int m = 0; m < rows; m++)
                for (int h = 0; h < 2; h++) {
                    dot[m][2 * h] = vaddw_s16(dot[m][2 * h], vget_low_s16(d16[m][h]));
                    dot[m][2 * h + 1] = vaddw_s16(dot[m][2 * h + 1], vget_high_s16(d16[m][h]));
                }
        }
#endif
        const uint16_t *sp = sbp + (size_t)g * 2 * I8_TILE;
        for (int q = 0; q < 4; q++) {
            const float32x4_t s = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sp + 4 * q)));
            const float32x4_t b = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sp + I8_TILE + 4 * q)));
            for (int m = 0; m < rows; m++) {
                const float d = dx[(size_t)m * groups + g], sx = xs[(size_t)m * groups + g];
                /* acc += s * (d * dot) + b * sx, rounded as the plain C */
                const float32x4_t t = vmulq_f32(s, vmulq_n_f32(vcvtq_f32_s32(dot[m][q]), d));
                out[m][q] = vaddq_f32(out[m][q], vaddq_f32(t, vmulq_n_f32(b, sx)));
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int q = 0; q < 4; q++) vst1q_f32(acc + m * I8_TILE + 4 * q, out[m][q]);
}

/* q8_i8_tile_plain with NEON. */
static void q8_i8_tile(const int8_t *wp, const float *sp, const float *op, const int8_t *xq,
                       const float *dx, const float *xs, float *acc, int rows, int k, int bs) {
    const int blocks = k / bs;
    float32x4_t out[I8_ROWS][4];
    for (int m = 0; m < I8_ROWS; m++)
        for (int q = 0; q < 4; q++) out[m][q] = vdupq_n_f32(0.f);
    for (int b = 0; b < blocks; b++) {
        int32x4_t dot[I8_ROWS][4];
        for (int m = 0; m < I8_ROWS; m++)
            for (int q = 0; q < 4; q++) dot[m][q] = vdupq_n_s32(0);
#ifdef I8_DOTPROD
        const int end = (b + 1) * bs / 2;
        for (int p = b * bs / 2; p < end; p += 2) {
            const int two = p + 1 < end;
            const int8_t *pp = wp + (size_t)p * 2 * I8_TILE;
            int8x16_t w[4];
            i8_columns4(vld1q_s8(pp), vld1q_s8(pp + I8_TILE),
                        two ? vld1q_s8(pp + 2 * I8_TILE) : vdupq_n_s8(0),
                        two ? vld1q_s8(pp + 3 * I8_TILE) : vdupq_n_s8(0), w);
            for (int m = 0; m < rows; m++) {
                const int8x16_t xv = i8_x4(xq + (size_t)m * k + 2 * p, two);
                for (int q = 0; q < 4; q++) dot[m][q] = vdotq_s32(dot[m][q], w[q], xv);
            }
        }
#else
        for (int p = b * bs / 2; p < (b + 1) * bs / 2; p++) {
            const int8x16_t c0 = vld1q_s8(wp + (size_t)p * 2 * I8_TILE);
            const int8x16_t c1 = vld1q_s8(wp + (size_t)p * 2 * I8_TILE + I8_TILE);
            for (int m = 0; m < rows; m++) {
                const int8_t *xm = xq + (size_t)m * k + 2 * p;
                const int8x8_t x0 = vdup_n_s8(xm[0]), x1 = vdup_n_s8(xm[1]);
                const int16x8_t l = vmlal_s8(vmull_s8(vget_low_s8(c0), x0), vget_low_s8(c1), x1);
                const int16x8_t h = vmlal_s8(vmull_s8(vget_high_s8(c0), x0), vget_high_s8(c1), x1);
                dot[m][0] = vaddw_s16(dot[m][0], vget_low_s16(l));
                dot[m][1] = vaddw_s16(dot[m][1], vget_high_s16(l));
                dot[m][2] = vaddw_s16(dot[m][2], vget_low_s16(h));
                dot[m][3] = vaddw_s16(dot[m][3], vget_high_s16(h));
            }
        }
#endif
        for (int q = 0; q < 4; q++) {
            const float32x4_t s = vld1q_f32(sp + (size_t)b * I8_TILE + 4 * q);
            const float32x4_t o = op != NULL ? vld1q_f32(op + (size_t)b * I8_TILE + 4 * q)
                                             : vdupq_n_f32(0.f);
            for (int m = 0; m < rows; m++) {
                /* a += s * (dx * dot); a += o * xs: rounded as the plain C */
                const float32x4_t t = vmulq_n_f32(vcvtq_f32_s32(dot[m][q]), dx[(size_t)m * blocks + b]);
                out[m][q] = vaddq_f32(out[m][q], vmulq_f32(s, t));
                if (op != NULL)
                    out[m][q] = vaddq_f32(out[m][q], vmulq_n_f32(o, xs[(size_t)m * blocks + b]));
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int q = 0; q < 4; q++) vst1q_f32(acc + m * I8_TILE + 4 * q, out[m][q]);
}

#define I8_NEON_PIECE 32 /* chunks of a group unpacked at a time (128 values of K) */

/* w4q_i8_tile_plain with NEON (the 6-bit layout and every scale form too). A chunk's 32 bytes
 * are already `sdot`'s operands: bytes 16h + 4j + i hold value i of column 4h + j (low nibble)
 * and of column 8 + 4h + j (high one), so one AND or shift (and the top bits) gives four
 * vectors of four columns x four values of K. Up to I8_NEON_PIECE chunks of a group are
 * unpacked once into such int8 vectors, then each row multiplies them: `sdot`, or `smull`
 * into int16 pairs widened by `sadalp` (4-bit and 6-bit codes: 4 chunks per int16 sum, at most
 * 4 * 63 * 127; the code book: 2). IQ4_NL's code book is looked up as its signed values
 * (`tbl`), their sums made the unsigned bytes' (I8_NL_VALUES) by 128 times the row's sum of x.
 * The same integers as the plain C, the scales applied with its float operations in its
 * order (bit for bit where the compiler does not fuse them there). */
static void w4q_i8_tile(const uint8_t *wp, const uint8_t *hp, const uint16_t *sbp, int zp,
                        const int8_t *xq, const float *dx, const float *xs, const int16_t *bsum,
                        float *acc, int rows, int k, int gs) {
    (void)bsum; /* the super-block sums are the AVX2 tile's */
    static const int8_t book_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1, 13, 25, 38, 53, 69, 89, 113};
    const int groups = k / gs, chunks = gs / 4, nl = zp == I8_NL;
    const uint8x16_t low = vdupq_n_u8(15), tops = vdupq_n_u8(0x30);
    const int8x16_t book = vld1q_s8(book_values);
    int8x16_t w[I8_NEON_PIECE][4];
    float32x4_t out[I8_ROWS][4];
    for (int m = 0; m < I8_ROWS; m++)
        for (int q = 0; q < 4; q++) out[m][q] = vdupq_n_f32(0.f);
    for (int g = 0; g < groups; g++) {
        const uint8_t *gp = wp + (size_t)g * chunks * 2 * I8_TILE;
        const uint8_t *hg = hp != NULL ? hp + (size_t)g * chunks * I8_TILE : NULL;
        int32x4_t dot[I8_ROWS][4];
        for (int m = 0; m < I8_ROWS; m++)
            for (int q = 0; q < 4; q++) dot[m][q] = vdupq_n_s32(0);
        for (int c0 = 0; c0 < chunks; c0 += I8_NEON_PIECE) {
            const int n = chunks - c0 < I8_NEON_PIECE ? chunks - c0 : I8_NEON_PIECE;
            for (int c = 0; c < n; c++) {
                const int cc = c0 + c;
                for (int h = 0; h < 2; h++) {
                    const uint8x16_t v = vld1q_u8(gp + cc * 32 + 16 * h);
                    uint8x16_t a = vandq_u8(v, low), b = vshrq_n_u8(v, 4);
                    if (hg != NULL) { /* bits 0-1 / 2-3 of the pair's byte, or 4-5 / 6-7 */
                        const uint8x16_t t = vld1q_u8(hg + (cc / 2) * 32 + 16 * h);
                        a = vorrq_u8(a, vandq_u8(cc % 2 ? t : vshlq_n_u8(t, 4), tops));
                        b = vorrq_u8(b, vandq_u8(cc % 2 ? vshrq_n_u8(t, 2) : vshlq_n_u8(t, 2), tops));
                    }
                    w[c][h] = nl ? vqtbl1q_s8(book, a) : vreinterpretq_s8_u8(a);
                    w[c][2 + h] = nl ? vqtbl1q_s8(book, b) : vreinterpretq_s8_u8(b);
                }
            }
            for (int m = 0; m < rows; m++) {
                const int8_t *xm = xq + (size_t)m * k + (size_t)g * gs + 4 * c0;
#ifdef I8_DOTPROD
                for (int c = 0; c < n; c++) {
                    int32_t four;
                    memcpy(&four, xm + 4 * c, sizeof four);
                    const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(four));
                    for (int q = 0; q < 4; q++) dot[m][q] = vdotq_s32(dot[m][q], w[c][q], xv);
                }
#else
                const int run = nl ? 2 : 4; /* chunks per int16 sum (see above) */
                int32x4_t lo[4], hi[4]; /* columns 4q, 4q + 1 and 4q + 2, 4q + 3: pairs of K */
                for (int q = 0; q < 4; q++) lo[q] = hi[q] = vdupq_n_s32(0);
                for (int c1 = 0; c1 < n; c1 += run) {
                    int16x8_t l16[4], h16[4];
                    for (int q = 0; q < 4; q++) l16[q] = h16[q] = vdupq_n_s16(0);
                    for (int c = c1; c < c1 + run && c < n; c++) {
                        int32_t four;
                        memcpy(&four, xm + 4 * c, sizeof four);
                        const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(four));
                        for (int q = 0; q < 4; q++) {
                            l16[q] = vmlal_s8(l16[q], vget_low_s8(w[c][q]), vget_low_s8(xv));
                            h16[q] = vmlal_high_s8(h16[q], w[c][q], xv);
                        }
                    }
                    for (int q = 0; q < 4; q++) {
                        lo[q] = vpadalq_s16(lo[q], l16[q]);
                        hi[q] = vpadalq_s16(hi[q], h16[q]);
                    }
                }
                for (int q = 0; q < 4; q++) dot[m][q] = vaddq_s32(dot[m][q], vpaddq_s32(lo[q], hi[q]));
#endif
            }
        }
        float sc[I8_TILE], of[I8_TILE];
        for (int j = 0; j < I8_TILE; j++) group_scale(sbp, zp, g, j, &sc[j], &of[j]);
        for (int m = 0; m < rows; m++) {
            const float d = dx[(size_t)m * groups + g], sx = xs[(size_t)m * groups + g];
            int32_t sum = 0; /* the code book's signed values to its bytes: + 128 * sum of x */
            if (nl)
                for (int v = 0; v < gs; v++) sum += xq[(size_t)m * k + (size_t)g * gs + v];
            for (int q = 0; q < 4; q++) {
                const int32x4_t dq = vaddq_s32(dot[m][q], vdupq_n_s32(128 * sum));
                /* acc += sc * (d * dot) + o * sx, rounded as the plain C */
                const float32x4_t t = vmulq_f32(vld1q_f32(sc + 4 * q),
                                                vmulq_n_f32(vcvtq_f32_s32(dq), d));
                out[m][q] = vaddq_f32(out[m][q], vaddq_f32(t, vmulq_n_f32(vld1q_f32(of + 4 * q), sx)));
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int q = 0; q < 4; q++) vst1q_f32(acc + m * I8_TILE + 4 * q, out[m][q]);
}
#endif

/* Whether this build has vector loops for the 6-bit layout and every scale form of the quads
 * layout (int8_dot.c's w6_gemm: AVX2 and up, NEON): where GGUF Q5/Q6 and IQ4 matrices keep
 * their own codes. */
int w6_vector(void) {
#if defined(I8_AVX2) || defined(I8_NEON)
    return 1;
#else
    return 0;
#endif
}

/* Whether this build has vector loops for the quads layout (else float32 layers keep the
 * pairs layout, whose vector loops it has: NEON). */
int w4q_vector(void) {
#ifdef I8_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Whether this build multiplies float32 activations through int8 dot products (1: AVX2,
 * 2: NEON, 3: NEON with `sdot`). */
int i8_dot_isa(void) {
#if defined(I8_AVX2)
    return 1;
#elif defined(I8_DOTPROD)
    return 3;
#elif defined(I8_NEON)
    return 2;
#else
    return 0;
#endif
}

/* One row of a tile's 16 results into y at `at`: float32, or rounded to bf16 (`y_bf16`). */
static inline void store_tile_row(void *y, int y_bf16, size_t at, const float *acc) {
#ifdef I8_AVX512
    if (y_bf16) { /* f32_to_bf16 on 16 lanes at once: the same bits */
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(acc));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(
                                                              _mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        return;
    }
#endif
    if (y_bf16)
        for (int j = 0; j < I8_TILE; j++) ((uint16_t *)y)[at + j] = f32_to_bf16(acc[j]);
    else
        memcpy((float *)y + at, acc, sizeof(float) * I8_TILE);
}

/* y [M][N] (float32, or x and y bf16 when `y_bf16`) = x [M][K] @ W.T for the 4-bit pairs layout of
 * quant_gemm.c (or the quads layout, `quads`), through int8 activations per group; `plain`
 * forces the plain-C loops. Returns 0, or -1 when scratch memory cannot be had. */
static int w4_gemm_i8(const void *x, const uint8_t *packed, const uint8_t *high,
                      const uint16_t *sb, int zp, void *y, int y_bf16, int m_rows, int k, int n,
                      int gs, int threads, int plain, int quads) {
    const int groups = k / gs, tiles = n / I8_TILE;
    (void)plain; /* builds without the vector loops have only the plain ones */
    int8_t *xq = malloc((size_t)m_rows * k + 64);
    float *dx = malloc(sizeof(float) * ((size_t)m_rows * groups + 1));
    float *xs = malloc(sizeof(float) * ((size_t)m_rows * groups + 1));
    /* activations per super-block (quantize_rows_super), as llama.cpp's Q8_K: for super-block
     * scales, and for the symmetric groups of Q6_K's form (6-bit codes, zero point 32, groups
     * of 16) and Q4_0's (4-bit, 8, 32), whose VNNI tiles then take 2 float32 operations per
     * group and row, not 4 (i8_sym_group512) */
    const int super = k % 256 == 0 &&
                      ((zp == I8_KQ && 256 % gs == 0) || (zp == 32 && high != NULL && gs == 16) ||
                       (zp == 8 && high == NULL && gs == 32));
    int16_t *bsum = super ? malloc(sizeof(int16_t) * ((size_t)m_rows * groups + 2)) : NULL;
    if (xq == NULL || dx == NULL || xs == NULL || (super && bsum == NULL) ||
        (super && quantize_rows_super(x, y_bf16, m_rows, k, gs, xq, dx, xs, bsum, threads))) {
        free(xq);
        free(dx);
        free(xs);
        free(bsum);
        return -1;
    }
    if (!super) quantize_rows_i8(x, y_bf16, m_rows, k, gs, xq, dx, xs, threads);
#if defined(I8_AVX512) && defined(__AVX512VNNI__)
    /* Q6_K's and Q4_0's forms in the VNNI tiles (i8_sym_group512): xs holds -zp * bsum as
     * int32 */
    if (super && zp > 0 && !plain) {
        int32_t *off = (int32_t *)xs;
        for (size_t i = 0; i < (size_t)m_rows * groups; i++) off[i] = -zp * bsum[i];
    }
#endif
#ifdef I8_AVX512
    /* The pairs layout's 512-bit tile reads x with each 8 values reordered. */
    const int wide = !plain && !quads && gs % 8 == 0;
    int8_t *xp = wide ? malloc((size_t)m_rows * k + 64) : NULL;
    if (wide && xp == NULL) {
        free(xq);
        free(dx);
        free(xs);
        free(bsum);
        return -1;
    }
    if (wide) i8_evens_odds(xq, xp, (size_t)m_rows * k);
#endif
#ifdef I8_WIDE_ROWS
    const int pass = !plain && quads ? I8_WIDE_ROWS : I8_ROWS; /* rows per pass over a tile */
#else
    const int pass = I8_ROWS;
#endif
    struct work_split split;
    work_split_init(&split, tiles, threads);
#pragma omp parallel num_threads(threads)
    {
        int t0, t1;
        while (work_split_take(&split, omp_get_thread_num(), &t0, &t1))
        for (int t = t0; t < t1; t++) {
            const uint8_t *wp = packed + (size_t)t * (k / 2) * I8_TILE;
            const uint8_t *hp = high != NULL ? high + (size_t)t * (k / 4) * I8_TILE : NULL;
            const uint16_t *sbp =
                sb + (size_t)t * (zp == I8_KQ ? (size_t)k / 256 : (size_t)groups) * sb_stride(zp);
            float acc[I8_MAX_ROWS * I8_TILE];
            for (int m0 = 0; m0 < m_rows; m0 += pass) {
                const int rows = m_rows - m0 < pass ? m_rows - m0 : pass;
                const int8_t *xm = xq + (size_t)m0 * k;
                const float *dm = dx + (size_t)m0 * groups, *sm = xs + (size_t)m0 * groups;
#ifdef I8_AVX512
                if (wide)
                    w4_i8_tile512(wp, sbp, xp + (size_t)m0 * k, dm, sm, acc, rows, k, gs);
                else
#endif
#if defined(I8_AVX2) || defined(I8_NEON)
                if (!plain && quads)
                    w4q_i8_tile(wp, hp, sbp, zp, xm, dm, sm, bsum != NULL ? bsum + (size_t)m0 * groups : NULL,
                                acc, rows, k, gs);
                else
#endif
#if defined(I8_AVX2) || defined(I8_NEON)
                if (!plain && !quads)
                    w4_i8_tile(wp, sbp, xm, dm, sm, acc, rows, k, gs);
                else
#endif
                if (quads)
                    w4q_i8_tile_plain(wp, hp, sbp, zp, xm, dm, sm, acc, rows, k, gs);
                else
                    w4_i8_tile_plain(wp, sbp, xm, dm, sm, acc, rows, k, gs);
                for (int m = 0; m < rows; m++)
                    store_tile_row(y, y_bf16, (size_t)(m0 + m) * n + (size_t)t * I8_TILE,
                                   acc + m * I8_TILE);
            }
        }
    }
    free(xq);
    free(dx);
    free(xs);
    free(bsum);
#ifdef I8_AVX512
    free(xp);
#endif
    return 0;
}

/* float16 values as float32 (`count` a multiple of 16). */
static void i8_widen_halves(const uint16_t *h, float *f, size_t count) {
#if defined(I8_AVX2)
    for (size_t i = 0; i < count; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(I8_NEON)
    for (size_t i = 0; i < count; i += 4)
        vst1q_f32(f + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#else
    for (size_t i = 0; i < count; i++) f[i] = f16_to_f32(h[i]);
#endif
}

/* y [M][N] (float32, or x and y bf16 when `y_bf16`) = x [M][K] @ W.T for 8-bit blocks of
 * `bs` values (see the top), through int8 activations per block; `scales` float16 when
 * `half` (else float32), `offsets` float32 or NULL; `plain` forces the plain-C loops. Needs N % 16 == 0, K % bs == 0, bs even. Returns 0, or -1
 * when scratch memory cannot be had. */
static int q8_gemm_i8(const void *x, const int8_t *codes, const void *scales, int half,
                      const float *offsets, void *y, int y_bf16, int m_rows, int k, int n, int bs,
                      int threads, int plain) {
    const int blocks = k / bs, tiles = n / I8_TILE;
    (void)plain;
    int8_t *xq = malloc((size_t)m_rows * k + 64);
    int16_t *x16 = malloc(sizeof(int16_t) * ((size_t)m_rows * k + 32));
    float *dx = malloc(sizeof(float) * ((size_t)m_rows * blocks + 1));
    float *xs = malloc(sizeof(float) * ((size_t)m_rows * blocks + 1));
    if (xq == NULL || x16 == NULL || dx == NULL || xs == NULL) {
        free(xq);
        free(x16);
        free(dx);
        free(xs);
        return -1;
    }
    quantize_rows_i8(x, y_bf16, m_rows, k, bs, xq, dx, xs, threads);
#ifdef I8_Q8_VNNI
    const int wide = !plain && bs % 4 == 0;
#else
    const int wide = 0;
#endif
    for (size_t i = 0; !wide && i < (size_t)m_rows * k; i++) x16[i] = xq[i]; /* AVX2 tile's */
#ifdef I8_Q8_VNNI
    int32_t *isum = wide ? malloc(sizeof(int32_t) * ((size_t)m_rows * blocks + 1)) : NULL;
    if (wide && isum == NULL) {
        free(xq);
        free(x16);
        free(dx);
        free(xs);
        return -1;
    }
    for (size_t i = 0; wide && i < (size_t)m_rows * blocks; i++) {
        int32_t sum = 0;
        for (int j = 0; j < bs; j++) sum += xq[i * bs + j];
        isum[i] = sum;
    }
#endif
#ifdef I8_Q8_VNNI
    const int pass = wide ? I8_WIDE_ROWS : I8_ROWS; /* rows per pass over a tile */
#else
    const int pass = I8_ROWS;
#endif
#ifdef I8_Q8_AMX
    /* 16-row passes through AMX; each thread makes a tile's B rows once for all of them */
    const int amx = wide && m_rows >= I8_Q8_AMX_MIN_ROWS && bs <= 64 && amx_allowed();
    int8_t *bbufs = amx ? aligned_alloc(64, (size_t)k * I8_TILE * threads) : NULL;
    if (amx && bbufs == NULL) {
        free(xq);
        free(x16);
        free(dx);
        free(xs);
        free(isum);
        return -1;
    }
#endif
    struct work_split split;
    work_split_init(&split, tiles, threads);
#pragma omp parallel num_threads(threads)
    {
#ifdef I8_Q8_AMX
        int8_t *bbuf = amx ? bbufs + (size_t)k * I8_TILE * omp_get_thread_num() : NULL;
        if (amx) q8_amx_configure(bs);
#endif
        int t0, t1;
        while (work_split_take(&split, omp_get_thread_num(), &t0, &t1))
        for (int t = t0; t < t1; t++) {
            const int8_t *wp = codes + (size_t)t * k * I8_TILE;
            /* float16 scales (Q8_0's own) become the tile's float32 ones here, in L1: the matrix
             * keeps the file's 2 bytes a block and column, the tiles read floats */
            float widened[half ? (size_t)blocks * I8_TILE : 1];
            const float *sp = (const float *)scales + (size_t)t * blocks * I8_TILE;
            if (half) {
                i8_widen_halves((const uint16_t *)scales + (size_t)t * blocks * I8_TILE, widened,
                                (size_t)blocks * I8_TILE);
                sp = widened;
            }
            const float *op = offsets != NULL ? offsets + (size_t)t * blocks * I8_TILE : NULL;
            int first = 0; /* the first row the vector tiles take */
#ifdef I8_Q8_AMX
            float acc[16 * I8_TILE];
            if (amx) {
                q8_amx_columns(wp, bbuf, k);
                for (; first + 16 <= m_rows; first += 16) {
                    q8_amx_rows16(bbuf, sp, op, xq + (size_t)first * k, dx + (size_t)first * blocks,
                                  xs + (size_t)first * blocks, acc, k, bs);
                    for (int m = 0; m < 16; m++)
                        store_tile_row(y, y_bf16, (size_t)(first + m) * n + (size_t)t * I8_TILE,
                                       acc + m * I8_TILE);
                }
            }
#else
            float acc[I8_MAX_ROWS * I8_TILE];
#endif
            for (int m0 = first; m0 < m_rows; m0 += pass) {
                const int rows = m_rows - m0 < pass ? m_rows - m0 : pass;
                const float *dm = dx + (size_t)m0 * blocks, *sm = xs + (size_t)m0 * blocks;
#ifdef I8_Q8_VNNI
                if (wide)
                    q8_i8_tile512(wp, sp, op, xq + (size_t)m0 * k, isum + (size_t)m0 * blocks,
                                  dm, sm, acc, rows, k, bs);
                else
#endif
#if defined(I8_AVX2)
                if (!plain)
                    q8_i8_tile(wp, sp, op, x16 + (size_t)m0 * k, dm, sm, acc, rows, k, bs);
                else
#elif defined(I8_NEON)
                if (!plain)
                    q8_i8_tile(wp, sp, op, xq + (size_t)m0 * k, dm, sm, acc, rows, k, bs);
                else
#endif
                    q8_i8_tile_plain(wp, sp, op, xq + (size_t)m0 * k, dm, sm, acc, rows, k, bs);
                for (int m = 0; m < rows; m++)
                    store_tile_row(y, y_bf16, (size_t)(m0 + m) * n + (size_t)t * I8_TILE,
                                   acc + m * I8_TILE);
            }
        }
#ifdef I8_Q8_AMX
        if (amx) _tile_release();
#endif
    }
    free(xq);
    free(x16);
    free(dx);
    free(xs);
#ifdef I8_Q8_VNNI
    free(isum);
#endif
#ifdef I8_Q8_AMX
    free(bbufs);
#endif
    return 0;
}

/* The least row count whose 8-bit product takes AMX in 16-row passes (0: never, in this build
 * or process), for the tests. */
int q8_amx_rows(void) {
#ifdef I8_Q8_AMX
    return amx_allowed() ? I8_Q8_AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

int q8_gemm_f32(const float *x, const int8_t *codes, const void *scales, int half,
                const float *offsets, float *y, int m_rows, int k, int n, int bs, int threads,
                int plain) {
    return q8_gemm_i8(x, codes, scales, half, offsets, y, 0, m_rows, k, n, bs, threads, plain);
}

/* The same for bf16 x and y (the rows read as they are, the products rounded to bf16). */
int q8_gemm_bf16(const uint16_t *x, const int8_t *codes, const void *scales, int half,
                 const float *offsets, uint16_t *y, int m_rows, int k, int n, int bs,
                 int threads) {
    return q8_gemm_i8(x, codes, scales, half, offsets, y, 1, m_rows, k, n, bs, threads, 0);
}

/* The 4-bit product through int8 activations for float32 x and y, for the tests:
 * `plain` picks the plain-C loops over the vector ones. */
int w4_i8_gemm_f32(const float *x, const uint8_t *packed, const uint16_t *sb, float *y,
                   int m_rows, int k, int n, int gs, int threads, int plain) {
    return w4_gemm_i8(x, packed, NULL, sb, 0, y, 0, m_rows, k, n, gs, threads, plain, 0);
}

/* The same for the quads layout (K % 4 == 0, group size % 4 == 0), on every build (the
 * plain-C loops where the build has no vector ones). */
int w4q_gemm_f32(const float *x, const uint8_t *packed, const uint16_t *sb, float *y,
                 int m_rows, int k, int n, int gs, int threads, int plain) {
    return w4_gemm_i8(x, packed, NULL, sb, 0, y, 0, m_rows, k, n, gs, threads, plain, 1);
}

/* The quads layout with the 6-bit layout's top bits (`high`; NULL: 4-bit codes) and
 * symmetric groups (zero point `zp` > 0: scales only; 0: scales and offsets; I8_KQ:
 * super-block scales; I8_NL: IQ4_NL's code book, 4-bit codes), see the top;
 * K % 8 == 0 and group size % 8 == 0 (% 4 without `high`), for float32 x and y, on every build
 * (`plain`: the plain-C loops). */
static int w6_fits(const uint8_t *high, int zp, int k, int gs) {
    return !(high != NULL ? k % 8 || gs % 8 : k % 4 || gs % 4) && !(zp == I8_NL && high != NULL) &&
           !(zp == I8_KQ && (gs != 32 || k % 256));
}

int w6_gemm_f32(const float *x, const uint8_t *packed, const uint8_t *high, const uint16_t *sb,
                int zp, float *y, int m_rows, int k, int n, int gs, int threads, int plain) {
    if (!w6_fits(high, zp, k, gs)) return -2;
    return w4_gemm_i8(x, packed, high, sb, zp, y, 0, m_rows, k, n, gs, threads, plain, 1);
}

/* The pairs layout of `tiles` tiles of K rows rewritten in the quads layout, in parallel
 * (the same bytes per tile, reordered). */
void w4_pairs_to_quads(const uint8_t *src, uint8_t *dst, long tiles, int k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tiles; t++) {
        const uint8_t *s = src + (size_t)t * (k / 2) * I8_TILE;
        uint8_t *d = dst + (size_t)t * (k / 2) * I8_TILE;
        for (int c = 0; c < k / 4; c++)
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 4; i++) {
                    const int kk = 4 * c + i, shift = 4 * (kk & 1);
                    const int lo = (s[(kk / 2) * I8_TILE + j] >> shift) & 15;
                    const int hi = (s[(kk / 2) * I8_TILE + 8 + j] >> shift) & 15;
                    d[c * 2 * I8_TILE + 4 * j + i] = (uint8_t)(lo | hi << 4);
                }
    }
}
