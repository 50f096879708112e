/* The body of decode_layer.c for one activation type: included once per type with DL_T, DL_SUF,
 * DL_LOAD, DL_STORE and DL_ROUND defined (and undefined again at the end). */
/* res_out = x (+ res_in, unless NULL); out = weight * T(res_out * rsqrt(mean(res_out^2) + eps)).
 * res_out may be res_in (in place). */
static void DL_FN(add_rms_norm)(const DL_T *x, const DL_T *res_in, DL_T *res_out,
                                const DL_T *weight, DL_T *out, int rows, int dim, float eps,
                                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int m = 0; m < rows; m++) {
        DL_T *r = res_out + (size_t)m * dim;
        const DL_T *xm = x + (size_t)m * dim;
        const DL_T *rin = res_in != NULL ? res_in + (size_t)m * dim : NULL;
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int d = 0; d < dim; d++) {
            float v = DL_LOAD(xm[d]);
            if (rin != NULL) v = DL_ROUND(v + DL_LOAD(rin[d]));
            r[d] = DL_STORE(v);
            sq += v * v;
        }
        const float inv = 1.f / sqrtf(sq / dim + eps);
        DL_T *o = out + (size_t)m * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) {
            const float normed = DL_ROUND(DL_LOAD(r[d]) * inv);
            o[d] = DL_STORE(DL_LOAD(weight[d]) * normed);
        }
    }
}

/* out = T(silu(gate)) * up, for rows of [gate | up]; silu through exp of -|g| only (the
 * exponentials of 64 columns at a time in the vector helper, the rest in simd loops). */
static void DL_FN(silu_and_mul)(const DL_T *gate_up, DL_T *out, int rows, int inter,
                                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int m = 0; m < rows; m++) {
        const DL_T *gm = gate_up + (size_t)m * 2 * inter;
        DL_T *om = out + (size_t)m * inter;
        float e[64];
        for (int j0 = 0; j0 < inter; j0 += 64) {
            const int n = inter - j0 < 64 ? inter - j0 : 64;
#pragma omp simd
            for (int j = 0; j < n; j++) {
                const float g = DL_LOAD(gm[j0 + j]);
                e[j] = g < 0.f ? g : -g;
            }
            exp_shifted(e, n, 0.f);
#pragma omp simd
            for (int j = 0; j < n; j++) {
                const float g = DL_LOAD(gm[j0 + j]), u = DL_LOAD(gm[inter + j0 + j]);
                const float sigmoid = (g < 0.f ? e[j] : 1.f) / (1.f + e[j]);
                om[j0 + j] = DL_STORE(DL_ROUND(g * sigmoid) * u);
            }
        }
    }
}

static int DL_FN(linear)(const struct w4_layer *w, const DL_T *x, DL_T *y, int rows, int threads);

/* The parts of a joined layer, each into its columns of y [rows][w->n] (through scratch rows
 * where there are several rows). */
static int DL_FN(joined_linear)(const struct w4_layer *w, const DL_T *x, DL_T *y, int rows,
                                int threads) {
    int widest = 0;
    for (int p = 0; p < w->n_parts; p++) widest = w->parts[p].n > widest ? w->parts[p].n : widest;
    DL_T *part_y = rows > 1 ? malloc(sizeof(DL_T) * (size_t)rows * widest) : NULL;
    if (rows > 1 && part_y == NULL) return -1;
    int rc = 0;
    for (int p = 0, at = 0; p < w->n_parts && rc == 0; at += w->parts[p++].n) {
        const struct w4_layer *part = &w->parts[p];
        if ((rc = DL_FN(linear)(part, x, rows > 1 ? part_y : y + at, rows, threads))) break;
        for (int m = 0; rows > 1 && m < rows; m++)
            memcpy(y + (size_t)m * w->n + at, part_y + (size_t)m * part->n, sizeof(DL_T) * part->n);
    }
    free(part_y);
    return rc;
}

