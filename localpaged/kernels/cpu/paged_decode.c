/* Decode attention over the paged KV cache, on the CPU, reading each request's blocks where
 * they lie (torch's path first gathers them into a padded batch, then masks the padding).
 *
 * One task per (request, KV head): the query heads sharing that KV head (GQA) are scored
 * against every context key, softmaxed in float32, and their values summed. The loops over the
 * head dimension are `omp simd`, vectorized by the compiler for the CPU it builds on; with
 * AVX512-BF16 the scores are VDPBF16PS dot products of the bf16 query and key rows.
 *
 *   q        T [B][Hq][D]             out T [B][Hq][D]      (T: bf16, or float32)
 *   k_cache  T [blocks][bs][Hkv][D], v_cache likewise
 *   tables   int32 [B][table_stride]  block ids of each request, in order
 *   seq_lens int32 [B]                context length of each request (including this token)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PD_AVX512BF16 1
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into an integer
 * power (built in the exponent bits) and a polynomial on [-0.5, 0.5] (relative error ~2e-7).
 * The vector forms below compute the same operations in the same order (separate multiplies
 * and adds, as the scalar code compiles under ISO C), so every build gives the same bits. */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504f;
    t = t < -126.f ? -126.f : t;
    const float n = (t + 12582912.f) - 12582912.f; /* round to nearest: 1.5 * 2^23 trick */
    const float f = t - n;
    float p = 1.535336188e-4f;
    p = p * f + 1.339887440e-3f;
    p = p * f + 9.618437357e-3f;
    p = p * f + 5.550332471e-2f;
    p = p * f + 2.402264791e-1f;
    p = p * f + 6.931472028e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* exp_nonpositive on a vector of W bits (512 or 256): exp_nonpositive16 or exp_nonpositive8. */
#define PD_EXP_VECTOR(W, LANES)                                                              \
    static inline __m##W exp_nonpositive##LANES(__m##W x) {                                  \
        const __m##W t = _mm##W##_max_ps(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504f)),  \
                                          _mm##W##_set1_ps(-126.f));                          \
        const __m##W big = _mm##W##_set1_ps(12582912.f);                                     \
        const __m##W n = _mm##W##_sub_ps(_mm##W##_add_ps(t, big), big);                      \
        const __m##W f = _mm##W##_sub_ps(t, n);                                              \
        static const float c[6] = {1.339887440e-3f, 9.618437357e-3f, 5.550332471e-2f,        \
                                   2.402264791e-1f, 6.931472028e-1f, 1.0f};                  \
        __m##W p = _mm##W##_set1_ps(1.535336188e-4f);                                        \
        for (int i = 0; i < 6; i++)                                                          \
            p = _mm##W##_add_ps(_mm##W##_mul_ps(p, f), _mm##W##_set1_ps(c[i]));              \
        const __m##W##i bits = _mm##W##_slli_epi32(                                          \
            _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23);      \
        return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(bits));                            \
    }
#if defined(__AVX512F__)
PD_EXP_VECTOR(512, 16)
#elif defined(__AVX2__)
PD_EXP_VECTOR(256, 8)
#endif
#undef PD_EXP_VECTOR

/* s[t] = e^(s[t] - shift) for t < len (every s[t] - shift <= 0); returns their sum. */
static inline float exp_shifted(float *s, int len, float shift) {
    float sum = 0.f;
    int t = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t),
                                                         _mm512_set1_ps(shift)));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t),
                                                        _mm256_set1_ps(shift)));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#endif
    for (; t < len; t++) {
        s[t] = exp_nonpositive(s[t] - shift);
        sum += s[t];
    }
    return sum;
}

/* The scores s[0 .. len) replaced by e^(s - max), unnormalized; returns their sum. */
static inline float pd_softmax(float *s, int len) {
    float top = s[0];
#pragma omp simd reduction(max : top)
    for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
    return exp_shifted(s, len, top);
}

