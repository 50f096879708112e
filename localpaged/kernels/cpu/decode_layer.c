/* One decoder layer of a Llama-family model for a decode step (one new token per request), on
 * the CPU, in a single call: the same computation as localpaged/model/llama.py's DecoderLayer
 * with every matrix 4-bit (quant_gemm.c) and the attention over the paged cache
 * (paged_decode.c). A decode step of a small model is otherwise dominated by the fixed cost of
 * some sixty small torch ops per layer; here they are loops over a few KiB.
 *
 * Built per activation type (bf16, float32: the model's dtype; the KV cache holds it too, or
 * float16 under float32): decode_layer_body.h is included once for each. Rounding follows the
 * torch path: tensors of the model's dtype between ops, float32 inside each op.
 */
/* Built as part of all.c, after quant_gemm.c and paged_decode.c. */
#include <math.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

struct w4_layer {
    const uint8_t *packed;
    const uint16_t *sb;
    const void *bias; /* the model's dtype; NULL: none */
    int k, n, group_size;
    /* Or int8 blocks (int8_dot.c, float32 models only) where `codes8` is set: a matrix of a
     * GGUF type without a 4-bit kernel, or a fused one of mixed types. */
    const int8_t *codes8;
    const void *scales8; /* float16 when half8, else float32 */
    const float *offsets8;
    int block8, half8;
    int quads; /* `packed` in the quads layout (int8_dot.c: every build, through w6_gemm) */
    const uint8_t *high; /* the 6-bit layout's top bits (int8_dot.c; quads), or NULL */
    int zero_point;      /* the form of sb (int8_dot.c; quads): 0, > 0 or I8_KQ */
    const int32_t *perm; /* act-order GPTQ: column i of the weight is input channel perm[i]
                          * (x is gathered in that order first); NULL: in order */
    /* Or `n_parts` matrices of one input side by side (their outputs' columns in order), each
     * in its own form where joining them would widen some (a Q4_K_M file's q/k in Q4_K, v in
     * Q6_K); the fields above then unused but k and n. */
    const struct w4_layer *parts;
    int n_parts;
};

struct decode_layer {
    const void *input_norm, *post_norm; /* [hidden], the model's dtype */
    struct w4_layer qkv, o, gate_up, down; /* gate_up all NULL: no MLP (the layer stops at
                                            * the MLP's normed input, left in x) */
    void *k_cache, *v_cache; /* [blocks][block_size][kv_heads][head_dim], the model's dtype
                              * (float16 under a float32 model where the step says kv_half) */
    const void *q_norm, *k_norm; /* [head_dim] RMSNorm weights of each q and k head before
                                  * rotary (Qwen3), the model's dtype; NULL: none */
};

struct decode_step {
    int batch, hidden, heads, kv_heads, head_dim, intermediate, block_size, table_stride;
    int threads;
    float eps, scale;
    const int64_t *slots;   /* [batch] cache slot of each new token */
    const int32_t *tables;  /* [batch][table_stride] */
    const int32_t *seq_lens;
    const float *cos_sin;   /* [batch][head_dim]: cos of each rotary pair, then sin */
    int kv_half;            /* float32 models: the KV cache holds float16 (else float32) */
};

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline float same_f32(float v) { return v; }

/* A new token's keys (or values), n elements, into its cache slot `at` (in elements): as they
 * are, or rounded to float16 (to nearest even, as torch's `.to(torch.float16)`). */
static void store_kv_bf16(void *cache, size_t at, const uint16_t *src, int n, int half) {
    (void)half; /* bf16 models keep a bf16 cache */
    memcpy((uint16_t *)cache + at, src, sizeof(uint16_t) * n);
}

