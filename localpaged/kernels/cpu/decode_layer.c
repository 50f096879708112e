/* One decoder layer of a Llama-family model for a decode step (one new token per request), on
 * the CPU, in a single call: the same computation as localpaged/model/llama.py's DecoderLayer
 * with every matrix 4-bit (quant_gemm.c) and the attention over the paged cache
 * (paged_decode.c). A decode step of a small model is otherwise dominated by the fixed cost of
 * some sixty small torch ops per layer; here they are loops over a few KiB.
 *
 * Rounding follows the torch path: bf16 tensors between ops, float32 inside each op.
 */
/* Built as part of all.c, after quant_gemm.c and paged_decode.c. */
#include <math.h>

struct w4_layer {
    const uint8_t *packed;
    const uint16_t *sb;
    const uint16_t *bias; /* NULL: none */
    int k, n, group_size;
};

struct decode_layer {
    const uint16_t *input_norm, *post_norm; /* [hidden] bf16 */
    struct w4_layer qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache; /* [blocks][block_size][kv_heads][head_dim] bf16 */
};

struct decode_step {
    int batch, hidden, heads, kv_heads, head_dim, intermediate, block_size, table_stride;
    int threads;
    float eps, scale;
    const int64_t *slots;   /* [batch] cache slot of each new token */
    const int32_t *tables;  /* [batch][table_stride] */
    const int32_t *seq_lens;
    const float *cos_sin;   /* [batch][head_dim]: cos of each rotary pair, then sin */
};

/* res_out = x (+ res_in, unless NULL); out = weight * bf16(res_out * rsqrt(mean(res_out^2) + eps)).
 * res_out may be res_in (in place). */
static void add_rms_norm(const uint16_t *x, const uint16_t *res_in, uint16_t *res_out,
                         const uint16_t *weight, uint16_t *out, int rows, int dim, float eps,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int m = 0; m < rows; m++) {
        uint16_t *r = res_out + (size_t)m * dim;
        const uint16_t *xm = x + (size_t)m * dim;
        const uint16_t *rin = res_in != NULL ? res_in + (size_t)m * dim : NULL;
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int d = 0; d < dim; d++) {
            float v = bf16_to_f32(xm[d]);
            if (rin != NULL) v = bf16_to_f32(f32_to_bf16(v + bf16_to_f32(rin[d])));
            r[d] = f32_to_bf16(v);
            sq += v * v;
        }
        const float inv = 1.f / sqrtf(sq / dim + eps);
        uint16_t *o = out + (size_t)m * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(r[d]) * inv));
            o[d] = f32_to_bf16(bf16_to_f32(weight[d]) * normed);
        }
    }
}

/* out = bf16(silu(gate)) * up, for rows of [gate | up]; silu through exp of -|g| only. */
static void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int m = 0; m < rows; m++) {
        const uint16_t *gm = gate_up + (size_t)m * 2 * inter;
        uint16_t *om = out + (size_t)m * inter;
#pragma omp simd
        for (int j = 0; j < inter; j++) {
            const float g = bf16_to_f32(gm[j]), u = bf16_to_f32(gm[inter + j]);
            const float e = exp_nonpositive(g < 0.f ? g : -g);
            const float sigmoid = g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
            om[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(g * sigmoid)) * u);
        }
    }
}

static int linear(const struct w4_layer *w, const uint16_t *x, uint16_t *y, int rows, int threads) {
    int rc = w4_gemm_bf16(x, w->packed, w->sb, y, rows, w->k, w->n, w->group_size, threads);
    if (rc == 0 && w->bias != NULL)
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < w->n; j++) {
                uint16_t *v = y + (size_t)m * w->n + j;
                *v = f32_to_bf16(bf16_to_f32(*v) + bf16_to_f32(w->bias[j]));
            }
    return rc;
}

/* Rotate the first `heads` head vectors of `row` (rotate-half pairs: d and d + half). */
static void rotate(uint16_t *row, int heads, int dim, const float *cos_sin) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        uint16_t *v = row + (size_t)h * dim;
        for (int d = 0; d < half; d++) {
            const float a = bf16_to_f32(v[d]), b = bf16_to_f32(v[d + half]);
            const float c = cos_sin[d], s = cos_sin[half + d];
            v[d] = f32_to_bf16(a * c - b * s);
            v[d + half] = f32_to_bf16(b * c + a * s);
        }
    }
}