/* q . k * scale: from the float32 query row `qf`, or (AVX512-BF16, dim % 32 == 0) straight
 * from the bf16 query `qb` with VDPBF16PS (products exact, sums in float32). */
static inline float dot_scaled_bf16(const float *qf, const uint16_t *qb, const uint16_t *kp,
                                    int dim, float scale) {
#ifdef PD_AVX512BF16
    if (dim % 32 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + d),
                                   (__m512bh)_mm512_loadu_si512(kp + d));
        return _mm512_reduce_add_ps(acc) * scale;
    }
#endif
    (void)qb;
    (void)scale; /* the float32 query row is scaled already */
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < dim; d++) s += qf[d] * bf16_to_f32(kp[d]);
    return s;
}

static inline float dot_scaled_f32(const float *qf, const float *qb, const float *kp, int dim,
                                   float scale) {
    (void)qb;
    (void)scale;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < dim; d++) s += qf[d] * kp[d];
    return s;
}

static inline float dot_scaled_f16(const float *qf, const float *qb, const uint16_t *kp, int dim,
                                   float scale) {
    (void)qb;
    (void)scale;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < dim; d++) s += qf[d] * f16_to_f32(kp[d]);
    return s;
}

static inline float as_f32(float v) { return v; }

#define MAX_REP 16  /* query heads per KV head */
#define MAX_DIM 256 /* head dimension */
/* Consecutive tokens of one request (a prompt chunk) attended in one task: every key and value
 * a task reads serves all its rows, so wide groups read the context fewer times. */
#define PD_GROUP_MAX 48
#define PD_GROUP_MIN 16
#define PD_KEYS 16  /* keys scored together by the grouped rows */
/* Values per weighted sum of the grouped rows (float32 cache): their sums stay in registers
 * across them (a prompt chunk's attention 1-6% faster than at 16 at a time, Zen 3). */
#define PD_PV_KEYS 64
/* Keys of a decode row's stretch (PD_SEG), rounded up to blocks: PD_SEG_KEYS, or as many as
 * take PD_SEG_BYTES of keys where that is more. With 64, one chat of SmolLM2-1.7B (4 KiB of
 * keys a token) at 350 tokens has six for two threads (128 left one thread a third of the
 * work more); SmolLM2-135M's stretches (384 bytes a token) stay at 128, where 32 chats ran
 * 10% slower at 64 (each stretch's fixed work twice as often). */
#define PD_SEG_KEYS 64
#define PD_SEG_BYTES (48 << 10)
/* Decode rows' units (stretch x KV heads) wanted per thread: where the stretches are fewer, each
 * is cut by KV heads too. More units cut a token's row (all heads, side by side) into more
 * pieces, each read apart; one stretch a thread kept a 1.7B model's attention 20% faster. */
#define PD_UNITS_PER_THREAD 1

/* Asks for the `bytes` bytes from `p` to be brought into the cache (L2), a line at a time. */
static inline void pd_prefetch_span(const void *p, size_t bytes) {
#if defined(__GNUC__)
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
#else
    (void)p, (void)bytes;
#endif
}

/* Blocks read in a burst of software prefetches ahead of their turn, at most (their heads' part):
 * a small block's rows are read before the hardware prefetchers find them (SmolLM2-135M: 6 KiB,
 * 32 chats at 350 tokens 15% faster with), while a large one's burst held back the reads it
 * waited for (SmolLM2-1.7B: 64 KiB, one chat's attention 25% faster without). */
#define PD_PREFETCH_BLOCK_MAX (16 << 10)

/* The block of `cache` holding key b0 of a context read up to t1, the next block (if any, and
 * small) asked for meanwhile: of each of its tokens' rows (`row_bytes`, every head) the
 * `head_bytes` from `head_at` that the reader's heads take. */
