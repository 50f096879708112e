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

/* The kernel once per element type of q, the cache and out: bf16, then float32. */
#define PD_T uint16_t
#define PD_LOAD bf16_to_f32
#define PD_STORE f32_to_bf16
#define PD_DOT dot_scaled_bf16
#define PD_NAME paged_decode_bf16
#include "paged_decode_body.h"

#define PD_T float
#define PD_LOAD as_f32
#define PD_STORE as_f32
#define PD_DOT dot_scaled_f32
#define PD_NAME paged_decode_f32
#include "paged_decode_body.h"