static int DL_FN(linear)(const struct w4_layer *w, const DL_T *x, DL_T *y, int rows, int threads) {
    if (w->n_parts > 0) return DL_FN(joined_linear)(w, x, y, rows, threads);
    DL_T *gathered = NULL;
    if (w->perm != NULL) { /* act-order: the input channels in the weight's column order */
        gathered = malloc(sizeof(DL_T) * (size_t)rows * w->k);
        if (gathered == NULL) return -1;
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < w->k; i++)
                gathered[(size_t)m * w->k + i] = x[(size_t)m * w->k + w->perm[i]];
        x = gathered;
    }
    int rc = w->codes8 != NULL ? DL_FN(q8_linear)(w, x, y, rows, threads)
             : w->quads      ? DL_FN(w4q_linear)(w, x, y, rows, threads)
                             : DL_FN(w4_gemm)(x, w->packed, w->sb, y, rows, w->k, w->n, w->group_size, threads);
    free(gathered);
    if (rc == 0 && w->bias != NULL)
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < w->n; j++) {
                DL_T *v = y + (size_t)m * w->n + j;
                *v = DL_STORE(DL_LOAD(*v) + DL_LOAD(((const DL_T *)w->bias)[j]));
            }
    return rc;
}

/* Rotate the first `heads` head vectors of `row` (rotate-half pairs: d and d + half). */
static void DL_FN(rotate)(DL_T *row, int heads, int dim, const float *cos_sin) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        DL_T *v = row + (size_t)h * dim;
        for (int d = 0; d < half; d++) {
            const float a = DL_LOAD(v[d]), b = DL_LOAD(v[d + half]);
            const float c = cos_sin[d], s = cos_sin[half + d];
            v[d] = DL_STORE(a * c - b * s);
            v[d + half] = DL_STORE(b * c + a * s);
        }
    }
}

/* x: [batch][hidden], in: the previous layer's output (or the embeddings), out: this layer's
 * MLP output. residual: [batch][hidden], in and out (`first`: none yet, x starts it).
 * Returns 0, or a negative number when scratch memory cannot be had. */
/* A mixture of experts' MLPs over `b` rows of x [b][hidden] into out: for each row, its `k`
 * chosen experts (chosen [b][k], in increasing expert order), each expert's gate_up,
 * silu-and-mul and down, times its router weight (weights [b][k]: the model dtype's values as
 * float32), summed in the model's dtype. Each expert runs once over all the rows that chose
 * it, in increasing expert order, as the torch module does: the same row counts per matmul
 * (on AMX they choose the kernel), the same sums. Returns 0, or -1 when out of memory. */
int DL_FN(moe_rows)(const struct w4_layer *gate_up, const struct w4_layer *down,
                    const int32_t *chosen, const float *weights, int k, const DL_T *x,
                    DL_T *out, int b, int hidden, int inter, int threads) {
    int experts = 0;
    for (int i = 0; i < b * k; i++) experts = chosen[i] >= experts ? chosen[i] + 1 : experts;
    DL_T *xs = malloc(sizeof(DL_T) * (size_t)b * hidden);
    DL_T *wide = malloc(sizeof(DL_T) * (size_t)b * 2 * inter);
    DL_T *narrow = malloc(sizeof(DL_T) * (size_t)b * inter);
    DL_T *y = malloc(sizeof(DL_T) * (size_t)b * hidden);
    int *rows = malloc(sizeof(int) * (size_t)b);
    float *w = malloc(sizeof(float) * (size_t)b);
    int rc = -1;
    if (xs == NULL || wide == NULL || narrow == NULL || y == NULL || rows == NULL || w == NULL)
        goto done;
    for (size_t i = 0; i < (size_t)b * hidden; i++) out[i] = DL_STORE(0.f);
    for (int e = 0; e < experts; e++) {
        int n = 0;
        for (int m = 0; m < b; m++)
            for (int j = 0; j < k; j++)
                if (chosen[(size_t)m * k + j] == e) {
                    rows[n] = m;
                    w[n++] = weights[(size_t)m * k + j];
                }
        if (n == 0) continue;
        for (int r = 0; r < n; r++)
            memcpy(xs + (size_t)r * hidden, x + (size_t)rows[r] * hidden, sizeof(DL_T) * hidden);
        if ((rc = DL_FN(linear)(&gate_up[e], xs, wide, n, threads))) goto done;
        DL_FN(silu_and_mul)(wide, narrow, n, inter, threads);
        if ((rc = DL_FN(linear)(&down[e], narrow, y, n, threads))) goto done;
        for (int r = 0; r < n; r++) {
            DL_T *om = out + (size_t)rows[r] * hidden;
            const DL_T *yr = y + (size_t)r * hidden;
            for (int i = 0; i < hidden; i++)
                om[i] = DL_STORE(DL_ROUND(DL_LOAD(om[i]) + DL_ROUND(DL_LOAD(yr[i]) * w[r])));
        }
    }
    rc = 0;
done:
    free(xs);
    free(wide);
    free(narrow);
    free(y);
    free(rows);
    free(w);
    return rc;
}