static inline const void *pd_block(const void *cache, const int32_t *table, int b0, int t1,
                                   int block_size, size_t row_bytes, size_t head_at,
                                   size_t head_bytes) {
    const size_t block_bytes = (size_t)block_size * row_bytes;
    if (b0 + block_size < t1 && (size_t)block_size * head_bytes <= PD_PREFETCH_BLOCK_MAX) {
        const char *next = (const char *)cache + (size_t)table[b0 / block_size + 1] * block_bytes;
        if (head_bytes == row_bytes)
            pd_prefetch_span(next, block_bytes);
        else
            for (int t = 0; t < block_size; t++)
                pd_prefetch_span(next + (size_t)t * row_bytes + head_at, head_bytes);
    }
    return (const char *)cache + (size_t)table[b0 / block_size] * block_bytes;
}

/* Where head h's row of token t lies in a paged cache (`row`: one token's rows, every head), in
 * elements from the cache's start. */
static inline size_t pd_row_at(const int32_t *table, int t, int block_size, size_t row, int h,
                               int dim) {
    return ((size_t)table[t / block_size] * block_size + t % block_size) * row + (size_t)h * dim;
}

#define PD_AHEAD 32 /* keys ahead whose rows PD_ROWS fetches (pd_prefetch_head) */

/* Asks for head h's rows of the keys (or values) [t, t + PD_KEYS) of a context of `len` to be
 * brought into the cache: one head's rows lie a token's whole row of heads apart, too far for
 * the prefetchers to follow (4-8 KiB on models with many KV heads). */
static inline void pd_prefetch_head(const void *cache, const int32_t *table, int t, int len,
                                    int h, size_t row, int dim, int block_size, size_t elem) {
#if defined(__GNUC__)
    const int end = t + PD_KEYS < len ? t + PD_KEYS : len;
    for (; t < end; t++) {
        const char *p = (const char *)cache + pd_row_at(table, t, block_size, row, h, dim) * elem;
        for (size_t b = 0; b < (size_t)dim * elem; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
#else
    (void)cache, (void)table, (void)t, (void)len, (void)h, (void)row, (void)dim;
    (void)block_size, (void)elem;
#endif
}

#if defined(__AVX512F__) || defined(__AVX2__)
#define PD_HAVE_DOT8 1
/* The sums of eight vectors' lanes, as one vector: a tree of horizontal adds
 * ([a0 a1 a2 a3 | a4 a5 a6 a7] halves summed, then the two 128-bit lanes). */
static inline __m256 pd_sum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

#if defined(__AVX512F__)
/* pd_sum8 of eight 512-bit vectors (each one's halves added first). */
static inline __m256 pd_sum8_512(const __m512 *w) {
    __m256 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_add_ps(_mm512_castps512_ps256(w[i]), _mm512_extractf32x8_ps(w[i], 1));
    return pd_sum8(a);
}
#endif

/* Elements d .. d + 7 of a key row as float32 (bf16 widened: its bits are float32's top half;
 * float16 by F16C's VCVTPH2PS where the build has it). */
static inline __m256 pd_load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 pd_load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 pd_load8_f16(const uint16_t *p) {
#if defined(__F16C__) || defined(__AVX512F__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = f16_to_f32(p[i]);
    return _mm256_loadu_ps(f);
#endif
}

/* Elements `at` .. `at` + 7 (pd_key8) or + 15 (pd_key16) of a float32 cache, or of a float16
 * one (`half`) widened exactly: a constant after inlining. */
static inline __attribute__((always_inline)) __m256 pd_key8(const void *k, size_t at, int half) {
    return half ? pd_load8_f16((const uint16_t *)k + at) : pd_load8_f32((const float *)k + at);
}
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 pd_key16(const void *k, size_t at, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + at)))
                : _mm512_loadu_ps((const float *)k + at);
}
#endif

/* q . k for 8 keys k + i * k_stride (i < 8), float32 or float16 (`half`), dim % 8 == 0: eight
 * independent sums (one dot product alone is a chain of dependent adds and a horizontal sum),
 * reduced together by a tree of horizontal adds. */
