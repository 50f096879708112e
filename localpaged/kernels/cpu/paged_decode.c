/* Decode attention over the paged KV cache, on the CPU, reading each request's blocks where
 * they lie (torch's path first gathers them into a padded batch, then masks the padding).
 *
 * One task per (request, KV head): the query heads sharing that KV head (GQA) are scored
 * against every context key, softmaxed in float32, and their values summed. The loops over the
 * head dimension are `omp simd`, vectorized by the compiler for the CPU it builds on; with
 * AVX512-BF16 the scores are VDPBF16PS dot products of the bf16 query and key rows.
 *
 *   q        bf16 [B][Hq][D]          out bf16 [B][Hq][D]
 *   k_cache  bf16 [blocks][bs][Hkv][D], v_cache likewise
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
static inline float dot_scaled(const float *qf, const uint16_t *qb, const uint16_t *kp, int dim,
                               float scale) {
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

#define MAX_REP 16  /* query heads per KV head */
#define MAX_DIM 256 /* head dimension */

/* Returns 0, -1 when scratch memory cannot be had, -2 for shapes past the limits above. */
int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *tables, int table_stride, const int32_t *seq_lens,
                      uint16_t *out, int batch, int heads, int kv_heads, int dim, int block_size,
                      float scale, int threads) {
    const int rep = heads / kv_heads;
    if (rep > MAX_REP || dim > MAX_DIM) return -2;
    int max_len = 1;
    for (int b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)rep * max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int b = 0; b < batch; b++)
            for (int h = 0; h < kv_heads; h++) {
                if (scores == NULL) continue;
                const int len = seq_lens[b];
                const int32_t *table = tables + (size_t)b * table_stride;
                const size_t row = (size_t)kv_heads * dim; /* one token's keys, all heads */
                float qf[MAX_REP][MAX_DIM], acc[MAX_REP][MAX_DIM];
                for (int r = 0; r < rep; r++) {
                    const uint16_t *qp = q + ((size_t)b * heads + (size_t)h * rep + r) * dim;
                    for (int d = 0; d < dim; d++) qf[r][d] = bf16_to_f32(qp[d]) * scale;
                }
                const uint16_t *q0 = q + ((size_t)b * heads + (size_t)h * rep) * dim;
                /* keys block by block: no division per key */
                for (int t0 = 0; t0 < len; t0 += block_size) {
                    const uint16_t *kb = k_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)h * dim;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    for (int i = 0; i < n; i++)
                        for (int r = 0; r < rep; r++)
                            scores[(size_t)r * len + t0 + i] =
                                dot_scaled(qf[r], q0 + (size_t)r * dim, kb + (size_t)i * row, dim,
                                           scale);
                }
                float total[MAX_REP];
                for (int r = 0; r < rep; r++) {
                    float *sr = scores + (size_t)r * len, top = sr[0], sum = 0.f;
                    for (int t = 1; t < len; t++) top = sr[t] > top ? sr[t] : top;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < len; t++) {
                        sr[t] = exp_nonpositive(sr[t] - top);
                        sum += sr[t];
                    }
                    total[r] = sum;
                    memset(acc[r], 0, sizeof(float) * dim);
                }
                for (int t0 = 0; t0 < len; t0 += block_size) {
                    const uint16_t *vb = v_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)h * dim;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    for (int i = 0; i < n; i++) {
                        const uint16_t *vp = vb + (size_t)i * row;
                        float vf[MAX_DIM];
#pragma omp simd
                        for (int d = 0; d < dim; d++) vf[d] = bf16_to_f32(vp[d]);
                        for (int r = 0; r < rep; r++) {
                            const float p = scores[(size_t)r * len + t0 + i];
#pragma omp simd
                            for (int d = 0; d < dim; d++) acc[r][d] += p * vf[d];
                        }
                    }
                }
                for (int r = 0; r < rep; r++) {
                    uint16_t *op = out + ((size_t)b * heads + (size_t)h * rep + r) * dim;
                    const float inv = 1.f / total[r];
                    for (int d = 0; d < dim; d++) op[d] = f32_to_bf16(acc[r][d] * inv);
                }
            }
        free(scores);
    }
    return failed ? -1 : 0;
}