int DL_FN(decode_layer)(const struct decode_step *s, const struct decode_layer *l, DL_T *x,
                        DL_T *residual, int first) {
    const int b = s->batch, hd = s->head_dim;
    const int nq = s->heads * hd, nkv = s->kv_heads * hd, nqkv = nq + 2 * nkv;
    const size_t widest = (size_t)(nqkv > 2 * s->intermediate ? nqkv : 2 * s->intermediate);
    DL_T *normed = malloc(sizeof(DL_T) * (size_t)b * s->hidden);
    DL_T *wide = malloc(sizeof(DL_T) * (size_t)b * widest);
    DL_T *narrow = malloc(sizeof(DL_T) * (size_t)b *
                          (size_t)(nq > s->intermediate ? nq : s->intermediate));
    DL_T *q = malloc(sizeof(DL_T) * (size_t)b * nq);
    int rc = -1;
    if (normed == NULL || wide == NULL || narrow == NULL || q == NULL) goto done;

    DL_FN(add_rms_norm)(x, first ? NULL : residual, residual, l->input_norm, normed, b, s->hidden,
                        s->eps, s->threads);
    if ((rc = DL_FN(linear)(&l->qkv, normed, wide, b, s->threads))) goto done;
    const size_t row = (size_t)s->kv_heads * hd; /* one cache slot */
    for (int m = 0; m < b; m++) {
        DL_T *qkv = wide + (size_t)m * nqkv;
        const float *cs = s->cos_sin + (size_t)m * hd;
        if (l->q_norm != NULL) { /* each head normalized in place, as rows of head_dim */
            DL_FN(add_rms_norm)(qkv, NULL, qkv, l->q_norm, qkv, s->heads, hd, s->eps, 1);
            DL_FN(add_rms_norm)(qkv + nq, NULL, qkv + nq, l->k_norm, qkv + nq, s->kv_heads, hd,
                                s->eps, 1);
        }
        DL_FN(rotate)(qkv, s->heads, hd, cs);
        DL_FN(rotate)(qkv + nq, s->kv_heads, hd, cs);
        memcpy(q + (size_t)m * nq, qkv, sizeof(DL_T) * nq);
        DL_FN(store_kv)(l->k_cache, (size_t)s->slots[m] * row, qkv + nq, nkv, s->kv_half);
        DL_FN(store_kv)(l->v_cache, (size_t)s->slots[m] * row, qkv + nq + nkv, nkv, s->kv_half);
    }
    if ((rc = DL_FN(attend)(s, q, l->k_cache, l->v_cache, narrow))) goto done;
    if ((rc = DL_FN(linear)(&l->o, narrow, x, b, s->threads))) goto done;

    DL_FN(add_rms_norm)(x, residual, residual, l->post_norm, normed, b, s->hidden, s->eps,
                        s->threads);
    if (l->gate_up.packed == NULL && l->gate_up.codes8 == NULL && l->gate_up.n_parts == 0) {
        /* No MLP here (a mixture of experts, run by the caller): x is its input. */
        memcpy(x, normed, sizeof(DL_T) * (size_t)b * s->hidden);
        goto done;
    }
    if ((rc = DL_FN(linear)(&l->gate_up, normed, wide, b, s->threads))) goto done;
    DL_FN(silu_and_mul)(wide, narrow, b, s->intermediate, s->threads);
    rc = DL_FN(linear)(&l->down, narrow, x, b, s->threads);
done:
    free(normed);
    free(wide);
    free(narrow);
    free(q);
    return rc;
}

/* decode_layer for layers[0 .. n) in turn: a decode step's layers in one call (one call a layer,
 * each return to Python found its state cold, its caches refilled by the weights' stream). */
int DL_FN(decode_layers)(const struct decode_step *s, const struct decode_layer *layers, int n,
                         DL_T *x, DL_T *residual) {
    for (int i = 0; i < n; i++) {
        const int rc = DL_FN(decode_layer)(s, layers + i, x, residual, i == 0);
        if (rc) return rc;
    }
    return 0;
}

#undef DL_T
#undef DL_SUF
#undef DL_LOAD
#undef DL_STORE
#undef DL_ROUND