static inline __attribute__((always_inline)) __m256 pd_dot8_of(const float *q, const void *k,
                                                               size_t k_stride, int dim,
                                                               int half) {
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        __m512 w[8];
        for (int i = 0; i < 8; i++) w[i] = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 16) {
            const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                w[i] = _mm512_fmadd_ps(qv, pd_key16(k, i * k_stride + d, half), w[i]);
        }
        return pd_sum8_512(w);
    }
#endif
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_fmadd_ps(qv, pd_key8(k, i * k_stride + d, half), a[i]);
    }
    return pd_sum8(a);
}

#endif

#ifdef PD_AVX512BF16
/* pd_dot8_of for bf16 query and keys (dim % 32 == 0), products by VDPBF16PS (exact, summed in
 * float32). */
static inline __m256 pd_dot8_bf16(const uint16_t *q, const uint16_t *k, size_t k_stride,
                                  int dim) {
    __m512 w[8];
    for (int i = 0; i < 8; i++) w[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            w[i] = _mm512_dpbf16_ps(w[i], qv, (__m512bh)_mm512_loadu_si512(k + i * k_stride + d));
    }
    return pd_sum8_512(w);
}
#endif

/* Eight keys' scores (k + i * k_stride, i < 8) for one query row, scaled, in each element type's
 * way: PD_KEYS8 of paged_decode_body.h (qf: the float32 query row, scaled already; q: the row as
 * the model has it). */