static void store_kv_f32(void *cache, size_t at, const float *src, int n, int half) {
    if (!half) {
        memcpy((float *)cache + at, src, sizeof(float) * n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    int i = 0;
#if defined(__F16C__) || defined(__AVX512F__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

/* The step's attention over the paged cache (see paged_decode.c) for the cache's type. */
static int attend_bf16(const struct decode_step *s, const uint16_t *q, const void *k_cache,
                       const void *v_cache, uint16_t *out) {
    return paged_decode_bf16(q, k_cache, v_cache, s->tables, s->table_stride, s->seq_lens, out,
                             s->batch, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale,
                             s->threads);
}

static int attend_f32(const struct decode_step *s, const float *q, const void *k_cache,
                      const void *v_cache, float *out) {
    if (s->kv_half)
        return paged_decode_f32h(q, k_cache, v_cache, s->tables, s->table_stride, s->seq_lens, out,
                                 s->batch, s->heads, s->kv_heads, s->head_dim, s->block_size,
                                 s->scale, s->threads);
    return paged_decode_f32(q, k_cache, v_cache, s->tables, s->table_stride, s->seq_lens, out,
                            s->batch, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale,
                            s->threads);
}

static int q8_linear_f32(const struct w4_layer *w, const float *x, float *y, int rows,
                         int threads) {
    return q8_gemm_f32(x, w->codes8, w->scales8, w->half8, w->offsets8, y, rows, w->k, w->n, w->block8,
                       threads, 0);
}

/* bf16 models: the rows read as they are, the product rounded to bf16 (int8 activations). */
static int q8_linear_bf16(const struct w4_layer *w, const uint16_t *x, uint16_t *y, int rows,
                          int threads) {
    return q8_gemm_bf16(x, w->codes8, w->scales8, w->half8, w->offsets8, y, rows, w->k, w->n, w->block8,
                        threads);
}

/* The quads layout, 4-bit or 6-bit, any form of scales: w6_gemm covers them all. */
static int w4q_linear_f32(const struct w4_layer *w, const float *x, float *y, int rows,
                          int threads) {
    return w6_gemm_f32(x, w->packed, w->high, w->sb, w->zero_point, y, rows, w->k, w->n,
                       w->group_size, threads, 0);
}

static int w4q_linear_bf16(const struct w4_layer *w, const uint16_t *x, uint16_t *y, int rows,
                           int threads) {
    return w6_gemm_bf16(x, w->packed, w->high, w->sb, w->zero_point, y, rows, w->k, w->n,
                        w->group_size, threads);
}

#define DL_CAT2(a, b) a##_##b
#define DL_CAT(a, b) DL_CAT2(a, b)
#define DL_FN(name) DL_CAT(name, DL_SUF)

#define DL_T uint16_t
#define DL_SUF bf16
#define DL_LOAD bf16_to_f32
#define DL_STORE f32_to_bf16
#define DL_ROUND round_bf16
#include "decode_layer_body.h"

#define DL_T float
#define DL_SUF f32
#define DL_LOAD same_f32
#define DL_STORE same_f32
#define DL_ROUND same_f32
#include "decode_layer_body.h"

/* The layer's elementwise ops on their own, for the torch layers (prefill steps), per
 * activation type. */
#define DL_ROWS(T, SUF)                                                                          \
    void rms_norm_rows_##SUF(const T *x, const T *res_in, T *res_out, const T *weight, T *out,  \
                             int rows, int dim, float eps, int threads) {                       \
        add_rms_norm_##SUF(x, res_in, res_out, weight, out, rows, dim, eps, threads);           \
    }                                                                                            \
    void silu_and_mul_rows_##SUF(const T *gate_up, T *out, int rows, int inter, int threads) {  \
        silu_and_mul_##SUF(gate_up, out, rows, inter, threads);                                  \
    }                                                                                            \
    /* Rotate, in place, `rows` tokens' q heads and k heads (rows `q_stride` / `k_stride`      \
     * elements apart, heads contiguous within a row); cos_sin: [rows][dim] float32. */         \
    void rotary_rows_##SUF(T *q, long q_stride, int q_heads, T *k, long k_stride, int k_heads,  \
                           int dim, const float *cos_sin, int rows, int threads) {              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows >= 16)")       \
        for (int m = 0; m < rows; m++) {                                                         \
            rotate_##SUF(q + (size_t)m * q_stride, q_heads, dim, cos_sin + (size_t)m * dim);    \
            rotate_##SUF(k + (size_t)m * k_stride, k_heads, dim, cos_sin + (size_t)m * dim);    \
        }                                                                                        \
    }

DL_ROWS(uint16_t, bf16)
DL_ROWS(float, f32)
