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

/* e^x for x <= 0 (softmax after subtracting the max), vectorizable: 2^(x log2 e) split into
 * an integer power (built in the exponent bits) and a polynomial on [-0.5, 0.5]
 * (relative error ~2e-7). */
#pragma omp declare simd
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

/* The scores s[0 .. len) replaced by e^(s - max), unnormalized; returns their sum. */
static inline float pd_softmax(float *s, int len) {
    float top = s[0], sum = 0.f;
#pragma omp simd reduction(max : top)
    for (int t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; t++) {
        s[t] = exp_nonpositive(s[t] - top);
        sum += s[t];
    }
    return sum;
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

static inline float as_f32(float v) { return v; }

#define MAX_REP 16  /* query heads per KV head */
#define MAX_DIM 256 /* head dimension */
#define PD_GROUP 8  /* consecutive tokens of one request attended in one task (a prompt chunk) */
#define PD_KEYS 16  /* keys scored together by the grouped rows */

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* s[i][key] = sum over d of q[i * dim + d] * tile[d][key], for PD_KEYS keys and nq <= 4
 * query rows q (four independent sums: the tile's loads shared, no chain of one sum). */
static inline void pd_scores16x4(const float *q, int nq, const float (*tile)[PD_KEYS],
                                 int dim, float (*s)[PD_KEYS]) {
    const float *q0 = q, *q1 = q + (nq > 1 ? dim : 0), *q2 = q + (nq > 2 ? 2 * dim : 0),
                *q3 = q + (nq > 3 ? 3 * dim : 0); /* missing rows repeat row 0, unstored */
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < dim; d++) {
        const __m512 t = _mm512_loadu_ps(tile[d]);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), t, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[d]), t, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[d]), t, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[d]), t, a3);
    }
    _mm512_storeu_ps(s[0], a0);
    if (nq > 1) _mm512_storeu_ps(s[1], a1);
    if (nq > 2) _mm512_storeu_ps(s[2], a2);
    if (nq > 3) _mm512_storeu_ps(s[3], a3);
#elif defined(__AVX2__)
    const float *rows[4] = {q0, q1, q2, q3};
    for (int i = 0; i < nq; i += 2) { /* two rows a pass: four chains of 8 keys */
        const float *qa = rows[i], *qb = rows[i + 1 < nq ? i + 1 : i];
        __m256 al = _mm256_setzero_ps(), ah = al, bl = al, bh = al;
        for (int d = 0; d < dim; d++) {
            const __m256 tl = _mm256_loadu_ps(tile[d]), th = _mm256_loadu_ps(tile[d] + 8);
            const __m256 xa = _mm256_set1_ps(qa[d]), xb = _mm256_set1_ps(qb[d]);
            al = _mm256_fmadd_ps(xa, tl, al);
            ah = _mm256_fmadd_ps(xa, th, ah);
            bl = _mm256_fmadd_ps(xb, tl, bl);
            bh = _mm256_fmadd_ps(xb, th, bh);
        }
        _mm256_storeu_ps(s[i], al);
        _mm256_storeu_ps(s[i] + 8, ah);
        if (i + 1 < nq) {
            _mm256_storeu_ps(s[i + 1], bl);
            _mm256_storeu_ps(s[i + 1] + 8, bh);
        }
    }
#else
    const float *rows[4] = {q0, q1, q2, q3};
    for (int i = 0; i < nq; i++) {
        for (int kk = 0; kk < PD_KEYS; kk++) s[i][kk] = 0.f;
        for (int d = 0; d < dim; d++)
            for (int kk = 0; kk < PD_KEYS; kk++) s[i][kk] += rows[i][d] * tile[d][kk];
    }
#endif
}

/* a[d] += sum over keys k < n of p[k] * vals[k][d], in key order. */
static inline void pd_weighted_sum(const float *p, int n, const float (*vals)[MAX_DIM],
                                   int dim, float *a) {
    int d = 0;
#if defined(__AVX512F__)
    for (; d + 64 <= dim; d += 64) {
        __m512 a0 = _mm512_loadu_ps(a + d), a1 = _mm512_loadu_ps(a + d + 16);
        __m512 a2 = _mm512_loadu_ps(a + d + 32), a3 = _mm512_loadu_ps(a + d + 48);
        for (int k = 0; k < n; k++) {
            const __m512 pk = _mm512_set1_ps(p[k]);
            a0 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(vals[k] + d), a0);
            a1 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(vals[k] + d + 16), a1);
            a2 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(vals[k] + d + 32), a2);
            a3 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(vals[k] + d + 48), a3);
        }
        _mm512_storeu_ps(a + d, a0);
        _mm512_storeu_ps(a + d + 16, a1);
        _mm512_storeu_ps(a + d + 32, a2);
        _mm512_storeu_ps(a + d + 48, a3);
    }
#elif defined(__AVX2__)
    for (; d + 32 <= dim; d += 32) {
        __m256 a0 = _mm256_loadu_ps(a + d), a1 = _mm256_loadu_ps(a + d + 8);
        __m256 a2 = _mm256_loadu_ps(a + d + 16), a3 = _mm256_loadu_ps(a + d + 24);
        for (int k = 0; k < n; k++) {
            const __m256 pk = _mm256_set1_ps(p[k]);
            a0 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vals[k] + d), a0);
            a1 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vals[k] + d + 8), a1);
            a2 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vals[k] + d + 16), a2);
            a3 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vals[k] + d + 24), a3);
        }
        _mm256_storeu_ps(a + d, a0);
        _mm256_storeu_ps(a + d + 8, a1);
        _mm256_storeu_ps(a + d + 16, a2);
        _mm256_storeu_ps(a + d + 24, a3);
    }
#endif
    for (; d < dim; d++) {
        float sum = a[d];
        for (int k = 0; k < n; k++) sum += p[k] * vals[k][d];
        a[d] = sum;
    }
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

/* The kernel once per element type of q, the cache and out: bf16, then float32. */
#define PD_T uint16_t
#define PD_LOAD bf16_to_f32
#define PD_STORE f32_to_bf16
#define PD_DOT dot_scaled_bf16
#define PD_NAME paged_decode_bf16
#define PD_ROWS paged_rows_bf16
#include "paged_decode_body.h"

#define PD_T float
#define PD_LOAD as_f32
#define PD_STORE as_f32
#define PD_DOT dot_scaled_f32
#define PD_NAME paged_decode_f32
#define PD_ROWS paged_rows_f32
#include "paged_decode_body.h"