#ifdef PD_AVX512BF16
static inline __m256 pd_keys8_bf16(const float *qf, const uint16_t *q, const uint16_t *k,
                                   size_t k_stride, int dim, float scale) {
    (void)qf;
    return _mm256_mul_ps(pd_dot8_bf16(q, k, k_stride, dim), _mm256_set1_ps(scale));
}
#endif
#ifdef PD_HAVE_DOT8
static inline __m256 pd_keys8_f32(const float *qf, const float *q, const float *k,
                                  size_t k_stride, int dim, float scale) {
    (void)q, (void)scale;
    return pd_dot8_of(qf, k, k_stride, dim, 0);
}
/* A float16 cache's (a float32 model's): the same sums of the same products. */
static inline __m256 pd_keys8_f16(const float *qf, const float *q, const uint16_t *k,
                                  size_t k_stride, int dim, float scale) {
    (void)q, (void)scale;
    return pd_dot8_of(qf, k, k_stride, dim, 1);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#define PD_LOAD8_VECTOR 1 /* pd_load8_* (above) */

/* tile[d][k0 + i] = r[i][d] for eight rows r of eight elements: an 8x8 transpose in registers
 * (the scalar copy into the keys' transposed tile cost as much as a tenth of a prompt chunk's
 * attention). */
static inline void pd_transpose8(const __m256 r[8], float (*tile)[PD_KEYS], int k0) {
    const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    _mm256_storeu_ps(tile[0] + k0, _mm256_permute2f128_ps(b0, b4, 0x20));
    _mm256_storeu_ps(tile[1] + k0, _mm256_permute2f128_ps(b1, b5, 0x20));
    _mm256_storeu_ps(tile[2] + k0, _mm256_permute2f128_ps(b2, b6, 0x20));
    _mm256_storeu_ps(tile[3] + k0, _mm256_permute2f128_ps(b3, b7, 0x20));
    _mm256_storeu_ps(tile[4] + k0, _mm256_permute2f128_ps(b0, b4, 0x31));
    _mm256_storeu_ps(tile[5] + k0, _mm256_permute2f128_ps(b1, b5, 0x31));
    _mm256_storeu_ps(tile[6] + k0, _mm256_permute2f128_ps(b2, b6, 0x31));
    _mm256_storeu_ps(tile[7] + k0, _mm256_permute2f128_ps(b3, b7, 0x31));
}
#endif

#if defined(__AVX512F__)
#define PD_QROWS 8  /* query rows scored together against a tile of keys */
#else
#define PD_QROWS 12
#endif

/* s[i * s_stride + key] = sum over d of q[i * dim + d] * tile[d][key], for PD_KEYS keys and
 * nq <= PD_QROWS query rows q: independent sums (eight chains of FMAs), the tile's loads
 * shared by the rows. Missing rows repeat row 0 and are not stored. */
static inline void pd_scores16(const float *q, int nq, const float (*tile)[PD_KEYS], int dim,
                               float *s, size_t s_stride) {
    const float *rows[PD_QROWS];
    for (int i = 0; i < PD_QROWS; i++) rows[i] = q + (i < nq ? (size_t)i * dim : 0);
#if defined(__AVX512F__)
    __m512 acc[PD_QROWS];
    for (int i = 0; i < PD_QROWS; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d++) {
        const __m512 t = _mm512_loadu_ps(tile[d]);
#pragma GCC unroll 8
        for (int i = 0; i < PD_QROWS; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(rows[i][d]), t, acc[i]);
    }
    for (int i = 0; i < nq; i++) _mm512_storeu_ps(s + i * s_stride, acc[i]);
#elif defined(__AVX2__)
    for (int i0 = 0; i0 < nq; i0 += 6) { /* six rows a pass: twelve chains of 8 keys */
        const float *r[6];
        for (int i = 0; i < 6; i++) r[i] = i0 + i < nq ? rows[i0 + i] : rows[0];
        __m256 lo[6], hi[6];
        for (int i = 0; i < 6; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d++) {
            const __m256 tl = _mm256_loadu_ps(tile[d]), th = _mm256_loadu_ps(tile[d] + 8);
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                const __m256 x = _mm256_broadcast_ss(r[i] + d);
                lo[i] = _mm256_fmadd_ps(x, tl, lo[i]);
                hi[i] = _mm256_fmadd_ps(x, th, hi[i]);
            }
        }
        for (int i = 0; i < 6 && i0 + i < nq; i++) {
            _mm256_storeu_ps(s + (i0 + i) * s_stride, lo[i]);
            _mm256_storeu_ps(s + (i0 + i) * s_stride + 8, hi[i]);
        }
    }
#else
    for (int i = 0; i < nq; i++) {
        float *si = s + i * s_stride;
        for (int kk = 0; kk < PD_KEYS; kk++) si[kk] = 0.f;
        for (int d = 0; d < dim; d++)
            for (int kk = 0; kk < PD_KEYS; kk++) si[kk] += rows[i][d] * tile[d][kk];
    }
#endif
}

/* a[i * dim + d] += sum over k < n of p[i * p_stride + k] * vals[k][d], for nq <= R query
 * rows (R, 4 or 6, a constant after inlining): the values' loads shared by the rows (missing
 * rows repeat row 0, not stored). vals[k] points at value row k: in the cache (float32) or in a
 * converted copy (bf16). */
static inline __attribute__((always_inline)) void pd_weighted_rows(
    const float *p, size_t p_stride, int nq, int n, const float *const *vals, int dim, float *a,
    const int R) {
    const float *pr[6];
    float *ar[6];
    for (int i = 0; i < R; i++) {
        pr[i] = p + (i < nq ? (size_t)i * p_stride : 0);
        ar[i] = a + (i < nq ? (size_t)i * dim : 0);
    }
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 64 <= dim; d += 64) {
        __m512 acc[6][4];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_loadu_ps(ar[i] + d + 16 * c);
        for (int k = 0; k < n; k++) {
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(vals[k] + d + 16 * c);
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                const __m512 pk = _mm512_set1_ps(pr[i][k]);
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_fmadd_ps(pk, v[c], acc[i][c]);
            }
        }
        for (int i = 0; i < nq; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(ar[i] + d + 16 * c, acc[i][c]);
    }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
    for (; d + 16 <= dim; d += 16) {
        __m256 acc[6][2];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < 2; c++) acc[i][c] = _mm256_loadu_ps(ar[i] + d + 8 * c);
        for (int k = 0; k < n; k++) {
            const __m256 v0 = _mm256_loadu_ps(vals[k] + d), v1 = _mm256_loadu_ps(vals[k] + d + 8);
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                const __m256 pk = _mm256_set1_ps(pr[i][k]);
                acc[i][0] = _mm256_fmadd_ps(pk, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(pk, v1, acc[i][1]);
            }
        }
        for (int i = 0; i < nq; i++)
            for (int c = 0; c < 2; c++) _mm256_storeu_ps(ar[i] + d + 8 * c, acc[i][c]);
    }