/* x: [batch][hidden], in: the previous layer's output (or the embeddings), out: this layer's
 * MLP output. residual: [batch][hidden], in and out (`first`: none yet, x starts it).
 * Returns 0, or a negative number when scratch memory cannot be had. */
int decode_layer_bf16(const struct decode_step *s, const struct decode_layer *l, uint16_t *x,
                      uint16_t *residual, int first) {
    const int b = s->batch, hd = s->head_dim;
    const int nq = s->heads * hd, nkv = s->kv_heads * hd, nqkv = nq + 2 * nkv;
    const size_t widest = (size_t)(nqkv > 2 * s->intermediate ? nqkv : 2 * s->intermediate);
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)b * s->hidden);
    uint16_t *wide = malloc(sizeof(uint16_t) * (size_t)b * widest);
    uint16_t *narrow = malloc(sizeof(uint16_t) * (size_t)b *
                              (size_t)(nq > s->intermediate ? nq : s->intermediate));
    uint16_t *q = malloc(sizeof(uint16_t) * (size_t)b * nq);
    int rc = -1;
    if (normed == NULL || wide == NULL || narrow == NULL || q == NULL) goto done;

    add_rms_norm(x, first ? NULL : residual, residual, l->input_norm, normed, b, s->hidden, s->eps,
                 s->threads);
    if ((rc = linear(&l->qkv, normed, wide, b, s->threads))) goto done;
    const size_t row = (size_t)s->kv_heads * hd; /* one cache slot */
    for (int m = 0; m < b; m++) {
        uint16_t *qkv = wide + (size_t)m * nqkv;
        const float *cs = s->cos_sin + (size_t)m * hd;
        rotate(qkv, s->heads, hd, cs);
        rotate(qkv + nq, s->kv_heads, hd, cs);
        memcpy(q + (size_t)m * nq, qkv, sizeof(uint16_t) * nq);
        memcpy(l->k_cache + (size_t)s->slots[m] * row, qkv + nq, sizeof(uint16_t) * nkv);
        memcpy(l->v_cache + (size_t)s->slots[m] * row, qkv + nq + nkv, sizeof(uint16_t) * nkv);
    }
    if ((rc = paged_decode_bf16(q, l->k_cache, l->v_cache, s->tables, s->table_stride,
                                s->seq_lens, narrow, b, s->heads, s->kv_heads, hd, s->block_size,
                                s->scale, s->threads)))
        goto done;
    if ((rc = linear(&l->o, narrow, x, b, s->threads))) goto done;

    add_rms_norm(x, residual, residual, l->post_norm, normed, b, s->hidden, s->eps, s->threads);
    if ((rc = linear(&l->gate_up, normed, wide, b, s->threads))) goto done;
    silu_and_mul(wide, narrow, b, s->intermediate, s->threads);
    rc = linear(&l->down, narrow, x, b, s->threads);
done:
    free(normed);
    free(wide);
    free(narrow);
    free(q);
    return rc;
}

/* The layer's elementwise ops on their own, for the torch layers (prefill steps) on bf16. */
void rms_norm_rows_bf16(const uint16_t *x, const uint16_t *res_in, uint16_t *res_out,
                        const uint16_t *weight, uint16_t *out, int rows, int dim, float eps,
                        int threads) {
    add_rms_norm(x, res_in, res_out, weight, out, rows, dim, eps, threads);
}

void silu_and_mul_rows_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                            int threads) {
    silu_and_mul(gate_up, out, rows, inter, threads);
}

/* Rotate, in place, `rows` tokens' q heads and k heads (rows `q_stride` / `k_stride` elements
 * apart, heads contiguous within a row); cos_sin: [rows][dim] float32. */
void rotary_rows_bf16(uint16_t *q, long q_stride, int q_heads, uint16_t *k, long k_stride,
                      int k_heads, int dim, const float *cos_sin, int rows, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
    for (int m = 0; m < rows; m++) {
        rotate(q + (size_t)m * q_stride, q_heads, dim, cos_sin + (size_t)m * dim);
        rotate(k + (size_t)m * k_stride, k_heads, dim, cos_sin + (size_t)m * dim);
    }
}