#endif
    for (; d < dim; d++)
        for (int i = 0; i < nq; i++) {
            float sum = ar[i][d];
            for (int k = 0; k < n; k++) sum += pr[i][k] * vals[k][d];
            ar[i][d] = sum;
        }
}

/* pd_weighted_rows for nq <= 4 rows, R fitted to them: a row short of four would cost its
 * multiply-adds all the same (a decode row of a model with as many KV heads as query heads,
 * SmolLM2-1.7B's, did four rows' work for one). Each row's sums are the same either way. */
static inline void pd_weighted_sum4(const float *p, size_t p_stride, int nq, int n,
                                    const float *const *vals, int dim, float *a) {
    switch (nq) {
    case 1: pd_weighted_rows(p, p_stride, 1, n, vals, dim, a, 1); break;
    case 2: pd_weighted_rows(p, p_stride, 2, n, vals, dim, a, 2); break;
    case 3: pd_weighted_rows(p, p_stride, 3, n, vals, dim, a, 3); break;
    default: pd_weighted_rows(p, p_stride, nq, n, vals, dim, a, 4);
    }
}

/* pd_weighted_rows for nq rows, any number: six rows a pass on AVX2 builds (twelve chains of
 * FMAs, each value row's loads shared by six rows), four with AVX-512's 32 registers. */
static inline void pd_weighted_sum(const float *p, size_t p_stride, int nq, int n,
                                   const float *const *vals, int dim, float *a) {
    int j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    for (; j + 6 <= nq; j += 6)
        pd_weighted_rows(p + (size_t)j * p_stride, p_stride, 6, n, vals, dim,
                         a + (size_t)j * dim, 6);
#endif
    for (; j < nq; j += 4)
        pd_weighted_sum4(p + (size_t)j * p_stride, p_stride, nq - j < 4 ? nq - j : 4, n, vals,
                         dim, a + (size_t)j * dim);
}

/* The rows of a task (see PD_GROUP_MAX) for `batch` rows: the widest group that still leaves
 * the threads four tasks each (a task is a group's KV head) and keeps a thread's scores
 * (`rep` query heads a row, `stride` keys each) within PD_SCORES_BYTES, else PD_GROUP_MIN;
 * then evened out over as many groups as a multiple of the threads (a 151-token chunk had gone
 * as 48, 48, 48 and 7 rows: one thread's two tasks 96 rows, the other's 55).
 * With 16 rows a task, a prompt chunk of SmolLM2-1.7B (one query head per KV head) read its
 * keys and values 3x as often and ran at 35-51 GMAC/s; at 48, 45-68 (2-core Intel AVX-512). */
#define PD_SCORES_BYTES (16L << 20)
static int pd_group_rows(int batch, int kv_heads, int rep, int stride, int threads) {
    int group = PD_GROUP_MIN;
    for (int g = PD_GROUP_MAX; g > PD_GROUP_MIN; g -= 16)
        if ((long)(batch + g - 1) / g * kv_heads >= 4L * threads
            && (long)rep * g * stride * (long)sizeof(float) <= PD_SCORES_BYTES) {
            group = g;
            break;
        }
    if (batch < 1 || threads < 1) return group;
    int groups = (batch + group - 1) / group;
    groups = (groups + threads - 1) / threads * threads;
    return (batch + groups - 1) / groups;
}

/* Whether row b is the token after row b - 1's in the same request: a context one longer,
 * over the same blocks. */
static int pd_continues(const int32_t *tables, int stride, const int32_t *seq_lens,
                        int block_size, int b) {
    if (seq_lens[b] != seq_lens[b - 1] + 1) return 0;
    const int blocks = (seq_lens[b] + block_size - 1) / block_size;
    return memcmp(tables + (size_t)b * stride, tables + (size_t)(b - 1) * stride,
                  sizeof(int32_t) * blocks) == 0;
}

/* Value row `vp` as float32 for the weighted sums: converted into `buf` (bf16), or where it
 * lies in the cache (float32: a copy per key cost 9% of a 32-request decode step). */
static inline const float *pd_value_row_bf16(const uint16_t *vp, int dim, float *buf) {
#pragma omp simd
    for (int d = 0; d < dim; d++) buf[d] = bf16_to_f32(vp[d]);
    return buf;
}

static inline const float *pd_value_row_f32(const float *vp, int dim, float *buf) {
    (void)dim, (void)buf;
    return vp;
}

static inline const float *pd_value_row_f16(const uint16_t *vp, int dim, float *buf) {
    int d = 0;
#if defined(PD_HAVE_DOT8)
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(buf + d, pd_load8_f16(vp + d));
#endif
    for (; d < dim; d++) buf[d] = f16_to_f32(vp[d]);
    return buf;
}

/* The kernel once per element type of q and out, and of the cache: bf16 and bf16, float32 and
 * float32, float32 and float16 (the float16 cache of a float32 model: half the bytes a step
 * reads and keeps, each element widened exactly). */
#define PD_Q uint16_t
#define PD_QLOAD bf16_to_f32
#define PD_T uint16_t
#define PD_LOAD bf16_to_f32
#define PD_STORE f32_to_bf16
#define PD_DOT dot_scaled_bf16
#ifdef PD_AVX512BF16
#define PD_KEYS8 pd_keys8_bf16
#define PD_KEYS8_OK(dim) ((dim) % 32 == 0)
#endif
#define PD_NAME paged_decode_bf16
#define PD_ROWS paged_rows_bf16
#define PD_SEG paged_stretch_bf16
#define PD_MERGE paged_merge_bf16
#define PD_F32 0
#define PD_VALUE_ROW pd_value_row_bf16
#define PD_LOAD8 pd_load8_bf16
#include "paged_decode_body.h"

#define PD_Q float
#define PD_QLOAD as_f32
#define PD_T float
#define PD_LOAD as_f32
#define PD_STORE as_f32
#define PD_DOT dot_scaled_f32
#ifdef PD_HAVE_DOT8
#define PD_KEYS8 pd_keys8_f32
#define PD_KEYS8_OK(dim) ((dim) % 8 == 0)
#endif
#define PD_NAME paged_decode_f32
#define PD_ROWS paged_rows_f32
#define PD_SEG paged_stretch_f32
#define PD_MERGE paged_merge_f32
#define PD_F32 1
#define PD_VALUE_ROW pd_value_row_f32
#define PD_LOAD8 pd_load8_f32
#include "paged_decode_body.h"

#define PD_Q float
#define PD_QLOAD as_f32
#define PD_T uint16_t
#define PD_LOAD f16_to_f32
#define PD_STORE as_f32
#define PD_DOT dot_scaled_f16
#ifdef PD_HAVE_DOT8
#define PD_KEYS8 pd_keys8_f16
#define PD_KEYS8_OK(dim) ((dim) % 8 == 0)
#endif
#define PD_NAME paged_decode_f32h
#define PD_ROWS paged_rows_f32h
#define PD_SEG paged_stretch_f32h
#define PD_MERGE paged_merge_f32h
#define PD_F32 0
#define PD_VALUE_ROW pd_value_row_f16
#define PD_LOAD8 pd_load8_f16
#include "paged_decode_body.h"
